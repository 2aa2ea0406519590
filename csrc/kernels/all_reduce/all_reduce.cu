#include "all_reduce.h"

#include <algorithm>

#include "../common.cuh"
#include "../launch.cuh"

namespace dpcuda {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// 16 bytes per load: 4 floats, 2 doubles, 8 halves.
template <typename T>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T> __device__ __forceinline__ T sgd_value(double d, float f);
template <> __device__ __forceinline__ double sgd_value<double>(double d, float) { return d; }
template <> __device__ __forceinline__ float sgd_value<float>(double, float f) { return f; }

// The SGD hyperparameters in the accumulation type A (double for float64 buffers, else float).
template <typename A>
struct SgdIn {
  A lr, mu, wd;
  bool decay;
  __device__ __forceinline__ explicit SgdIn(const SgdArgs& s)
      : lr(sgd_value<A>(s.lr_d, s.lr)),
        mu(sgd_value<A>(s.momentum_d, s.momentum)),
        wd(sgd_value<A>(s.weight_decay_d, s.weight_decay)),
        decay(s.weight_decay_d != 0.0) {}
};

// The SGD element formula in the accumulation type: returns the new parameter; `m` holds the
// momentum buffer's value and receives the new one (used only with momentum). Everything is
// passed by value or by register reference, so nothing lands in local memory.
template <typename A>
__device__ __forceinline__ A sgd_step(A g, A p, bool use_m, A& m, const SgdIn<A>& s) {
  A d = s.decay ? g + s.wd * p : g;
  if (use_m) {
    d = s.mu * m + d;
    m = d;
  }
  return p - s.lr * d;
}

template <typename T>
__device__ __forceinline__ acc_t<T> fixed_sum(const Replicas<const T>& in, int nin, int64_t i,
                                              bool mean) {
  acc_t<T> acc = to_acc(in.ptr[0][i]);
  for (int r = 1; r < nin; ++r) acc = acc + to_acc(in.ptr[r][i]);
  if (mean) acc = acc / static_cast<acc_t<T>>(nin);
  return acc;
}

// One thread per 16-byte vector of every buffer, grid-stride; the tail past the last whole
// vector is done element by element by the same threads.
template <typename T>
__global__ void reduce_kernel(const __grid_constant__ Replicas<const T> in, int nin,
                              const __grid_constant__ Replicas<T> out, int nout,
                              int64_t begin, int64_t end, bool mean, bool vectorised) {
  using V = Vec<T>;
  constexpr int K = V::kSize;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_from = begin;
  if (vectorised) {
    const int64_t nvec = (end - begin) / K;
    for (int64_t v = tid; v < nvec; v += stride) {
      const int64_t i0 = begin + v * K;
      acc_t<T> acc[K];
      V x = *reinterpret_cast<const V*>(in.ptr[0] + i0);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = to_acc(x.v[k]);
      for (int r = 1; r < nin; ++r) {
        x = *reinterpret_cast<const V*>(in.ptr[r] + i0);
#pragma unroll
        for (int k = 0; k < K; ++k) acc[k] = acc[k] + to_acc(x.v[k]);
      }
      V y;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        y.v[k] = from_acc<T>(mean ? acc[k] / static_cast<acc_t<T>>(nin) : acc[k]);
      }
      for (int o = 0; o < nout; ++o) *reinterpret_cast<V*>(out.ptr[o] + i0) = y;
    }
    scalar_from = begin + nvec * K;
  }
  for (int64_t i = scalar_from + tid; i < end; i += stride) {
    const T y = from_acc<T>(fixed_sum(in, nin, i, mean));
    for (int o = 0; o < nout; ++o) out.ptr[o][i] = y;
  }
}

template <typename T>
__global__ void reduce_sgd_kernel(const __grid_constant__ Replicas<const T> grads, int ngrads,
                                  const __grid_constant__ Replicas<T> params, int nparams,
                                  const __grid_constant__ Replicas<T> momenta, int nmomenta,
                                  int64_t begin, int64_t end, bool mean,
                                  const __grid_constant__ SgdArgs sgd) {
  const SgdIn<acc_t<T>> in(sgd);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < end; i += stride) {
    // The reduced gradient is rounded to T, as the unfused path (all-reduce, then SGD) stores
    // it, so every algorithm gives the same bits for the half types too.
    const acc_t<T> g = to_acc(from_acc<T>(fixed_sum(grads, ngrads, i, mean)));
    acc_t<T> m = nmomenta ? to_acc(momenta.ptr[0][i]) : acc_t<T>(0);
    const T p = from_acc<T>(sgd_step(g, to_acc(params.ptr[0][i]), nmomenta > 0, m, in));
    for (int o = 0; o < nparams; ++o) params.ptr[o][i] = p;
    const T mt = from_acc<T>(m);
    for (int o = 0; o < nmomenta; ++o) momenta.ptr[o][i] = mt;
  }
}

