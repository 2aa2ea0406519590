// Stream capture in the emulation (csrc/emu/runtime.cpp): every all-reduce schedule, plain, with
// SGD (and its step records) and with Adam and clipping (reduce_update), captured once as a
// graph forked over the devices' streams and replayed several times on fresh inputs, must give
// the bits of the same schedule launched directly on the same inputs. And the runtime's capture
// errors: a host-side wait, a synchronous copy, a query of a captured event, the legacy stream,
// a wait on an event outside the capture and a fork never joined each fail the call as CUDA
// fails it, invalidate the capture and are reported.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cpu/all_reduce.h"
#include "emu_test.h"
#include "kernels/all_reduce/schedule.h"
#include "kernels/optim/update.h"

using dpcuda::AllReduceAlgorithm;
using emu_test::DeviceBuffer;
namespace optim = dpcuda::optim;

namespace {

enum class Op { kAllReduce, kSgd, kAdamClip };

struct Case {
  int replicas;
  int devices;  // replica r lives on device r % devices
  bool peers;
  AllReduceAlgorithm algorithm;
  int64_t n;
  Op op;
};

constexpr int kReplays = 3;

std::vector<double> adam_hyper() {
  std::vector<double> h(optim::kHyper, 0.0);
  const double lr = 0.01, step = 2;
  h[optim::kLr] = lr;
  h[optim::kWeightDecay] = 0.01;
  h[optim::kOneMinusBeta1] = 0.1;
  h[optim::kBeta2] = 0.999;
  h[optim::kOneMinusBeta2] = 1.0 - 0.999;
  h[optim::kEps] = 1e-8;
  h[optim::kBeta1] = 0.9;
  h[optim::kStep] = step;
  h[optim::kDecay] = 1.0 - lr * 0.01;
  h[optim::kFlags] = optim::kDecoupled;
  return h;
}

// One emulated machine with a case's buffers; run() launches the case's schedule on them.
struct Rig {
  Case c;
  int R, D;
  std::vector<cudaStream_t> streams;
  std::vector<std::vector<bool>> readable;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> g, p, m, s1, s2;
  std::vector<std::unique_ptr<DeviceBuffer<double>>> rec, hyper;
  emu_test::PerDevice scratch_bufs, workspace;
  std::unique_ptr<DeviceBuffer<double>> loss;
  std::unique_ptr<DeviceBuffer<float>> norm;
  dpcuda::cuda::ScheduleReplicas<float> reps;
  std::vector<float*> params, momenta;
  std::vector<const double*> records;
  dpcuda::cuda::UpdateState<float> state;
  std::vector<std::vector<const double*>> hpt;
  std::vector<void*> scratch;
  dpcuda::cuda::ClipArgs<float> clip;
  dpcuda::cuda::AllReducePlan plan;

  Rig(const Case& cs, uint64_t seed) : c(cs), R(cs.replicas), D(cs.devices) {
    dpcuda::emu::Config cfg = emu_test::config(D, seed, 30);
    cfg.peer.assign(D, std::vector<bool>(D, c.peers));
    dpcuda::emu::reset(cfg);
    streams = emu_test::open_devices(D, &readable);
    const int64_t align = 16 / sizeof(float);
    hpt.resize(R);
    const std::vector<double> h = adam_hyper();
    for (int r = 0; r < R; ++r) {
      CUDA_OK(cudaSetDevice(r % D));
      g.push_back(std::make_unique<DeviceBuffer<float>>(c.n));
      reps.data.push_back(g.back()->ptr);
      reps.device.push_back(r % D);
      p.push_back(std::make_unique<DeviceBuffer<float>>(c.n));
      params.push_back(p.back()->ptr);
      if (c.op == Op::kSgd) {
        m.push_back(std::make_unique<DeviceBuffer<float>>(c.n));
        momenta.push_back(m.back()->ptr);
        rec.push_back(std::make_unique<DeviceBuffer<double>>(dpcuda::cuda::kRecord));
        records.push_back(rec.back()->ptr);
      }
      if (c.op == Op::kAdamClip) {
        int64_t b, e;
        dpcuda::cpu::shard_range(c.n, R, r, align, &b, &e);
        s1.push_back(std::make_unique<DeviceBuffer<float>>(e - b));
        s2.push_back(std::make_unique<DeviceBuffer<float>>(e - b));
        state.state1.push_back(s1.back()->ptr);
        state.state2.push_back(s2.back()->ptr);
        hyper.push_back(std::make_unique<DeviceBuffer<double>>(h.size()));
        hyper.back()->upload(h);
        hpt[r].push_back(hyper.back()->ptr);
      }
    }
    plan = dpcuda::cuda::plan_all_reduce(reps.device, streams, readable, c.algorithm, c.n,
                                         sizeof(float));
    std::vector<size_t> scratch_bytes = plan.scratch_bytes;
    for (size_t& b : scratch_bytes) b += 1;
    scratch_bufs = emu_test::per_device(scratch_bytes);
    scratch = scratch_bufs.ptrs;
    if (c.op == Op::kAdamClip) {
      clip.max_norm = 0.5;
      workspace = emu_test::per_device(
          std::vector<size_t>(D, dpcuda::cuda::clip_workspace_bytes(plan)));
      clip.workspace = workspace.ptrs;
    }
    CUDA_OK(cudaSetDevice(0));
    loss = std::make_unique<DeviceBuffer<double>>(1);
    norm = std::make_unique<DeviceBuffer<float>>(1);
    clip.norm_out = norm->ptr;
  }

