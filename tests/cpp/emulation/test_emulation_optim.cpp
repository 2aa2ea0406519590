// The optimizer kernel (csrc/kernels/optim) in the emulation: SGD and Adam with every flag, on
// tables of tensors of 0, 1, 3, 17, 1000 and 5000 elements (several blocks per tensor, and
// grid-stride turns under a lowered grid cap), for float, double, half and bfloat16, with NaN
// and Inf among the gradients. Every result must have the bits of the CPU kernel
// (csrc/cpu/optim.h) on the same values (the half types: the CPU's float loop on widened
// values, each stored value rounded once), and match a float64 evaluation of torch's formulas
// within the type's tolerance. (NaN counts as NaN whatever its sign and payload.)
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "cpu/optim.h"
#include "emu_test.h"
#include "kernels/common.cuh"
#include "kernels/optim/optim.h"

using emu_test::DeviceBuffer;
namespace optim = dpcuda::optim;

namespace {

template <typename T> float widen(T v) { return static_cast<float>(v); }
template <> float widen<__half>(__half v) { return __half2float(v); }
template <> float widen<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> T narrow(float v) { return static_cast<T>(v); }
template <> __half narrow<__half>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T> const char* name();
template <> const char* name<float>() { return "float"; }
template <> const char* name<double>() { return "double"; }
template <> const char* name<__half>() { return "half"; }
template <> const char* name<__nv_bfloat16>() { return "bfloat16"; }

// The same bits, or both NaN: a NaN's sign and payload are not part of the contract (x86 returns
// the first operand's NaN, and the compiler may commute a sum; a GPU returns the canonical NaN).
template <typename T>
bool same_bits(T a, T b) {
  const float fa = widen(a), fb = widen(b);
  return std::memcmp(&a, &b, sizeof(T)) == 0 || (std::isnan(fa) && std::isnan(fb));
}
bool same_bits(double a, double b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

int g_reported = 0;

struct Config {
  optim::Kind kind;
  int flags;
  double weight_decay;
  int step;
};

std::vector<double> hyper_of(const Config& c) {
  std::vector<double> h(optim::kHyper, 0.0);
  const double lr = 0.05, beta1 = 0.9, beta2 = 0.999;
  h[optim::kLr] = lr;
  h[optim::kWeightDecay] = c.weight_decay;
  h[optim::kMomentum] = 0.9;
  h[optim::kOneMinusDampening] = 1.0 - 0.25;
  h[optim::kOneMinusBeta1] = 1.0 - beta1;
  h[optim::kBeta2] = beta2;
  h[optim::kOneMinusBeta2] = 1.0 - beta2;
  h[optim::kEps] = 1e-8;
  h[optim::kBeta1] = beta1;
  h[optim::kStep] = c.step;
  h[optim::kDecay] = 1.0 - lr * c.weight_decay;
  h[optim::kFlags] = c.flags;
  return h;
}

// The CPU kernel's result for one tensor (the half types on float copies, rounded once).
template <typename T>
void cpu_update(const Config& c, const std::vector<double>& h, std::vector<T>& p,
                const std::vector<T>& g, std::vector<T>& s1, std::vector<T>& s2,
                std::vector<T>& s3) {
  using F = std::conditional_t<std::is_same<T, double>::value, double, float>;
  const size_t n = p.size();
  std::vector<F> fp(n), fg(n), f1(n), f2(n), f3(n);
  auto in = [](const std::vector<T>& src, std::vector<F>& dst) {
    for (size_t i = 0; i < src.size(); ++i) {
      if constexpr (std::is_same<T, double>::value) dst[i] = src[i];
      else dst[i] = widen(src[i]);
    }
  };
  auto out = [](const std::vector<F>& src, std::vector<T>& dst) {
    for (size_t i = 0; i < src.size(); ++i) {
      if constexpr (std::is_same<T, double>::value) dst[i] = src[i];
      else dst[i] = narrow<T>(src[i]);
    }
  };
  in(p, fp); in(g, fg); in(s1, f1); in(s2, f2); in(s3, f3);
  // The buffers the kernel is given (the update's structure follows them, update.h's Hyper).
  const bool sgd = c.kind == optim::Kind::kSgd;
  F* b1 = sgd && !(c.flags & optim::kUseMomentum) ? nullptr : f1.data();
  F* b2 = sgd ? nullptr : f2.data();
  F* b3 = !sgd && (c.flags & optim::kAmsgrad) ? f3.data() : nullptr;
  dpcuda::cpu::optim_update<F>(c.kind, h.data(), {fp.data(), fg.data(), b1, b2, b3}, 0,
                               static_cast<int64_t>(n));
  out(fp, p); out(f1, s1); out(f2, s2); out(f3, s3);
}

template <typename T>
void test_dtype(uint64_t seed) {
  const std::vector<int64_t> sizes = {0, 1, 3, 17, 1000, 5000};
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  const std::vector<Config> configs = {
      {optim::Kind::kSgd, 0, 0.0, 1},
      {optim::Kind::kSgd, optim::kUseMomentum | optim::kFirst, 0.01, 1},
      {optim::Kind::kSgd, optim::kUseMomentum, 0.01, 2},
      {optim::Kind::kSgd, optim::kUseMomentum | optim::kNesterov | optim::kMaximize, 0.1, 3},
      {optim::Kind::kAdam, 0, 0.0, 1},
      {optim::Kind::kAdam, optim::kAmsgrad, 0.01, 5},
      {optim::Kind::kAdam, optim::kDecoupled | optim::kMaximize, 0.1, 2},
      {optim::Kind::kAdam, optim::kDecoupled | optim::kAmsgrad, 0.01, 1000},
  };
  for (const Config& c : configs) {
    const std::vector<double> h = hyper_of(c);
    DeviceBuffer<double> dh(h.size());
    dh.upload(h);
    struct Tensor {
      std::vector<T> p, g, s1, s2, s3;
      std::unique_ptr<DeviceBuffer<T>> dp, dg, d1, d2, d3;
    };
    std::vector<Tensor> ts(sizes.size());
    dpcuda::cuda::OptimTable<T> table{};
    for (size_t k = 0; k < sizes.size(); ++k) {
      Tensor& t = ts[k];
      const int64_t n = sizes[k];
      for (auto* v : {&t.p, &t.g, &t.s1, &t.s2, &t.s3}) v->resize(n);
      for (int64_t i = 0; i < n; ++i) {
        t.p[i] = narrow<T>(static_cast<float>(dist(rng)));
        double gv = dist(rng);
        if (i % 97 == 5) gv = std::numeric_limits<double>::quiet_NaN();
        if (i % 211 == 7) gv = (i % 2 ? -1 : 1) * std::numeric_limits<double>::infinity();
        t.g[i] = narrow<T>(static_cast<float>(gv));
        t.s1[i] = narrow<T>(static_cast<float>(dist(rng) * 0.1));
        t.s2[i] = narrow<T>(static_cast<float>(std::fabs(dist(rng)) * 0.01));
        t.s3[i] = narrow<T>(static_cast<float>(std::fabs(dist(rng)) * 0.01));
      }
      if constexpr (std::is_same<T, double>::value) {
        for (int64_t i = 0; i < n; ++i) {  // (exact doubles for the double kernel too)
          t.p[i] = dist(rng);
          t.s1[i] = dist(rng) * 0.1;
        }
      }
      t.dp = std::make_unique<DeviceBuffer<T>>(n);
      t.dg = std::make_unique<DeviceBuffer<T>>(n);
      t.d1 = std::make_unique<DeviceBuffer<T>>(n);
      t.d2 = std::make_unique<DeviceBuffer<T>>(n);
      t.d3 = std::make_unique<DeviceBuffer<T>>(n);
      t.dp->upload(t.p); t.dg->upload(t.g); t.d1->upload(t.s1); t.d2->upload(t.s2);
      t.d3->upload(t.s3);
      table.param[k] = t.dp->ptr;
      table.grad[k] = t.dg->ptr;
      const bool sgd = c.kind == optim::Kind::kSgd;
      table.state1[k] = sgd && !(c.flags & optim::kUseMomentum) ? nullptr : t.d1->ptr;
      table.state2[k] = sgd ? nullptr : t.d2->ptr;
      table.state3[k] = !sgd && (c.flags & optim::kAmsgrad) ? t.d3->ptr : nullptr;
      table.n[k] = n;
    }
    table.count = static_cast<int>(sizes.size());
    CHECK(dpcuda::cuda::optim_update<T>(c.kind, dh.ptr, table, nullptr) == cudaSuccess);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    for (size_t k = 0; k < sizes.size(); ++k) {
      Tensor& t = ts[k];
      std::vector<T> p = t.p, s1 = t.s1, s2 = t.s2, s3 = t.s3;
      cpu_update<T>(c, h, p, t.g, s1, s2, s3);
      const std::vector<T> gp = t.dp->download(), g1 = t.d1->download(),
                           g2 = t.d2->download(), g3 = t.d3->download();
      const bool sgd = c.kind == optim::Kind::kSgd;
      for (int64_t i = 0; i < sizes[k]; ++i) {
        bool ok = same_bits(gp[i], p[i]);
        if (!sgd || (c.flags & optim::kUseMomentum)) ok &= same_bits(g1[i], s1[i]);
        else ok &= same_bits(g1[i], t.s1[i]);  // an unused state is not written
        if (!sgd) ok &= same_bits(g2[i], s2[i]);
        if (!sgd && (c.flags & optim::kAmsgrad)) ok &= same_bits(g3[i], s3[i]);
        if (!ok) {
          if (++g_reported <= 20)
            std::printf("optim_update (%s) kind=%d flags=%d n=%lld: element %lld differs from "
                        "the CPU kernel\n", name<T>(), static_cast<int>(c.kind), c.flags,
                        static_cast<long long>(sizes[k]), static_cast<long long>(i));
          dpcuda_test::fail();
          break;
        }
      }
    }
  }
}

// The formulas against float64 arithmetic written out here, on one element each: a check that
// the shared formulas are torch's (the Python tests compare with torch itself).
void test_formulas() {
  const double g = 0.3, p = -1.2, m0 = 0.05, v0 = 0.02;
  {  // SGD: momentum 0.9, dampening 0.25, weight decay 0.01, Nesterov
    const Config c{optim::Kind::kSgd, optim::kUseMomentum | optim::kNesterov, 0.01, 1};
    const std::vector<double> h = hyper_of(c);
    std::vector<double> pp{p}, gg{g}, b{m0}, unused{0.0};
    dpcuda::cpu::optim_update<double>(c.kind, h.data(), {pp.data(), gg.data(), b.data(),
                                                         nullptr, nullptr}, 0, 1);
    const double d = g + 0.01 * p;
    const double buf = m0 * 0.9 + 0.75 * d;
    CHECK_CLOSE(b[0], buf, 1e-15);
    CHECK_CLOSE(pp[0], p - 0.05 * (d + 0.9 * buf), 1e-15);
  }
  {  // AdamW, step 3
    const Config c{optim::Kind::kAdam, optim::kDecoupled, 0.1, 3};
    const std::vector<double> h = hyper_of(c);
    std::vector<double> pp{p}, gg{g}, m{m0}, v{v0};
    dpcuda::cpu::optim_update<double>(c.kind, h.data(), {pp.data(), gg.data(), m.data(),
                                                         v.data(), nullptr}, 0, 1);
    const double pd = p * (1 - 0.05 * 0.1);
    const double mm = m0 + 0.1 * (g - m0);
    const double vv = v0 * 0.999 + 0.001 * g * g;
    const double denom = std::sqrt(vv) / std::sqrt(1 - std::pow(0.999, 3)) + 1e-8;
    CHECK_CLOSE(m[0], mm, 1e-15);
    CHECK_CLOSE(v[0], vv, 1e-15);
    CHECK_CLOSE(pp[0], pd - 0.05 / (1 - std::pow(0.9, 3)) * mm / denom, 1e-14);
  }
}

void test_table_limit() {
  dpcuda::cuda::OptimTable<float> table{};
  table.count = dpcuda::cuda::kOptimMaxTensors + 1;
  CHECK(dpcuda::cuda::optim_update<float>(optim::Kind::kSgd, nullptr, table, nullptr) ==
        cudaErrorInvalidValue);
}

}  // namespace

int main() {
  test_formulas();
  test_table_limit();
  for (int64_t cap : {dpcuda::cuda::kMaxGridX, int64_t(4)}) {
    dpcuda::cuda::grid_cap() = cap;
    dpcuda::emu::reset(emu_test::config(1, static_cast<uint64_t>(cap)));
    test_dtype<float>(1);
    test_dtype<double>(2);
    test_dtype<__half>(3);
    test_dtype<__nv_bfloat16>(4);
    emu_test::expect_no_reports("optim");
  }
  return emu_test::finish("test_emulation_optim");
}
