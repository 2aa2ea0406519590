// CUDA kernel of the fused softmax cross-entropy (LossGrad). One block per row: a first sweep
// keeps a running max and rescaled sum of exponentials (online softmax) and the sum of logits,
// a second writes the gradient; the softmax itself is never stored. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dpcuda {
namespace cuda {

// loss[r] (in float, or double for double logits) and, when grad is not null,
// grad[r, :] = d loss[r] / d logits[r, :], both multiplied by scale; see csrc/cpu/cross_entropy.h
// for the formulas. Rows whose label equals ignore_index get zero loss and zero gradient; a
// label outside [0, classes) gives NaN (the adapter rejects such labels before the launch).
template <typename T, typename Acc>
cudaError_t cross_entropy_forward_backward(const T* logits, const int64_t* labels, Acc* loss,
                                           T* grad, int64_t rows, int64_t classes, double scale,
                                           double label_smoothing, int64_t ignore_index,
                                           cudaStream_t stream);

}  // namespace cuda
}  // namespace dpcuda
