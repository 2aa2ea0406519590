// CPU kernel of the fused softmax cross-entropy (LossGrad): loss and gradient of each row from
// the logits, with log-sum-exp for stability and without materialising the softmax. Torch-free.
#pragma once

#include <cstdint>

namespace dpcuda {
namespace cpu {

// For rows [row_begin, row_end) of (rows, classes) logits with labels in [0, classes) or equal to
// ignore_index (the caller checks):
//   loss[r]    = scale * (lse - (1 - eps) * z_y - eps / C * sum_c z_c)      (0 if ignored)
//   grad[r, c] = scale * (softmax_c - (1 - eps) * [c == y] - eps / C)       (0 if ignored)
// grad may be null when only the loss is wanted.
template <typename T>
void cross_entropy_rows(const T* logits, const int64_t* labels, T* loss, T* grad,
                        int64_t row_begin, int64_t row_end, int64_t classes, double scale,
                        double label_smoothing, int64_t ignore_index);

}  // namespace cpu
}  // namespace dpcuda
