// Every all-reduce schedule (csrc/kernels/all_reduce/schedule.cu) on emulated devices: one_shot,
// two_shot and ring, plain and with SGD fused, for 1 to 8 and 16 replicas on their own devices
// or sharing them, with peer access all on, all off and mixed, under random stream delays.
// Every replica must end bit-identical to the fixed-order CPU sum (and SGD step).
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

namespace {

template <typename T> double to_float(T v) { return static_cast<double>(v); }
template <> double to_float<__half>(__half v) { return __half2float(v); }
template <typename T> T from_float(double v) { return static_cast<T>(v); }
template <> __half from_float<__half>(double v) {
  return __float2half_rn(static_cast<float>(v));  // v holds a float: exact
}

enum class Peers { kAll, kNone, kMixed };

struct Case {
  int replicas;
  int devices;  // replica r lives on device r % devices
  Peers peers;
  AllReduceAlgorithm algorithm;
  int64_t n;
  bool sgd;
  bool momentum;
  // With sgd: the replicas' step records given to reduce_sgd: none; all clear (with scaled_by
  // the rows they count: the same bits as none); one (a random replica) saying NaN/Inf or a
  // bad label, when no replica may be updated; or counting a third of the rows the gradients
  // were scaled for, when the reduced gradient is tripled. With records, replica 0's device
  // receives the loss: the records' losses summed (times 3 when tripled).
  enum { kNone, kClear, kSkip, kTriple } records = kNone;
};

// The replica counts this run takes (--replicas); a case of another count is passed over (its
// seed still taken: each case has the same seed whichever counts run).
std::vector<int> g_counts;

template <typename T>
void run_case(const Case& c, uint64_t seed) {
  if (!emu_test::has(g_counts, c.replicas)) return;
  using Acc = dpcuda::cuda::acc_t<T>;
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
  std::normal_distribution<float> dist(0.0f, 10.0f);
  std::vector<std::vector<T>> x(R, std::vector<T>(c.n));
  for (auto& b : x)
    for (auto& v : b) v = from_float<T>(dist(rng));
  std::vector<T> p0(c.n), m0(c.n);
  for (auto& v : p0) v = from_float<T>(dist(rng));
  for (auto& v : m0) v = from_float<T>(dist(rng) * 0.1f);
  // The expected bits: the fixed-order mean, rounded to T, then the SGD element formula.
  std::vector<T> want(c.n), want_p(c.n), want_m(c.n);
  const dpcuda::cuda::SgdArgs sgd{0.05, c.momentum ? 0.9 : 0.0, 0.01};
  for (int64_t i = 0; i < c.n; ++i) {
    Acc acc = static_cast<Acc>(to_float(x[0][i]));
    for (int r = 1; r < R; ++r) acc = acc + static_cast<Acc>(to_float(x[r][i]));
    acc = acc / static_cast<Acc>(R);
    want[i] = from_float<T>(acc);
    const Acc g = static_cast<Acc>(to_float(want[i])), p = static_cast<Acc>(to_float(p0[i]));
    // The kernels take float64 buffers' hyperparameters in double, the others' in float.
    const bool dbl = sizeof(Acc) == 8;
    const Acc wd = dbl ? Acc(0.01) : Acc(0.01f), mu = dbl ? Acc(0.9) : Acc(0.9f);
    const Acc lr = dbl ? Acc(0.05) : Acc(0.05f);
    Acc g2 = g;
    if (c.records == Case::kTriple) g2 = static_cast<Acc>(to_float(from_float<T>(g * Acc(3))));
    Acc d = g2 + wd * p;
    if (c.momentum) d = mu * static_cast<Acc>(to_float(m0[i])) + d;
    want_p[i] = from_float<T>(p - lr * d);
    want_m[i] = from_float<T>(d);
  }
  const bool skip = c.records == Case::kSkip;
  if (skip) {
    want_p = p0;
    want_m = m0;
  }
  const int who = static_cast<int>(rng() % R);
  std::vector<std::unique_ptr<DeviceBuffer<T>>> g, p, m;
  std::vector<std::unique_ptr<DeviceBuffer<double>>> rec;
  std::vector<const double*> records;
  dpcuda::cuda::ScheduleReplicas<T> reps;
  std::vector<T*> params, momenta;
  for (int r = 0; r < R; ++r) {
    CUDA_OK(cudaSetDevice(r % D));
    if (c.records != Case::kNone) {
      rec.push_back(std::make_unique<DeviceBuffer<double>>(dpcuda::cuda::kRecord));
      rec.back()->upload({0.5 + r, skip && r == who && who % 2 == 0 ? 1.0 : 0.0,
                          skip && r == who && who % 2 == 1 ? 1.0 : 0.0, 2.0});
      records.push_back(rec.back()->ptr);
    }
    g.push_back(std::make_unique<DeviceBuffer<T>>(c.n));
    g.back()->upload(x[r]);
    reps.data.push_back(g.back()->ptr);
    reps.device.push_back(r % D);
    if (c.sgd) {
      p.push_back(std::make_unique<DeviceBuffer<T>>(c.n));
      p.back()->upload(p0);
      params.push_back(p.back()->ptr);
      if (c.momentum) {
        m.push_back(std::make_unique<DeviceBuffer<T>>(c.n));
        m.back()->upload(m0);
        momenta.push_back(m.back()->ptr);
      }
    }
  }
  const dpcuda::cuda::AllReducePlan plan = dpcuda::cuda::plan_all_reduce(
      reps.device, streams, readable, c.algorithm, c.n, sizeof(T));
  std::vector<std::unique_ptr<DeviceBuffer<char>>> scratch;
  std::vector<void*> scratch_ptrs;
  for (int d = 0; d < D; ++d) {
    CUDA_OK(cudaSetDevice(d));
    scratch.push_back(std::make_unique<DeviceBuffer<char>>(plan.scratch_bytes[d] + 1));
    scratch_ptrs.push_back(scratch.back()->ptr);
  }
  CUDA_OK(cudaSetDevice(0));
  DeviceBuffer<double> loss(1);  // on device 0, replica 0's
  loss.upload({-1.0});
  // The records count 2 rows each: scaled_by 2R (fix 1), or 6R (tripled).
  const double scaled_by = c.records == Case::kNone ? 0.0 : c.records == Case::kTriple ? 6.0 * R
                                                                                       : 2.0 * R;
  if (c.sgd) {
    CUDA_OK(dpcuda::cuda::reduce_sgd<T>(plan, reps, params, momenta, sgd, true, scratch_ptrs,
                                        records, scaled_by,
                                        c.records == Case::kNone ? nullptr : loss.ptr));
  } else {
    CUDA_OK(dpcuda::cuda::all_reduce<T>(plan, reps, scratch_ptrs, true));
  }
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  CHECK(current == 0);  // the schedule restores the caller's device
  for (int d = 0; d < D; ++d) {
    CUDA_OK(cudaSetDevice(d));
    CUDA_OK(cudaStreamSynchronize(streams[d]));
  }
  auto same = [](const std::vector<T>& a, const std::vector<T>& b) {
    return std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
  };
  bool ok = true;
  for (int r = 0; r < R; ++r) {
    if (c.sgd) {
      ok = ok && same(p[r]->download(), want_p);
      if (c.momentum) ok = ok && same(m[r]->download(), want_m);
    } else {
      ok = ok && same(g[r]->download(), want);
    }
  }
  if (c.sgd && c.records != Case::kNone) {
    double want_loss = 0.0;
    for (int r = 0; r < R; ++r) want_loss += 0.5 + r;
    if (c.records == Case::kTriple) want_loss *= 3.0;
    ok = ok && loss.download()[0] == want_loss;
  }
  if (!ok) {
    std::printf("schedule %d R=%d devices=%d peers=%d n=%lld sgd=%d momentum=%d records=%d "
                "(%zu-byte): replicas differ from the expected values\n",
                static_cast<int>(c.algorithm), R, D, static_cast<int>(c.peers),
                static_cast<long long>(c.n), c.sgd, c.momentum, static_cast<int>(c.records),
                sizeof(T));
    dpcuda_test::fail();
  }
  emu_test::expect_no_reports("schedules");
}

}  // namespace

