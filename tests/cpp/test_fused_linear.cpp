// Tests of the CPU fused-linear kernels against formulas written out here independently:
// forward values against the textbook definitions, derivatives against central differences.
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "activation_reference.h"
#include "check.h"
#include "cpu/fused_linear.h"

using dpcuda::Activation;
using dpcuda_test::activation_reference;

namespace {



template <typename T>
void test_forward(int64_t rows, int64_t cols, Activation act, std::mt19937& rng, double tol) {
  std::normal_distribution<double> dist(0.0, 2.0);
  std::vector<T> gemm(rows * cols), bias(cols), out, pre(rows * cols, T(NAN));
  for (auto& v : gemm) v = T(dist(rng));
  for (auto& v : bias) v = T(dist(rng));
  out = gemm;
  // Two row ranges, as two threads of the adapter would call it.
  const int64_t mid = rows / 2;
  dpcuda::cpu::bias_activation_forward<T>(out.data(), pre.data(), bias.data(), 0, mid, cols, act);
  dpcuda::cpu::bias_activation_forward<T>(out.data(), pre.data(), bias.data(), mid, rows, cols,
                                          act);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double z = double(gemm[r * cols + c]) + double(bias[c]);
      CHECK_CLOSE(double(pre[r * cols + c]), z, tol);
      CHECK_CLOSE(double(out[r * cols + c]), activation_reference(act, z), tol);
    }
  }
  // The GEMM's result in pre instead (pre_activation_forward): the same bits, with a bias and
  // without (then pre is read only: it keeps the GEMM's values).
  for (const bool with_bias : {true, false}) {
    std::vector<T> pre2 = gemm, out2(rows * cols, T(NAN)), want_out = gemm,
                   want_pre(rows * cols, T(NAN));
    const T* b = with_bias ? bias.data() : nullptr;
    dpcuda::cpu::bias_activation_forward<T>(want_out.data(), want_pre.data(), b, 0, rows, cols,
                                            act);
    dpcuda::cpu::pre_activation_forward<T>(out2.data(), pre2.data(), b, 0, mid, cols, act);
    dpcuda::cpu::pre_activation_forward<T>(out2.data(), pre2.data(), b, mid, rows, cols, act);
    CHECK(std::memcmp(out2.data(), want_out.data(), out2.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(pre2.data(), want_pre.data(), pre2.size() * sizeof(T)) == 0);
  }
}

// Without a bias, the passes take a range of rows as one row of its elements (flatten_rows):
// the same bits as the rows taken one at a time (the old loops, and any split of the rows over
// threads), for every element, its position in the vector loop whatever it is. Backward: a
// dense upstream gradient and an expanded scalar one (y.sum()'s), with no bias sum.
template <typename T>
void test_flat_rows(int64_t rows, int64_t cols, Activation act, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 3.0);
  std::vector<T> gemm(rows * cols), go(rows * cols);
  for (auto& v : gemm) v = T(dist(rng));
  for (auto& v : go) v = T(dist(rng));
  const auto same = [](const std::vector<T>& a, const std::vector<T>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };
  std::vector<T> out = gemm, pre(rows * cols, T(NAN)), out1 = gemm, pre1(rows * cols, T(NAN));
  dpcuda::cpu::bias_activation_forward<T>(out.data(), pre.data(), nullptr, 0, rows, cols, act);
  std::vector<T> from_pre(rows * cols, T(NAN)), from_pre1(rows * cols, T(NAN));
  dpcuda::cpu::pre_activation_forward<T>(from_pre.data(), gemm.data(), nullptr, 0, rows, cols,
                                         act);
  for (int64_t r = 0; r < rows; ++r) {
    dpcuda::cpu::bias_activation_forward<T>(out1.data(), pre1.data(), nullptr, r, r + 1, cols,
                                            act);
    dpcuda::cpu::pre_activation_forward<T>(from_pre1.data(), gemm.data(), nullptr, r, r + 1,
                                           cols, act);
  }
  CHECK(same(out, out1) && same(pre, pre1) && same(from_pre, from_pre1));
  CHECK(same(out, from_pre));
  for (const bool expanded : {false, true}) {
    const int64_t rs = expanded ? 0 : cols, cs = expanded ? 0 : 1;
    std::vector<T> g(rows * cols, T(NAN)), g1(rows * cols, T(NAN));
    dpcuda::cpu::activation_backward_rows<T>(go.data(), pre.data(), g.data(), nullptr, 0, rows,
                                             cols, act, rs, cs);
    for (int64_t r = 0; r < rows; ++r) {
      dpcuda::cpu::activation_backward_rows<T>(go.data(), pre.data(), g1.data(), nullptr, r,
                                               r + 1, cols, act, rs, cs);
    }
    CHECK(same(g, g1));
    for (int64_t i = 0; i < rows * cols; ++i) {  // (written, against the formula's value)
      const T want = dpcuda::activation_backward_value<T>(act, go[expanded ? 0 : i], pre[i]);
      CHECK(std::memcmp(&g[i], &want, sizeof(T)) == 0);
    }
  }
}