  // Fresh inputs, drawn from `draw`: by cudaMemcpy, or (async) queued on streams[0] from host
  // memory kept until the next upload, so that what runs next on streams[0] must wait for them.
  std::vector<std::vector<float>> staged;
  std::vector<std::vector<double>> staged_records;
  void upload(uint64_t draw, bool async = false) {
    std::mt19937 rng(static_cast<unsigned>(draw));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    staged.clear();
    staged_records.clear();
    staged.reserve(8 * R);
    staged_records.reserve(R);
    auto put = [&](DeviceBuffer<float>& b, std::vector<float> v) {
      if (!async) return b.upload(v);
      staged.push_back(std::move(v));
      CUDA_OK(cudaMemcpyAsync(b.ptr, staged.back().data(), b.n * sizeof(float),
                              cudaMemcpyHostToDevice, streams[0]));
    };
    auto fill = [&](DeviceBuffer<float>& b, float scale) {
      std::vector<float> v(b.n);
      for (auto& x : v) x = dist(rng) * scale;
      put(b, std::move(v));
    };
    for (int r = 0; r < R; ++r) {
      fill(*g[r], 1.0f);
      fill(*p[r], 1.0f);
      if (c.op == Op::kSgd) {
        fill(*m[r], 0.1f);
        // a clear record (loss, no NaN, no bad label, 2 rows): the update applies
        staged_records.push_back({0.25 + r, 0.0, 0.0, 2.0});
        if (async) {
          CUDA_OK(cudaMemcpyAsync(rec[r]->ptr, staged_records.back().data(), 4 * sizeof(double),
                                  cudaMemcpyHostToDevice, streams[0]));
        } else {
          rec[r]->upload(staged_records.back());
        }
      }
      if (c.op == Op::kAdamClip) {
        fill(*s1[r], 0.1f);
        std::vector<float> v(s2[r]->n);
        for (auto& x : v) x = std::abs(dist(rng)) * 0.01f;
        put(*s2[r], std::move(v));
      }
    }
  }

  cudaError_t run() {
    switch (c.op) {
      case Op::kAllReduce:
        return dpcuda::cuda::all_reduce<float>(plan, reps, scratch, true);
      case Op::kSgd:
        return dpcuda::cuda::reduce_sgd<float>(plan, reps, params, momenta, {0.05, 0.9, 0.01},
                                               true, scratch, records, 2.0 * R, loss->ptr);
      case Op::kAdamClip:
        return dpcuda::cuda::reduce_update<float>(plan, reps, params, state, optim::Kind::kAdam,
                                                  {{0, c.n, 0}}, hpt, true, scratch, true,
                                                  &clip);
    }
    return cudaErrorInvalidValue;
  }

  // Everything the schedule writes, as bytes.
  std::vector<std::vector<float>> result() {
    std::vector<std::vector<float>> out;
    for (int r = 0; r < R; ++r) {
      out.push_back(g[r]->download());
      out.push_back(p[r]->download());
      if (c.op == Op::kSgd) out.push_back(m[r]->download());
      if (c.op == Op::kAdamClip) {
        out.push_back(s1[r]->download());
        out.push_back(s2[r]->download());
      }
    }
    if (c.op == Op::kSgd) {
      const std::vector<double> l = loss->download();
      out.push_back({static_cast<float>(l[0])});
    }
    if (c.op == Op::kAdamClip) out.push_back(norm->download());
    return out;
  }

  void sync() {
    for (int d = 0; d < D; ++d) {
      CUDA_OK(cudaSetDevice(d));
      CUDA_OK(cudaStreamSynchronize(streams[d]));
    }
    CUDA_OK(cudaSetDevice(0));
  }

