#include "epilogue.h"

#include <algorithm>

#include "../common.cuh"
#include "../launch.cuh"

namespace dpcuda {
namespace cuda {
namespace {

constexpr int kForwardThreads = 256;
// The backward block is 32 columns wide (one warp reads 32 consecutive elements of a row) and
// kRowLanes rows deep; the lanes' sums are combined in shared memory in lane order.
constexpr int kRowLanes = 8;

// z and out may alias (the in-place case), so neither is __restrict__.
template <typename T, Activation A>
__global__ void activation_forward_kernel(const T* z, T* out, int64_t n) {
  using acc = acc_t<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = from_acc<T>(activate<acc>(A, to_acc(z[i])));
  }
}

template <typename T, Activation A, bool kWriteGrad, bool kBias>
__global__ void activation_backward_kernel(const T* __restrict__ grad_out,
                                           const T* __restrict__ saved, T* __restrict__ grad_pre,
                                           acc_t<T>* __restrict__ partial, int64_t rows,
                                           int64_t cols, int64_t chunk_rows) {
  using acc = acc_t<T>;
  __shared__ acc lane_sums[kRowLanes][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  acc sum = acc(0);
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) {
      const int64_t i = r * cols + c;
      acc v = to_acc(grad_out[i]);
      if (kWriteGrad) {
        v = activation_backward_value<acc>(A, v, to_acc(saved[i]));
        grad_pre[i] = from_acc<T>(v);
      }
      sum += v;
    }
  }
  if (kBias) {
    lane_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
      acc total = acc(0);
#pragma unroll
      for (int k = 0; k < kRowLanes; ++k) total += lane_sums[k][threadIdx.x];
      partial[static_cast<int64_t>(blockIdx.y) * cols + c] = total;
    }
  }
}

// Rows per partial sum: depends on the shape alone, so the summation order never changes.
// ceil(rows / 512), at least 32 and at most kMaxChunkRows (each of a block's kRowLanes lanes
// adds a chunk's rows in order: the cap bounds that sum's rounding error whatever the batch),
// unless the chunks would outnumber the grid's kMaxChunks rows.
constexpr int64_t kMaxChunkRows = 1024, kMaxChunks = 65535;
// The levels of reduce_partials_kernel's counter: enough for kMaxChunks chunks.
constexpr int kChunkLevels = 16;
static_assert(kMaxChunks < (int64_t(1) << kChunkLevels), "a level for every bit of the count");

// A column's chunk sums added pairwise in a fixed tree (a binary counter over the chunks: level
// b holds the sum of 2^b of them; the levels left at the end folded from the lowest up), onto 0:
// the rounding error grows with the log of the chunk count, as in the CPU's
// reduce_column_partials (the same tree). The levels are registers: every index below is a
// constant once the loops over them are unrolled (no local memory).
template <typename T>
__global__ void reduce_partials_kernel(const acc_t<T>* __restrict__ partial, int64_t chunks,
                                       int64_t cols, T* __restrict__ out) {
  using acc = acc_t<T>;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  acc level[kChunkLevels];
#pragma unroll
  for (int b = 0; b < kChunkLevels; ++b) level[b] = acc(0);
  for (int64_t k = 0; k < chunks; ++k) {
    acc v = partial[k * cols + c];
    bool carry = true;
#pragma unroll
    for (int b = 0; b < kChunkLevels; ++b) {
      if (carry) {
        if ((k >> b) & 1) {
          v = level[b] + v;
        } else {
          level[b] = v;
          carry = false;
        }
      }
    }
  }
  acc total = acc(0);
  bool first = true;
#pragma unroll
  for (int b = 0; b < kChunkLevels; ++b) {
    if ((chunks >> b) & 1) {
      total = first ? level[b] : level[b] + total;
      first = false;
    }
  }
  out[c] = from_acc<T>(acc(0) + total);
}

