#include "all_reduce.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "../kernels/optim/clip.h"
#include "target.h"

namespace dpcuda {
namespace cpu {
namespace {

// Elements per block: the accumulator of one block stays in L1 while every input streams in.
constexpr int64_t kBlock = 2048;
// The reduce-update's blocks: longer runs of each stream between the switches from summing the
// gradients to updating the weights and state. 8192 measured 6-20% faster than 2048 against
// all_reduce_ + torch's fused AdamW (benchmarks/bench_optim.py's reduce-update part, 2 and 4
// replicas, 0.2 M and 4 M elements).
constexpr int64_t kUpdateBlock = 8192;

// acc[0, len) = fixed-order sum (or mean) of in[r][base + 0, len).
template <typename T>
inline void sum_block(const T* const* in, int nin, int64_t base, int64_t len, bool mean,
                      T* __restrict__ acc) {
  std::memcpy(acc, in[0] + base, static_cast<size_t>(len) * sizeof(T));
  for (int r = 1; r < nin; ++r) {
    const T* __restrict__ x = in[r] + base;
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + x[i];
  }
  if (mean) {
    const T count = static_cast<T>(nin);
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / count;
  }
}

// The wrapper's SGD step: dpcuda.optim's SGD formula (csrc/kernels/optim/update.h, the one
// every update goes through) with dampening 0, no Nesterov, the momentum buffer from zero.
template <typename T>
inline void sgd_block(const T* __restrict__ g, const T* param, const T* momentum, int64_t len,
                      Sgd sgd, T* __restrict__ new_param, T* __restrict__ new_momentum) {
  double v[optim::kHyper] = {};
  v[optim::kLr] = sgd.lr;
  v[optim::kWeightDecay] = sgd.weight_decay;
  v[optim::kMomentum] = sgd.momentum;
  v[optim::kOneMinusDampening] = 1.0;
  const bool use_momentum = sgd.momentum != 0.0;
  const optim::Hyper<T> h(v, use_momentum, false);
  if (use_momentum) {
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) {
      T b = momentum[i];
      new_param[i] = optim::sgd(g[i], param[i], b, h);
      new_momentum[i] = b;
    }
  } else {
#pragma GCC ivdep
    for (int64_t i = 0; i < len; ++i) {
      T unused = T(0);
      new_param[i] = optim::sgd(g[i], param[i], unused, h);
    }
  }
}

}  // namespace

template <typename T>
DPCUDA_CPU_CLONES void reduce_range(const T* const* in, int nin, T* const* out, int nout,
                                    int64_t begin, int64_t end, bool mean) {
  T acc[kBlock];
  for (int64_t base = begin; base < end; base += kBlock) {
    const int64_t len = std::min(kBlock, end - base);
    sum_block(in, nin, base, len, mean, acc);
    for (int o = 0; o < nout; ++o) {
      std::memcpy(out[o] + base, acc, static_cast<size_t>(len) * sizeof(T));
    }
  }
}

template <typename T>
DPCUDA_CPU_CLONES void chain_accumulate(const T* partial, T* own, int64_t begin, int64_t end,
                                        int divide_by) {
  const T count = static_cast<T>(divide_by);
  for (int64_t i = begin; i < end; ++i) {
    const T acc = partial[i] + own[i];
    own[i] = divide_by > 0 ? acc / count : acc;
  }
}

template <typename T>
DPCUDA_CPU_CLONES void reduce_sgd_range(const T* const* grads, int ngrads, T* const* params,
                                        int nparams, T* const* momenta, int nmomenta,
                                        int64_t begin, int64_t end, bool mean, Sgd sgd) {
  T g[kBlock], p[kBlock], m[kBlock];
  for (int64_t base = begin; base < end; base += kBlock) {
    const int64_t len = std::min(kBlock, end - base);
    sum_block(grads, ngrads, base, len, mean, g);
    sgd_block(g, params[0] + base, nmomenta ? momenta[0] + base : nullptr, len, sgd, p, m);
    for (int o = 0; o < nparams; ++o) {
      std::memcpy(params[o] + base, p, static_cast<size_t>(len) * sizeof(T));
    }
    for (int o = 0; o < nmomenta; ++o) {
      std::memcpy(momenta[o] + base, m, static_cast<size_t>(len) * sizeof(T));
    }
  }
}

template <typename T>
DPCUDA_CPU_CLONES void sgd_range(const T* grad, T* param, T* momentum, int64_t begin,
                                 int64_t end, Sgd sgd) {
  T p[kBlock], m[kBlock];
  for (int64_t base = begin; base < end; base += kBlock) {
    const int64_t len = std::min(kBlock, end - base);
    sgd_block(grad + base, param + base, momentum ? momentum + base : nullptr, len, sgd, p, m);
    std::memcpy(param + base, p, static_cast<size_t>(len) * sizeof(T));
    if (momentum) std::memcpy(momentum + base, m, static_cast<size_t>(len) * sizeof(T));
  }
}

namespace {

// Elements per unit of work handed to a thread.
constexpr int64_t kPiece = 1 << 16;

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// [begin, end) cut into pieces of kPiece elements.
void add_pieces(int64_t begin, int64_t end, Ranges* out) {
  for (int64_t b = begin; b < end; b += kPiece) out->emplace_back(b, std::min(end, b + kPiece));
}

// Every replica's two-shot shard, cut into pieces.
template <typename T>
Ranges shard_pieces(int64_t n, int replicas) {
  Ranges pieces;
  for (int k = 0; k < replicas; ++k) {
    int64_t b, e;
    shard_range(n, replicas, k, 16 / sizeof(T), &b, &e);
    add_pieces(b, e, &pieces);
  }
  return pieces;
}

template <typename T>
void sgd_all(T* const* params, T* const* grads, T* const* momenta, int replicas, int64_t n,
             Sgd sgd, const ParallelFor& parallel) {
  Ranges pieces;
  add_pieces(0, n, &pieces);
  const int64_t np = static_cast<int64_t>(pieces.size());
  parallel(0, replicas * np, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t r = w / np;
      sgd_range<T>(grads[r], params[r], momenta ? momenta[r] : nullptr, pieces[w % np].first,
                   pieces[w % np].second, sgd);
    }
  });
}

}  // namespace

