// The optimizer kernel (csrc/kernels/optim) in the emulation: SGD and Adam with every flag, on
// tables of tensors of 0, 1, 3, 17, 1000 and 5000 elements (several blocks per tensor, and
// grid-stride turns under a lowered grid cap), for float, double, half and bfloat16, with NaN
// and Inf among the gradients. Every result must have the bits of the CPU kernel
// (csrc/cpu/optim.h) on the same values (the half types: the CPU's float loop on widened
// values, each stored value rounded once), and match a float64 evaluation of torch's formulas
// within the type's tolerance. (NaN counts as NaN whatever its sign and payload.)
// And the fused update's bookkeeping kernels (counts.h: update_hyper, update_counts) against
// their CPU twin, bit for bit: launched directly on random rows, counts, records (flags 0, 1 or
// NaN) and ring slots (out of range too), and captured once as a graph replayed 40 times on
// fresh records, its ring wrapping and its counts advancing as 40 direct launches would.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "cpu/optim.h"
#include "kernels/optim/counts.h"
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


// One case of the bookkeeping kernels: rows, counts, records and a ring on the host.
struct CountsCase {
  optim::Kind kind;
  int64_t groups, n;
  int replicas;
  int64_t slots;
  bool base, counts, ring;
};

struct CountsState {
  std::vector<double> hyper, base, ring;
  std::vector<float> counts;
  std::vector<int64_t> first, slot;
  std::vector<std::vector<double>> records;
};

std::vector<double> random_records(std::mt19937_64& rng, int replicas) {
  std::uniform_int_distribution<int> pick(0, 7);
  const double flags[] = {0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, std::nan("")};
  std::vector<double> out;
  for (int r = 0; r < replicas; ++r) {
    out.push_back(std::uniform_real_distribution<double>(-3.0, 3.0)(rng));
    out.push_back(flags[pick(rng)]);
    out.push_back(flags[pick(rng)]);
    out.push_back(static_cast<double>(pick(rng) * 40));
  }
  return out;
}

CountsState random_state(const CountsCase& c, std::mt19937_64& rng) {
  CountsState s;
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  std::uniform_int_distribution<int> whole(0, 500);
  s.hyper.resize(c.groups * optim::kHyper);
  s.base.resize(c.groups * optim::kHyper);
  for (double& v : s.hyper) v = u(rng);
  for (double& v : s.base) v = u(rng);
  for (int64_t g = 0; g < c.groups; ++g) {
    s.hyper[g * optim::kHyper + optim::kFlags] = whole(rng) % 64;
    s.base[g * optim::kHyper + optim::kFlags] = whole(rng) % 64;
  }
  const int64_t n = c.kind == optim::Kind::kAdam ? c.n : c.groups;
  for (int64_t i = 0; i < n; ++i) {
    s.counts.push_back(c.kind == optim::Kind::kAdam ? static_cast<float>(whole(rng))
                                                    : static_cast<float>(whole(rng) % 2));
  }
  for (int64_t g = 0; g < c.groups; ++g) s.first.push_back(whole(rng) % c.n);
  s.slot = {static_cast<int64_t>(whole(rng)) - 250};
  s.ring.resize(c.slots * c.replicas * optim::kStatusRecord);
  for (double& v : s.ring) v = u(rng);
  const std::vector<double> flat = random_records(rng, c.replicas);
  for (int r = 0; r < c.replicas; ++r) {
    s.records.emplace_back(flat.begin() + r * optim::kStatusRecord,
                           flat.begin() + (r + 1) * optim::kStatusRecord);
  }
  return s;
}

// The CPU twin's step on s.
void cpu_counts_step(const CountsCase& c, CountsState& s) {
  const int64_t n = c.counts ? static_cast<int64_t>(s.counts.size()) : 0;
  dpcuda::cpu::update_hyper(c.kind, s.hyper.data(), c.groups, c.base ? s.base.data() : nullptr,
                            c.counts ? s.counts.data() : nullptr, n, s.first.data());
  std::vector<const double*> ptrs;
  for (const auto& r : s.records) ptrs.push_back(r.data());
  dpcuda::cpu::update_counts(c.kind, ptrs.data(), c.replicas,
                             c.counts ? s.counts.data() : nullptr, n,
                             c.ring ? s.ring.data() : nullptr, c.slots, s.slot.data());
}

template <typename T>
bool same_vector(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!same_bits(a[i], b[i])) return false;
  }
  return true;
}

// The same state on the device, and the two launches on `stream`.
struct DeviceCounts {
  const CountsCase& c;
  DeviceBuffer<double> hyper, base, ring;
  DeviceBuffer<float> counts;
  DeviceBuffer<int64_t> first, slot;
  std::vector<std::unique_ptr<DeviceBuffer<double>>> records;
  dpcuda::cuda::CountRecords table{};

  DeviceCounts(const CountsCase& cs, const CountsState& s)
      : c(cs), hyper(s.hyper.size()), base(s.base.size()), ring(s.ring.size()),
        counts(s.counts.size()), first(s.first.size()), slot(1) {
    hyper.upload(s.hyper);
    base.upload(s.base);
    ring.upload(s.ring);
    counts.upload(s.counts);
    first.upload(s.first);
    slot.upload(s.slot);
    for (const auto& r : s.records) {
      records.push_back(std::make_unique<DeviceBuffer<double>>(r.size()));
      records.back()->upload(r);
      table.ptr[table.n++] = records.back()->ptr;
    }
  }

