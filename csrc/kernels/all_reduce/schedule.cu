// The all-reduce schedules over the CUDA runtime API (see schedule.h). Host code only: the
// kernels are the launchers of all_reduce.h.
#include "schedule.h"

#include <algorithm>

#include "../../cpu/all_reduce.h"
#include "../common.cuh"
#include "../optim/clip.h"

namespace dpcuda {
namespace cuda {
namespace {

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The first error of a call; later calls still run where they must (the closing barrier).
struct Status {
  cudaError_t err = cudaSuccess;
  bool ok(cudaError_t e) {
    if (err == cudaSuccess && e != cudaSuccess) err = e;
    return err == cudaSuccess;
  }
  bool good() const { return err == cudaSuccess; }
};

// Restores the caller's current device.
struct DeviceScope {
  int saved = 0;
  DeviceScope() { cudaGetDevice(&saved); }
  ~DeviceScope() { cudaSetDevice(saved); }
};

// Sub-buffers of one device's scratch allocation, each 256-byte aligned.
struct Arena {
  char* base = nullptr;
  size_t used = 0;
  void* take(size_t bytes) {
    void* p = base + used;
    used += round_up(bytes);
    return p;
  }
};

bool reads(const AllReducePlan& p, int d, int e) {
  return d == e || (d < static_cast<int>(p.readable.size()) &&
                    e < static_cast<int>(p.readable[d].size()) && p.readable[d][e]);
}

void shard(const AllReducePlan& p, int k, int64_t* b, int64_t* e) {
  cpu::shard_range(p.n, p.replicas, k, static_cast<int64_t>(16 / p.elem_size), b, e);
}

void ring_chunk(const AllReducePlan& p, int64_t c, int64_t* b, int64_t* e) {
  cpu::shard_range(p.n, static_cast<int>(ring_chunks(p.n)), static_cast<int>(c),
                   static_cast<int64_t>(16 / p.elem_size), b, e);
}

// After it, work queued on any device's stream runs after everything queued so far on all. It
// runs in full even after an error, so that no device frees what a peer may still read.
void barrier(const AllReducePlan& p, Status& st) {
  if (p.devices.size() < 2) return;
  std::vector<cudaEvent_t> ev(p.devices.size(), nullptr);
  for (size_t i = 0; i < p.devices.size(); ++i) {
    const int d = p.devices[i];
    cudaSetDevice(d);
    const cudaError_t e = cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming);
    st.ok(e);
    if (e != cudaSuccess) {
      ev[i] = nullptr;
      continue;
    }
    st.ok(cudaEventRecord(ev[i], p.stream[d]));
  }
  for (size_t i = 0; i < p.devices.size(); ++i) {
    cudaSetDevice(p.devices[i]);
    for (size_t j = 0; j < p.devices.size(); ++j) {
      if (j != i && ev[j] != nullptr) st.ok(cudaStreamWaitEvent(p.stream[p.devices[i]], ev[j], 0));
    }
  }
  for (cudaEvent_t e : ev) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

// A range of replica i's buffer as kernels on device d may read it: the buffer itself, or a copy
// staged into d's scratch.
template <typename V>
const V* readable_from(const AllReducePlan& p, int d, const V* src, int src_device, int64_t len,
                       Arena& arena, Status& st) {
  if (reads(p, d, src_device) || len == 0) return src;
  V* staged = static_cast<V*>(arena.take(static_cast<size_t>(len) * sizeof(V)));
  st.ok(cudaMemcpyPeerAsync(staged, d, src, src_device, static_cast<size_t>(len) * sizeof(V),
                            p.stream[d]));
  return staged;
}

// Shard [b, e) of every replica's gradient as owner k's device reads it: the buffer itself (its
// own, a peer's it may read) or a copy staged into its arena.
template <typename T>
Replicas<const T> shard_inputs(const AllReducePlan& p, const ScheduleReplicas<T>& grads, int k,
                               int64_t b, int64_t e, std::vector<Arena>& arena, Status& st) {
  const int d = grads.device[k];
  Replicas<const T> in{};
  for (int i = 0; i < p.replicas; ++i) {
    in.ptr[i] = readable_from<T>(p, d, grads.data[i] + b, grads.device[i], e - b, arena[d], st);
  }
  return in;
}

// Each device's view of the replicas' step records, indexed by device: the records themselves,
// or copies staged on the device's stream into its record area (kRecord doubles each, 256 bytes
// apart). Called after a barrier, so that every record is complete; loss_out left null.
std::vector<StepRecords> stage_records(const AllReducePlan& p,
                                       const std::vector<const double*>& records,
                                       double scaled_by, const std::vector<int>& device,
                                       const std::vector<void*>& scratch, Status& st) {
  std::vector<StepRecords> seen(p.scratch_bytes.size(), StepRecords{});
  if (records.empty()) return seen;
  for (int d : p.devices) {
    cudaSetDevice(d);
    StepRecords& out = seen[d];
    out.n = static_cast<int>(records.size());
    out.scaled_by = scaled_by;
    Arena area;
    area.base = static_cast<char*>(scratch[d]) + p.records_offset[d];
    for (int r = 0; r < out.n; ++r) {
      out.ptr[r] = readable_from<double>(p, d, records[r], device[r], kRecord, area, st);
    }
  }
  return seen;
}

// seen (with sgd): each device's records (stage_records); replica 0's launch writes loss_out.
template <typename T>
void two_shot(const AllReducePlan& p, const ScheduleReplicas<T>& grads,
              const std::vector<T*>& params, const std::vector<T*>& momenta, const SgdArgs* sgd,
              bool mean, std::vector<Arena>& arena, Status& st,
              const std::vector<StepRecords>& seen = {}, double* loss_out = nullptr) {
  const int R = p.replicas;
  for (int k = 0; k < R && st.good(); ++k) {
    int64_t b, e;
    shard(p, k, &b, &e);
    if (e <= b) continue;
    const int d = grads.device[k];
    cudaSetDevice(d);
    const Replicas<const T> in = shard_inputs(p, grads, k, b, e, arena, st);
    if (sgd) {
      // The loss is written by replica 0's shard (never empty: shard 0 starts at element 0).
      StepRecords rec = seen[d];
      if (k == 0) rec.loss_out = loss_out;
      Replicas<T> out{}, mom{};
      out.ptr[0] = params[k] + b;
      if (!momenta.empty()) mom.ptr[0] = momenta[k] + b;
      st.ok(reduce_sgd_range<T>(in, R, out, 1, mom, momenta.empty() ? 0 : 1, 0, e - b, mean,
                                *sgd, rec, p.stream[d]));
    } else {
      Replicas<T> out{};
      out.ptr[0] = grads.data[k] + b;
      st.ok(reduce_range<T>(in, R, out, 1, 0, e - b, mean, p.stream[d]));
    }
  }
  barrier(p, st);
  // All-gather: replica j copies every other shard from its owner.
  const std::vector<T*>& out = sgd ? params : grads.data;
  for (int j = 0; j < R && st.good(); ++j) {
    const int d = grads.device[j];
    cudaSetDevice(d);
    for (int k = 0; k < R; ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      if (k == j || e <= b) continue;
      const size_t bytes = static_cast<size_t>(e - b) * sizeof(T);
      st.ok(cudaMemcpyPeerAsync(out[j] + b, d, out[k] + b, grads.device[k], bytes, p.stream[d]));
      if (sgd && !momenta.empty()) {
        st.ok(cudaMemcpyPeerAsync(momenta[j] + b, d, momenta[k] + b, grads.device[k], bytes,
                                  p.stream[d]));
      }
    }
  }
}

template <typename T>
void one_shot(const AllReducePlan& p, const ScheduleReplicas<T>& bufs, bool mean,
              std::vector<Arena>& arena, Status& st) {
  const int R = p.replicas;
  const int64_t n = p.n;
  // Inputs a device cannot read are staged once per device; every replica reduces into scratch.
  std::vector<std::vector<const T*>> input(arena.size(), std::vector<const T*>(R, nullptr));
  for (int d : p.devices) {
    if (!st.good()) break;
    cudaSetDevice(d);
    for (int i = 0; i < R; ++i) {
      input[d][i] = readable_from<T>(p, d, bufs.data[i], bufs.device[i], n, arena[d], st);
    }
  }
  std::vector<T*> out(R);
  for (int r = 0; r < R && st.good(); ++r) {
    const int d = bufs.device[r];
    cudaSetDevice(d);
    out[r] = static_cast<T*>(arena[d].take(static_cast<size_t>(n) * sizeof(T)));
    Replicas<const T> in{};
    for (int i = 0; i < R; ++i) in.ptr[i] = input[d][i];
    Replicas<T> o{};
    o.ptr[0] = out[r];
    st.ok(reduce_range<T>(in, R, o, 1, 0, n, mean, p.stream[d]));
  }
  // Nobody overwrites a buffer that a peer may still be reading.
  barrier(p, st);
  for (int r = 0; r < R && st.good(); ++r) {
    const int d = bufs.device[r];
    cudaSetDevice(d);
    st.ok(cudaMemcpyAsync(bufs.data[r], out[r], static_cast<size_t>(n) * sizeof(T),
                          cudaMemcpyDeviceToDevice, p.stream[d]));
  }
}

template <typename T>
void ring(const AllReducePlan& p, const ScheduleReplicas<T>& bufs, bool mean,
          std::vector<Arena>& arena, Status& st) {
  using A = acc_t<T>;
  const int R = p.replicas;
  const int64_t chunks = ring_chunks(p.n);
  int64_t b0, e0;
  ring_chunk(p, 0, &b0, &e0);
  const int64_t chunk_max = e0 - b0;
  std::vector<A*> work(R, nullptr);
  std::vector<void*> stage(R, nullptr);
  std::vector<cudaEvent_t> done(static_cast<size_t>(R * chunks), nullptr);
  for (int r = 1; r < R; ++r) {
    const int d = bufs.device[r];
    cudaSetDevice(d);
    work[r] = static_cast<A*>(arena[d].take(static_cast<size_t>(p.n) * sizeof(A)));
    // One chunk of staging per replica, reused chunk after chunk on the same stream.
    if (!reads(p, d, bufs.device[r - 1])) {
      stage[r] = arena[d].take(static_cast<size_t>(chunk_max) * (r == 1 ? sizeof(T) : sizeof(A)));
    }
    for (int64_t c = 0; c < chunks; ++c) {
      cudaEvent_t& ev = done[r * chunks + c];
      if (!st.ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming))) ev = nullptr;
    }
  }
  for (int64_t c = 0; c < chunks && st.good(); ++c) {
    int64_t b, e;
    ring_chunk(p, c, &b, &e);
    const size_t len = static_cast<size_t>(e - b);
    for (int r = 1; r < R && st.good(); ++r) {
      const int d = bufs.device[r];
      const int prev = bufs.device[r - 1];
      cudaSetDevice(d);
      if (r > 1) st.ok(cudaStreamWaitEvent(p.stream[d], done[(r - 1) * chunks + c], 0));
      const T* prev_x = nullptr;
      const A* prev_acc = nullptr;
      if (r == 1) {
        prev_x = bufs.data[0] + b;
        if (stage[r]) {
          st.ok(cudaMemcpyPeerAsync(stage[r], d, prev_x, prev, len * sizeof(T), p.stream[d]));
          prev_x = static_cast<const T*>(stage[r]);
        }
      } else {
        prev_acc = work[r - 1] + b;
        if (stage[r]) {
          st.ok(cudaMemcpyPeerAsync(stage[r], d, prev_acc, prev, len * sizeof(A), p.stream[d]));
          prev_acc = static_cast<const A*>(stage[r]);
        }
      }
      const bool last = r == R - 1;
      st.ok(chain_accumulate<T, A>(prev_x, prev_acc, bufs.data[r] + b, work[r] + b,
                                   last ? bufs.data[r] + b : nullptr, 0, e - b,
                                   last && mean ? R : 0, p.stream[d]));
      st.ok(cudaEventRecord(done[r * chunks + c], p.stream[d]));
    }
  }
  // Every replica copies each finished chunk of the last one.
  for (int64_t c = 0; c < chunks && st.good(); ++c) {
    int64_t b, e;
    ring_chunk(p, c, &b, &e);
    for (int j = 0; j < R - 1 && st.good(); ++j) {
      const int d = bufs.device[j];
      cudaSetDevice(d);
      st.ok(cudaStreamWaitEvent(p.stream[d], done[(R - 1) * chunks + c], 0));
      st.ok(cudaMemcpyPeerAsync(bufs.data[j] + b, d, bufs.data[R - 1] + b, bufs.device[R - 1],
                                static_cast<size_t>(e - b) * sizeof(T), p.stream[d]));
    }
  }
  for (cudaEvent_t ev : done) {
    if (ev != nullptr) cudaEventDestroy(ev);
  }
}

std::vector<Arena> arenas(const std::vector<void*>& scratch) {
  std::vector<Arena> a(scratch.size());
  for (size_t d = 0; d < scratch.size(); ++d) a[d].base = static_cast<char*>(scratch[d]);
  return a;
}

// What a call must be given: at most kMaxReplicas replicas, the buffers the plan was made for,
// and scratch for every device the plan asks scratch of.
template <typename T>
bool valid_call(const AllReducePlan& p, const ScheduleReplicas<T>& bufs,
                const std::vector<void*>& scratch) {
  if (p.replicas > kMaxReplicas || static_cast<int>(bufs.data.size()) != p.replicas ||
      bufs.device != p.replica_device || scratch.size() < p.scratch_bytes.size()) {
    return false;
  }
  for (size_t d = 0; d < p.scratch_bytes.size(); ++d) {
    if (p.scratch_bytes[d] > 0 && scratch[d] == nullptr) return false;
  }
  return true;
}

template <typename T>
Replicas<T> all_of(const std::vector<T*>& v) {
  Replicas<T> r{};
  for (size_t i = 0; i < v.size(); ++i) r.ptr[i] = v[i];
  return r;
}

}  // namespace

