// The CPU kernels' bits, as one hash: every function csrc/cpu marks DPCUDA_CPU_CLONES, run on
// fixed inputs (ordinary values, values where the activations' polynomials switch branches or
// clamp, +-Inf, NaN, -0), float and double. CMake builds this program once per x86 target
// (DPCUDA_CPU_TARGET: x86-64-v4, x86-64-v3, the baseline), and ctest checks the hashes are
// equal: the clones the loader picks on different CPUs compute the same bits. A twin built with
// FMA contraction allowed must differ (the check can fail).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/all_reduce.h"
#include "cpu/cross_entropy.h"
#include "cpu/fused_linear.h"
#include "cpu/optim.h"

namespace {

using namespace dpcuda;

struct Hash {
  uint64_t h = 1469598103934665603ull;
  // Every bit of every value, but a NaN's sign and payload: x86 propagates one operand's NaN
  // or makes its default NaN depending on the operand order the compiler chose, which the
  // scalar and the vector loops may choose differently (torch promises no NaN payload either).
  template <typename T>
  void add(const std::vector<T>& v) {
    for (T x : v) {
      if (std::isnan(x)) x = std::numeric_limits<T>::quiet_NaN();
      unsigned char p[sizeof(T)];
      std::memcpy(p, &x, sizeof(T));
      for (unsigned char c : p) h = (h ^ c) * 1099511628211ull;
    }
  }
  // bfloat16 bit patterns, a NaN's sign and payload left out likewise.
  void add_bfloat16(const std::vector<uint16_t>& v) {
    for (uint16_t b : v) {
      if ((b & 0x7fffu) > 0x7f80u) b = 0x7fc0u;
      h = (h ^ (b & 0xffu)) * 1099511628211ull;
      h = (h ^ (b >> 8)) * 1099511628211ull;
    }
  }
};

// The upper halves of floats: bfloat16 bit patterns (truncated; the kernels' inputs).
std::vector<uint16_t> to_bfloat16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], sizeof u);
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  return bits;
}

template <typename T>
std::vector<T> inputs(size_t n, uint32_t seed, double spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, spread);
  std::vector<T> v(n);
  for (auto& x : v) x = T(dist(rng));
  // Where the polynomials switch branches or clamp, and the non-finite values.
  const double special[] = {0.0, -0.0, 0.625, -0.625, 10.0, -10.0, 13.3, -13.3, 88.5, -88.5,
                            87.0, -87.0, 1e-30, -1e-30, 200.0, -200.0};
  for (size_t i = 0; i < sizeof special / sizeof *special && 3 * i < n; ++i) v[3 * i] = T(special[i]);
  if (n > 60) {
    v[50] = std::numeric_limits<T>::infinity();
    v[53] = -std::numeric_limits<T>::infinity();
    v[56] = std::numeric_limits<T>::quiet_NaN();
  }
  return v;
}

template <typename T>
void layer(Hash& hash) {
  const int64_t rows = 67, cols = 37;
  for (int a = 0; a <= 6; ++a) {
    const auto act = static_cast<Activation>(a);
    for (double spread : {1.0, 6.0}) {
      auto out = inputs<T>(rows * cols, 1 + a, spread);
      const auto bias = inputs<T>(cols, 100 + a, 1.0);
      std::vector<T> pre(rows * cols);
      auto from_pre = out;  // (the GEMM's result in pre: pre_activation_forward)
      std::vector<T> out2(rows * cols);
      cpu::bias_activation_forward<T>(out.data(), pre.data(), bias.data(), 0, rows, cols, act);
      hash.add(out);
      hash.add(pre);
      auto no_bias = from_pre;  // (the same, without a bias: pre read only)
      cpu::pre_activation_forward<T>(out2.data(), from_pre.data(), bias.data(), 0, rows, cols,
                                     act);
      hash.add(out2);
      hash.add(from_pre);
      cpu::pre_activation_forward<T>(out2.data(), no_bias.data(), nullptr, 0, rows, cols, act);
      hash.add(out2);
      hash.add(no_bias);
      const auto go = inputs<T>(rows * cols, 200 + a, 1.0);
      // dense, expanded (one value a row) and transposed upstream gradients
      const int64_t strides[3][2] = {{cols, 1}, {1, 0}, {1, rows}};
      for (const auto& s : strides) {
        std::vector<T> g(rows * cols), part(cols);
        cpu::activation_backward_rows<T>(go.data(), pre.data(), g.data(), part.data(), 0, rows,
                                         cols, act, s[0], s[1]);
        hash.add(g);
        hash.add(part);
        if (act == Activation::kNone) {  // the bias-only pass (no gradient written)
          cpu::activation_backward_rows<T>(go.data(), nullptr, nullptr, part.data(), 0, rows,
                                           cols, act, s[0], s[1]);
          hash.add(part);
        }
      }
    }
  }
  // The bias-only sums over whole columns of a column-major gradient (the adapter's): 64-row
  // blocks, 16-row blocks and a rest; past 8192 rows, blocks of 8192 added pairwise.
  for (const int64_t n : {int64_t(67), int64_t(113), int64_t(200), int64_t(3 * 8192 + 77)}) {
    const auto go = inputs<T>(n * 37, 500 + n, 2.0);
    std::vector<T> sums(37);
    cpu::column_major_bias_sums<T>(go.data(), sums.data(), n, 0, 37, n);
    hash.add(sums);
  }
  auto partials = inputs<T>(9 * 41, 300, 2.0);  // (the reduction overwrites its partials)
  std::vector<T> reduced(41);
  cpu::reduce_column_partials<T>(partials.data(), 9, 41, reduced.data(), 0, 41);
  hash.add(reduced);
}

