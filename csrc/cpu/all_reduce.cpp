#include "all_reduce.h"

#include <algorithm>
#include <cstring>

#include "target.h"

namespace dpcuda {
namespace cpu {
namespace {

// Elements per block: the accumulator of one block stays in L1 while every input streams in.
constexpr int64_t kBlock = 2048;

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

// The SGD element formula; every path that updates parameters goes through it.
template <typename T>
inline void sgd_block(const T* __restrict__ g, const T* param, const T* momentum, int64_t len,
                      Sgd sgd, T* __restrict__ new_param, T* __restrict__ new_momentum) {
  const T lr = static_cast<T>(sgd.lr);
  const T mu = static_cast<T>(sgd.momentum);
  const T wd = static_cast<T>(sgd.weight_decay);
  const bool decay = sgd.weight_decay != 0.0;
  const bool use_momentum = sgd.momentum != 0.0;
#pragma GCC ivdep
  for (int64_t i = 0; i < len; ++i) {
    const T p = param[i];
    T d = decay ? g[i] + wd * p : g[i];
    if (use_momentum) {
      d = mu * momentum[i] + d;
      new_momentum[i] = d;
    }
    new_param[i] = p - lr * d;
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

#define DPCUDA_INSTANTIATE(T)                                                                  \
  template void reduce_range<T>(const T* const*, int, T* const*, int, int64_t, int64_t, bool); \
  template void chain_accumulate<T>(const T*, T*, int64_t, int64_t, int);                      \
  template void reduce_sgd_range<T>(const T* const*, int, T* const*, int, T* const*, int,      \
                                    int64_t, int64_t, bool, Sgd);                              \
  template void sgd_range<T>(const T*, T*, T*, int64_t, int64_t, Sgd);

DPCUDA_INSTANTIATE(float)
DPCUDA_INSTANTIATE(double)
#undef DPCUDA_INSTANTIATE

}  // namespace cpu
}  // namespace dpcuda
