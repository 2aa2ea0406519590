#include "cross_entropy.h"

#include <algorithm>
#include <limits>

#include "../kernels/transcendental.h"
#include "target.h"

namespace dpcuda {
namespace cpu {
namespace {

// Classes per block of exponentials when there is no gradient row to hold them.
constexpr int64_t kBlock = 256;

// The gradient of an ignored row, as torch's: log_softmax's backward of a zero gradient,
// 0 - exp(log_softmax(z)) * 0, which is NaN throughout when the row's log-sum-exp is NaN (a NaN
// or +inf logit, or every logit -inf) and 0 otherwise.
template <typename T>
T ignored_row_grad(const T* z, int64_t classes) {
  T zmax = -std::numeric_limits<T>::infinity();
  bool nan = false;
  for (int64_t c = 0; c < classes; ++c) {
    nan |= z[c] != z[c];
    zmax = z[c] > zmax ? z[c] : zmax;
  }
  const bool nan_row = nan || zmax == std::numeric_limits<T>::infinity() ||
                       zmax == -std::numeric_limits<T>::infinity();
  return nan_row ? std::numeric_limits<T>::quiet_NaN() : T(0);
}

}  // namespace

template <typename T>
DPCUDA_CPU_CLONES void cross_entropy_rows(const T* logits, const int64_t* labels, T* loss,
                                          T* grad, int64_t row_begin, int64_t row_end,
                                          int64_t classes, double scale, double label_smoothing,
                                          int64_t ignore_index) {
  const T s = static_cast<T>(scale);
  const T eps = static_cast<T>(label_smoothing);
  const T eps_per_class = eps / static_cast<T>(classes);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* z = logits + r * classes;
    T* g = grad ? grad + r * classes : nullptr;
    const int64_t y = labels[r];
    if (y == ignore_index) {
      loss[r] = T(0);
      if (g) {
        const T fill = ignored_row_grad(z, classes);
        for (int64_t c = 0; c < classes; ++c) g[c] = fill;
      }
      continue;
    }
    // Pass 1: the max and the sum of the logits (both vectorise).
    T zmax = -std::numeric_limits<T>::infinity();
    T zsum = T(0);
    for (int64_t c = 0; c < classes; ++c) {
      zmax = z[c] > zmax ? z[c] : zmax;
      zsum += z[c];
    }
    // Pass 2: exp(z - max), the one transcendental per element, kept in the gradient row
    // when there is one so that pass 3 only scales it (a block on the stack otherwise). The
    // exponentials are a loop of their own, which vectorises; their sum, in order, another.
    T sumexp = T(0);
    T block[kBlock];
    for (int64_t c0 = 0; c0 < classes; c0 += kBlock) {
      const int64_t len = std::min(kBlock, classes - c0);
      T* __restrict__ e = g ? g + c0 : block;
      const T* __restrict__ zc = z + c0;
      for (int64_t c = 0; c < len; ++c) e[c] = math_exp(zc[c] - zmax);
      for (int64_t c = 0; c < len; ++c) sumexp += e[c];
    }
    const T lse = zmax + math_log(sumexp);
    // Without smoothing the sum of the logits takes no part: 0 * (-inf) for a masked class
    // would make the loss NaN where torch's is finite.
    const T smooth = eps != T(0) ? eps_per_class * zsum : T(0);
    loss[r] = s * (lse - (T(1) - eps) * z[y] - smooth);
    if (g) {
      const T inv = s / sumexp;
      const T shift = s * eps_per_class;
      for (int64_t c = 0; c < classes; ++c) g[c] = g[c] * inv - shift;
      g[y] -= s * (T(1) - eps);
    }
  }
}

template void cross_entropy_rows<float>(const float*, const int64_t*, float*, float*, int64_t,
                                        int64_t, int64_t, double, double, int64_t);
template void cross_entropy_rows<double>(const double*, const int64_t*, double*, double*,
                                         int64_t, int64_t, int64_t, double, double, int64_t);

}  // namespace cpu
}  // namespace dpcuda