  // Capture run() from streams[0], forked into every other device's stream and joined back.
  cudaGraph_t capture() {
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamBeginCapture(streams[0], cudaStreamCaptureModeGlobal));
    cudaEvent_t fork;
    CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CUDA_OK(cudaEventRecord(fork, streams[0]));
    std::vector<cudaEvent_t> joins(D);
    for (int d = 1; d < D; ++d) {
      CUDA_OK(cudaSetDevice(d));
      CUDA_OK(cudaStreamWaitEvent(streams[d], fork, 0));
    }
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(run());
    for (int d = 1; d < D; ++d) {
      CUDA_OK(cudaSetDevice(d));
      CUDA_OK(cudaEventCreateWithFlags(&joins[d], cudaEventDisableTiming));
      CUDA_OK(cudaEventRecord(joins[d], streams[d]));
      CUDA_OK(cudaSetDevice(0));
      CUDA_OK(cudaStreamWaitEvent(streams[0], joins[d], 0));
    }
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(streams[0], &graph));
    CUDA_OK(cudaEventDestroy(fork));
    for (int d = 1; d < D; ++d) CUDA_OK(cudaEventDestroy(joins[d]));
    return graph;
  }

  ~Rig() {
    for (int d = 0; d < D; ++d) {
      CUDA_OK(cudaSetDevice(d));
      CUDA_OK(cudaStreamSynchronize(streams[d]));
    }
    CUDA_OK(cudaSetDevice(0));
  }
};

// The replica counts this run takes (--replicas); a case of another count is passed over (its
// seed still taken: each case has the same seed whichever counts run).
std::vector<int> g_counts;

void replay_matches_direct(const Case& c, uint64_t seed) {
  if (!emu_test::has(g_counts, c.replicas)) return;
  Rig rig(c, seed);
  std::vector<std::vector<std::vector<float>>> direct;
  for (int k = 0; k < kReplays; ++k) {
    rig.upload(seed * 7 + k);
    CUDA_OK(rig.run());
    rig.sync();
    direct.push_back(rig.result());
  }
  const std::vector<std::vector<float>> before = rig.result();
  cudaGraph_t graph = rig.capture();
  rig.sync();
  CHECK(rig.result() == before);  // a capture runs nothing
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int k = 0; k < kReplays; ++k) {
    // (the inputs queued on the launching stream: the graph must start after them)
    rig.upload(seed * 7 + k, true);
    CUDA_OK(cudaGraphLaunch(exec, rig.streams[0]));
    CUDA_OK(cudaStreamSynchronize(rig.streams[0]));  // (the graph's end: every lane done)
    const std::vector<std::vector<float>> got = rig.result();
    bool same = got.size() == direct[k].size();
    for (size_t i = 0; same && i < got.size(); ++i) {
      same = got[i].size() == direct[k][i].size() &&
             std::memcmp(got[i].data(), direct[k][i].data(), got[i].size() * sizeof(float)) == 0;
    }
    if (!same) {
      std::printf("capture: algorithm %d op %d R=%d devices=%d peers=%d n=%lld: replay %d "
                  "differs from the direct launch\n",
                  static_cast<int>(c.algorithm), static_cast<int>(c.op), c.replicas, c.devices,
                  c.peers, static_cast<long long>(c.n), k);
      dpcuda_test::fail();
    }
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  emu_test::expect_no_reports("capture");
}