int64_t all_reduce_scratch(AllReduceAlgorithm algorithm, int replicas, int64_t n) {
  return algorithm == AllReduceAlgorithm::kOneShot && replicas > 1 ? replicas * n : 0;
}

template <typename T>
void all_reduce(T* const* bufs, int R, int64_t n, bool mean, AllReduceAlgorithm algorithm,
                T* scratch, const ParallelFor& parallel) {
  if (n == 0 || R == 1) return;  // x / 1 == x: a single replica's mean is itself
  std::vector<const T*> in(bufs, bufs + R);
  if (algorithm == AllReduceAlgorithm::kTwoShot) {
    const Ranges pieces = shard_pieces<T>(n, R);
    parallel(0, static_cast<int64_t>(pieces.size()), [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        reduce_range<T>(in.data(), R, bufs, R, pieces[p].first, pieces[p].second, mean);
      }
    });
  } else if (algorithm == AllReduceAlgorithm::kOneShot) {
    Ranges pieces;
    add_pieces(0, n, &pieces);
    const int64_t np = static_cast<int64_t>(pieces.size());
    parallel(0, R * np, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        T* out = scratch + (w / np) * n;
        reduce_range<T>(in.data(), R, &out, 1, pieces[w % np].first, pieces[w % np].second,
                        mean);
      }
    });
    parallel(0, R * np, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        const auto [b, e] = pieces[w % np];
        std::copy(scratch + (w / np) * n + b, scratch + (w / np) * n + e, bufs[w / np] + b);
      }
    });
  } else {
    const int64_t chunks = ring_chunks(n);
    auto chunk = [&](int64_t c, int64_t* b, int64_t* e) {
      shard_range(n, static_cast<int>(chunks), static_cast<int>(c), 16 / sizeof(T), b, e);
    };
    // Reduce: at step s, replica r (1..R-1) adds chunk s - (r - 1) to replica r-1's partial.
    for (int64_t s = 0; s < chunks + R - 2; ++s) {
      parallel(1, R, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; ++r) {
          const int64_t c = s - (r - 1);
          if (c < 0 || c >= chunks) continue;
          int64_t b, e;
          chunk(c, &b, &e);
          chain_accumulate<T>(bufs[r - 1], bufs[r], b, e, r == R - 1 && mean ? R : 0);
        }
      });
    }
    // Broadcast: every other replica copies the last replica's result.
    parallel(0, (R - 1) * chunks, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        int64_t b, e;
        chunk(w % chunks, &b, &e);
        std::copy(bufs[R - 1] + b, bufs[R - 1] + e, bufs[w / chunks] + b);
      }
    });
  }
}

