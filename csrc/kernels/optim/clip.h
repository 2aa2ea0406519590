// Gradient clipping by the global norm inside the fused reduce-update (torch's
// clip_grad_norm_(parameters, max_norm), norm type 2), shared by the CPU kernels and the CUDA
// kernels so that both compute the same norm, the same coefficient and so the same bits.
//
// The norm's summation order is fixed, whatever the threads or the grid: each replica's shard
// of the reduced gradient is cut into chunks of kNormChunk elements from the shard's start; in a
// chunk, lane l (of kNormLanes) sums the squares of elements l, l + kNormLanes, ... in float64,
// one after another, and the lanes' sums are added as a tree (the shared-memory reduction of a
// CUDA block: lane l takes lane l + w for w = 128, 64, ..., 1). The chunks' partial sums, shard
// after shard, are combined the same way (lane l sums partials l, l + kNormLanes, ...; then the
// tree). Squares of float, half and bfloat16 values are exact in float64.
//
// Then as torch.nn.utils.clip_grad_norm_ computes it on tensors of the gradients' dtype:
// norm = sqrt(total); coef = max_norm / (norm + 1e-6), which torch evaluates (a Python number
// over a tensor) as reciprocal(norm + 1e-6) * max_norm; then at most 1 (NaN stays NaN, as
// torch.clamp). Each result is computed in the accumulation type A (float for float, half and
// bfloat16; double for float64) and stored in the gradients' dtype, as torch's tensors hold
// them. The update reads g * coef, rounded to the gradient's type.
#pragma once

#include <cstdint>

#include "update.h"

namespace dpcuda {
namespace optim {

constexpr int kNormLanes = 256;
constexpr int kNormPerLane = 16;
constexpr int64_t kNormChunk = static_cast<int64_t>(kNormLanes) * kNormPerLane;

// How many chunks (partial sums) a shard of len elements has.
inline int64_t norm_chunks(int64_t len) { return (len + kNormChunk - 1) / kNormChunk; }

DPCUDA_MATH_BEGIN

// The tree over the lanes' sums, in place (the result in s[0]).
DPCUDA_HD void lane_tree(double* s) {
  for (int w = kNormLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) s[l] = rn::add(s[l], s[l + w]);
  }
}

// The clip coefficient from the sum of squares; *norm receives the norm. round(x): x stored in
// the gradients' dtype and read back (the identity for float and double).
template <typename A, typename Round>
DPCUDA_HD A clip_coefficient(double total, double max_norm, A* norm, const Round& round) {
  const A n = round(static_cast<A>(rn::sqrt(total)));
  *norm = n;
  const A inverse = round(rn::div(A(1), round(rn::add(n, static_cast<A>(1e-6)))));
  const A coef = round(rn::mul(inverse, static_cast<A>(max_norm)));
  return coef > A(1) ? A(1) : coef;
}

DPCUDA_MATH_END
}  // namespace optim
}  // namespace dpcuda