AllReducePlan plan_all_reduce(const std::vector<int>& replica_device,
                              const std::vector<cudaStream_t>& stream,
                              const std::vector<std::vector<bool>>& readable,
                              AllReduceAlgorithm algorithm, int64_t n, size_t elem_size) {
  AllReducePlan p;
  p.algorithm = algorithm;
  p.replicas = static_cast<int>(replica_device.size());
  p.n = n;
  p.elem_size = elem_size;
  p.replica_device = replica_device;
  p.stream = stream;
  p.readable = readable;
  int max_device = 0;
  for (int d : replica_device) {
    if (std::find(p.devices.begin(), p.devices.end(), d) == p.devices.end()) p.devices.push_back(d);
    max_device = std::max(max_device, d);
  }
  p.scratch_bytes.assign(static_cast<size_t>(max_device) + 1, 0);
  p.records_offset.assign(static_cast<size_t>(max_device) + 1, 0);
  if (n == 0 || p.replicas < 2 || p.devices.size() < 2) return p;
  const int R = p.replicas;
  const size_t whole = round_up(static_cast<size_t>(n) * elem_size);
  if (algorithm == AllReduceAlgorithm::kOneShot) {
    for (int d : p.devices) {
      for (int r = 0; r < R; ++r) {
        if (replica_device[r] == d) p.scratch_bytes[d] += whole;
        if (!reads(p, d, replica_device[r])) p.scratch_bytes[d] += whole;
      }
    }
  } else if (algorithm == AllReduceAlgorithm::kTwoShot) {
    for (int k = 0; k < R; ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      const int d = replica_device[k];
      for (int r = 0; r < R; ++r) {
        if (!reads(p, d, replica_device[r]) && e > b) {
          p.scratch_bytes[d] += round_up(static_cast<size_t>(e - b) * elem_size);
        }
      }
    }
  } else {
    const size_t acc = elem_size == 8 ? 8 : 4;
    int64_t b0, e0;
    ring_chunk(p, 0, &b0, &e0);
    for (int r = 1; r < R; ++r) {
      const int d = replica_device[r];
      p.scratch_bytes[d] += round_up(static_cast<size_t>(n) * acc);
      if (!reads(p, d, replica_device[r - 1])) {
        p.scratch_bytes[d] += round_up(static_cast<size_t>(e0 - b0) * (r == 1 ? elem_size : acc));
      }
    }
  }
  // The step records a reduce_sgd may be given, staged where a device cannot read them.
  for (int d : p.devices) {
    p.records_offset[d] = p.scratch_bytes[d];
    for (int r = 0; r < R; ++r) {
      if (!reads(p, d, replica_device[r])) p.scratch_bytes[d] += round_up(kRecord * sizeof(double));
    }
  }
  return p;
}

