// CUDA kernels of the replica all-reduce and of the SGD step fused into it. Torch-free: the
// adapter (csrc/torch/all_reduce.cpp) owns the algorithm — which device runs which range,
// peer access, staging and the events that order the devices — and these launch one kernel
// each on the stream they are given.
//
// Pointers may live on other devices: a kernel reads a peer's memory directly when peer access
// is enabled (the adapter stages a copy into local memory when it is not). The summation order
// is the CPU's (csrc/cpu/all_reduce.h): acc = x[0]; acc += x[r] for r = 1..R-1; acc /= R for a
// mean, accumulated in float for the half types, so every algorithm gives the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../optim/update.h"

namespace dpcuda {
namespace cuda {

// The most replicas one call handles (kernel arguments carry their pointers by value).
constexpr int kMaxReplicas = 16;

template <typename T>
struct Replicas {
  T* ptr[kMaxReplicas];
};

// The wrapper's SGD hyperparameters, rounded to the accumulation type in the kernels.
struct SgdArgs {
  double lr;
  double momentum;
  double weight_decay;
};

// The step_status records (see step_status below: kRecord doubles each) that an update obeys,
// so that a step needs no host read between its status and its update. The update writes
// nothing when any record says NaN/Inf (record[1]) or a bad label (record[2]). n == 0: no
// records, the update applies as given. Each pointer must be readable by the kernel's device
// (the schedules stage records a device cannot read).
//
// scaled_by > 0: the replicas' losses and gradients were scaled by 1 / scaled_by labels (rows),
// before the rows that count (the labels not ignored, record[3] summed over the records) were
// known; the reduced gradient is multiplied by fix = scaled_by / rows (1 when no row counts: the
// gradient is then 0), rounded to the buffer type, before the SGD step. fix is exactly 1 when
// rows == scaled_by, so that case gives the bits of a gradient scaled by 1 / rows from the start.
// loss_out, when not null: block 0 writes the step's loss there (whether or not the update is
// skipped): the records' losses summed in replica order from 0.0, times fix when scaled_by > 0
// (NaN when no row counts).
constexpr int kRecord = 4;
struct StepRecords {
  const double* ptr[kMaxReplicas];
  int n;
  double scaled_by;
  double* loss_out;
};

// Elements [begin, end) of each buffer: the fixed-order sum (or mean) of in.ptr[0..nin),
// written to out.ptr[0..nout). An output may alias an input only at the same element (each
// thread reads its elements from every input before writing them).
template <typename T>
cudaError_t reduce_range(Replicas<const T> in, int nin, Replicas<T> out, int nout,
                         int64_t begin, int64_t end, bool mean, cudaStream_t stream);

// The reduction fused with SGD (torch.optim.SGD's formula, dampening 0): g = fixed-order sum
// (or mean) of grads; param and momentum read from params.ptr[0] / momenta.ptr[0]; the updated
// values written to every params.ptr[0..nparams) and momenta.ptr[0..nmomenta); nothing written
// when a record says skip.
template <typename T>
cudaError_t reduce_sgd_range(Replicas<const T> grads, int ngrads, Replicas<T> params,
                             int nparams, Replicas<T> momenta, int nmomenta, int64_t begin,
                             int64_t end, bool mean, SgdArgs sgd, StepRecords records,
                             cudaStream_t stream);

// The reduction fused with an optimizer's update (dpcuda.optim: optim/update.h's formulas), on
// elements [begin, end): g = fixed-order sum (or mean) of grads, rounded to T (as the unfused
// path stores it); the update of `kind` with the kHyper values at hyper (device memory) on
// params.ptr[0]'s values and the state s1..s3 (null where the optimizer has none; element i at
// s[i]: the caller offsets the pointers); the new parameter written to every
// params.ptr[0..nparams), the new state to s1..s3. records: as reduce_sgd_range's (nothing
// written when one says skip; g times their fix, rounded to T). scale (device memory, or null):
// the clip coefficient; the update reads g (times fix) * scale, rounded to T (clip.h).
template <typename T>
cudaError_t reduce_update_range(Replicas<const T> grads, int ngrads, Replicas<T> params,
                                int nparams, T* s1, T* s2, T* s3, int64_t begin, int64_t end,
                                bool mean, optim::Kind kind, const double* hyper,
                                cudaStream_t stream, const double* scale = nullptr,
                                StepRecords records = {});

// Clipping's pass over one shard of len elements (optim/clip.h's order): block c takes chunk c
// (kNormChunk elements): the fixed-order sum (or mean) of in.ptr[0..nin), rounded to T, written
// to out (null: read only; out may be one of the ins) and its sum of squares to partials[c]
// (norm_chunks(len) values). records: their fix applied to the rounded sum (rounded to T again)
// before it is written and squared; block 0 writes records.loss_out where given.
template <typename T>
cudaError_t reduce_square_sum(Replicas<const T> in, int nin, T* out, int64_t len, bool mean,
                              double* partials, cudaStream_t stream, StepRecords records = {});

// The shards' partial sums, in shard order, as one device reads them.
struct NormParts {
  const double* ptr[kMaxReplicas];
  int64_t count[kMaxReplicas];
  int n;
};

// The clip coefficient (clip.h) from every shard's partial sums, in one block: written to *coef
// (device memory, a double holding the accumulation type's value) and the norm to *norm_out as
// T (null: not written; NaN when a record says skip).
template <typename T>
cudaError_t clip_coefficient(const NormParts& parts, double max_norm, double* coef, T* norm_out,
                             cudaStream_t stream, StepRecords records = {});

// The ring (chain) step in the accumulation type A (float for half types, else T):
// acc = (first ? A(prev_x[i]) : prev_acc[i]) + A(own[i]); written to work[i], or, on the last
// replica, divided by divide_by when above 0 and stored to own[i] as T.
template <typename T, typename A>
cudaError_t chain_accumulate(const T* prev_x, const A* prev_acc, const T* own, A* work,
                             T* final_out, int64_t begin, int64_t end, int divide_by,
                             cudaStream_t stream);

// The check a step makes before its update, in one launch: record[0] = the replica's loss
// (the sum of loss[0, loss_n) in float64, in an order that depends on loss_n alone; NaN where
// loss is null), record[1] = 1 if an element of grad[0, n) is NaN or
// +-Inf else 0, record[2] = *label_flag (the loss kernel's bad-label flag; 0 where null),
// record[3] = how many of labels[0, labels_n) are not ignore_index (0 where labels is null), and
// *label_flag set back to 0 when clear_flag. Each block judges its elements, and the last block
// to finish (an atomic ticket) combines the verdicts and writes the record. work holds
// step_status_workspace() ints: zero when first used, it is left zero again by every launch.
// L is float or double.
template <typename T, typename L>
cudaError_t step_status(const T* grad, int64_t n, const L* loss, int64_t loss_n,
                        const int64_t* labels, int64_t labels_n, int64_t ignore_index,
                        int* label_flag, bool clear_flag, int* work, double* record,
                        cudaStream_t stream);

// The ints step_status needs in `work`.
int64_t step_status_workspace();

// SGD alone on gradients already reduced (the same element formula); nothing written when a
// record says skip.
template <typename T>
cudaError_t sgd_range(const T* grad, T* param, T* momentum, int64_t n, SgdArgs sgd,
                      StepRecords records, cudaStream_t stream);

}  // namespace cuda
}  // namespace dpcuda