  cudaError_t run(cudaStream_t stream) {
    const int64_t n = c.counts ? static_cast<int64_t>(counts.n) : 0;
    cudaError_t e = dpcuda::cuda::update_hyper(c.kind, hyper.ptr, c.groups,
                                               c.base ? base.ptr : nullptr,
                                               c.counts ? counts.ptr : nullptr, n, first.ptr,
                                               stream);
    if (e != cudaSuccess) return e;
    return dpcuda::cuda::update_counts(c.kind, table, c.counts ? counts.ptr : nullptr, n,
                                       c.ring ? ring.ptr : nullptr, c.slots, slot.ptr, stream);
  }

  bool matches(const CountsState& s) const {
    return same_vector(hyper.download(), s.hyper) && same_vector(counts.download(), s.counts) &&
           same_vector(ring.download(), s.ring) && slot.download() == s.slot;
  }
};

std::vector<CountsCase> counts_cases() {
  std::vector<CountsCase> cases;
  for (optim::Kind kind : {optim::Kind::kAdam, optim::Kind::kSgd}) {
    for (int64_t n : {1, 3, 300}) {           // (300: more counts than the block's threads)
      for (int replicas : {1, 2, 5, 16}) {
        for (int mode = 0; mode < 4; ++mode) {
          const bool counts = kind == optim::Kind::kAdam || mode != 3;
          cases.push_back({kind, kind == optim::Kind::kAdam ? 3 : n % 7 + 1, n, replicas,
                           mode == 2 ? 1 : 5, mode != 1, counts, mode != 0});
        }
      }
    }
  }
  return cases;
}

void test_counts_direct() {
  dpcuda::emu::reset(emu_test::config(1, 11));
  std::mt19937_64 rng(77);
  for (const CountsCase& c : counts_cases()) {
    for (int trial = 0; trial < 3; ++trial) {
      CountsState s = random_state(c, rng);
      DeviceCounts d(c, s);
      CUDA_OK(d.run(nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      cpu_counts_step(c, s);
      if (!d.matches(s)) {
        std::printf("update_hyper/update_counts kind=%d groups=%lld n=%lld replicas=%d "
                    "slots=%lld base=%d counts=%d ring=%d: differ from the CPU twin\n",
                    static_cast<int>(c.kind), static_cast<long long>(c.groups),
                    static_cast<long long>(c.n), c.replicas, static_cast<long long>(c.slots),
                    c.base, c.counts, c.ring);
        dpcuda_test::fail();
      }
    }
  }
  emu_test::expect_no_reports("counts");
}

void test_counts_captured() {
  constexpr int kReplays = 40;
  std::mt19937_64 rng(78);
  for (const CountsCase& c : counts_cases()) {
    if (!c.ring || !c.base) continue;  // (a graphed step's: the graph's rows and its ring)
    dpcuda::emu::reset(emu_test::config(1, 12));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    CountsState s = random_state(c, rng);
    DeviceCounts d(c, s);
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    CUDA_OK(d.run(stream));
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(d.matches(s));  // (a capture runs nothing)
    bool same = true;
    for (int k = 0; k < kReplays && same; ++k) {
      // this step's records, queued on the stream before the replay (as a step's status)
      const std::vector<double> flat = random_records(rng, c.replicas);
      for (int r = 0; r < c.replicas; ++r) {
        s.records[r].assign(flat.begin() + r * optim::kStatusRecord,
                            flat.begin() + (r + 1) * optim::kStatusRecord);
        CUDA_OK(cudaMemcpyAsync(d.records[r]->ptr, s.records[r].data(),
                                optim::kStatusRecord * sizeof(double), cudaMemcpyHostToDevice,
                                stream));
      }
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      cpu_counts_step(c, s);
      same = d.matches(s);
    }
    if (!same) {
      std::printf("update_hyper/update_counts captured, kind=%d n=%lld replicas=%d slots=%lld: "
                  "a replay differs from the CPU twin's step\n", static_cast<int>(c.kind),
                  static_cast<long long>(c.n), c.replicas, static_cast<long long>(c.slots));
      dpcuda_test::fail();
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
    emu_test::expect_no_reports("counts captured");
  }
}

void test_counts_limits() {
  dpcuda::emu::reset(emu_test::config(1, 13));
  dpcuda::cuda::CountRecords many{};
  many.n = dpcuda::cuda::kMaxReplicas + 1;
  DeviceBuffer<float> counts(4);
  CHECK(dpcuda::cuda::update_counts(optim::Kind::kAdam, many, counts.ptr, 4, nullptr, 0,
                                    nullptr, nullptr) == cudaErrorInvalidValue);
  dpcuda::cuda::CountRecords one{};
  one.n = 1;
  DeviceBuffer<double> ring(4), record(4);
  one.ptr[0] = record.ptr;
  CHECK(dpcuda::cuda::update_counts(optim::Kind::kAdam, one, counts.ptr, 4, ring.ptr, 1,
                                    nullptr, nullptr) == cudaErrorInvalidValue);  // no slot
  DeviceBuffer<double> hyper(optim::kHyper);
  CHECK(dpcuda::cuda::update_hyper(optim::Kind::kAdam, hyper.ptr, 1, nullptr, nullptr, 0,
                                   nullptr, nullptr) == cudaErrorInvalidValue);  // no counts
  // an index of first outside counts: a NaN step, never another count's
  DeviceBuffer<int64_t> first(1);
  first.upload({4});
  counts.upload({1.0f, 2.0f, 3.0f, 4.0f});
  CUDA_OK(dpcuda::cuda::update_hyper(optim::Kind::kAdam, hyper.ptr, 1, nullptr, counts.ptr, 4,
                                     first.ptr, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(std::isnan(hyper.download()[optim::kStep]));
  emu_test::expect_no_reports("counts limits");
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
  test_counts_direct();
  test_counts_captured();
  test_counts_limits();
  return emu_test::finish("test_emulation_optim");
}