// The errors of the runtime during a capture: the call fails as CUDA fails it, the capture is
// invalidated, and the emulator reports it.
void capture_errors() {
  const Case c{2, 2, true, AllReduceAlgorithm::kTwoShot, 1000, Op::kAllReduce};
  struct Misuse {
    const char* name;
    cudaError_t call;    // what the misusing call returns
    cudaError_t end;     // what cudaStreamEndCapture returns
    const char* report;  // what the emulator reports
  };
  const Misuse misuses[] = {
      {"stream sync", cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated,
       "cudaStreamSynchronize of the capturing stream"},
      {"device sync", cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated,
       "cudaDeviceSynchronize during stream capture"},
      {"memcpy", cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated,
       "cudaMemcpy during stream capture"},
      {"malloc", cudaErrorStreamCaptureUnsupported, cudaErrorStreamCaptureInvalidated,
       "cudaMalloc during stream capture"},
      {"event query", cudaErrorCapturedEvent, cudaErrorStreamCaptureInvalidated,
       "cudaEventQuery of an event recorded in the capture"},
      {"legacy stream", cudaErrorStreamCaptureImplicit, cudaErrorStreamCaptureInvalidated,
       "during stream capture: cudaErrorStreamCaptureImplicit"},
      {"outside event", cudaErrorStreamCaptureIsolation, cudaErrorStreamCaptureInvalidated,
       "a wait on an event recorded outside the capture"},
      {"unjoined", cudaSuccess, cudaErrorStreamCaptureUnjoined, "was not joined back"},
  };
  uint64_t seed = 900;
  for (const Misuse& misuse : misuses) {
    Rig rig(c, ++seed);
    rig.upload(seed);
    cudaEvent_t inside;
    CUDA_OK(cudaEventCreate(&inside));
    cudaEvent_t outside0;
    CUDA_OK(cudaEventCreate(&outside0));
    CUDA_OK(cudaEventRecord(outside0, rig.streams[0]));
    rig.sync();
    CUDA_OK(cudaStreamBeginCapture(rig.streams[0], cudaStreamCaptureModeGlobal));
    CUDA_OK(cudaEventRecord(inside, rig.streams[0]));
    CUDA_OK(cudaSetDevice(1));
    CUDA_OK(cudaStreamWaitEvent(rig.streams[1], inside, 0));  // the fork
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(rig.run());
    const std::string name = misuse.name;
    cudaError_t got = cudaSuccess;
    void* where = nullptr;
    float host = 0.0f;
    if (name == "stream sync") got = cudaStreamSynchronize(rig.streams[0]);
    if (name == "device sync") got = cudaDeviceSynchronize();
    if (name == "memcpy") got = cudaMemcpy(&host, rig.g[0]->ptr, 4, cudaMemcpyDeviceToHost);
    if (name == "malloc") got = cudaMalloc(&where, 64);
    if (name == "event query") got = cudaEventQuery(inside);
    if (name == "legacy stream") got = cudaMemsetAsync(rig.g[0]->ptr, 0, 4, nullptr);
    if (name == "outside event") got = cudaStreamWaitEvent(rig.streams[0], outside0, 0);
    if (name == "unjoined") {
      // work on the forked stream after the schedule's last join
      CUDA_OK(cudaSetDevice(1));
      got = cudaMemsetAsync(rig.g[1]->ptr, 0, 4, rig.streams[1]);
      CUDA_OK(cudaSetDevice(0));
    }
    CHECK(got == misuse.call);
    if (got != misuse.call) std::printf("misuse %s: the call returned %d\n", misuse.name, got);
    (void)cudaGetLastError();
    cudaStreamCaptureStatus status;
    CUDA_OK(cudaStreamIsCapturing(rig.streams[0], &status));
    CHECK(status == (misuse.call == cudaSuccess ? cudaStreamCaptureStatusActive
                                                : cudaStreamCaptureStatusInvalidated));
    if (name != "unjoined") {
      cudaEvent_t join;
      CUDA_OK(cudaSetDevice(1));
      CUDA_OK(cudaEventCreate(&join));
      (void)cudaEventRecord(join, rig.streams[1]);
      CUDA_OK(cudaSetDevice(0));
      (void)cudaStreamWaitEvent(rig.streams[0], join, 0);
      CUDA_OK(cudaEventDestroy(join));
    }
    cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(&host);
    const cudaError_t end = cudaStreamEndCapture(rig.streams[0], &graph);
    CHECK(end == misuse.end);
    CHECK(graph == nullptr);
    if (end != misuse.end) std::printf("misuse %s: end capture returned %d\n", misuse.name, end);
    (void)cudaGetLastError();
    CUDA_OK(cudaStreamIsCapturing(rig.streams[1], &status));
    CHECK(status == cudaStreamCaptureStatusNone);  // the fork ended with the capture
    emu_test::expect_report(misuse.report, misuse.name);
    // The streams work again after the failed capture, eagerly.
    rig.upload(seed + 1);
    CUDA_OK(rig.run());
    rig.sync();
    CUDA_OK(cudaEventDestroy(outside0));
    CUDA_OK(cudaEventDestroy(inside));
  }
}

}  // namespace

// test_emulation_capture [--replicas LIST] (default: 1-4 and 8; the sanitizer builds run a few,
// CMakeLists.txt)
int main(int argc, char** argv) {
  g_counts = emu_test::replicas(argc, argv, {1, 2, 3, 4, 8});
  uint64_t seed = 500;
  const AllReduceAlgorithm kAlgorithms[] = {
      AllReduceAlgorithm::kOneShot, AllReduceAlgorithm::kTwoShot, AllReduceAlgorithm::kRing};
  for (AllReduceAlgorithm a : kAlgorithms) {
    for (int R : {1, 2, 3, 4}) {
      for (bool peers : {true, false}) {
        for (Op op : {Op::kAllReduce, Op::kSgd, Op::kAdamClip}) {
          replay_matches_direct({R, R, peers, a, 1003, op}, ++seed);
        }
      }
      // Replicas sharing devices.
      replay_matches_direct({R, (R + 1) / 2, true, a, 1003, Op::kSgd}, ++seed);
      replay_matches_direct({R, 1, true, a, 1003, Op::kAdamClip}, ++seed);
    }
    replay_matches_direct({8, 8, false, a, 4099, Op::kAllReduce}, ++seed);
  }
  capture_errors();
  return emu_test::finish("test_emulation_capture");
}
