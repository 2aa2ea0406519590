// CUDA kernels of the fused linear layer for what cuBLASLt's epilogues cannot do: the
// activation epilogue that keeps the pre-activation, and the activation backward fused
// with the bias-gradient column reduction. Torch-free: raw pointers and a stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../activation.h"

namespace dpcuda {
namespace cuda {

// out = act(z) elementwise over n elements; out may alias z. The bias is not an argument: the
// adapter has cuBLASLt add it in the GEMM's epilogue (free), and z then stays as the saved
// pre-activation of the smooth activations, which cuBLASLt's own activation epilogues (relu,
// and gelu only as the tanh approximation) cannot keep. T is float, double, __half or
// __nv_bfloat16.
template <typename T>
cudaError_t activation_forward(const T* z, T* out, int64_t n, Activation act,
                               cudaStream_t stream);

// Elements of the workspace (in the accumulation type of T: double for double, float otherwise)
// that activation_backward needs for its per-chunk partial bias sums.
int64_t activation_backward_workspace(int64_t rows, int64_t cols);

// g = grad_out * act'(saved) written to grad_pre (null for activation "none": g is grad_out),
// and grad_bias = column sums of g when grad_bias is not null, summed in a fixed order (chunks
// of rows, then the chunks pairwise in a fixed tree) so results are bitwise reproducible.
template <typename T>
cudaError_t activation_backward(const T* grad_out, const T* saved, T* grad_pre, T* grad_bias,
                                void* workspace, int64_t rows, int64_t cols, Activation act,
                                cudaStream_t stream);

// Whether this build's kernels have an image the current device can run: cudaSuccess, or the
// error a launch would give (cudaErrorNoKernelImageForDevice: a GPU older than every
// architecture compiled in). Every kernel is built for the same architectures, so one stands
// for all. Asks the runtime (cudaFuncGetAttributes), launches nothing.
cudaError_t kernel_image_status();

}  // namespace cuda
}  // namespace dpcuda