template <typename T>
void reduce_sgd(T* const* params, T* const* grads, T* const* momenta, int R, int64_t n,
                bool mean, AllReduceAlgorithm algorithm, Sgd sgd, T* scratch,
                const ParallelFor& parallel) {
  if (n == 0) return;
  if (algorithm != AllReduceAlgorithm::kTwoShot) {
    all_reduce<T>(grads, R, n, mean, algorithm, scratch, parallel);
    sgd_all<T>(params, grads, momenta, R, n, sgd, parallel);
    return;
  }
  std::vector<const T*> g(grads, grads + R);
  const Ranges pieces = shard_pieces<T>(n, R);
  parallel(0, static_cast<int64_t>(pieces.size()), [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      reduce_sgd_range<T>(g.data(), R, params, R, momenta, momenta ? R : 0, pieces[w].first,
                          pieces[w].second, mean, sgd);
    }
  });
}

template <typename T>
DPCUDA_CPU_CLONES void reduce_update_range(const T* const* grads, int ngrads, T* const* params,
                                           int nparams, T* s1, T* s2, T* s3,
                                           int64_t state_offset, int64_t begin, int64_t end,
                                           bool mean, optim::Kind kind, const double* hyper,
                                           const double* scale, void (*round)(T*, int64_t)) {
  T g[kUpdateBlock];
  for (int64_t base = begin; base < end; base += kUpdateBlock) {
    const int64_t len = std::min(kUpdateBlock, end - base);
    // One gradient (already reduced) is read where it is; several are summed into g.
    const T* sum = grads[0] + base;
    if (ngrads > 1 || mean) {
      sum_block(grads, ngrads, base, len, mean, g);
      sum = g;
    }
    if (scale != nullptr) {
      // torch's clip_grad_norm_: grad.mul_(clip_coef), each product rounded to T.
      const T s = static_cast<T>(*scale);
#pragma GCC ivdep
      for (int64_t i = 0; i < len; ++i) g[i] = sum[i] * s;
      if (round != nullptr) round(g, len);
      sum = g;
    }
    const int64_t at = base - state_offset;
    // The update's own loop (csrc/cpu/optim.cpp) on this block, in place on params[0]: the
    // bits of optim_update. The other replicas copy the block.
    optim_update<T>(kind, hyper, {params[0] + base, sum, s1 ? s1 + at : nullptr,
                                  s2 ? s2 + at : nullptr, s3 ? s3 + at : nullptr}, 0, len);
    for (int o = 1; o < nparams; ++o) {
      std::memcpy(params[o] + base, params[0] + base, static_cast<size_t>(len) * sizeof(T));
    }
  }
}

// Elements per unit of work of reduce_update.
constexpr int64_t kUpdatePiece = 1 << 13;

