// CUDA kernels of dpcuda's optimizers: the element formulas of update.h applied to a list of
// tensors in one launch (a multi-tensor update: each tensor gets its share of the grid's blocks),
// and the fused update's bookkeeping on the device (counts.h's formulas).
// Torch-free: the adapter (csrc/torch/optim.cpp) checks the tensors and hands their pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../all_reduce/all_reduce.h"
#include "counts.h"
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

// The records update_counts reads: one step_status record per replica (cuda::kRecord doubles
// each), on the launch's device.
struct CountRecords {
  const double* ptr[kMaxReplicas];
  int n;
};

// counts.h's update_hyper over `groups` rows of kHyper doubles at hyper (base: as many rows, or
// null; counts: n floats, or null for SGD without momentum; first: groups int64, Adam only).
// One block.
cudaError_t update_hyper(optim::Kind kind, double* hyper, int64_t groups, const double* base,
                         const float* counts, int64_t n, const int64_t* first,
                         cudaStream_t stream);

// counts.h's update_counts: counts (n floats, or null), ring (slots x records.n x kRecord
// doubles, or null) and slot (one int64, with ring). One block.
cudaError_t update_counts(optim::Kind kind, const CountRecords& records, float* counts,
                          int64_t n, double* ring, int64_t slots, int64_t* slot,
                          cudaStream_t stream);

}  // namespace cuda
}  // namespace dpcuda