// (see kMaxChunkRows above)
int64_t chunk_rows_for(int64_t rows) {
  const int64_t by_count = std::min(kMaxChunkRows, std::max<int64_t>(32, ceil_div(rows, 512)));
  return std::max(by_count, ceil_div(rows, kMaxChunks));
}

template <typename T, Activation A, bool kWriteGrad, bool kBias>
cudaError_t launch_backward(const T* grad_out, const T* saved, T* grad_pre, acc_t<T>* partial,
                            int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t chunk_rows = chunk_rows_for(rows);
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)),
                  static_cast<unsigned>(ceil_div(rows, chunk_rows)));
  const dim3 block(32, kRowLanes);
  return launch(activation_backward_kernel<T, A, kWriteGrad, kBias>, grid, block, 0, stream,
                grad_out, saved, grad_pre, partial, rows, cols, chunk_rows);
}

}  // namespace

template <typename T>
cudaError_t activation_forward(const T* z, T* out, int64_t n, Activation act,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, kForwardThreads), max_grid_x());
  cudaError_t err = cudaSuccess;
  with_activation(act, [&](auto a) {
    err = launch(activation_forward_kernel<T, decltype(a)::value>,
                 dim3(static_cast<unsigned>(blocks)), dim3(kForwardThreads), 0, stream, z, out, n);
  });
  return err;
}

int64_t activation_backward_workspace(int64_t rows, int64_t cols) {
  if (rows == 0) return 0;
  return ceil_div(rows, chunk_rows_for(rows)) * cols;
}

template <typename T>
cudaError_t activation_backward(const T* grad_out, const T* saved, T* grad_pre, T* grad_bias,
                                void* workspace, int64_t rows, int64_t cols, Activation act,
                                cudaStream_t stream) {
  using acc = acc_t<T>;
  if (cols == 0) return cudaSuccess;
  acc* partial = static_cast<acc*>(workspace);
  if (rows > 0) {
    const bool write_grad = grad_pre != nullptr && act != Activation::kNone;
    const bool bias = grad_bias != nullptr;
    cudaError_t err = cudaSuccess;
    with_activation(act, [&](auto a) {
      constexpr Activation A = decltype(a)::value;
      if (write_grad && bias) {
        err = launch_backward<T, A, true, true>(grad_out, saved, grad_pre, partial, rows, cols,
                                                stream);
      } else if (write_grad) {
        err = launch_backward<T, A, true, false>(grad_out, saved, grad_pre, partial, rows, cols,
                                                 stream);
      } else if (bias) {
        err = launch_backward<T, A, false, true>(grad_out, saved, grad_pre, partial, rows, cols,
                                                 stream);
      }
    });
    if (err != cudaSuccess) return err;
  }
  if (grad_bias != nullptr) {
    // With no rows there are no partials: the kernel then writes zeros.
    const int64_t chunks = rows == 0 ? 0 : ceil_div(rows, chunk_rows_for(rows));
    return launch(reduce_partials_kernel<T>, dim3(static_cast<unsigned>(ceil_div(cols, 256))),
                  dim3(256), 0, stream, partial, chunks, cols, grad_bias);
  }
  return cudaSuccess;
}

cudaError_t kernel_image_status() {
  cudaFuncAttributes attributes;
  const void* kernel =
      reinterpret_cast<const void*>(&activation_forward_kernel<float, Activation::kNone>);
  const cudaError_t err = cudaFuncGetAttributes(&attributes, kernel);
  // The failed query leaves the error as the last one; a later launch must not report it.
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

#define DPCUDA_INSTANTIATE(T)                                                                  \
  template cudaError_t activation_forward<T>(const T*, T*, int64_t, Activation, cudaStream_t); \
  template cudaError_t activation_backward<T>(const T*, const T*, T*, T*, void*, int64_t,      \
                                              int64_t, Activation, cudaStream_t);

DPCUDA_FOR_EACH_TYPE(DPCUDA_INSTANTIATE)
#undef DPCUDA_INSTANTIATE

}  // namespace cuda
}  // namespace dpcuda
