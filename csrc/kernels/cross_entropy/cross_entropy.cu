#include "cross_entropy.h"

#include <algorithm>
#include <limits>

#include "../activation.h"
#include "../common.cuh"
#include "../launch.cuh"

namespace dpcuda {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Up to this many classes a row takes a group of lanes within a warp (cross_entropy_group_kernel);
// above it, a block (cross_entropy_block_kernel). At 10 classes a 256-thread block per row left
// 246 threads idle and still paid 8 butterfly steps and the cross-warp pass.
constexpr int64_t kGroupMaxClasses = 1024;

// Lanes per row of the group kernel: the class count rounded up to a power of two, at most 32.
inline int group_width(int64_t classes) {
  int width = 1;
  while (width < 32 && width < classes) width *= 2;
  return width;
}

// Running (max, sum of exp(z - max)) pair of the online softmax.
template <typename acc>
struct MaxSum {
  acc m;
  acc s;
};

template <typename acc>
__device__ __forceinline__ MaxSum<acc> combine(MaxSum<acc> a, MaxSum<acc> b) {
  const acc m = a.m > b.m ? a.m : b.m;
  // Both sides hold only masked classes: their sums are 0, or NaN if a NaN logit was seen
  // (a NaN never becomes the max), which must survive.
  if (m == -std::numeric_limits<acc>::infinity()) return {m, a.s + b.s};
  return {m, a.s * math_exp(a.m - m) + b.s * math_exp(b.m - m)};
}

// Block-wide reduction in a fixed order (butterfly inside each warp, then the warps in
// sequence), so a row's loss is the same on every run.
template <typename acc>
__device__ void block_reduce(MaxSum<acc>& ms, acc& zsum) {
  __shared__ MaxSum<acc> warp_ms[kWarps];
  __shared__ acc warp_z[kWarps];
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum<acc> other{__shfl_xor_sync(0xffffffffu, ms.m, offset),
                      __shfl_xor_sync(0xffffffffu, ms.s, offset)};
    ms = combine(ms, other);
    zsum += __shfl_xor_sync(0xffffffffu, zsum, offset);
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    warp_ms[warp] = ms;
    warp_z[warp] = zsum;
  }
  __syncthreads();
  MaxSum<acc> total = warp_ms[0];
  acc ztotal = warp_z[0];
  for (int w = 1; w < kWarps; ++w) {
    total = combine(total, warp_ms[w]);
    ztotal += warp_z[w];
  }
  ms = total;
  zsum = ztotal;
  // The shared arrays are reused by the next row of a grid-stride loop.
  __syncthreads();
}

// The online softmax's running pair over one thread's classes c = first, first + step, ...
template <typename T, typename acc>
__device__ __forceinline__ void accumulate_row(const T* z, int64_t classes, int64_t first,
                                               int64_t step, MaxSum<acc>& ms, acc& zsum) {
  for (int64_t c = first; c < classes; c += step) {
    const acc v = to_acc(z[c]);
    if (v > ms.m) {
      ms.s = ms.s * math_exp(ms.m - v) + acc(1);
      ms.m = v;
    } else if (v != -std::numeric_limits<acc>::infinity()) {
      // A masked class (-inf) adds nothing; exp(v - m) would be NaN while m is still -inf.
      // NaN takes this branch and makes the sum NaN.
      ms.s += math_exp(v - ms.m);
    }
    zsum += v;
  }
}

// A row's loss (written by the thread with first == 0) and gradient (classes c = first,
// first + step, ...) from its reduced pair and sum of logits.
template <typename T, typename acc>
__device__ __forceinline__ void finish_row(const T* z, int64_t y, acc* loss, T* g,
                                           int64_t classes, int64_t first, int64_t step,
                                           MaxSum<acc> ms, acc zsum, acc scale, acc eps,
                                           int* label_error) {
  const acc eps_per_class = eps / static_cast<acc>(classes);
  const bool valid = y >= 0 && y < classes;
  const acc nan = std::numeric_limits<acc>::quiet_NaN();
  // A +inf logit makes the whole row NaN, as torch's log_softmax (z - max is NaN there); a
  // row of only -inf logits is NaN too (its sum of exponentials is 0).
  const acc nan_if_inf = ms.m == std::numeric_limits<acc>::infinity() ? nan : acc(0);
  if (first == 0) {
    const acc lse = ms.m + math_log(ms.s) + nan_if_inf;
    // Without smoothing the sum of the logits takes no part: 0 * (-inf) for a masked class
    // would make the loss NaN where torch's is finite.
    const acc smooth = eps != acc(0) ? eps_per_class * zsum : acc(0);
    *loss = valid ? scale * (lse - (acc(1) - eps) * to_acc(z[y]) - smooth) : nan;
    // Many threads may find a bad label at once: an atomic, so that no store is a race.
    if (!valid && label_error != nullptr) atomicOr(label_error, 1);
  }
  if (g != nullptr) {
    const acc inv = acc(1) / ms.s + nan_if_inf;
    for (int64_t c = first; c < classes; c += step) {
      const acc p = math_exp(to_acc(z[c]) - ms.m) * inv;
      const acc target = c == y ? (acc(1) - eps) + eps_per_class : eps_per_class;
      g[c] = from_acc<T>(valid ? scale * (p - target) : nan);
    }
  }
}

