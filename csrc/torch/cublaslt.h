// A linear layer's small GEMMs through cuBLASLt with algorithms that launch one kernel (CUDA
// builds only): the forward with its bias, the input gradient, and the weight gradient, with the
// bias gradient where it is wanted (one more kernel, cuBLASLt's own, for the bias).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dpcuda {

// Whether cuBLASLt has an algorithm for grad_weight = g^T x (with grad_bias = g's column sums
// in the same call, its BGRADB epilogue, where grad_bias is defined) that does not split the
// batch dimension (no reduction kernel, no atomics, no workspace: the same bits every run). A
// heuristic query, cached per device, dtype, shape and pointer alignment. False where cuBLASLt
// offers none (double), a bias gradient is not 16-byte aligned, a dimension is empty, the GEMM
// is large (over 2^28 multiply-adds, where split-K pays for its kernels), or the path is
// switched off: the caller then uses its own kernels.
// g: (rows, out), x: (rows, in), grad_weight: (out, in), grad_bias: (out,) or undefined;
// contiguous, one dtype, on the current device.
bool weight_grad_lt_available(const at::Tensor& g, const at::Tensor& x,
                              const at::Tensor& grad_weight, const at::Tensor& grad_bias);

// Runs it on the current stream (after weight_grad_lt_available said true); false (nothing
// launched) if cuBLASLt refuses the call.
bool weight_grad_lt(const at::Tensor& g, const at::Tensor& x, const at::Tensor& grad_weight,
                    const at::Tensor& grad_bias);

// out = x @ weight^T (+ bias) by a one-pass cuBLASLt algorithm (its BIAS epilogue adds the
// bias), where cuBLASLt has one and the GEMM is small enough that its launches dominate (at
// most 2^28 multiply-adds); false (nothing launched) otherwise. x: (rows, in), weight: (out,
// in), bias: (out,) or undefined, out: (rows, out); contiguous, one dtype, current device.
bool linear_lt(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
               const at::Tensor& out);

// grad_input = g @ weight the same way. g: (rows, out), weight: (out, in), grad_input: (rows,
// in).
bool input_grad_lt(const at::Tensor& g, const at::Tensor& weight, const at::Tensor& grad_input);

// cuBLAS and cuBLASLt want a current CUDA context. A thread that has made no CUDA runtime call
// yet has none (autograd's device thread, whose device already matched the guard's, which then
// set nothing): torch's handle pools then warn ("no current CUDA context") and set it. Setting
// the device once per thread and device (not a synchronisation) makes its primary context
// current first.
void bind_cuda_context(int device);

// The switch of all three (on unless DPCUDA_CUBLASLT=0 was set when first asked): returns the
// previous setting. Tests compare the paths with it.
bool set_cublaslt(bool on);

// Calls of weight_grad_lt, linear_lt and input_grad_lt that ran, since the process started (tests: the path was taken).
int64_t cublaslt_calls();

}  // namespace dpcuda
