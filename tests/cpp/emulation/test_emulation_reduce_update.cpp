// The reduction fused with dpcuda.optim's update (schedule.h's reduce_update, the kernel
// reduce_update_range) on emulated devices: SGD (momentum, its first step, Nesterov), Adam
// (amsgrad) and AdamW, with two parameter groups (two segments, two hyperparameter arrays),
// for one_shot, two_shot and ring, 1 to 8 replicas on their own devices or sharing them, peer
// access on, off and mixed, under random stream delays, float, double and half. Every replica
// must end with the weights of the CPU's fused reduce-update (csrc/cpu/all_reduce.h), bit for
// bit, and each replica's state shard with the CPU's state for that shard (without the gather:
// replica 0 with those weights, the others untouched); with clipping by the global norm, the
// norm too (optim/clip.h's order, on the shards of several chunks each). With step records
// (DataParallel's non-blocking step): clear records whose rows differ from scaled_by (the
// reduced gradient times their fix, before clipping and the update, as the CPU computes it
// after its reduction) and the step's loss; a record that says NaN/Inf (nothing written, the
// norm NaN). Under ASan/UBSan and TSan too (the ctest builds of CMakeLists.txt).
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cpu/all_reduce.h"
#include "emu_test.h"
#include "kernels/all_reduce/schedule.h"
#include "kernels/common.cuh"

using dpcuda::AllReduceAlgorithm;
using emu_test::DeviceBuffer;
namespace optim = dpcuda::optim;