// A column-major upstream gradient (a transposed one, rs = 1, cs = rows) with and without the
// bias sum, over the whole range and a sub-range: the bits of the same gradient made contiguous.
template <typename T>
void test_column_major(int64_t rows, int64_t cols, Activation act, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 3.0);
  std::vector<T> pre(rows * cols), go(rows * cols), go_t(rows * cols);
  for (auto& v : pre) v = T(dist(rng));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      go[r * cols + c] = T(dist(rng));
      go_t[c * rows + r] = go[r * cols + c];
    }
  }
  const auto same = [](const std::vector<T>& a, const std::vector<T>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };
  const int64_t begin = rows > 2 ? 1 : 0, end = rows > 2 ? rows - 1 : rows;
  for (const bool with_bias : {false, true}) {
    for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, rows}, {begin, end}}) {
      std::vector<T> g(rows * cols, T(NAN)), g_t(rows * cols, T(NAN));
      std::vector<T> sum(cols, T(NAN)), sum_t(cols, T(NAN));
      // ("none" writes no g: the sums alone, as the adapter calls it)
      const bool none = act == Activation::kNone;
      dpcuda::cpu::activation_backward_rows<T>(go.data(), pre.data(), none ? nullptr : g.data(),
                                               with_bias ? sum.data() : nullptr, b, e, cols,
                                               act, cols, 1);
      dpcuda::cpu::activation_backward_rows<T>(go_t.data(), pre.data(),
                                               none ? nullptr : g_t.data(),
                                               with_bias ? sum_t.data() : nullptr, b, e, cols,
                                               act, 1, rows);
      CHECK(same(g, g_t));
      if (with_bias && act != Activation::kNone) CHECK(same(sum, sum_t));
      if (with_bias && act == Activation::kNone) {
        // (the sums alone over a column-major gradient: 64 lanes down each column, then a
        // fixed tree; equal within rounding, the same bits for any clone, and the bits of that
        // order written out here: row r into lane (r - b) % 64, lane j += lane j + 32, + 16,
        // + 8, + 4, + 2, + 1)
        for (int64_t c = 0; c < cols; ++c) {
          double magnitude = 0;
          for (int64_t r = b; r < e; ++r) magnitude += std::fabs(double(go[r * cols + c]));
          const double tol = (sizeof(T) == 4 ? 0x1p-20 : 0x1p-48) * magnitude;
          CHECK(std::fabs(double(sum_t[c]) - double(sum[c])) <= tol);
          T lane[64] = {};
          for (int64_t r = b; r < e; ++r) lane[(r - b) % 64] += go[r * cols + c];
          for (int width = 32; width > 0; width /= 2) {
            for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
          }
          const T want = T(0) + lane[0];
          CHECK(std::memcmp(&want, &sum_t[c], sizeof want) == 0);
        }
      }
    }
  }
}