template <typename T>
cudaError_t all_reduce(const AllReducePlan& p, const ScheduleReplicas<T>& bufs,
                       const std::vector<void*>& scratch, bool mean) {
  if (!valid_call(p, bufs, scratch)) return cudaErrorInvalidValue;
  if (p.n == 0 || p.replicas < 2) return cudaSuccess;  // x / 1 == x
  const DeviceScope scope;
  Status st;
  if (p.devices.size() == 1) {
    // Replicas sharing one device: one kernel reads every buffer once and writes every buffer
    // once; each thread reads its elements from every input before writing them.
    const int d = p.devices[0];
    cudaSetDevice(d);
    Replicas<const T> in{};
    for (int r = 0; r < p.replicas; ++r) in.ptr[r] = bufs.data[r];
    return reduce_range<T>(in, p.replicas, all_of(bufs.data), p.replicas, 0, p.n, mean,
                           p.stream[d]);
  }
  std::vector<Arena> arena = arenas(scratch);
  barrier(p, st);  // every buffer is complete before any peer reads it
  if (p.algorithm == AllReduceAlgorithm::kTwoShot) {
    two_shot<T>(p, bufs, {}, {}, nullptr, mean, arena, st);
  } else if (p.algorithm == AllReduceAlgorithm::kOneShot) {
    one_shot<T>(p, bufs, mean, arena, st);
  } else {
    ring<T>(p, bufs, mean, arena, st);
  }
  barrier(p, st);  // nobody reuses a buffer or scratch before every peer is done with it
  return st.err;
}