// test_emulation_schedules [--replicas LIST] (default: 1-8 and 16; the sanitizer builds run a
// few, CMakeLists.txt)
int main(int argc, char** argv) {
  g_counts = emu_test::replicas(argc, argv, {1, 2, 3, 4, 5, 6, 7, 8, 16});
  uint64_t seed = 100;
  const AllReduceAlgorithm kAlgorithms[] = {
      AllReduceAlgorithm::kOneShot, AllReduceAlgorithm::kTwoShot, AllReduceAlgorithm::kRing};
  for (AllReduceAlgorithm a : kAlgorithms) {
    for (int R : {1, 2, 3, 4, 5, 6, 7, 8, 16}) {
      for (Peers peers : {Peers::kAll, Peers::kNone, Peers::kMixed}) {
        for (int64_t n : {int64_t(1), int64_t(1000), int64_t(4099)}) {
          run_case<float>({R, R, peers, a, n, false, false}, ++seed);
          run_case<float>({R, R, peers, a, n, true, n != 1}, ++seed);
        }
      }
      // Replicas sharing devices, and the half type.
      run_case<float>({R, (R + 1) / 2, Peers::kMixed, a, 1000, false, false}, ++seed);
      run_case<float>({R, 1, Peers::kAll, a, 1000, true, true}, ++seed);
      run_case<__half>({R, R, Peers::kMixed, a, 1001, false, false}, ++seed);
      run_case<__half>({R, R, Peers::kNone, a, 1001, true, true}, ++seed);
      run_case<double>({R, R, Peers::kAll, a, 999, true, false}, ++seed);
      // The update obeying the replicas' step records (staged where a device cannot read them).
      for (Peers peers : {Peers::kAll, Peers::kNone, Peers::kMixed}) {
        run_case<float>({R, R, peers, a, 1000, true, true, Case::kClear}, ++seed);
        run_case<float>({R, R, peers, a, 1000, true, true, Case::kSkip}, ++seed);
        run_case<float>({R, R, peers, a, 1000, true, true, Case::kTriple}, ++seed);
      }
      run_case<__half>({R, R, Peers::kNone, a, 1001, true, false, Case::kTriple}, ++seed);
      run_case<float>({R, (R + 1) / 2, Peers::kNone, a, 1000, true, false, Case::kSkip}, ++seed);
      run_case<__half>({R, R, Peers::kMixed, a, 1001, true, true, Case::kSkip}, ++seed);
    }
  }
  // Buffers long enough for the ring to pipeline several chunks.
  for (Peers peers : {Peers::kAll, Peers::kNone}) {
    for (int R : {2, 3, 5}) {
      run_case<float>({R, R, peers, AllReduceAlgorithm::kRing, 3 * dpcuda::kRingMinChunk + 5,
                       false, false},
                      ++seed);
    }
  }
  return emu_test::finish("test_emulation_schedules");
}