// The bfloat16 passes: the forward (in place and not), the backward over the three layouts with
// the bias sums, and the bias-only pass.
void bfloat16_layer(Hash& hash) {
  const int64_t rows = 67, cols = 37;
  for (int a = 0; a <= 6; ++a) {
    const auto act = static_cast<Activation>(a);
    for (double spread : {1.0, 6.0}) {
      const auto z = to_bfloat16_bits(inputs<float>(rows * cols, 1 + a, spread));
      std::vector<uint16_t> out(z.size()), in_place = z;
      cpu::bfloat16_activation_forward(z.data(), out.data(), 0, rows * cols, act);
      cpu::bfloat16_activation_forward(in_place.data(), in_place.data(), 0, rows * cols, act);
      hash.add_bfloat16(out);
      hash.add_bfloat16(in_place);
      const auto saved = saved_for_backward(act) == Saved::kOutput ? out : z;
      const auto go = to_bfloat16_bits(inputs<float>(rows * cols, 200 + a, 1.0));
      const int64_t strides[3][2] = {{cols, 1}, {1, 0}, {1, rows}};
      for (const auto& s : strides) {
        std::vector<uint16_t> g(rows * cols);
        std::vector<float> part(cols);
        cpu::bfloat16_activation_backward_rows(go.data(), saved.data(), g.data(), part.data(), 0,
                                               rows, cols, act, s[0], s[1]);
        hash.add_bfloat16(g);
        hash.add(part);
        if (act == Activation::kNone) {
          cpu::bfloat16_activation_backward_rows(go.data(), nullptr, nullptr, part.data(), 0,
                                                 rows, cols, act, s[0], s[1]);
          hash.add(part);
        }
      }
    }
  }
  for (const int64_t n : {int64_t(67), int64_t(113), int64_t(200)}) {
    const auto go = to_bfloat16_bits(inputs<float>(n * 37, 500 + n, 2.0));
    std::vector<float> sums(37);
    cpu::bfloat16_column_major_bias_sums(go.data(), sums.data(), n, 0, 37, n);
    hash.add(sums);
  }
}

template <typename T>
void loss(Hash& hash) {
  const int64_t rows = 23, classes = 19;
  for (double spread : {1.0, 30.0}) {
    const auto logits = inputs<T>(rows * classes, 400, spread);
    std::vector<int64_t> labels(rows);
    for (int64_t r = 0; r < rows; ++r) labels[r] = r % 7 == 3 ? -100 : (r * 5) % classes;
    std::vector<T> l(rows), g(rows * classes);
    cpu::cross_entropy_rows<T>(logits.data(), labels.data(), l.data(), g.data(), 0, rows, classes,
                               0.5, 0.1, -100);
    hash.add(l);
    hash.add(g);
  }
}

template <typename T>
void updates(Hash& hash) {
  const int64_t n = 1000;
  for (int kind = 0; kind <= 1; ++kind) {
    for (double flags : {0.0, 2.0 + 32.0, 4.0 + 16.0}) {
      double hyper[optim::kHyper] = {};
      hyper[0] = 0.01, hyper[1] = 0.1, hyper[2] = 0.9, hyper[3] = 0.8;
      hyper[4] = 0.9, hyper[5] = 0.999, hyper[6] = 0.5, hyper[7] = 1e-8, hyper[8] = 0.3;
      hyper[9] = 3, hyper[10] = 0.999, hyper[11] = flags;
      auto p = inputs<T>(n, 500, 1.0), s1 = inputs<T>(n, 501, 0.1), s2 = inputs<T>(n, 502, 0.1);
      auto s3 = inputs<T>(n, 503, 0.1);
      for (auto& v : s2) v = v * v;
      for (auto& v : s3) v = v * v;
      const auto g = inputs<T>(n, 504, 1.0);
      cpu::optim_update<T>(static_cast<optim::Kind>(kind), hyper,
                           {p.data(), g.data(), s1.data(), s2.data(), s3.data()}, 0, n);
      hash.add(p);
      hash.add(s1);
      hash.add(s2);
      hash.add(s3);
    }
  }
  // the fixed-order sums of the all-reduce, and the norm's chunk sums
  const auto a = inputs<T>(n, 600, 1.0), b = inputs<T>(n, 601, 1.0), c = inputs<T>(n, 602, 1.0);
  const T* in[3] = {a.data(), b.data(), c.data()};
  std::vector<T> out(n), own = c;
  T* outs[1] = {out.data()};
  cpu::reduce_range<T>(in, 3, outs, 1, 0, n, true);
  cpu::chain_accumulate<T>(a.data(), own.data(), 0, n, 3);
  hash.add(out);
  hash.add(own);
  std::vector<double> sums = {cpu::chunk_sum_of_squares<T>(a.data(), 999)};
  hash.add(sums);
}

}  // namespace

int main() {
#if defined(DPCUDA_BITS_NEEDS_AVX512)
  // (the x86-64-v4 build, on a CPU without AVX-512: nothing to compare)
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl") ||
      !__builtin_cpu_supports("avx512cd")) {
    std::printf("skip\n");
    return 0;
  }
#endif
  Hash hash;
  layer<float>(hash);
  layer<double>(hash);
  bfloat16_layer(hash);
  loss<float>(hash);
  loss<double>(hash);
  updates<float>(hash);
  updates<double>(hash);
  std::printf("%016llx\n", static_cast<unsigned long long>(hash.h));
  return 0;
}
