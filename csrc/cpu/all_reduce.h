// CPU kernels of the replica all-reduce and of the SGD step fused into it, and the algorithms
// (one-shot, two-shot, ring) that hand threads shards and pieces of them. Torch-free (raw
// pointers, element ranges, a parallel-for passed in) so the CMake build tests them without
// libtorch; the ATen adapter (csrc/torch/all_reduce.cpp) passes at::parallel_for.
//
// The summation order is fixed: acc = x[0]; acc = acc + x[r] for r = 1..R-1; acc = acc / R for
// a mean. Every algorithm computes each element with exactly this sequence of operations, so
// every algorithm and every replica ends with the same bits.
#pragma once

#include <cstdint>
#include <functional>

#include "../kernels/all_reduce/algorithm.h"
#include "optim.h"

namespace dpcuda {
namespace cpu {

// SGD as torch.optim.SGD (dampening 0, no Nesterov), element by element:
//   g = grad + weight_decay * param;  buf = momentum * buf + g;  g = buf;  param -= lr * g
// with the momentum buffer starting at zero (so the first step's buf is g, as torch's clone).
struct Sgd {
  double lr;
  double momentum;
  double weight_decay;
};

// Elements [begin, end): the fixed-order sum (or mean) of in[0..nin), written to every
// out[0..nout). An out may be one of the ins (in place): each block is read in full before
// it is written.
template <typename T>
void reduce_range(const T* const* in, int nin, T* const* out, int nout, int64_t begin,
                  int64_t end, bool mean);

// The chain step of the ring algorithm: own[i] = partial[i] + own[i] (partial holds the sum of
// the replicas before this one), divided by `divide_by` when it is above 0 (the last replica of
// a mean). The same operations, in the same order, as reduce_range.
template <typename T>
void chain_accumulate(const T* partial, T* own, int64_t begin, int64_t end, int divide_by);

// The reduction fused with the SGD step: g = fixed-order sum (or mean) of grads[0..ngrads);
// params[0] and momenta[0] hold the current state (every replica holds the same); the updated
// parameter is written to every params[0..nparams), the updated momentum buffer to every
// momenta[0..nmomenta) (nmomenta is 0 when sgd.momentum is 0).
template <typename T>
void reduce_sgd_range(const T* const* grads, int ngrads, T* const* params, int nparams,
                      T* const* momenta, int nmomenta, int64_t begin, int64_t end, bool mean,
                      Sgd sgd);

// The SGD step alone on one replica, for gradients already reduced: the same element formula.
template <typename T>
void sgd_range(const T* grad, T* param, T* momentum, int64_t begin, int64_t end, Sgd sgd);

// The shard of a buffer of n elements that replica k of R owns in the two-shot algorithm:
// [begin, end), boundaries rounded to `align` elements (16 bytes) so vector loads stay aligned.
inline void shard_range(int64_t n, int replicas, int k, int64_t align, int64_t* begin,
                        int64_t* end) {
  int64_t per = (n + replicas - 1) / replicas;
  per = (per + align - 1) / align * align;
  const int64_t b = per * k;
  *begin = b < n ? b : n;
  *end = b + per < n ? b + per : n;
}

// Runs body(lo, hi) over subranges of [begin, end), on as many threads as it likes.
using ParallelFor =
    std::function<void(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>&)>;

// Elements of T that all_reduce and reduce_sgd need as scratch (one-shot: a copy per replica).
int64_t all_reduce_scratch(AllReduceAlgorithm algorithm, int replicas, int64_t n);

// In place: every bufs[r] ends holding the fixed-order sum (or mean) of all. On the CPU the
// replicas share one memory, so two-shot is one pass: each shard is read from every replica and
// written to every replica at once.
template <typename T>
void all_reduce(T* const* bufs, int replicas, int64_t n, bool mean, AllReduceAlgorithm algorithm,
                T* scratch, const ParallelFor& parallel);

// The reduction of grads fused with the SGD step (momenta null when sgd.momentum is 0): every
// params[r] ends with the same updated values. grads is reduced in place except by two-shot.
template <typename T>
void reduce_sgd(T* const* params, T* const* grads, T* const* momenta, int replicas, int64_t n,
                bool mean, AllReduceAlgorithm algorithm, Sgd sgd, T* scratch,
                const ParallelFor& parallel);

// A range of the flat buffers whose update has one parameter group's hyperparameters
// (hyper[group]: optim::kHyper float64 values).
struct UpdateSegment {
  int64_t begin, end;
  int group;
};

// The optimizer state of the fused reduce-update: state1..3 (optim.h's OptimTensor roles; null
// where the optimizer has none) hold one pointer per replica, to replica k's shard of the state:
// the elements shard_range(n, R, k, 16 / sizeof(T)) gives, and nothing else (ZeRO-1: each
// replica keeps the state of the shard it owns).
template <typename T>
struct ShardedState {
  T* const* state1;
  T* const* state2;
  T* const* state3;
};

// Elements [begin, end) of the reduction fused with an optimizer's update: g = fixed-order sum
// (or mean) of grads[0..ngrads); the update of `kind` (csrc/kernels/optim/update.h, the element
// formula dpcuda.optim runs) on params[0]'s values and the state (s1..s3, null where unused,
// element i at s[i - state_offset]); the new parameter written to every params[0..nparams).
// scale (null, or the clip coefficient): the update reads g * scale, rounded to T and then by
// `round` where given.
template <typename T>
void reduce_update_range(const T* const* grads, int ngrads, T* const* params, int nparams,
                         T* s1, T* s2, T* s3, int64_t state_offset, int64_t begin, int64_t end,
                         bool mean, optim::Kind kind, const double* hyper,
                         const double* scale = nullptr, void (*round)(T*, int64_t) = nullptr);

// Clipping by the global norm in reduce_update (csrc/kernels/optim/clip.h): the gradient is
// scaled by max_norm / (norm + 1e-6), at most 1, before the update. norm_out (null, or where the
// norm is written). The norm's chunks follow the two_shot split of `shards` shards aligned to
// `align` elements (0: the call's own replicas and alignment; the adapter's half types give the
// half buffers' split, which the CUDA kernels follow). round (null, or applied to the clipped
// gradient: the half types' rounding).
template <typename T>
struct Clip {
  double max_norm;
  T* norm_out = nullptr;
  int shards = 0;
  int64_t align = 0;
  void (*round)(T*, int64_t) = nullptr;
};

// The norm's canonical sums (clip.h): a chunk's sum of squares of x[0, len), len at most
// optim::kNormChunk; and the combination of the chunks' partial sums.
template <typename T>
double chunk_sum_of_squares(const T* x, int64_t len);
double combine_partials(const double* partials, int64_t count);

// The reduction of grads fused with the update: every params[r] ends with the same updated
// values; replica k's state shard is updated by shard k's owner alone. two_shot: each shard is
// reduced and updated in one pass (grads untouched); one_shot and ring: the gradients are
// all-reduced in place first, then each shard updated from its owner's copy. reduced: the
// gradients are already reduced (every grads[r] holds the same values): no reduction, each
// shard updated from grads[0]. segments cover [0, n) in order; hyper[g] is group g's array.
// gather false: only params[0] takes the updated weights (the caller copies them to the
// others before they are read), which saves the writes of replicas 1..R-1. clip (null, or
// clipping by the global norm): each owner's shard of the reduced gradient is written to its
// own grads[k] (two_shot's reduce-scatter) as its chunks' sums of squares are taken, the norm
// and coefficient follow from those partial sums, and the update reads the clipped gradient.
template <typename T>
void reduce_update(T* const* params, T* const* grads, ShardedState<T> state, int replicas,
                   int64_t n, bool mean, bool reduced, AllReduceAlgorithm algorithm,
                   optim::Kind kind, const UpdateSegment* segments, int nsegments,
                   const double* const* hyper, T* scratch, const ParallelFor& parallel,
                   bool gather = true, const Clip<T>* clip = nullptr);

}  // namespace cpu
}  // namespace dpcuda