namespace {

// clip.h's order over term(0..count): lane l sums the terms l, l + kNormLanes, ... one after
// another, then the lanes' sums are added as the tree.
template <typename Term>
double lane_sum(int64_t count, const Term& term) {
  double s[optim::kNormLanes];
  for (int l = 0; l < optim::kNormLanes; ++l) {
    double acc = 0.0;
    for (int64_t i = l; i < count; i += optim::kNormLanes) acc = acc + term(i);
    s[l] = acc;
  }
  optim::lane_tree(s);
  return s[0];
}

}  // namespace

template <typename T>
double chunk_sum_of_squares(const T* x, int64_t len) {
  return lane_sum(len, [x](int64_t i) {
    const double v = static_cast<double>(x[i]);
    return v * v;
  });
}

double combine_partials(const double* partials, int64_t count) {
  return lane_sum(count, [partials](int64_t i) { return partials[i]; });
}

namespace {

// reduce_update's clipping pass: two_shot reduces each owner's shard into its own grads[k] as
// it takes the chunks' sums of squares (no pass of its own over the gradients); otherwise the
// gradients are reduced already and it reads the owners' copies. Returns the coefficient.
template <typename T>
double clip_pass(T* const* grads, int R, int64_t n, bool mean, bool reduced, bool two_shot,
                 const Clip<T>& clip, const ParallelFor& parallel) {
  const int shards = clip.shards > 0 ? clip.shards : R;
  const int64_t align = clip.align > 0 ? clip.align : static_cast<int64_t>(16 / sizeof(T));
  struct Chunk {
    int shard;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (int k = 0; k < shards; ++k) {
    int64_t b, e;
    shard_range(n, shards, k, align, &b, &e);
    for (int64_t x = b; x < e; x += optim::kNormChunk) {
      chunks.push_back({k, x, std::min(e, x + optim::kNormChunk)});
    }
  }
  std::vector<double> partial(chunks.size());
  std::vector<const T*> g(grads, grads + R);
  parallel(0, static_cast<int64_t>(chunks.size()), [&](int64_t lo, int64_t hi) {
    T acc[optim::kNormChunk];
    for (int64_t w = lo; w < hi; ++w) {
      const Chunk& c = chunks[w];
      const int64_t len = c.end - c.begin;
      const T* src;
      if (two_shot) {
        sum_block(g.data(), R, c.begin, len, mean, acc);
        std::memcpy(grads[c.shard] + c.begin, acc, static_cast<size_t>(len) * sizeof(T));
        src = acc;
      } else {
        src = (reduced ? grads[0] : grads[std::min(c.shard, R - 1)]) + c.begin;
      }
      partial[w] = chunk_sum_of_squares<T>(src, len);
    }
  });
  // (the half types' adapter rounds each result to half, as the CUDA kernels store them)
  auto round = [&clip](T x) {
    if (clip.round != nullptr) clip.round(&x, 1);
    return x;
  };
  T norm;
  const T coef = optim::clip_coefficient<T>(
      combine_partials(partial.data(), static_cast<int64_t>(partial.size())), clip.max_norm,
      &norm, round);
  if (clip.norm_out != nullptr) *clip.norm_out = norm;
  return static_cast<double>(coef);
}

}  // namespace

template <typename T>
void reduce_update(T* const* params, T* const* grads, ShardedState<T> state, int R, int64_t n,
                   bool mean, bool reduced, AllReduceAlgorithm algorithm, optim::Kind kind,
                   const UpdateSegment* segments, int nsegments, const double* const* hyper,
                   T* scratch, const ParallelFor& parallel, bool gather, const Clip<T>* clip) {
  if (n == 0) {
    if (clip != nullptr && clip->norm_out != nullptr) *clip->norm_out = T(0);
    return;
  }
  const bool two_shot = !reduced && algorithm == AllReduceAlgorithm::kTwoShot;
  if (!reduced && !two_shot) all_reduce<T>(grads, R, n, mean, algorithm, scratch, parallel);
  std::vector<const T*> g(grads, grads + R);
  double coef = 1.0;
  if (clip != nullptr) coef = clip_pass<T>(grads, R, n, mean, reduced, two_shot, *clip, parallel);
  // Fused: the update sums every replica's gradient as it goes (two_shot without clipping);
  // else it reads the owner's reduced copy (grads[k]; grads[0] when reduced).
  const bool fused = two_shot && clip == nullptr;
  // (shard, begin, end, segment) pieces: each within one shard and one segment.
  struct Piece {
    int shard;
    int64_t begin, end;
    int segment;
  };
  std::vector<Piece> pieces;
  for (int k = 0; k < R; ++k) {
    int64_t b, e;
    shard_range(n, R, k, 16 / sizeof(T), &b, &e);
    for (int s = 0; s < nsegments; ++s) {
      const int64_t lo = std::max(b, segments[s].begin), hi = std::min(e, segments[s].end);
      // (pieces of kUpdatePiece elements: small enough that threads get even shares)
      for (int64_t x = lo; x < hi; x += kUpdatePiece) {
        pieces.push_back({k, x, std::min(hi, x + kUpdatePiece), s});
      }
    }
  }
  parallel(0, static_cast<int64_t>(pieces.size()), [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const Piece& pc = pieces[w];
      int64_t b, e;
      shard_range(n, R, pc.shard, 16 / sizeof(T), &b, &e);
      auto shard_of = [&](T* const* s) { return s ? s[pc.shard] : nullptr; };
      // Fused: the sum of every replica's gradient; else the owner's already reduced copy.
      const T* const* in = fused ? g.data() : (reduced ? g.data() : g.data() + pc.shard);
      reduce_update_range<T>(in, fused ? R : 1, params, gather ? R : 1, shard_of(state.state1),
                             shard_of(state.state2), shard_of(state.state3), b, pc.begin,
                             pc.end, fused && mean, kind, hyper[segments[pc.segment].group],
                             clip ? &coef : nullptr, clip ? clip->round : nullptr);
    }
  });
}

