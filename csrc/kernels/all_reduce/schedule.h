// The multi-device all-reduce schedules, torch-free, over the CUDA runtime API: raw pointers,
// the caller's streams, events between the devices, peer reads where the caller has enabled
// peer access and staged copies (cudaMemcpyPeerAsync into scratch memory) where not. The same
// source runs against the real runtime (the ATen adapter csrc/torch/all_reduce.cpp) and against
// the emulated one (csrc/emu, tests/cpp/emulation).
//
//   one_shot  every replica reduces every peer's whole buffer into scratch; after a barrier each
//             copies its scratch over its own buffer.
//   two_shot  replica k owns shard k: it reduces shard k of every peer (reduce-scatter, with the
//             SGD step fused in for reduce_sgd) and, after a barrier, every replica copies the
//             other shards from their owners (all-gather).
//   ring      a pipelined chain: replica r adds chunk c to the partial sum (in the accumulation
//             type) of replicas 0..r-1 once replica r-1 has produced it; the last replica's
//             chunks are then copied to all. All chain work is queued before any copy-back, so
//             the chunks flow through the devices in chunks + R - 2 steps.
// All three compute every element as acc = x[0]; acc += x[1]; ...; acc /= R (mean), so every
// replica ends with the same bits whichever algorithm ran. Replicas that share one device are
// reduced by one kernel that reads every buffer once and writes every buffer once.
//
// Ordering: a barrier (every device's stream waits for every other's) opens and closes every
// call, so buffers are complete before any peer reads them and no peer still reads scratch or a
// buffer when the call's work is done. On an error the schedule stops queueing work, still
// queues the closing barrier, and returns the first error. A call whose buffers do not match its
// plan, with more than kMaxReplicas replicas or without the planned scratch, queues nothing and
// returns cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithm.h"
#include "all_reduce.h"

