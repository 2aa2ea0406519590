// CPU kernels of the fused linear layer: the passes that follow and precede the GEMMs. Torch-free
// (raw pointers, row ranges) so the CMake build tests them without libtorch; the ATen adapter
// parallelises them by handing each thread a range of rows.
#pragma once

#include <cstdint>

#include "../kernels/activation.h"

namespace dpcuda {
namespace cpu {

// Rows [row_begin, row_end) of a row-major (rows, cols) matrix `out` that holds x @ W^T on entry:
// z = out + bias (bias may be null), pre = z when pre is not null, out = act(z).
template <typename T>
void bias_activation_forward(T* out, T* pre, const T* bias, int64_t row_begin, int64_t row_end,
                             int64_t cols, Activation act);

// The same for a layer that keeps its pre-activation, with the GEMM's result in `pre` instead:
// rows [row_begin, row_end) of pre hold x @ W^T on entry; z = pre + bias is written back to pre
// (bias may be null: pre is then read only), out = act(z). The bits of bias_activation_forward;
// without a bias one stream fewer (no copy of z).
template <typename T>
void pre_activation_forward(T* out, T* pre, const T* bias, int64_t row_begin, int64_t row_end,
                            int64_t cols, Activation act);

// Rows [row_begin, row_end): g = grad_out * act'(saved), written to grad_pre unless it is null
// (activation "none", where g is grad_out itself), and the column sums of g over these rows
// written to bias_partial[0, cols) when it is not null. saved and grad_pre are row-major
// (rows, cols); grad_out's element (r, c) is at grad_out[r * go_row_stride + c * go_col_stride]
// (row-major: cols and 1; an expanded gradient, as sum() and mean() hand back: 0 and 0; a
// transposed one: 1 and rows), read where it lies, with no copy; the same bits either way.
template <typename T>
void activation_backward_rows(const T* grad_out, const T* saved, T* grad_pre, T* bias_partial,
                              int64_t row_begin, int64_t row_end, int64_t cols, Activation act,
                              int64_t go_row_stride, int64_t go_col_stride);

template <typename T>
void activation_backward_rows(const T* grad_out, const T* saved, T* grad_pre, T* bias_partial,
                              int64_t row_begin, int64_t row_end, int64_t cols,
                              Activation act) {
  activation_backward_rows<T>(grad_out, saved, grad_pre, bias_partial, row_begin, row_end, cols,
                              act, cols, 1);
}

// Rows [row_begin, row_end) of a bfloat16 (rows, cols) matrix g, given as its bit patterns, its
// element (r, c) at g[r * row_stride + c * col_stride] (read where it lies, as
// activation_backward_rows reads grad_out): the column sums written to partial[0, cols), each
// value widened to float exactly (bfloat16 is the upper half of a float) and added in row order:
// the bits of activation_backward_rows's sums for "none" over g converted to float, without the
// converted copy.
void bfloat16_column_sums(const uint16_t* g, float* partial, int64_t row_begin, int64_t row_end,
                          int64_t cols, int64_t row_stride, int64_t col_stride);

// The bias gradient from per-chunk partial sums: out[c] = sum over chunks k, in order, of
// partials[k * cols + c], for columns [col_begin, col_end). The fixed order keeps it deterministic.
template <typename T>
void reduce_column_partials(const T* partials, int64_t chunks, int64_t cols, T* out,
                            int64_t col_begin, int64_t col_end);

// How many rows each partial sum of the bias gradient covers. It depends on the shape alone,
// never on the thread count, so results are identical whatever the machine.
inline int64_t bias_chunk_rows(int64_t rows) {
  const int64_t by_count = (rows + 63) / 64;
  return by_count > 32 ? by_count : 32;
}

}  // namespace cpu
}  // namespace dpcuda