#define DPCUDA_INSTANTIATE(T)                                                                  \
  template void all_reduce<T>(T* const*, int, int64_t, bool, AllReduceAlgorithm, T*,          \
                              const ParallelFor&);                                             \
  template void reduce_sgd<T>(T* const*, T* const*, T* const*, int, int64_t, bool,            \
                              AllReduceAlgorithm, Sgd, T*, const ParallelFor&);               \
  template void reduce_range<T>(const T* const*, int, T* const*, int, int64_t, int64_t, bool); \
  template void chain_accumulate<T>(const T*, T*, int64_t, int64_t, int);                      \
  template void reduce_sgd_range<T>(const T* const*, int, T* const*, int, T* const*, int,      \
                                    int64_t, int64_t, bool, Sgd);                              \
  template void sgd_range<T>(const T*, T*, T*, int64_t, int64_t, Sgd);                       \
  template void reduce_update_range<T>(const T* const*, int, T* const*, int, T*, T*, T*,      \
                                       int64_t, int64_t, int64_t, bool, optim::Kind,          \
                                       const double*, const double*,                          \
                                       void (*)(T*, int64_t));                                \
  template void reduce_update<T>(T* const*, T* const*, ShardedState<T>, int, int64_t, bool,   \
                                 bool, AllReduceAlgorithm, optim::Kind, const UpdateSegment*,  \
                                 int, const double* const*, T*, const ParallelFor&, bool,      \
                                 const Clip<T>*);                                              \
  template double chunk_sum_of_squares<T>(const T*, int64_t);

DPCUDA_INSTANTIATE(float)
DPCUDA_INSTANTIATE(double)
#undef DPCUDA_INSTANTIATE

}  // namespace cpu
}  // namespace dpcuda