namespace {

template <typename T> float widen(T v) { return static_cast<float>(v); }
template <> float widen<__half>(__half v) { return __half2float(v); }
double widen(double v) { return v; }
template <typename T> T narrow(float v) { return static_cast<T>(v); }
template <> __half narrow<__half>(float v) { return __float2half_rn(v); }
// A reference value (float or double, held in a double exactly) stored as T.
template <typename T> T stored(double v) { return narrow<T>(static_cast<float>(v)); }
template <> double stored<double>(double v) { return v; }

template <typename T>
bool same(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

enum class Peers { kAll, kNone, kMixed };

struct Case {
  int replicas;
  int devices;  // replica r lives on device r % devices
  Peers peers;
  AllReduceAlgorithm algorithm;
  int64_t n;
  optim::Kind kind;
  int flags;
  // false: only replica 0 takes the new weights (the others must keep theirs), which the
  // schedule refuses with cudaErrorInvalidValue when the replicas span several devices.
  bool gather = true;
  // >= 0: clipping by the global norm (the norm checked too, bit for bit).
  double max_norm = -1.0;
  // Step records: 0 none; 1 clear, counting fewer rows than scaled_by (a fix of 24/17);
  // 2 one replica's record says NaN/Inf (the update skipped).
  int records = 0;
};

std::vector<double> hyper_of(const Case& c, int group) {
  std::vector<double> h(optim::kHyper, 0.0);
  const double lr = group ? 0.01 : 0.05, wd = group ? 0.0 : 0.02, step = 3;
  h[optim::kLr] = lr;
  h[optim::kWeightDecay] = wd;
  h[optim::kMomentum] = 0.9;
  h[optim::kOneMinusDampening] = 1.0;
  h[optim::kOneMinusBeta1] = 0.1;
  h[optim::kBeta2] = 0.999;
  h[optim::kOneMinusBeta2] = 1.0 - 0.999;
  h[optim::kEps] = 1e-8;
  h[optim::kBeta1] = 0.9;
  h[optim::kStep] = step;
  h[optim::kDecay] = 1.0 - lr * wd;
  h[optim::kFlags] = c.flags;
  return h;
}

int g_reported = 0;

// The records' rows: scaled_by as the step scaled the losses, and the rows they count.
constexpr double kScaledBy = 24.0;
constexpr double kRows = 17.0;

// The CPU reference of the half type's clipped gradient: rounded to half, as the kernels store it.
template <typename F>
void round_half(F* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<F>(__half2float(__float2half_rn(static_cast<float>(x[i]))));
  }
}

void fail(const char* what, const Case& c, int r, int64_t i) {
  if (++g_reported <= 20)
    std::printf("reduce_update %s: R=%d D=%d algo=%d n=%lld kind=%d flags=%d clip=%g records=%d: "
                "replica %d element %lld differs\n", what, c.replicas, c.devices,
                static_cast<int>(c.algorithm), static_cast<long long>(c.n),
                static_cast<int>(c.kind), c.flags, c.max_norm, c.records, r,
                static_cast<long long>(i));
  dpcuda_test::fail();
}

// The replica counts this run takes (--replicas); a case of another count is passed over (its
// seed still taken: each case has the same seed whichever counts run).
std::vector<int> g_counts;

template <typename T>
void run_case(const Case& c, uint64_t seed) {
  if (!emu_test::has(g_counts, c.replicas)) return;
  const int R = c.replicas, D = c.devices;
  dpcuda::emu::Config cfg = emu_test::config(D, seed, 50);
  std::mt19937 rng(static_cast<unsigned>(seed));
  cfg.peer.assign(D, std::vector<bool>(D, c.peers == Peers::kAll));
  if (c.peers == Peers::kMixed) {
    for (int d = 0; d < D; ++d)
      for (int e = 0; e < D; ++e) cfg.peer[d][e] = rng() % 2 == 0;
  }
  dpcuda::emu::reset(cfg);
  std::vector<std::vector<bool>> readable;
  const std::vector<cudaStream_t> streams = emu_test::open_devices(D, &readable);
  const int64_t n = c.n;
  const bool sgd = c.kind == optim::Kind::kSgd;
  const bool s1_used = !sgd || (c.flags & optim::kUseMomentum);
  const bool s3_used = !sgd && (c.flags & optim::kAmsgrad);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::vector<T>> x(R, std::vector<T>(n));
  for (auto& b : x)
    for (auto& v : b) v = narrow<T>(dist(rng));
  std::vector<T> p0(n), a0(n), b0(n), c0(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = narrow<T>(dist(rng));
    a0[i] = narrow<T>(dist(rng) * 0.1f);
    b0[i] = narrow<T>(std::fabs(dist(rng)) * 0.01f);
    c0[i] = narrow<T>(std::fabs(dist(rng)) * 0.02f);
  }
  const int64_t cut = n / 3;
  const std::vector<dpcuda::cpu::UpdateSegment> segs = {{0, cut, 0}, {cut, n, 1}};
  const std::vector<double> h0 = hyper_of(c, 0), h1 = hyper_of(c, 1);
  const double* hp[2] = {h0.data(), h1.data()};
  // The CPU's result: the float or double kernels on the same values; the half type as the
  // adapter runs it (the mean rounded to half, then the float update of rounded values).
  using F = std::conditional_t<std::is_same<T, double>::value, double, float>;
  std::vector<F> wp(n), wa(n), wb(n), wc(n);
  F cpu_norm = F(-1);
  {
    std::vector<std::vector<F>> gx(R, std::vector<F>(n));
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < n; ++i) gx[r][i] = widen(x[r][i]);
    for (int64_t i = 0; i < n; ++i) {
      wp[i] = widen(p0[i]);
      wa[i] = widen(a0[i]);
      wb[i] = widen(b0[i]);
      wc[i] = widen(c0[i]);
    }
    bool reduced = false;
    if (std::is_same<T, __half>::value || c.records == 1) {
      // The mean rounded to T, then (records) times the fix, rounded to T again.
      const F fix = static_cast<F>(kScaledBy / kRows);
      for (int64_t i = 0; i < n; ++i) {
        F acc = gx[0][i];
        for (int r = 1; r < R; ++r) acc = acc + gx[r][i];
        gx[0][i] = widen(stored<T>(acc / static_cast<F>(R)));
        if (c.records == 1) gx[0][i] = widen(stored<T>(gx[0][i] * fix));
      }
      reduced = true;
    }
    std::vector<F*> gp;
    for (int r = 0; r < (reduced ? 1 : R); ++r) gp.push_back(gx[r].data());
    F* s1 = s1_used ? wa.data() : nullptr;
    F* s2 = sgd ? nullptr : wb.data();
    F* s3 = s3_used ? wc.data() : nullptr;
    std::vector<F> copies((reduced ? 0 : R - 1) * n);
    std::vector<F*> outs{wp.data()};
    for (int r = 1; r < (reduced ? 1 : R); ++r) outs.push_back(copies.data() + (r - 1) * n);
    for (int r = 1; r < static_cast<int>(outs.size()); ++r)
      std::memcpy(outs[r], wp.data(), n * sizeof(F));
    // Each shard's state pointer into the whole state (the CPU's split of F, the same as T's
    // where F is T; the half type's reference runs as one replica, one shard).
    const int shards = reduced ? 1 : R;
    std::vector<F*> q1(shards), q2(shards), q3(shards);
    for (int k = 0; k < shards; ++k) {
      int64_t b, e;
      dpcuda::cpu::shard_range(n, shards, k, 16 / sizeof(F), &b, &e);
      q1[k] = s1 ? s1 + b : nullptr;
      q2[k] = s2 ? s2 + b : nullptr;
      q3[k] = s3 ? s3 + b : nullptr;
    }
    dpcuda::cpu::Clip<F> clip{c.max_norm, &cpu_norm, R, static_cast<int64_t>(16 / sizeof(T)),
                              std::is_same<T, __half>::value ? &round_half<F> : nullptr};
    dpcuda::cpu::reduce_update<F>(outs.data(), gp.data(),
                                  {s1 ? q1.data() : nullptr, s2 ? q2.data() : nullptr,
                                   s3 ? q3.data() : nullptr},
                                  shards, n, true, reduced,
                                  AllReduceAlgorithm::kTwoShot, c.kind, segs.data(), 2, hp,
                                  nullptr, [](int64_t b, int64_t e, const auto& body) {
                                    body(b, e);
                                  }, true, c.max_norm >= 0.0 ? &clip : nullptr);
    if (c.records == 2) {  // skipped: everything as it was, the norm NaN
      for (int64_t i = 0; i < n; ++i) {
        wp[i] = widen(p0[i]);
        wa[i] = widen(a0[i]);
        wb[i] = widen(b0[i]);
        wc[i] = widen(c0[i]);
      }
      cpu_norm = static_cast<F>(NAN);
    }
  }
  // The records, one per replica on its device: [loss, NaN/Inf, bad label, rows counted].
  std::vector<std::unique_ptr<DeviceBuffer<double>>> record_bufs;
  std::vector<const double*> records;
  double want_loss = 0.0;
  for (int r = 0; r < R && c.records != 0; ++r) {
    CUDA_OK(cudaSetDevice(r % D));
    const double loss = 0.25 * (r + 1), rows = r == 0 ? kRows : 0.0;
    want_loss += loss;
    record_bufs.push_back(std::make_unique<DeviceBuffer<double>>(4));
    record_bufs.back()->upload({loss, c.records == 2 && r == R - 1 ? 1.0 : 0.0, 0.0, rows});
    records.push_back(record_bufs.back()->ptr);
  }
  want_loss *= kScaledBy / kRows;
  // The devices' buffers: full gradients and weights per replica, one state shard each.
  const int64_t align = 16 / sizeof(T);
  std::vector<std::unique_ptr<DeviceBuffer<T>>> g, p, s1, s2, s3;
  std::vector<std::unique_ptr<DeviceBuffer<double>>> hyper;
  dpcuda::cuda::ScheduleReplicas<T> reps;
  std::vector<T*> params;
  dpcuda::cuda::UpdateState<T> state;
  std::vector<std::vector<const double*>> hpt(R);
  auto shard_of = [&](const std::vector<T>& full, int k) {
    int64_t b, e;
    dpcuda::cpu::shard_range(n, R, k, align, &b, &e);
    return std::vector<T>(full.begin() + b, full.begin() + e);
  };
  for (int r = 0; r < R; ++r) {
    CUDA_OK(cudaSetDevice(r % D));
    g.push_back(std::make_unique<DeviceBuffer<T>>(n));
    g.back()->upload(x[r]);
    reps.data.push_back(g.back()->ptr);
    reps.device.push_back(r % D);
    p.push_back(std::make_unique<DeviceBuffer<T>>(n));
    p.back()->upload(p0);
    params.push_back(p.back()->ptr);
    auto add = [&](std::vector<std::unique_ptr<DeviceBuffer<T>>>& v, const std::vector<T>& full,
                   std::vector<T*>& ptrs) {
      const std::vector<T> part = shard_of(full, r);
      v.push_back(std::make_unique<DeviceBuffer<T>>(part.size()));
      if (!part.empty()) v.back()->upload(part);
      ptrs.push_back(v.back()->ptr);
    };
    if (s1_used) add(s1, a0, state.state1);
    if (!sgd) add(s2, b0, state.state2);
    if (s3_used) add(s3, c0, state.state3);
    for (const auto* h : {&h0, &h1}) {
      hyper.push_back(std::make_unique<DeviceBuffer<double>>(h->size()));
      hyper.back()->upload(*h);
      hpt[r].push_back(hyper.back()->ptr);
    }
  }
  std::vector<int> device;
  for (int r = 0; r < R; ++r) device.push_back(r % D);
  const dpcuda::cuda::AllReducePlan plan = dpcuda::cuda::plan_all_reduce(
      device, streams, readable, c.algorithm, n, sizeof(T));
  const emu_test::PerDevice scratch_bufs = emu_test::per_device(plan.scratch_bytes);
  const std::vector<void*>& scratch = scratch_bufs.ptrs;
  const std::vector<dpcuda::cuda::UpdateSegment> cuda_segs = {{0, cut, 0}, {cut, n, 1}};
  dpcuda::cuda::ClipArgs<T> clip;
  clip.max_norm = c.max_norm;
  const emu_test::PerDevice workspace =
      emu_test::per_device(std::vector<size_t>(D, dpcuda::cuda::clip_workspace_bytes(plan)));
  clip.workspace = workspace.ptrs;
  CUDA_OK(cudaSetDevice(0));
  DeviceBuffer<T> norm(1);
  clip.norm_out = norm.ptr;
  DeviceBuffer<double> loss_out(1);
  const cudaError_t err = dpcuda::cuda::reduce_update<T>(
      plan, reps, params, state, c.kind, cuda_segs, hpt, true, scratch, c.gather,
      c.max_norm >= 0.0 ? &clip : nullptr, records, c.records ? kScaledBy : 0.0,
      c.records ? loss_out.ptr : nullptr);
  if (!c.gather && plan.devices.size() > 1) {
    CHECK(err == cudaErrorInvalidValue);
    // (refused before any launch: every replica keeps its weights)
    for (int r = 0; r < R; ++r) {
      const std::vector<T> got = p[r]->download();
      for (int64_t i = 0; i < n; ++i) {
        if (!same(got[i], p0[i])) {
          fail("refused call's weights", c, r, i);
          break;
        }
      }
    }
  } else {
    CHECK(err == cudaSuccess);
  }
  for (int d = 0; d < D; ++d) {
    CUDA_OK(cudaSetDevice(d));
    CUDA_OK(cudaStreamSynchronize(streams[d]));
  }
  for (int r = 0; r < R && err == cudaSuccess; ++r) {
    const std::vector<T> got = p[r]->download();
    for (int64_t i = 0; i < n; ++i) {
      if (!same(got[i], r == 0 || c.gather ? stored<T>(wp[i]) : p0[i])) {
        fail("weights", c, r, i);
        break;
      }
    }
    int64_t b, e;
    dpcuda::cpu::shard_range(n, R, r, align, &b, &e);
    auto check_state = [&](const std::vector<std::unique_ptr<DeviceBuffer<T>>>& v,
                           const std::vector<F>& want, const char* what) {
      if (v.empty() || e <= b) return;
      const std::vector<T> shard = v[r]->download();
      for (int64_t i = b; i < e; ++i) {
        if (!same(shard[i - b], stored<T>(want[i]))) {
          fail(what, c, r, i);
          break;
        }
      }
    };
    if (r == 0 && c.max_norm >= 0.0) {
      const T got_norm = norm.download()[0];
      const bool nan_ok = c.records == 2 && widen(got_norm) != widen(got_norm);
      if (!nan_ok && !same(got_norm, stored<T>(cpu_norm))) fail("norm", c, r, 0);
    }
    if (r == 0 && c.records != 0 && !same(loss_out.download()[0], want_loss)) {
      fail("loss_out", c, r, 0);
    }
    check_state(s1, wa, "state1");
    check_state(s2, wb, "state2");
    check_state(s3, wc, "state3");
  }
  for (int d = 0; d < D; ++d) {
    CUDA_OK(cudaSetDevice(d));
    CUDA_OK(cudaStreamDestroy(streams[d]));
  }
  emu_test::expect_no_reports("reduce_update");
}

}  // namespace

