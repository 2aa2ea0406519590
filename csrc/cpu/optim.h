// CPU kernels of dpcuda's optimizers: the element formulas of csrc/kernels/optim/update.h over
// one tensor's elements [begin, end), for float and double (the adapter runs half types on
// float copies, as the CUDA kernels compute them in float). Torch-free.
#pragma once

#include <cstdint>

#include "../kernels/optim/counts.h"
#include "../kernels/optim/update.h"

namespace dpcuda {
namespace cpu {

// One tensor's buffers: the parameter, its gradient and the optimizer's state (SGD: state1 is
// the momentum buffer; Adam: exp_avg, exp_avg_sq and max_exp_avg_sq). A state the update does
// not use may be null.
template <typename T>
struct OptimTensor {
  T* param;
  const T* grad;
  T* state1;
  T* state2;
  T* state3;
};

// Elements [begin, end) of t updated by the optimizer `kind` with the hyperparameters `hyper`
// (optim::kHyper float64 values).
template <typename T>
void optim_update(optim::Kind kind, const double* hyper, OptimTensor<T> t, int64_t begin,
                  int64_t end);

// The update's bookkeeping (csrc/kernels/optim/counts.h): update_hyper over `groups` rows of
// optim::kHyper values, and update_counts from `replicas` step_status records, with the formulas
// the CUDA kernels apply.
void update_hyper(optim::Kind kind, double* hyper, int64_t groups, const double* base,
                  const float* counts, int64_t n, const int64_t* first);
void update_counts(optim::Kind kind, const double* const* records, int replicas, float* counts,
                   int64_t n, double* ring, int64_t slots, int64_t* slot);

}  // namespace cpu
}  // namespace dpcuda
