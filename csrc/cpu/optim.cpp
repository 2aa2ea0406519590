#include "optim.h"

#include "target.h"

namespace dpcuda {
namespace cpu {
namespace {

// The formulas branch on the flags once per element; with the flags fixed for the whole loop
// the compiler hoists them, and the loops vectorise. Inlined into optim_update, so that each of
// its clones (target.h) compiles them for its own instruction set.
template <typename T>
inline __attribute__((always_inline)) void sgd_loop(const optim::Hyper<T>& h, OptimTensor<T> t,
                                                     int64_t begin, int64_t end) {
  T* __restrict__ p = t.param;
  const T* __restrict__ g = t.grad;
  T* __restrict__ buf = t.state1;
  if (h.has(optim::kUseMomentum)) {
    for (int64_t i = begin; i < end; ++i) {
      T b = h.has(optim::kFirst) ? T(0) : buf[i];
      p[i] = optim::sgd(g[i], p[i], b, h);
      buf[i] = b;
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      T unused = T(0);
      p[i] = optim::sgd(g[i], p[i], unused, h);
    }
  }
}

template <typename T>
inline __attribute__((always_inline)) void adam_loop(const optim::Hyper<T>& h, OptimTensor<T> t,
                                                      int64_t begin, int64_t end) {
  T* __restrict__ p = t.param;
  const T* __restrict__ g = t.grad;
  T* __restrict__ m = t.state1;
  T* __restrict__ v = t.state2;
  T* __restrict__ vmax = t.state3;
  if (h.has(optim::kAmsgrad)) {
    for (int64_t i = begin; i < end; ++i) {
      T mi = m[i], vi = v[i], wi = vmax[i];
      p[i] = optim::adam(g[i], p[i], mi, vi, wi, h);
      m[i] = mi;
      v[i] = vi;
      vmax[i] = wi;
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      T mi = m[i], vi = v[i], unused = T(0);
      p[i] = optim::adam(g[i], p[i], mi, vi, unused, h);
      m[i] = mi;
      v[i] = vi;
    }
  }
}

}  // namespace

template <typename T>
DPCUDA_CPU_CLONES void optim_update(optim::Kind kind, const double* hyper, OptimTensor<T> t,
                                    int64_t begin, int64_t end) {
  const optim::Hyper<T> h(hyper, t.state1 != nullptr, t.state3 != nullptr);
  if (kind == optim::Kind::kSgd) {
    sgd_loop<T>(h, t, begin, end);
  } else {
    adam_loop<T>(h, t, begin, end);
  }
}

template void optim_update<float>(optim::Kind, const double*, OptimTensor<float>, int64_t,
                                  int64_t);
template void optim_update<double>(optim::Kind, const double*, OptimTensor<double>, int64_t,
                                   int64_t);

void update_hyper(optim::Kind kind, double* hyper, int64_t groups, const double* base,
                  const float* counts, int64_t n, const int64_t* first) {
  for (int64_t g = 0; g < groups; ++g) {
    optim::complete_row(kind, hyper + g * optim::kHyper,
                        base != nullptr ? base + g * optim::kHyper : nullptr, counts, n, first,
                        g);
  }
}

void update_counts(optim::Kind kind, const double* const* records, int replicas, float* counts,
                   int64_t n, double* ring, int64_t slots, int64_t* slot) {
  const bool applied = optim::update_applied(records, replicas);
  for (int64_t i = 0; counts != nullptr && i < n; ++i) {
    counts[i] = optim::advanced_count(kind, counts[i], applied);
  }
  if (ring == nullptr) return;
  const int64_t s = optim::ring_slot(*slot, slots);
  double* row = ring + s * replicas * optim::kStatusRecord;
  constexpr int kRecord = optim::kStatusRecord;
  for (int r = 0; r < replicas; ++r) {
    for (int k = 0; k < kRecord; ++k) row[r * kRecord + k] = records[r][k];
  }
  *slot = (s + 1) % slots;
}

}  // namespace cpu
}  // namespace dpcuda