void test_activation_grad(Activation act) {
  const auto saved = dpcuda::saved_for_backward(act);
  for (double z = -6.0; z <= 6.0; z += 0.37) {
    const double h = 1e-6;
    const double numeric =
        (activation_reference(act, z + h) - activation_reference(act, z - h)) / (2 * h);
    const double s = saved == dpcuda::Saved::kOutput ? activation_reference(act, z) : z;
    CHECK_CLOSE(dpcuda::activation_grad<double>(act, s), numeric, 1e-6);
  }
}

template <typename T>
void test_backward(int64_t rows, int64_t cols, Activation act, std::mt19937& rng, double tol) {
  std::normal_distribution<double> dist(0.0, 1.5);
  std::vector<T> z(rows * cols), go(rows * cols), saved(rows * cols), g(rows * cols, T(NAN));
  for (auto& v : z) v = T(dist(rng));
  for (auto& v : go) v = T(dist(rng));
  const bool from_output = dpcuda::saved_for_backward(act) == dpcuda::Saved::kOutput;
  for (size_t i = 0; i < z.size(); ++i) {
    saved[i] = from_output ? T(activation_reference(act, z[i])) : z[i];
  }
  const int64_t chunk = dpcuda::cpu::bias_chunk_rows(rows);
  const int64_t chunks = (rows + chunk - 1) / chunk;
  std::vector<T> partials(chunks * cols, T(NAN)), grad_bias(cols, T(NAN));
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t r1 = std::min(rows, (k + 1) * chunk);
    dpcuda::cpu::activation_backward_rows<T>(go.data(), saved.data(), g.data(),
                                             partials.data() + k * cols, k * chunk, r1, cols,
                                             act);
  }
  dpcuda::cpu::reduce_column_partials<T>(partials.data(), chunks, cols, grad_bias.data(), 0,
                                         cols);
  for (int64_t c = 0; c < cols; ++c) {
    double want_bias = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r * cols + c;
      const double zz = z[i];
      const double d = act == Activation::kRelu ? (zz > 0 ? 1.0 : 0.0)
                       : (activation_reference(act, zz + 1e-6) -
                          activation_reference(act, zz - 1e-6)) / 2e-6;
      CHECK_CLOSE(double(g[i]), double(go[i]) * d, tol);
      want_bias += double(go[i]) * d;
    }
    CHECK_CLOSE(double(grad_bias[c]), want_bias, tol * rows);
  }
}

}  // namespace

// bfloat16: the upper half of a float's bits. The reference rounding is written apart from the
// kernels': the float value's bits, rounded to nearest even by whether the dropped half is
// above, below or at a tie, and a NaN kept a NaN of its sign.
float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t kept = u >> 16, dropped = u & 0xffffu;
  const bool up = dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u));
  return static_cast<uint16_t>(kept + (up ? 1u : 0u));
}

// A bfloat16 value for the templated checks: its bits, made from a double rounded once.
struct Bf16 {
  uint16_t bits = 0;
  Bf16() = default;
  explicit Bf16(double v) : bits(bf16_round(static_cast<float>(v))) {}
};
static_assert(sizeof(Bf16) == sizeof(uint16_t), "an array of Bf16 is one of bits");

bool same_bf16(uint16_t a, uint16_t b) {
  const bool nan_a = (a & 0x7fffu) > 0x7f80u, nan_b = (b & 0x7fffu) > 0x7f80u;
  return nan_a || nan_b ? nan_a && nan_b : a == b;
}

