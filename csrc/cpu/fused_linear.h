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
// transposed one: 1 and rows), read where it lies, with no copy; the same values either way (a
// NaN may come out with another sign or payload: x86 passes a vector operation's first NaN
// operand, and the loops' operand orders differ), but for the sums alone (grad_pre null,
// "none") over a column-major grad_out, which are added along its columns in another fixed
// order (equal within rounding).
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

// bfloat16, given as its bit patterns, computed in float with the float pass's functions and
// rounded once to nearest even where torch rounds, so that its results are torch's within that
// rounding (a value differs from torch's where the two float results, a few float ulps apart,
// round to neighbouring bfloat16 values, or where torch's float formula cancels and this one
// does not: gelu's gradient in its left tail).
//
// The forward pass over elements [begin, end) of z: out = act(z), z being the GEMM's result
// with the bias in it (out may be z).
void bfloat16_activation_forward(const uint16_t* z, uint16_t* out, int64_t begin, int64_t end,
                                 Activation act);

// activation_backward_rows for bfloat16: g = grad_out * act'(saved) rounded once (written to
// grad_pre unless it is null), and the column sums, in float and in row order, of g as stored
// (each rounded value widened back exactly; of grad_out itself where grad_pre is null, for
// "none", in the lanes' order over a column-major grad_out, as activation_backward_rows's).
// grad_out is read where it lies, as in activation_backward_rows.
void bfloat16_activation_backward_rows(const uint16_t* grad_out, const uint16_t* saved,
                                       uint16_t* grad_pre, float* bias_partial,
                                       int64_t row_begin, int64_t row_end, int64_t cols,
                                       Activation act, int64_t go_row_stride,
                                       int64_t go_col_stride);

// bfloat16_activation_backward_rows writing g column-major: row r of column c at grad_pre + r
// + c * g_col_stride (grad_pre is g's first element, not its row row_begin). The same values
// and the same sums; g in the layout that torch's activation backward gives it over a
// column-major (transposed) grad_out, whose GEMMs can be the faster for it.
void bfloat16_activation_backward_to_columns(const uint16_t* grad_out, const uint16_t* saved,
                                             uint16_t* grad_pre, float* bias_partial,
                                             int64_t row_begin, int64_t row_end, int64_t cols,
                                             Activation act, int64_t go_row_stride,
                                             int64_t go_col_stride, int64_t g_col_stride);

// The sums alone ("none") over a column-major grad_out (row stride 1, column c at grad_out + c
// * go_col_stride) of `rows` rows, for columns [col_begin, col_end), whole columns: the bits of
// activation_backward_rows over rows [0, rows) onto zeroed sums. bfloat16: as
// bfloat16_activation_backward_rows's, in float.
template <typename T>
void column_major_bias_sums(const T* grad_out, T* out, int64_t rows, int64_t col_begin,
                            int64_t col_end, int64_t go_col_stride);

void bfloat16_column_major_bias_sums(const uint16_t* grad_out, float* out, int64_t rows,
                                     int64_t col_begin, int64_t col_end,
                                     int64_t go_col_stride);

// The bias gradient from per-chunk partial sums: out[c] = 0 + the sum over chunks k of
// partials[k * cols + c], for columns [col_begin, col_end), added pairwise in a fixed tree
// (chunk k += chunk k + s for s = 1, 2, 4, ... and k a multiple of 2s), so the rounding error
// grows with the log of the chunk count, not with the count. Overwrites those columns of
// partials. The fixed order keeps it deterministic.
template <typename T>
void reduce_column_partials(T* partials, int64_t chunks, int64_t cols, T* out,
                            int64_t col_begin, int64_t col_end);

// How many rows each partial sum of the bias gradient covers: ceil(rows / 64), at least 32 and
// at most kMaxBiasChunkRows. It depends on the shape alone, never on the thread count, so
// results are identical whatever the machine. A chunk adds its rows in row order, so its
// rounding error grows with its length: the cap bounds it (float32: a relative error within
// about (128 + log2(chunks)) * 2^-24 of the sum of |g|, the tree over the chunks included,
// whatever the batch). Uncapped, 1.25M rows of one value (0.1 * y.sum()'s gradient) summed in
// chunks of 19.5K rows to a relative error of 1.7e-4, torch's cascade sum to 6e-7 (issue #27's
// review). Up to 8192 rows the cap changes nothing.
constexpr int64_t kMaxBiasChunkRows = 128;
inline int64_t bias_chunk_rows(int64_t rows) {
  const int64_t by_count = (rows + 63) / 64;
  return by_count < 32 ? 32 : by_count > kMaxBiasChunkRows ? kMaxBiasChunkRows : by_count;
}

}  // namespace cpu
}  // namespace dpcuda