// test_emulation_reduce_update [--replicas LIST] (default: 1, 2, 3, 5 and 8; the sanitizer
// builds run a few, CMakeLists.txt)
int main(int argc, char** argv) {
  g_counts = emu_test::replicas(argc, argv, {1, 2, 3, 5, 8});
  uint64_t seed = 500;
  const AllReduceAlgorithm kAlgorithms[] = {
      AllReduceAlgorithm::kOneShot, AllReduceAlgorithm::kTwoShot, AllReduceAlgorithm::kRing};
  const struct {
    optim::Kind kind;
    int flags;
  } kUpdates[] = {
      {optim::Kind::kSgd, optim::kUseMomentum},
      {optim::Kind::kSgd, optim::kUseMomentum | optim::kFirst | optim::kNesterov},
      {optim::Kind::kSgd, optim::kMaximize},
      {optim::Kind::kAdam, optim::kAmsgrad},
      {optim::Kind::kAdam, optim::kDecoupled | optim::kMaximize},
  };
  for (AllReduceAlgorithm a : kAlgorithms) {
    for (int R : {1, 2, 3, 5, 8}) {
      for (const auto& u : kUpdates) {
        for (Peers peers : {Peers::kAll, Peers::kNone, Peers::kMixed}) {
          run_case<float>({R, R, peers, a, 1000, u.kind, u.flags}, ++seed);
        }
        run_case<float>({R, R, Peers::kMixed, a, 7, u.kind, u.flags}, ++seed);
        run_case<float>({R, (R + 1) / 2, Peers::kMixed, a, 1000, u.kind, u.flags}, ++seed);
        run_case<float>({R, 1, Peers::kAll, a, 1000, u.kind, u.flags}, ++seed);
        run_case<float>({R, 1, Peers::kAll, a, 1000, u.kind, u.flags, false}, ++seed);
      }
      run_case<float>({R, R, Peers::kAll, a, 100, optim::Kind::kAdam, 0, false}, ++seed);
      // Clipping: active (max_norm 1), inactive (1e6) and zeroing (0); shards of many chunks.
      // (shards of several chunks where there are few replicas; sizes kept small for TSan)
      for (Peers peers : {Peers::kAll, Peers::kNone, Peers::kMixed}) {
        run_case<float>({R, R, peers, a, peers == Peers::kMixed ? 20011 : 9001,
                         optim::Kind::kAdam, optim::kDecoupled, true, 1.0}, ++seed);
      }
      run_case<float>({R, 1, Peers::kAll, a, 12289, optim::Kind::kAdam, optim::kAmsgrad, false,
                       1.0}, ++seed);
      run_case<float>({R, (R + 1) / 2, Peers::kMixed, a, 9000, optim::Kind::kSgd,
                       optim::kUseMomentum, true, 1e6}, ++seed);
      run_case<double>({R, R, Peers::kMixed, a, 9001, optim::Kind::kSgd, optim::kNesterov |
                        optim::kUseMomentum, true, 0.5}, ++seed);
      run_case<float>({R, R, Peers::kAll, a, 1000, optim::Kind::kSgd, 0, true, 0.0}, ++seed);
      run_case<float>({R, R, Peers::kMixed, a, 7, optim::Kind::kAdam, 0, true, 0.5}, ++seed);
      run_case<__half>({R, R, Peers::kMixed, a, 9001, optim::Kind::kAdam, optim::kDecoupled, true,
                        1.0}, ++seed);
      run_case<__half>({R, 1, Peers::kAll, a, 1001, optim::Kind::kAdam, optim::kDecoupled, false},
                       ++seed);
      run_case<double>({R, R, Peers::kNone, a, 999, optim::Kind::kAdam, optim::kAmsgrad},
                       ++seed);
      run_case<__half>({R, R, Peers::kMixed, a, 1001, optim::Kind::kAdam, optim::kDecoupled},
                       ++seed);
      run_case<__half>({R, R, Peers::kNone, a, 1001, optim::Kind::kSgd, optim::kUseMomentum},
                       ++seed);
      // Step records: a fix (with and without clipping), a skip; shared and own devices.
      for (int rec : {1, 2}) {
        run_case<float>({R, R, Peers::kMixed, a, 1000, optim::Kind::kAdam, optim::kDecoupled,
                         true, -1.0, rec}, ++seed);
        run_case<float>({R, R, Peers::kMixed, a, 9001, optim::Kind::kAdam, optim::kAmsgrad,
                         true, 1.0, rec}, ++seed);
        run_case<float>({R, 1, Peers::kAll, a, 1000, optim::Kind::kSgd, optim::kUseMomentum,
                         false, 0.5, rec}, ++seed);
        run_case<__half>({R, (R + 1) / 2, Peers::kNone, a, 1001, optim::Kind::kAdam,
                          optim::kDecoupled, true, 1.0, rec}, ++seed);
        run_case<double>({R, 1, Peers::kAll, a, 999, optim::Kind::kAdam, 0, false, -1.0, rec},
                         ++seed);
      }
    }
  }
  return emu_test::finish("test_emulation_reduce_update");
}