// The bfloat16 passes against the float kernels on the widened values: each result is the
// float result rounded once (bit for bit), and the bias sums are the float sums of the rounded
// g; for dense, expanded (one value, one a row) and transposed upstream gradients. The inputs
// include +-0, +-Inf, NaN and the largest finite bfloat16 (whose activation may round up to
// Inf).
void test_bfloat16(int64_t rows, int64_t cols, Activation act, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const int64_t n = rows * cols;
  std::vector<uint16_t> z(n), go(n);
  for (auto& v : z) v = bf16_round(dist(rng));
  for (auto& v : go) v = bf16_round(dist(rng));
  const uint16_t special[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x7f7f, 0xff7f,
                              0x3f80, 0xbf80, 0x0001, 0x4120, 0xc150};
  for (size_t i = 0; i < sizeof special / sizeof *special && int64_t(5 * i) < n; ++i) {
    z[5 * i] = special[i];
    go[(7 * i + 3) % n] = special[(i + 4) % 12];
  }
  std::vector<float> zf(n), gof(n);
  for (int64_t i = 0; i < n; ++i) zf[i] = bf16_value(z[i]), gof[i] = bf16_value(go[i]);
  // forward: out of place and in place
  std::vector<uint16_t> out(n), in_place = z;
  dpcuda::cpu::bfloat16_activation_forward(z.data(), out.data(), 0, n, act);
  dpcuda::cpu::bfloat16_activation_forward(in_place.data(), in_place.data(), 0, n, act);
  std::vector<float> outf(n);
  outf = zf;
  dpcuda::cpu::bias_activation_forward<float>(outf.data(), nullptr, nullptr, 0, rows, cols, act);
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad += !same_bf16(out[i], bf16_round(outf[i])) || !same_bf16(in_place[i], out[i]);
  }
  CHECK(bad == 0);
  // backward, from the saved tensor the layer keeps (bfloat16)
  const bool from_output = dpcuda::saved_for_backward(act) == dpcuda::Saved::kOutput;
  const std::vector<uint16_t>& saved = from_output ? out : z;
  std::vector<float> savedf(n);
  for (int64_t i = 0; i < n; ++i) savedf[i] = bf16_value(saved[i]);
  const int64_t layouts[4][2] = {{cols, 1}, {0, 0}, {1, 0}, {1, rows}};
  for (const auto& l : layouts) {
    // the gradient's element (r, c) at go[r * l[0] + c * l[1]]; its dense copy for the float
    // kernel
    std::vector<float> dense(n);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dense[r * cols + c] = gof[r * l[0] + c * l[1]];
    }
    std::vector<float> gf(n), unused(cols);
    dpcuda::cpu::activation_backward_rows<float>(dense.data(), savedf.data(), gf.data(),
                                                 unused.data(), 0, rows, cols, act);
    const bool none = act == Activation::kNone;
    std::vector<uint16_t> g(n);
    std::vector<float> sums(cols, -1.0f);
    dpcuda::cpu::bfloat16_activation_backward_rows(go.data(), none ? nullptr : saved.data(),
                                                   none ? nullptr : g.data(), sums.data(), 0,
                                                   rows, cols, act, l[0], l[1]);
    std::vector<float> want_sums(cols, 0.0f);
    bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t want = bf16_round(gf[r * cols + c]);
        if (!none) bad += !same_bf16(g[r * cols + c], want);
        want_sums[c] += bf16_value(want);
      }
    }
    CHECK(bad == 0);
    // without the sums (a layer without a bias): the same g (NaN where NaN: same_bf16)
    if (!none) {
      std::vector<uint16_t> g_alone(n);
      dpcuda::cpu::bfloat16_activation_backward_rows(go.data(), saved.data(), g_alone.data(),
                                                     nullptr, 0, rows, cols, act, l[0], l[1]);
      bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += !same_bf16(g_alone[i], g[i]);
      CHECK(bad == 0);
    }
    // (bit for bit, but the sums alone over a column-major gradient: their own fixed order,
    // equal within rounding, an Inf or NaN where the row order has one)
    const bool lanes = none && l[0] == 1 && l[1] != 0;
    bad = 0;
    for (int64_t c = 0; c < cols; ++c) {
      double magnitude = 0;
      for (int64_t r = 0; r < rows; ++r) magnitude += std::fabs(dense[r * cols + c]);
      const bool finite = std::isfinite(want_sums[c]);
      if (!finite || !lanes) {
        bad += std::isnan(want_sums[c]) ? !std::isnan(sums[c])
                                        : std::memcmp(&sums[c], &want_sums[c], 4) != 0;
      } else {
        bad += !(std::fabs(double(sums[c]) - want_sums[c]) <= 0x1p-20 * magnitude);
      }
    }
    CHECK(bad == 0);
  }
}

