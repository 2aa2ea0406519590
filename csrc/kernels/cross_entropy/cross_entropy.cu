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

template <typename T, typename acc>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                         acc* __restrict__ loss, T* __restrict__ grad, int64_t rows,
                         int64_t classes, acc scale, acc eps, int64_t ignore_index) {
  const acc eps_per_class = eps / static_cast<acc>(classes);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = logits + row * classes;
    T* g = grad != nullptr ? grad + row * classes : nullptr;
    const int64_t y = labels[row];
    if (y == ignore_index) {
      if (threadIdx.x == 0) loss[row] = acc(0);
      if (g != nullptr) {
        for (int64_t c = threadIdx.x; c < classes; c += kThreads) g[c] = from_acc<T>(acc(0));
      }
      continue;
    }
    MaxSum<acc> ms{-std::numeric_limits<acc>::infinity(), acc(0)};
    acc zsum = acc(0);
    for (int64_t c = threadIdx.x; c < classes; c += kThreads) {
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
    block_reduce(ms, zsum);
    const bool valid = y >= 0 && y < classes;
    const acc nan = std::numeric_limits<acc>::quiet_NaN();
    // A +inf logit makes the whole row NaN, as torch's log_softmax (z - max is NaN there); a
    // row of only -inf logits is NaN too (its sum of exponentials is 0).
    const acc nan_if_inf = ms.m == std::numeric_limits<acc>::infinity()
                               ? std::numeric_limits<acc>::quiet_NaN()
                               : acc(0);
    if (threadIdx.x == 0) {
      const acc lse = ms.m + math_log(ms.s) + nan_if_inf;
      // Without smoothing the sum of the logits takes no part: 0 * (-inf) for a masked class
      // would make the loss NaN where torch's is finite.
      const acc smooth = eps != acc(0) ? eps_per_class * zsum : acc(0);
      loss[row] = valid ? scale * (lse - (acc(1) - eps) * to_acc(z[y]) - smooth)
                        : nan;
    }
    if (g != nullptr) {
      const acc inv = acc(1) / ms.s + nan_if_inf;
      for (int64_t c = threadIdx.x; c < classes; c += kThreads) {
        const acc p = math_exp(to_acc(z[c]) - ms.m) * inv;
        const acc target = c == y ? (acc(1) - eps) + eps_per_class : eps_per_class;
        g[c] = from_acc<T>(valid ? scale * (p - target) : nan);
      }
    }
  }
}

}  // namespace

template <typename T, typename Acc>
cudaError_t cross_entropy_forward_backward(const T* logits, const int64_t* labels, Acc* loss,
                                           T* grad, int64_t rows, int64_t classes, double scale,
                                           double label_smoothing, int64_t ignore_index,
                                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(rows, max_grid_x());
  return launch(cross_entropy_kernel<T, Acc>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                0, stream, logits, labels, loss, grad, rows, classes, static_cast<Acc>(scale),
                static_cast<Acc>(label_smoothing), ignore_index);
}

template cudaError_t cross_entropy_forward_backward<float, float>(const float*, const int64_t*,
                                                                  float*, float*, int64_t,
                                                                  int64_t, double, double,
                                                                  int64_t, cudaStream_t);
template cudaError_t cross_entropy_forward_backward<double, double>(
    const double*, const int64_t*, double*, double*, int64_t, int64_t, double, double, int64_t,
    cudaStream_t);
template cudaError_t cross_entropy_forward_backward<__half, float>(const __half*, const int64_t*,
                                                                   float*, __half*, int64_t,
                                                                   int64_t, double, double,
                                                                   int64_t, cudaStream_t);
template cudaError_t cross_entropy_forward_backward<__nv_bfloat16, float>(
    const __nv_bfloat16*, const int64_t*, float*, __nv_bfloat16*, int64_t, int64_t, double,
    double, int64_t, cudaStream_t);

}  // namespace cuda
}  // namespace dpcuda
