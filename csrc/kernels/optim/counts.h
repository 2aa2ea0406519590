// The bookkeeping of a fused update that DataParallel keeps on the device (dpcuda/parallel/
// fused_update.py, graphed.py), so that a non-blocking step reads no value on the host, each
// part one small launch: a graphed step's graph holds two nodes for it where it held eight to
// eleven (a copy, an index_select, adds, a stack, a comparison, an `all`, an index_copy_, a
// remainder). This header holds the formulas, shared by the CUDA kernels (declared in optim.h)
// and their CPU twin (csrc/cpu/optim.h), so both give the same bits; torch-free and CUDA-free,
// as update.h. The adapter (csrc/torch/optim.cpp) checks the tensors.
//
// counts: Adam's step counts, one per parameter (float32, as torch keeps state["step"]), or
// SGD's momentum-begun flags, one per parameter group (float32 0 or 1).
//
//   update_hyper   before the update: each group's kHyper row completed from the counts (the
//                  host writes the rest): base (null, or the rows a graph copies in first, from
//                  the host's last write) copied over the row; Adam: kStep = counts[first[g]] +
//                  1 (first[g]: the parameter whose count stands for group g; an index outside
//                  counts makes the step NaN, so the update writes NaN, never a wrong number);
//                  SGD with counts: kFirst added to kFlags where group g's momentum has not
//                  begun.
//   update_counts  after the update, from the replicas' step_status records (none: the update
//                  applied): whether the update applied (no record says NaN/Inf or a bad label,
//                  as the update decides); Adam: every count + 1 where it applied; SGD: every
//                  flag 1 where it applied; with a ring (slots rows of `replicas` records), the
//                  records into row *slot and *slot advanced modulo slots (a slot outside
//                  [0, slots) taken modulo slots first).
#pragma once

#include <cstdint>

#include "update.h"

namespace dpcuda {
namespace optim {

// The doubles of a step_status record (cuda::kRecord: [loss, NaN/Inf, bad label, rows]).
constexpr int kStatusRecord = 4;

DPCUDA_MATH_BEGIN

// Group g's row, completed (update_hyper above).
DPCUDA_HD void complete_row(Kind kind, double* row, const double* base, const float* counts,
                            int64_t n, const int64_t* first, int64_t g) {
  if (base != nullptr) {
    for (int k = 0; k < kHyper; ++k) row[k] = base[k];
  }
  if (kind == Kind::kAdam) {
    const int64_t i = first[g];
    row[kStep] = i >= 0 && i < n ? static_cast<double>(counts[i]) + 1.0 : NAN;
  } else if (counts != nullptr) {
    row[kFlags] += (1.0 - static_cast<double>(counts[g])) * static_cast<double>(kFirst);
  }
}

// Whether the update applied: no record says NaN/Inf (record[1]) or a bad label (record[2]),
// each compared with 0 as the update compares them (a NaN flag says skip).
DPCUDA_HD bool update_applied(const double* const* records, int n) {
  for (int r = 0; r < n; ++r) {
    if (!(records[r][1] == 0.0 && records[r][2] == 0.0)) return false;
  }
  return true;
}

// A count after an update that applied or not.
DPCUDA_HD float advanced_count(Kind kind, float count, bool applied) {
  if (kind == Kind::kAdam) return applied ? count + 1.0f : count;
  return applied ? 1.0f : count;
}

// A ring slot in [0, slots).
DPCUDA_HD int64_t ring_slot(int64_t slot, int64_t slots) {
  const int64_t s = slot % slots;
  return s < 0 ? s + slots : s;
}

DPCUDA_MATH_END
}  // namespace optim

}  // namespace dpcuda