// The bfloat16 sums alone over a column-major gradient in their fixed order, bit for bit: row r
// into lane (r - b) % 64, lane j += lane j + 32, + 16, ..., + 1 (as test_column_major's for
// float and double). Values of exponents far apart, so that float sums round and any other order
// gives other bits (bfloat16 values of like size add exactly in float).
void test_bfloat16_column_order(std::mt19937& rng) {
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-12, 24);
  for (const int64_t rows : {int64_t(5), int64_t(16), int64_t(37), int64_t(100), int64_t(300)}) {
    const int64_t cols = 3;
    std::vector<uint16_t> go(rows * cols);  // column-major: (r, c) at go[c * rows + r]
    for (auto& v : go) {
      const float f = std::ldexp(mantissa(rng), exponent(rng)) * (rng() % 2 ? 1.0f : -1.0f);
      uint32_t u;
      std::memcpy(&u, &f, sizeof u);
      v = uint16_t(u >> 16);
    }
    const int64_t b = rows > 2 ? 1 : 0;
    std::vector<float> sums(cols, -1.0f);
    dpcuda::cpu::bfloat16_activation_backward_rows(go.data(), nullptr, nullptr, sums.data(), b,
                                                   rows, cols, Activation::kNone, 1, rows);
    for (int64_t c = 0; c < cols; ++c) {
      float lane[64] = {};
      for (int64_t r = b; r < rows; ++r) lane[(r - b) % 64] += bf16_value(go[c * rows + r]);
      for (int width = 32; width > 0; width /= 2) {
        for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
      }
      const float want = 0.0f + lane[0];
      CHECK(std::memcmp(&want, &sums[c], sizeof want) == 0);
    }
  }
}

// The sums alone over whole columns of a column-major gradient (column_major_bias_sums, the
// adapter's) against activation_backward_rows over all the rows onto zeroed sums, bit for bit,
// and against the lanes' order written out: values of exponents far apart (float sums round, so
// another order gives other bits), a -0 column (its sum +0), NaN and +-Inf in some columns,
// and column ranges. bfloat16 through its own pair of functions.
template <typename T, typename Value, typename Whole, typename Rows>
void check_column_major_totals(std::mt19937& rng, Value value, Whole whole, Rows by_rows) {
  using Acc = decltype(value(T()));
  std::uniform_int_distribution<int> exponent(-12, 24);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  for (const int64_t rows : {int64_t(0), int64_t(1), int64_t(63), int64_t(100), int64_t(2049)}) {
    const int64_t cols = 7;
    std::vector<T> go(rows * cols);  // column-major: (r, c) at go[c * rows + r]
    for (auto& v : go) v = T(std::ldexp(mantissa(rng), exponent(rng)) * (rng() % 2 ? 1 : -1));
    for (int64_t r = 0; r < rows; ++r) {
      go[1 * rows + r] = T(-0.0);
      if (r == rows / 2) go[2 * rows + r] = T(NAN);
      if (r == rows / 3) go[3 * rows + r] = T(INFINITY);
      if (r == rows / 3) go[4 * rows + r] = T(-INFINITY);
    }
    std::vector<Acc> want(cols, Acc(-1)), got(cols, Acc(7));
    by_rows(go.data(), want.data(), rows, cols);
    whole(go.data(), got.data(), rows, 1, cols - 1, rows);
    CHECK(got[0] == Acc(7) && got[cols - 1] == Acc(7));  // (only the columns asked for)
    whole(go.data(), got.data(), rows, 0, 1, rows);
    whole(go.data(), got.data(), rows, cols - 1, cols, rows);
    for (int64_t c = 0; c < cols; ++c) {
      CHECK(std::memcmp(&want[c], &got[c], sizeof(Acc)) == 0);
      Acc lane[64] = {};
      for (int64_t r = 0; r < rows; ++r) lane[r % 64] += value(go[c * rows + r]);
      for (int width = 32; width > 0; width /= 2) {
        for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
      }
      const Acc expect = Acc(0) + lane[0];
      CHECK(std::memcmp(&expect, &got[c], sizeof(Acc)) == 0);
    }
    CHECK(!std::signbit(got[1]));
    if (rows > 0) CHECK(std::isnan(got[2]) && got[3] == Acc(INFINITY));
  }
}

