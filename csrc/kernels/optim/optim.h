// CUDA kernels of dpcuda's optimizers: the element formulas of update.h applied to a list of
// tensors in one launch (a multi-tensor update: each tensor gets its share of the grid's blocks).
// Torch-free: the adapter (csrc/torch/optim.cpp) checks the tensors and hands their pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "update.h"

namespace dpcuda {
namespace cuda {

// The most tensors one launch takes (the table travels as a kernel parameter).
constexpr int kOptimMaxTensors = 24;

// Up to kOptimMaxTensors tensors: parameter, gradient, state (SGD: state1 the momentum buffer;
// Adam: exp_avg, exp_avg_sq, max_exp_avg_sq; null where unused) and element count.
template <typename T>
struct OptimTable {
  T* param[kOptimMaxTensors];
  const T* grad[kOptimMaxTensors];
  T* state1[kOptimMaxTensors];
  T* state2[kOptimMaxTensors];
  T* state3[kOptimMaxTensors];
  int64_t n[kOptimMaxTensors];
  int count;
};

// Every tensor of the table updated by the optimizer `kind`, whose hyperparameters are the
// optim::kHyper float64 values at `hyper` (device memory, read by the kernel). T is float,
// double, __half or __nv_bfloat16 (computed in float and rounded to T once per stored value).
template <typename T>
cudaError_t optim_update(optim::Kind kind, const double* hyper, const OptimTable<T>& table,
                         cudaStream_t stream);

}  // namespace cuda
}  // namespace dpcuda