namespace dpcuda {
namespace cuda {


// One buffer per replica and the device it lives on.
template <typename T>
struct ScheduleReplicas {
  std::vector<T*> data;
  std::vector<int> device;
};

// What a call needs besides the buffers: the algorithm, the devices' streams and which device
// may read which, and the scratch memory each device must provide.
struct AllReducePlan {
  AllReduceAlgorithm algorithm = AllReduceAlgorithm::kTwoShot;
  int replicas = 0;
  int64_t n = 0;
  size_t elem_size = 0;
  std::vector<int> replica_device;
  std::vector<int> devices;  // the distinct devices, in order of first appearance
  // Indexed by device ordinal: the stream each device works on, whether kernels on device d
  // may read device e's memory (peer access enabled by the caller), the scratch bytes device d
  // must provide (each a separate allocation on that device).
  std::vector<cudaStream_t> stream;
  std::vector<std::vector<bool>> readable;
  std::vector<size_t> scratch_bytes;
  // Where in device d's scratch the step records a reduce_sgd stages are put (the last
  // 256 * (replicas whose device d cannot read) bytes of scratch_bytes[d]).
  std::vector<size_t> records_offset;
};

AllReducePlan plan_all_reduce(const std::vector<int>& replica_device,
                              const std::vector<cudaStream_t>& stream,
                              const std::vector<std::vector<bool>>& readable,
                              AllReduceAlgorithm algorithm, int64_t n, size_t elem_size);

// In place: every buffer ends holding the fixed-order sum (or mean) of all of them. T is float,
// double, __half or __nv_bfloat16; scratch[d] holds plan.scratch_bytes[d] bytes on device d.
template <typename T>
cudaError_t all_reduce(const AllReducePlan& plan, const ScheduleReplicas<T>& buffers,
                       const std::vector<void*>& scratch, bool mean);

// The reduction of grads fused with torch.optim.SGD's step: every params[r] (and momenta[r],
// empty when sgd.momentum is 0) ends holding the same updated values. grads is reduced in place
// unless the plan's algorithm is two_shot (which never writes grads). records: none, or one
// step_status record per replica on its replica's device; the update obeys them as StepRecords
// says (skipped on NaN/Inf or a bad label, the gradient rescaled when scaled_by > 0), decided
// on the devices (records a device cannot read are staged into its scratch after the opening
// barrier). loss_out (on replica 0's device, or null) receives the step's loss from replica 0's
// launch. scaled_by and loss_out need records.
template <typename T>
cudaError_t reduce_sgd(const AllReducePlan& plan, const ScheduleReplicas<T>& grads,
                       const std::vector<T*>& params, const std::vector<T*>& momenta,
                       SgdArgs sgd, bool mean, const std::vector<void*>& scratch,
                       const std::vector<const double*>& records = {}, double scaled_by = 0.0,
                       double* loss_out = nullptr);

// The optimizer state of reduce_update, sharded (ZeRO-1): each list is empty (a state the
// optimizer does not have) or holds one pointer per replica, to the state of the shard that
// replica owns (the elements the two_shot split gives it, shard_range), on its device.
template <typename T>
struct UpdateState {
  std::vector<T*> state1, state2, state3;
};

// A range of the buffers whose update takes one parameter group's hyperparameters.
struct UpdateSegment {
  int64_t begin, end;
  int group;
};

// Clipping by the global norm in reduce_update (optim/clip.h: torch's clip_grad_norm_ with
// norm type 2, in an order fixed by the shards). workspace[d]: clip_workspace_bytes(plan) bytes
// on each device d of the plan (the shards' partial sums, the copies of the peers' that a device
// cannot read, the coefficient); norm_out: null, or where the norm is written, as T, on replica
// 0's device.
template <typename T>
struct ClipArgs {
  double max_norm = 0.0;
  std::vector<void*> workspace;
  T* norm_out = nullptr;
};

size_t clip_workspace_bytes(const AllReducePlan& plan);

// The reduction of grads fused with an optimizer's update (optim/update.h): every params[r] ends
// with the same updated values, and each replica updates the state of its own shard only.
// two_shot: each owner reduces its shard and updates it in one kernel (grads untouched), then
// every replica copies the other shards' weights from their owners (the all-gather moves weights
// only); one_shot and ring: the gradients are all-reduced in place, then each owner updates its
// shard from its copy and the weights are all-gathered the same way. Replicas sharing one device:
// one kernel per shard reads every gradient and writes every replica's weights. segments cover
// [0, n) in order; hyper[r][g] is group g's kHyper array on replica r's device. gather false
// (replicas sharing one device only; cudaErrorInvalidValue otherwise): only params[0] takes the
// updated weights, the caller copying them to the others before they are read. clip (null, or
// clipping by the global norm): each owner reduces its shard into its own grads[k] (for
// two_shot and replicas sharing a device; one_shot and ring all-reduce first) and takes its
// chunks' sums of squares in the same pass; after a barrier every device combines all the
// partial sums in shard order into the same coefficient (one block; peers' sums it cannot read
// are staged); then each owner updates its shard from its reduced copy, scaled. records,
// scaled_by, loss_out: as reduce_sgd's: the update (and the gather's new weights) obeys the
// records on the devices: nothing updated when one says skip (the norm then NaN), the reduced
// gradient times their fix before clipping and the update, the step's loss into loss_out.
template <typename T>
cudaError_t reduce_update(const AllReducePlan& plan, const ScheduleReplicas<T>& grads,
                          const std::vector<T*>& params, const UpdateState<T>& state,
                          optim::Kind kind, const std::vector<UpdateSegment>& segments,
                          const std::vector<std::vector<const double*>>& hyper, bool mean,
                          const std::vector<void*>& scratch, bool gather = true,
                          const ClipArgs<T>* clip = nullptr,
                          const std::vector<const double*>& records = {}, double scaled_by = 0.0,
                          double* loss_out = nullptr);

}  // namespace cuda
}  // namespace dpcuda