void test_column_major_totals(std::mt19937& rng) {
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    check_column_major_totals<T>(
        rng, [](T v) { return v; },
        [](const T* g, T* out, int64_t rows, int64_t b, int64_t e, int64_t cs) {
          dpcuda::cpu::column_major_bias_sums<T>(g, out, rows, b, e, cs);
        },
        [](const T* g, T* out, int64_t rows, int64_t cols) {
          dpcuda::cpu::activation_backward_rows<T>(g, nullptr, nullptr, out, 0, rows, cols,
                                                   Activation::kNone, 1, rows);
        });
  };
  run(0.0f);
  run(0.0);
  check_column_major_totals<Bf16>(
      rng, [](Bf16 v) { return bf16_value(v.bits); },
      [](const Bf16* g, float* out, int64_t rows, int64_t b, int64_t e, int64_t cs) {
        dpcuda::cpu::bfloat16_column_major_bias_sums(reinterpret_cast<const uint16_t*>(g), out,
                                                     rows, b, e, cs);
      },
      [](const Bf16* g, float* out, int64_t rows, int64_t cols) {
        dpcuda::cpu::bfloat16_activation_backward_rows(reinterpret_cast<const uint16_t*>(g),
                                                       nullptr, nullptr, out, 0, rows, cols,
                                                       Activation::kNone, 1, rows);
      });
}

// Ties round to even: tanh's gradient at the output 0.5 is go * 0.75, which for go = 1 + 2^-7
// and 1 + 3 * 2^-7 falls exactly halfway between two bfloat16 values (0x3f418000 and
// 0x3f448000 as floats); the first rounds up to the even neighbour (0x3f42), the second down
// (0x3f44). Truncation gives 0x3f41 and 0x3f44, rounding half up 0x3f42 and 0x3f45.
void test_bfloat16_ties() {
  const uint16_t go[2] = {0x3f81, 0x3f83}, saved[2] = {0x3f00, 0x3f00};
  uint16_t g[2] = {0, 0};
  float sums[2];
  dpcuda::cpu::bfloat16_activation_backward_rows(go, saved, g, sums, 0, 1, 2, Activation::kTanh,
                                                 2, 1);
  CHECK(g[0] == 0x3f42 && g[1] == 0x3f44);
  CHECK(bf16_round(bf16_value(0x3f81) * 0.75f) == 0x3f42);
  CHECK(bf16_round(bf16_value(0x3f83) * 0.75f) == 0x3f44);
}