// An ignored row: loss 0, and torch's gradient, log_softmax's backward of a zero gradient
// (0 - exp(log_softmax(z)) * 0): NaN throughout when the row's log-sum-exp is NaN (a NaN or +inf
// logit, or every logit -inf; accumulate_row's pair says which), 0 otherwise.
template <typename T, typename acc>
__device__ __forceinline__ void finish_ignored_row(acc* loss, T* g, int64_t classes,
                                                   int64_t first, int64_t step,
                                                   MaxSum<acc> ms) {
  if (first == 0) *loss = acc(0);
  if (g == nullptr) return;
  const acc inf = std::numeric_limits<acc>::infinity();
  const bool nan_row = ms.s != ms.s || ms.m == inf || ms.m == -inf;
  const T fill = from_acc<T>(nan_row ? std::numeric_limits<acc>::quiet_NaN() : acc(0));
  for (int64_t c = first; c < classes; c += step) g[c] = fill;
}

// Rows of many classes: one block per row.
template <typename T, typename acc>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_block_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                               acc* __restrict__ loss, T* __restrict__ grad, int64_t rows,
                               int64_t classes, acc scale, acc eps, int64_t ignore_index,
                               int* label_error) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = logits + row * classes;
    T* g = grad != nullptr ? grad + row * classes : nullptr;
    const int64_t y = labels[row];
    MaxSum<acc> ms{-std::numeric_limits<acc>::infinity(), acc(0)};
    acc zsum = acc(0);
    // Ignored rows too: their gradient depends on whether the log-sum-exp is NaN.
    accumulate_row(z, classes, threadIdx.x, kThreads, ms, zsum);
    block_reduce(ms, zsum);
    if (y == ignore_index) {
      finish_ignored_row(loss + row, g, classes, threadIdx.x, kThreads, ms);
      continue;
    }
    finish_row(z, y, loss + row, g, classes, threadIdx.x, kThreads, ms, zsum, scale, eps,
               label_error);
  }
}

// Rows of up to kGroupMaxClasses classes: a group of `width` lanes per row (a power of two up
// to 32: the class count rounded up), kThreads / width rows per block at a time, reduced with
// width-wide butterflies (no shared memory, no barrier). Every lane of a warp runs every
// iteration, even for a row past the end or an ignored one, since the shuffles take the whole
// warp; the grid-stride loop's bound is the same for the whole block. At least 2 blocks per
// SM: without that bound ptxas spilled 12 bytes of the float kernel on sm_80 (at 40 registers).
template <typename T, typename acc>
__global__ void __launch_bounds__(kThreads, 2)
    cross_entropy_group_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                               acc* __restrict__ loss, T* __restrict__ grad, int64_t rows,
                               int64_t classes, acc scale, acc eps, int64_t ignore_index,
                               int* label_error, int width) {
  const int groups = kThreads / width;
  const int lane = static_cast<int>(threadIdx.x) % width;
  const int group = static_cast<int>(threadIdx.x) / width;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const int64_t y = active ? labels[row] : 0;
    const bool ignored = active && y == ignore_index;
    const T* z = logits + (active ? row : 0) * classes;
    MaxSum<acc> ms{-std::numeric_limits<acc>::infinity(), acc(0)};
    acc zsum = acc(0);
    if (active) accumulate_row(z, classes, lane, width, ms, zsum);
    for (int offset = width / 2; offset > 0; offset >>= 1) {
      // Lanes offset apart belong to the same group: groups are aligned runs of width lanes.
      MaxSum<acc> other{__shfl_xor_sync(0xffffffffu, ms.m, offset),
                        __shfl_xor_sync(0xffffffffu, ms.s, offset)};
      ms = combine(ms, other);
      zsum += __shfl_xor_sync(0xffffffffu, zsum, offset);
    }
    if (!active) continue;
    T* g = grad != nullptr ? grad + row * classes : nullptr;
    if (ignored) {
      finish_ignored_row(loss + row, g, classes, lane, width, ms);
      continue;
    }
    finish_row(z, y, loss + row, g, classes, lane, width, ms, zsum, scale, eps, label_error);
  }
}

}  // namespace

template <typename T, typename Acc>
cudaError_t cross_entropy_forward_backward(const T* logits, const int64_t* labels, Acc* loss,
                                           T* grad, int64_t rows, int64_t classes, double scale,
                                           double label_smoothing, int64_t ignore_index,
                                           int* label_error, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (classes > kGroupMaxClasses) {
    const int64_t blocks = std::min<int64_t>(rows, max_grid_x());
    return launch(cross_entropy_block_kernel<T, Acc>, dim3(static_cast<unsigned>(blocks)),
                  dim3(kThreads), 0, stream, logits, labels, loss, grad, rows, classes,
                  static_cast<Acc>(scale), static_cast<Acc>(label_smoothing), ignore_index,
                  label_error);
  }
  const int width = group_width(classes);
  const int64_t blocks = std::min<int64_t>(ceil_div(rows, kThreads / width), max_grid_x());
  return launch(cross_entropy_group_kernel<T, Acc>, dim3(static_cast<unsigned>(blocks)),
                dim3(kThreads), 0, stream, logits, labels, loss, grad, rows, classes,
                static_cast<Acc>(scale), static_cast<Acc>(label_smoothing), ignore_index,
                label_error, width);
}

#define DPCUDA_INSTANTIATE(T, Acc)                                                             \
  template cudaError_t cross_entropy_forward_backward<T, Acc>(                                  \
      const T*, const int64_t*, Acc*, T*, int64_t, int64_t, double, double, int64_t, int*,      \
      cudaStream_t);
DPCUDA_INSTANTIATE(float, float)
DPCUDA_INSTANTIATE(double, double)
DPCUDA_INSTANTIATE(__half, float)
DPCUDA_INSTANTIATE(__nv_bfloat16, float)
#undef DPCUDA_INSTANTIATE

}  // namespace cuda
}  // namespace dpcuda