template <typename T>
cudaError_t reduce_sgd(const AllReducePlan& p, const ScheduleReplicas<T>& grads,
                       const std::vector<T*>& params, const std::vector<T*>& momenta,
                       SgdArgs sgd, bool mean, const std::vector<void*>& scratch,
                       const std::vector<const double*>& records, double scaled_by,
                       double* loss_out) {
  if (!valid_call(p, grads, scratch) || params.size() != grads.data.size() ||
      (!momenta.empty() && momenta.size() != grads.data.size()) ||
      (!records.empty() && records.size() != grads.data.size()) ||
      (records.empty() && (scaled_by != 0.0 || loss_out != nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (p.n == 0) return cudaSuccess;
  const DeviceScope scope;
  Status st;
  const int R = p.replicas;
  if (p.devices.size() == 1) {
    const int d = p.devices[0];
    StepRecords rec = stage_records(p, records, scaled_by, grads.device, scratch, st)[d];
    rec.loss_out = loss_out;
    cudaSetDevice(d);
    Replicas<const T> in{};
    for (int r = 0; r < R; ++r) in.ptr[r] = grads.data[r];
    return reduce_sgd_range<T>(in, R, all_of(params), R, all_of(momenta),
                               static_cast<int>(momenta.size()), 0, p.n, mean, sgd, rec,
                               p.stream[d]);
  }
  if (p.algorithm == AllReduceAlgorithm::kTwoShot) {
    std::vector<Arena> arena = arenas(scratch);
    barrier(p, st);
    two_shot<T>(p, grads, params, momenta, &sgd, mean, arena, st,
                stage_records(p, records, scaled_by, grads.device, scratch, st), loss_out);
    barrier(p, st);
    return st.err;
  }
  if (!st.ok(all_reduce<T>(p, grads, scratch, mean))) return st.err;
  // (all_reduce closed with a barrier: every record is complete on every device's stream)
  const std::vector<StepRecords> seen =
      stage_records(p, records, scaled_by, grads.device, scratch, st);
  for (int r = 0; r < R && st.good(); ++r) {
    const int d = grads.device[r];
    cudaSetDevice(d);
    StepRecords rec = seen[d];
    if (r == 0) rec.loss_out = loss_out;
    st.ok(sgd_range<T>(grads.data[r], params[r], momenta.empty() ? nullptr : momenta[r], p.n, sgd,
                       rec, p.stream[d]));
  }
  // No device frees or rewrites a record that a peer's staged copy may still read.
  if (!records.empty()) barrier(p, st);
  return st.err;
}

namespace {

// Shard k's state pointer at element `at` of the shard (null for a state the optimizer lacks).
template <typename T>
T* state_at(const std::vector<T*>& s, int k, int64_t at) {
  return s.empty() ? nullptr : s[k] + at;
}

// Shard k's update over its part of each segment: in (ngrads inputs) and out (nout outputs)
// hold the shard's start, as the state shard does.
template <typename T>
struct Shard {
  const AllReducePlan& p;
  const std::vector<int>& device;
  const UpdateState<T>& state;
  optim::Kind kind;
  const std::vector<UpdateSegment>& segments;
  const std::vector<std::vector<const double*>>& hyper;
  Status& st;
  // Each device's step records (stage_records; set once they are staged) and where shard 0's
  // first launch writes the step's loss.
  const std::vector<StepRecords>* seen = nullptr;
  double* loss_out = nullptr;

  // fixed: the records' fix is already in `in` (the clipped path): the records only skip.
  void operator()(int k, const Replicas<const T>& in, int ngrads, const Replicas<T>& out,
                  int nout, bool mean, const double* scale = nullptr, bool fixed = false) const {
    int64_t b, e;
    shard(p, k, &b, &e);
    StepRecords rec{};
    if (seen != nullptr) rec = (*seen)[device[k]];
    if (fixed) rec.scaled_by = 0.0;
    bool first = k == 0 && !fixed;
    for (const UpdateSegment& seg : segments) {
      const int64_t lo = std::max(b, seg.begin), hi = std::min(e, seg.end);
      if (hi <= lo || !st.good()) continue;
      rec.loss_out = first ? loss_out : nullptr;
      first = false;
      Replicas<const T> i2{};
      Replicas<T> o2{};
      for (int r = 0; r < ngrads; ++r) i2.ptr[r] = in.ptr[r] + (lo - b);
      for (int o = 0; o < nout; ++o) o2.ptr[o] = out.ptr[o] + (lo - b);
      st.ok(reduce_update_range<T>(i2, ngrads, o2, nout, state_at(state.state1, k, lo - b),
                                   state_at(state.state2, k, lo - b),
                                   state_at(state.state3, k, lo - b), 0, hi - lo, mean, kind,
                                   hyper[k][seg.group], p.stream[device[k]], scale, rec));
    }
  }
};

// Every replica copies the other shards' weights from their owners.
template <typename T>
void gather_weights(const AllReducePlan& p, const ScheduleReplicas<T>& grads,
                    const std::vector<T*>& params, Status& st) {
  const int R = p.replicas;
  for (int j = 0; j < R && st.good(); ++j) {
    const int d = grads.device[j];
    cudaSetDevice(d);
    for (int k = 0; k < R; ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      if (k == j || e <= b) continue;
      st.ok(cudaMemcpyPeerAsync(params[j] + b, d, params[k] + b, grads.device[k],
                                static_cast<size_t>(e - b) * sizeof(T), p.stream[d]));
    }
  }
}

// The clip workspace's layout on one device: every shard's partial sums (shard k's at
// offset[k] doubles), then room for staged copies of them, then the coefficient.
struct ClipLayout {
  std::vector<int64_t> count, offset;
  int64_t total = 0;
  size_t staged_at = 0, coef_at = 0, bytes = 0;
  explicit ClipLayout(const AllReducePlan& p) {
    size_t staged = 0;
    for (int k = 0; k < p.replicas; ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      count.push_back(optim::norm_chunks(e - b));
      offset.push_back(total);
      total += count.back();
      staged += round_up(static_cast<size_t>(count.back()) * sizeof(double));
    }
    staged_at = round_up(static_cast<size_t>(total) * sizeof(double));
    coef_at = staged_at + staged;
    bytes = coef_at + 256;
  }
};

double* at_bytes(void* base, size_t offset) {
  return reinterpret_cast<double*>(static_cast<char*>(base) + offset);
}

// reduce_update with clipping (schedule.h): the reduced shards and their partial sums, the
// coefficient on every device, the scaled update of each shard from its owner's copy.
template <typename T>
void clipped_update(const AllReducePlan& p, const ScheduleReplicas<T>& grads,
                    const std::vector<T*>& params, Shard<T>& update_shard,
                    const ClipArgs<T>& clip, bool mean, bool gather,
                    const std::vector<void*>& scratch, const std::vector<const double*>& records,
                    double scaled_by, Status& st) {
  const int R = p.replicas;
  const bool one_device = p.devices.size() == 1;
  const ClipLayout lay(p);
  auto partials_of = [&](int k) {
    return at_bytes(clip.workspace[grads.device[k]], 0) + lay.offset[k];
  };
  // The records' fix is applied as each owner's shard is reduced and squared (shard 0's pass
  // writes the loss); the coefficient and the update then obey their skip.
  std::vector<StepRecords> seen;
  auto rec_of = [&](int k) {
    StepRecords rec = seen[grads.device[k]];
    if (k == 0) rec.loss_out = update_shard.loss_out;
    return rec;
  };
  if (one_device || p.algorithm == AllReduceAlgorithm::kTwoShot) {
    std::vector<Arena> arena = arenas(scratch);
    barrier(p, st);  // every gradient is complete before any peer reads it
    seen = stage_records(p, records, scaled_by, grads.device, scratch, st);
    for (int k = 0; k < R && st.good(); ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      if (e <= b) continue;
      const int d = grads.device[k];
      cudaSetDevice(d);
      const Replicas<const T> in = shard_inputs(p, grads, k, b, e, arena, st);
      st.ok(reduce_square_sum<T>(in, R, grads.data[k] + b, e - b, mean, partials_of(k),
                                 p.stream[d], rec_of(k)));
    }
  } else {
    if (!st.ok(all_reduce<T>(p, grads, scratch, mean))) return;
    seen = stage_records(p, records, scaled_by, grads.device, scratch, st);
    for (int k = 0; k < R && st.good(); ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      cudaSetDevice(grads.device[k]);
      Replicas<const T> in{};
      in.ptr[0] = grads.data[k] + b;
      // (with a fix the owner's copy takes the fixed gradient, which the update reads)
      const bool fix = !records.empty() && scaled_by > 0.0;
      st.ok(reduce_square_sum<T>(in, 1, fix ? grads.data[k] + b : nullptr, e - b, false,
                                 partials_of(k), p.stream[grads.device[k]], rec_of(k)));
    }
  }
  update_shard.seen = &seen;
  barrier(p, st);  // every partial sum is written before any device combines them
  for (int d : p.devices) {
    if (!st.good()) break;
    cudaSetDevice(d);
    Arena staged;
    staged.base = static_cast<char*>(clip.workspace[d]) + lay.staged_at;
    NormParts parts{};
    parts.n = R;
    for (int k = 0; k < R; ++k) {
      // (an empty shard has no partial sums: no pointer to a peer the device may not read)
      parts.ptr[k] = lay.count[k] == 0 ? nullptr
                                       : readable_from<double>(p, d, partials_of(k),
                                                               grads.device[k], lay.count[k],
                                                               staged, st);
      parts.count[k] = lay.count[k];
    }
    st.ok(clip_coefficient<T>(parts, clip.max_norm, at_bytes(clip.workspace[d], lay.coef_at),
                              d == grads.device[0] ? clip.norm_out : nullptr, p.stream[d],
                              seen[d]));
  }
  for (int k = 0; k < R && st.good(); ++k) {
    int64_t b, e;
    shard(p, k, &b, &e);
    const int d = grads.device[k];
    cudaSetDevice(d);
    Replicas<const T> in{};
    in.ptr[0] = grads.data[k] + b;
    Replicas<T> out{};
    const int nout = one_device && gather ? R : 1;
    for (int o = 0; o < nout; ++o) out.ptr[o] = params[one_device ? o : k] + b;
    update_shard(k, in, 1, out, nout, false, at_bytes(clip.workspace[d], lay.coef_at), true);
  }
  update_shard.seen = nullptr;
}

}  // namespace

size_t clip_workspace_bytes(const AllReducePlan& plan) { return ClipLayout(plan).bytes; }

template <typename T>
cudaError_t reduce_update(const AllReducePlan& p, const ScheduleReplicas<T>& grads,
                          const std::vector<T*>& params, const UpdateState<T>& state,
                          optim::Kind kind, const std::vector<UpdateSegment>& segments,
                          const std::vector<std::vector<const double*>>& hyper, bool mean,
                          const std::vector<void*>& scratch, bool gather,
                          const ClipArgs<T>* clip, const std::vector<const double*>& records,
                          double scaled_by, double* loss_out) {
  const size_t R = grads.data.size();
  auto fits = [&](const std::vector<T*>& s) { return s.empty() || s.size() == R; };
  if (!valid_call(p, grads, scratch) || params.size() != R || !fits(state.state1) ||
      !fits(state.state2) || !fits(state.state3) || hyper.size() != R ||
      (!gather && p.devices.size() != 1) ||
      (!records.empty() && records.size() != R) ||
      (records.empty() && (scaled_by != 0.0 || loss_out != nullptr))) {
    return cudaErrorInvalidValue;
  }
  int64_t covered = 0;
  for (const UpdateSegment& seg : segments) {
    if (seg.begin != covered || seg.end < seg.begin || seg.group < 0) return cudaErrorInvalidValue;
    for (const auto& h : hyper) {
      if (seg.group >= static_cast<int>(h.size())) return cudaErrorInvalidValue;
    }
    covered = seg.end;
  }
  if (covered != p.n) return cudaErrorInvalidValue;
  if (clip != nullptr) {
    for (int d : p.devices) {
      if (d >= static_cast<int>(clip->workspace.size()) || clip->workspace[d] == nullptr) {
        return cudaErrorInvalidValue;
      }
    }
  }
  const DeviceScope scope;
  if (p.n == 0) {
    // The norm of no gradient is 0, as torch's. (loss_out needs elements: the adapter checks.)
    if (clip == nullptr || clip->norm_out == nullptr) return cudaSuccess;
    cudaSetDevice(grads.device[0]);
    return cudaMemsetAsync(clip->norm_out, 0, sizeof(T), p.stream[grads.device[0]]);
  }
  Status st;
  Shard<T> update_shard{p, grads.device, state, kind, segments, hyper, st};
  update_shard.loss_out = loss_out;
  const int nr = static_cast<int>(R);
  if (clip != nullptr) {
    clipped_update<T>(p, grads, params, update_shard, *clip, mean, gather, scratch, records,
                      scaled_by, st);
    if (p.devices.size() > 1) {
      barrier(p, st);  // every shard's weights are updated before any peer copies them
      if (gather) gather_weights(p, grads, params, st);
      barrier(p, st);  // nobody reuses a buffer or scratch before every peer is done with it
    }
    return st.err;
  }
  std::vector<StepRecords> seen;
  if (p.devices.size() == 1) {
    cudaSetDevice(p.devices[0]);
    seen = stage_records(p, records, scaled_by, grads.device, scratch, st);
    update_shard.seen = &seen;
    for (int k = 0; k < nr && st.good(); ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      Replicas<const T> in{};
      Replicas<T> out{};
      for (int r = 0; r < nr; ++r) {
        in.ptr[r] = grads.data[r] + b;
        out.ptr[r] = params[r] + b;
      }
      update_shard(k, in, nr, out, gather ? nr : 1, mean);
    }
    return st.err;
  }
  if (p.algorithm == AllReduceAlgorithm::kTwoShot) {
    std::vector<Arena> arena = arenas(scratch);
    barrier(p, st);  // every gradient is complete before any peer reads it
    seen = stage_records(p, records, scaled_by, grads.device, scratch, st);
    update_shard.seen = &seen;
    for (int k = 0; k < nr && st.good(); ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      if (e <= b) continue;
      cudaSetDevice(grads.device[k]);
      const Replicas<const T> in = shard_inputs(p, grads, k, b, e, arena, st);
      Replicas<T> out{};
      out.ptr[0] = params[k] + b;
      update_shard(k, in, nr, out, 1, mean);
    }
  } else {
    if (!st.ok(all_reduce<T>(p, grads, scratch, mean))) return st.err;
    // (all_reduce closed with a barrier: every record is complete on every device's stream)
    seen = stage_records(p, records, scaled_by, grads.device, scratch, st);
    update_shard.seen = &seen;
    for (int k = 0; k < nr && st.good(); ++k) {
      int64_t b, e;
      shard(p, k, &b, &e);
      cudaSetDevice(grads.device[k]);
      Replicas<const T> in{};
      in.ptr[0] = grads.data[k] + b;
      Replicas<T> out{};
      out.ptr[0] = params[k] + b;
      update_shard(k, in, 1, out, 1, false);
    }
  }
  barrier(p, st);  // every shard's weights are updated before any peer copies them
  gather_weights(p, grads, params, st);
  barrier(p, st);  // nobody reuses a buffer or scratch before every peer is done with it
  return st.err;
}

#define DPCUDA_INSTANTIATE(T)                                                                   \
  template cudaError_t all_reduce<T>(const AllReducePlan&, const ScheduleReplicas<T>&,         \
                                     const std::vector<void*>&, bool);                         \
  template cudaError_t reduce_sgd<T>(const AllReducePlan&, const ScheduleReplicas<T>&,         \
                                     const std::vector<T*>&, const std::vector<T*>&, SgdArgs,  \
                                     bool, const std::vector<void*>&,                          \
                                     const std::vector<const double*>&, double, double*);    \
  template cudaError_t reduce_update<T>(const AllReducePlan&, const ScheduleReplicas<T>&,      \
                                        const std::vector<T*>&, const UpdateState<T>&,          \
                                        optim::Kind, const std::vector<UpdateSegment>&,         \
                                        const std::vector<std::vector<const double*>>&, bool,   \
                                        const std::vector<void*>&, bool, const ClipArgs<T>*,   \
                                        const std::vector<const double*>&, double, double*);

DPCUDA_FOR_EACH_TYPE(DPCUDA_INSTANTIATE)
#undef DPCUDA_INSTANTIATE

}  // namespace cuda
}  // namespace dpcuda