// bfloat16_activation_backward_to_columns against bfloat16_activation_backward_rows over the
// same rows: g's bits written column-major (column stride g_cs, at least the rows), the same
// sums' bits, with and without them, nothing written outside rows [b, rows); a transposed and a
// sliced transposed gradient (column stride rows and rows + 3; the blocked read from 16), more
// than one 32-row block in a call (37 and 70 rows), and fewer (5).
void test_bfloat16_to_columns(Activation act, std::mt19937& rng) {
  if (act == Activation::kNone) return;  // (no g to write)
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (const int64_t rows : {int64_t(5), int64_t(37), int64_t(70)}) {
    for (const int64_t cols : {int64_t(40), int64_t(300)}) {
      for (const int64_t extra : {int64_t(0), int64_t(3)}) {
        const int64_t cs = rows + extra, g_cs = rows + 2, b = 3;
        std::vector<uint16_t> go(cs * cols), saved(rows * cols);
        for (auto& v : go) v = bf16_round(dist(rng));
        for (auto& v : saved) v = bf16_round(dist(rng));
        go[4 + 2 * cs] = 0x7fc0;  // (a NaN and an Inf in the gradient)
        go[rows - 1] = 0x7f80;
        for (const bool with_sums : {true, false}) {
          std::vector<uint16_t> g_rows(rows * cols), g_cols(g_cs * cols, 0x1234);
          std::vector<float> sums_rows(cols), sums_cols(cols, -1.0f);
          dpcuda::cpu::bfloat16_activation_backward_rows(
              go.data(), saved.data(), g_rows.data(), with_sums ? sums_rows.data() : nullptr, b,
              rows, cols, act, 1, cs);
          dpcuda::cpu::bfloat16_activation_backward_to_columns(
              go.data(), saved.data(), g_cols.data(), with_sums ? sums_cols.data() : nullptr, b,
              rows, cols, act, 1, cs, g_cs);
          int bad = 0;
          for (int64_t c = 0; c < cols; ++c) {
            for (int64_t r = 0; r < g_cs; ++r) {
              const uint16_t got = g_cols[c * g_cs + r];
              bad += r >= b && r < rows ? !same_bf16(got, g_rows[r * cols + c]) : got != 0x1234;
            }
            if (with_sums) bad += std::memcmp(&sums_rows[c], &sums_cols[c], 4) != 0;
          }
          CHECK(bad == 0);
        }
      }
    }
  }
}

int main() {
  std::mt19937 rng(1234);
  test_bfloat16_ties();
  test_bfloat16_column_order(rng);
  test_column_major_totals(rng);
  // (17 and 100: blocks of 16 rows and a rest; from 16 columns the transposed gradient is read
  // in blocks, 16 columns at a time and a rest; fewer columns or rows: row by row)
  const int64_t sizes[] = {1, 3, 17, 100};
  for (Activation act : dpcuda_test::kAllActivations) {
    test_activation_grad(act);
    test_bfloat16_to_columns(act, rng);
    for (int64_t rows : sizes) {
      for (int64_t cols : sizes) {
        test_forward<double>(rows, cols, act, rng, 1e-12);
        test_forward<float>(rows, cols, act, rng, 1e-5);
        if (act != Activation::kNone) test_backward<double>(rows, cols, act, rng, 1e-6);
        test_flat_rows<float>(rows, cols, act, rng);
        test_flat_rows<double>(rows, cols, act, rng);
        test_column_major<float>(rows, cols, act, rng);
        test_column_major<double>(rows, cols, act, rng);
        test_bfloat16(rows, cols, act, rng);
      }
    }
  }
  // (wide rows and long columns: the blocked pass over whole blocks and a rest, at row lengths
  // a multiple of 1024 floats, where the buffer's padding matters, and not)
  for (Activation act : dpcuda_test::kAllActivations) {
    for (int64_t rows : {1040}) {
      for (int64_t cols : {255, 256, 1024, 1030}) {
        test_column_major<float>(rows, cols, act, rng);
        test_column_major<double>(rows, cols, act, rng);
        test_bfloat16(rows, cols, act, rng);
      }
    }
  }
  std::printf("test_fused_linear: %d failures\n", dpcuda_test::failures());
  return dpcuda_test::failures() == 0 ? 0 : 1;
}
