// CUDA kernels of the fused softmax cross-entropy (LossGrad): a group of lanes per row up to
// 1024 classes, a block per row above. A first sweep keeps a running max and rescaled sum of
// exponentials (online softmax) and the sum of logits, a second writes the gradient; the
// softmax itself is never stored. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dpcuda {
namespace cuda {

// loss[r] (in float, or double for double logits) and, when grad is not null,
// grad[r, :] = d loss[r] / d logits[r, :], both multiplied by scale; see csrc/cpu/cross_entropy.h
// for the formulas. Rows whose label equals ignore_index get zero loss and zero gradient. A
// label outside [0, classes) gives its row a NaN loss and gradient and, when label_error is
// not null, stores 1 there: a flag on the device that the caller reads when it synchronises
// anyway (the kernel never clears it), so that checking labels costs no synchronisation.
template <typename T, typename Acc>
cudaError_t cross_entropy_forward_backward(const T* logits, const int64_t* labels, Acc* loss,
                                           T* grad, int64_t rows, int64_t classes, double scale,
                                           double label_smoothing, int64_t ignore_index,
                                           int* label_error, cudaStream_t stream);

}  // namespace cuda
}  // namespace dpcuda