template <typename T, typename A>
__global__ void chain_kernel(const T* prev_x, const A* prev_acc, const T* own, A* work,
                             T* final_out, int64_t begin, int64_t end, int divide_by) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < end; i += stride) {
    A acc = (prev_x ? to_acc(prev_x[i]) : prev_acc[i]) + to_acc(own[i]);
    if (final_out) {
      if (divide_by > 0) acc = acc / static_cast<A>(divide_by);
      final_out[i] = from_acc<T>(acc);
    } else {
      work[i] = acc;
    }
  }
}

template <typename T>
__global__ void sgd_kernel(const T* grad, T* param, T* momentum, int64_t n,
                           const __grid_constant__ SgdArgs sgd) {
  const SgdIn<acc_t<T>> in(sgd);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    acc_t<T> m = momentum ? to_acc(momentum[i]) : acc_t<T>(0);
    param[i] = from_acc<T>(sgd_step(to_acc(grad[i]), to_acc(param[i]), momentum != nullptr, m,
                                    in));
    if (momentum) momentum[i] = from_acc<T>(m);
  }
}

int blocks_for(int64_t work) {
  return static_cast<int>(std::max<int64_t>(1, std::min(ceil_div(work, kThreads), max_grid_x())));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

template <typename T>
cudaError_t reduce_range(Replicas<const T> in, int nin, Replicas<T> out, int nout,
                         int64_t begin, int64_t end, bool mean, cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  bool vectorised = true;
  for (int r = 0; r < nin; ++r) vectorised = vectorised && aligned16(in.ptr[r] + begin);
  for (int o = 0; o < nout; ++o) vectorised = vectorised && aligned16(out.ptr[o] + begin);
  const int64_t work = vectorised ? ceil_div(end - begin, Vec<T>::kSize) : end - begin;
  return launch(reduce_kernel<T>, dim3(blocks_for(work)), dim3(kThreads), 0, stream, in, nin, out,
                nout, begin, end, mean, vectorised);
}

template <typename T>
cudaError_t reduce_sgd_range(Replicas<const T> grads, int ngrads, Replicas<T> params,
                             int nparams, Replicas<T> momenta, int nmomenta, int64_t begin,
                             int64_t end, bool mean, SgdArgs sgd, cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  return launch(reduce_sgd_kernel<T>, dim3(blocks_for(end - begin)), dim3(kThreads), 0, stream,
                grads, ngrads, params, nparams, momenta, nmomenta, begin, end, mean, sgd);
}

template <typename T, typename A>
cudaError_t chain_accumulate(const T* prev_x, const A* prev_acc, const T* own, A* work,
                             T* final_out, int64_t begin, int64_t end, int divide_by,
                             cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  return launch(chain_kernel<T, A>, dim3(blocks_for(end - begin)), dim3(kThreads), 0, stream,
                prev_x, prev_acc, own, work, final_out, begin, end, divide_by);
}

template <typename T>
cudaError_t sgd_range(const T* grad, T* param, T* momentum, int64_t n, SgdArgs sgd,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return launch(sgd_kernel<T>, dim3(blocks_for(n)), dim3(kThreads), 0, stream, grad, param,
                momentum, n, sgd);
}

#define DPCUDA_INSTANTIATE(T)                                                                  \
  template cudaError_t reduce_range<T>(Replicas<const T>, int, Replicas<T>, int, int64_t,      \
                                       int64_t, bool, cudaStream_t);                           \
  template cudaError_t reduce_sgd_range<T>(Replicas<const T>, int, Replicas<T>, int,           \
                                           Replicas<T>, int, int64_t, int64_t, bool, SgdArgs,  \
                                           cudaStream_t);                                      \
  template cudaError_t chain_accumulate<T, acc_t<T>>(const T*, const acc_t<T>*, const T*,      \
                                                     acc_t<T>*, T*, int64_t, int64_t, int,     \
                                                     cudaStream_t);                            \
  template cudaError_t sgd_range<T>(const T*, T*, T*, int64_t, SgdArgs, cudaStream_t);

DPCUDA_FOR_EACH_TYPE(DPCUDA_INSTANTIATE)
#undef DPCUDA_INSTANTIATE

}  // namespace cuda
}  // namespace dpcuda
