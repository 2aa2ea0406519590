#include "optim.h"

#include <algorithm>

#include "../common.cuh"
#include "../launch.cuh"

namespace dpcuda {
namespace cuda {
namespace {

constexpr int kThreads = 256;
// The most blocks one tensor gets; a larger tensor is covered by a grid-stride loop.
constexpr int64_t kMaxBlocksPerTensor = 1024;

// Block b works on tensor b / per_tensor, grid-striding over its elements with the other
// per_tensor - 1 blocks of that tensor. Every element is read and written by one thread.
template <typename T>
__global__ void optim_kernel(optim::Kind kind, const double* hyper,
                             const __grid_constant__ OptimTable<T> table, int per_tensor) {
  using A = acc_t<T>;
  const int index = static_cast<int>(blockIdx.x) / per_tensor;
  const int64_t first = static_cast<int64_t>(blockIdx.x % per_tensor) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(per_tensor) * blockDim.x;
  const optim::Hyper<A> h(hyper, table.state1[index] != nullptr,
                           table.state3[index] != nullptr);
  const int64_t n = table.n[index];
  T* p = table.param[index];
  const T* g = table.grad[index];
  if (kind == optim::Kind::kSgd) {
    T* buf = table.state1[index];
    const bool use_buf = h.has(optim::kUseMomentum);
    const bool first_step = h.has(optim::kFirst);
    for (int64_t i = first; i < n; i += stride) {
      A b = use_buf && !first_step ? to_acc(buf[i]) : A(0);
      p[i] = from_acc<T>(optim::sgd(to_acc(g[i]), to_acc(p[i]), b, h));
      if (use_buf) buf[i] = from_acc<T>(b);
    }
  } else {
    T* m = table.state1[index];
    T* v = table.state2[index];
    T* vmax = table.state3[index];
    const bool ams = h.has(optim::kAmsgrad);
    for (int64_t i = first; i < n; i += stride) {
      A mi = to_acc(m[i]), vi = to_acc(v[i]), wi = ams ? to_acc(vmax[i]) : A(0);
      p[i] = from_acc<T>(optim::adam(to_acc(g[i]), to_acc(p[i]), mi, vi, wi, h));
      m[i] = from_acc<T>(mi);
      v[i] = from_acc<T>(vi);
      if (ams) vmax[i] = from_acc<T>(wi);
    }
  }
}

}  // namespace

template <typename T>
cudaError_t optim_update(optim::Kind kind, const double* hyper, const OptimTable<T>& table,
                         cudaStream_t stream) {
  if (table.count <= 0) return cudaSuccess;
  if (table.count > kOptimMaxTensors) return cudaErrorInvalidValue;
  int64_t largest = 0;
  for (int i = 0; i < table.count; ++i) largest = std::max(largest, table.n[i]);
  if (largest == 0) return cudaSuccess;
  const int64_t cap = std::max<int64_t>(1, max_grid_x() / table.count);
  const int per_tensor = static_cast<int>(
      std::min({ceil_div(largest, kThreads), kMaxBlocksPerTensor, cap}));
  return launch(optim_kernel<T>, dim3(static_cast<unsigned int>(per_tensor * table.count)),
                dim3(kThreads), 0, stream, kind, hyper, table, per_tensor);
}

#define DPCUDA_INSTANTIATE(T)                                                               \
  template cudaError_t optim_update<T>(optim::Kind, const double*, const OptimTable<T>&,   \
                                       cudaStream_t);
DPCUDA_FOR_EACH_TYPE(DPCUDA_INSTANTIATE)
#undef DPCUDA_INSTANTIATE

}  // namespace cuda
}  // namespace dpcuda
