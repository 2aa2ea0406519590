// The emulated CUDA runtime API: N devices with their own memory and a peer-access matrix,
// streams that are worker threads running their queues in order (with optional seeded random
// delays), events that are counters, peer copies, and kernel launches whose grids run on the
// stream's worker (csrc/emu/block.cpp). The functions have the CUDA runtime's own names and
// signatures (cuda_runtime_api.h declares them): the schedules in csrc/kernels call them as
// they call the real runtime, and an emulated program links this file instead of libcudart.
//
// As on hardware: a launch with a bad configuration fails at once (cudaGetLastError says so);
// a kernel passed memory of another device without peer access enabled, or a kernel that
// misuses a barrier or a shuffle, puts the device in a sticky error state; an event recorded on
// a stream of another device is an invalid handle; so is a launch onto a stream of a device
// other than the current one. Every host wait is bounded.
//
// Stream capture (cudaStreamBeginCapture ... cudaStreamEndCapture, global mode) records the
// stream's operations as graph nodes instead of running them; an event recorded on a capturing
// stream forks the capture into the streams that wait on it (each a lane of the graph), and the
// origin must wait on events of every forked stream before the capture ends (else
// cudaErrorStreamCaptureUnjoined). During a capture the calls the real runtime refuses fail as
// it fails them, and invalidate the capture (cudaStreamEndCapture then returns
// cudaErrorStreamCaptureInvalidated): a synchronising call (cudaStreamSynchronize of the
// capturing stream, cudaDeviceSynchronize, cudaMemcpy, cudaMemset, cudaMalloc, cudaFree) and a
// query of the capturing stream give cudaErrorStreamCaptureUnsupported, a query or wait of an
// event recorded in the capture cudaErrorCapturedEvent, the legacy default stream
// cudaErrorStreamCaptureImplicit, a wait on an event recorded outside the capture
// cudaErrorStreamCaptureIsolation. Each is also reported. cudaGraphLaunch replays the nodes on
// worker streams of their own, one per lane and on the lane's device, each node after the
// nodes it depends on (across lanes through completion counters, as events), the whole after
// the launching stream's earlier work and before its later work.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda.h"
#include "emu.h"
#include "internal.h"
#include "tsan.h"

namespace dpcuda {
namespace emu {
namespace {

// The longest any wait lasts (a stream waiting on an event, the host on a stream) before it is
// reported as a hang.
constexpr auto kWaitBound = std::chrono::seconds(120);

// A lock of the emulator's own bookkeeping, hidden from TSan (see tsan.h).
struct QuietLock {
  Quiet quiet;
  std::unique_lock<std::mutex> lock;
  explicit QuietLock(std::mutex& m) : lock(m) {}
};

inline void notify(std::condition_variable& cv) {
  const Quiet quiet;
  cv.notify_all();
}

struct EventState {
  std::mutex m;
  std::condition_variable cv;
  uint64_t completed = 0;
};

}  // namespace
}  // namespace emu
}  // namespace dpcuda

namespace dpcuda {
namespace emu {
namespace {

// One operation of a capture: what the stream would have run, the nodes it waits for, and the
// lane (the captured stream) and device it ran on.
struct CaptureNode {
  std::function<void()> task;
  std::vector<size_t> deps;
  int lane;
  int device;
};

struct CaptureState {
  std::vector<CaptureNode> nodes;
  std::vector<int> lane_device;
  CUstream_st* origin = nullptr;
  std::vector<CUstream_st*> members;  // the origin, then every stream the capture forked into
  cudaError_t invalid = cudaSuccess;  // why the capture was invalidated
};

}  // namespace
}  // namespace emu
}  // namespace dpcuda

struct CUevent_st {
  std::shared_ptr<dpcuda::emu::EventState> state = std::make_shared<dpcuda::emu::EventState>();
  uint64_t recorded = 0;
  int device = 0;
  // The capture this event was last recorded in (null: recorded outside any) and the nodes
  // its record stands for.
  std::shared_ptr<dpcuda::emu::CaptureState> captured;
  std::vector<size_t> captured_tail;
};

struct CUgraph_st {
  std::vector<dpcuda::emu::CaptureNode> nodes;
  std::vector<int> lane_device;
};

struct CUgraphExec_st {
  std::vector<dpcuda::emu::CaptureNode> nodes;
  std::vector<CUstream_st*> lanes;  // a worker stream per lane, on the lane's device
  // Per node, the launch number it has completed; and the launch numbers started.
  std::vector<std::shared_ptr<dpcuda::emu::EventState>> done;
  std::shared_ptr<dpcuda::emu::EventState> start =
      std::make_shared<dpcuda::emu::EventState>();
  uint64_t launches = 0;
};

struct CUstream_st {
  int device = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool busy = false;
  bool stop = false;
  bool legacy = false;  // a device's default stream (cudaStreamLegacy)
  // Capture: the sequence this stream records into, its last nodes there and its lane.
  std::shared_ptr<dpcuda::emu::CaptureState> capture;
  std::vector<size_t> tail;
  int lane = 0;
  std::mt19937_64 rng;
  int max_delay_us = 0;
  std::thread worker;

  // The addresses of the stream's happens-before edges: host to stream at every enqueue, stream
  // to host at every completed operation.
  char enqueue_sync = 0;
  char done_sync = 0;

  void run() {
    for (;;) {
      std::function<void()> task;
      {
        dpcuda::emu::QuietLock q(m);
        cv.wait(q.lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
        busy = true;
      }
      if (max_delay_us > 0) {
        // Mostly short, now and then a stall 16 times as long: a stream that runs ahead of a
        // stalled one exposes a missing wait between them.
        const uint64_t draw = rng();
        const uint64_t us = draw % (max_delay_us + 1) * (draw >> 60 == 0 ? 16 : 1);
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      }
      dpcuda::emu::tsan_acquire(&enqueue_sync);
      task();
      dpcuda::emu::tsan_release(&done_sync);
      {
        dpcuda::emu::QuietLock q(m);
        task = nullptr;
        busy = false;
      }
      dpcuda::emu::notify(cv);
    }
  }

  void push(std::function<void()> task) {
    dpcuda::emu::tsan_release(&enqueue_sync);
    {
      dpcuda::emu::QuietLock q(m);
      queue.push_back(std::move(task));
    }
    dpcuda::emu::notify(cv);
  }

  // Waits until everything queued so far has run; false after kWaitBound.
  bool drain() {
    bool done;
    {
      dpcuda::emu::QuietLock q(m);
      done = cv.wait_for(q.lock, dpcuda::emu::kWaitBound, [&] { return queue.empty() && !busy; });
    }
    if (done) dpcuda::emu::tsan_acquire(&done_sync);
    return done;
  }
};

namespace dpcuda {
namespace emu {
namespace {

struct Allocation {
  size_t size;
  int device;
};

struct Machine {
  std::mutex m;
  Config config;
  std::vector<std::vector<bool>> enabled;
  std::map<uintptr_t, Allocation> allocations;
  std::vector<CUstream_st*> streams;
  std::vector<CUstream_st*> default_streams;
  std::vector<cudaError_t> sticky;
  std::vector<std::string> reports;
  int drop_wait = -1;
  int waits = 0;
  int64_t launches = 0;
  uint64_t stream_serial = 0;
  std::vector<std::shared_ptr<CaptureState>> captures;  // the captures in progress
};

Machine& machine() {
  // Never destroyed: worker threads may still be running at exit.
  static Machine* m = [] {
    auto* fresh = new Machine;
    fresh->enabled.assign(1, std::vector<bool>(1, false));
    fresh->sticky.assign(1, cudaSuccess);
    fresh->default_streams.assign(1, nullptr);
    return fresh;
  }();
  return *m;
}

thread_local int tl_device = 0;
thread_local cudaError_t tl_last_error = cudaSuccess;

cudaError_t fail(cudaError_t err) {
  tl_last_error = err;
  return err;
}

CUstream_st* new_stream(Machine& mm, int device) {
  auto* s = new CUstream_st;
  s->device = device;
  s->rng.seed(mm.config.seed * 0x9E3779B97F4A7C15ull + (++mm.stream_serial));
  s->max_delay_us = mm.config.max_delay_us;
  s->worker = std::thread([s] { s->run(); });
  mm.streams.push_back(s);
  return s;
}

void destroy_stream(CUstream_st* s) {
  if (!s->drain()) report("a stream did not drain within the wait bound at destruction");
  {
    const QuietLock lock(s->m);
    s->stop = true;
  }
  notify(s->cv);
  s->worker.join();
  const Quiet quiet;
  delete s;
}

// The stream a handle names: 0 (and the legacy / per-thread handles) is the current device's
// default stream.
CUstream_st* resolve(cudaStream_t stream) {
  Machine& mm = machine();
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
    const QuietLock lock(mm.m);
    CUstream_st*& s = mm.default_streams[tl_device];
    if (s == nullptr) {
      s = new_stream(mm, tl_device);
      s->legacy = true;
    }
    return s;
  }
  return stream;
}

int device_count() {
  return machine().config.devices;
}

cudaError_t sticky_error(int device) {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  return mm.sticky[device];
}

void set_sticky(int device, cudaError_t err) {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  if (mm.sticky[device] == cudaSuccess) mm.sticky[device] = err;
}

// The allocation that holds address p, if any.
bool find_allocation(const void* p, uintptr_t* begin, Allocation* found) {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = mm.allocations.upper_bound(a);
  if (it == mm.allocations.begin()) return false;
  --it;
  if (a >= it->first + it->second.size) return false;
  *begin = it->first;
  *found = it->second;
  return true;
}

// A copy's range must lie inside the allocation it starts in (device memory), as the runtime
// checks; memory that is no allocation is host memory.
bool copy_range_ok(const void* p, size_t bytes, int want_device, const char* what) {
  uintptr_t begin;
  Allocation a;
  if (!find_allocation(p, &begin, &a)) {
    if (want_device < 0) return true;
    report(std::string(what) + ": pointer is not device memory of device " +
           std::to_string(want_device));
    return false;
  }
  if (want_device >= 0 && a.device != want_device) {
    report(std::string(what) + ": pointer is memory of device " + std::to_string(a.device) +
           ", not of device " + std::to_string(want_device));
    return false;
  }
  if (reinterpret_cast<uintptr_t>(p) + bytes > begin + a.size) {
    report(std::string(what) + ": " + std::to_string(bytes) + " bytes run past the end of a " +
           std::to_string(a.size) + "-byte allocation");
    return false;
  }
  return true;
}

// Marks a capture invalid (the first reason stays), with a report naming the call.
void invalidate(const std::shared_ptr<CaptureState>& cap, cudaError_t why, const std::string& what) {
  report(what + " during stream capture: " + cudaGetErrorName(why) + " (the capture is invalidated)");
  if (cap->invalid == cudaSuccess) cap->invalid = why;
}

// A call the runtime refuses while any capture is in progress (global mode): fails the call
// and invalidates every capture. Returns the error, or cudaSuccess when none is in progress.
cudaError_t refuse_during_capture(const char* what,
                                  cudaError_t why = cudaErrorStreamCaptureUnsupported) {
  Machine& mm = machine();
  std::vector<std::shared_ptr<CaptureState>> active;
  {
    const QuietLock lock(mm.m);
    active = mm.captures;
  }
  if (active.empty()) return cudaSuccess;
  for (const auto& cap : active) invalidate(cap, why, what);
  return fail(why);
}

// Runs `task` on the stream in order, or, while the stream captures, records it as a node that
// depends on the stream's last nodes.
cudaError_t enqueue(CUstream_st* s, std::function<void()> task, const char* what) {
  if (const auto cap = s->capture) {
    if (cap->invalid != cudaSuccess) return fail(cudaErrorStreamCaptureInvalidated);
    cap->nodes.push_back({std::move(task), s->tail, s->lane, s->device});
    s->tail.assign(1, cap->nodes.size() - 1);
    return cudaSuccess;
  }
  if (s->legacy) {
    if (const cudaError_t e = refuse_during_capture(what, cudaErrorStreamCaptureImplicit)) {
      return e;
    }
  }
  s->push(std::move(task));
  return cudaSuccess;
}

// A stream's wait (on its worker) until `state` has completed `generation`, bounded.
void wait_on_worker(const std::shared_ptr<EventState>& state, uint64_t generation, int device,
                    const char* what) {
  bool done;
  {
    QuietLock q(state->m);
    done = state->cv.wait_for(q.lock, kWaitBound, [&] { return state->completed >= generation; });
  }
  if (done) {
    tsan_acquire(state.get());
  } else {
    report("a stream of device " + std::to_string(device) + " waited on " + what +
           " past the wait bound");
    set_sticky(device, cudaErrorLaunchTimeout);
  }
}

void complete(const std::shared_ptr<EventState>& state, uint64_t generation) {
  tsan_release(state.get());
  {
    const QuietLock lock(state->m);
    if (state->completed < generation) state->completed = generation;
  }
  notify(state->cv);
}

// Queues a copy on the stream after checking both ranges (device -1: any memory).
cudaError_t copy_async(void* dst, int dst_device, const void* src, int src_device, size_t count,
                       cudaStream_t stream, const char* what) {
  if (!copy_range_ok(dst, count, dst_device, (std::string(what) + " destination").c_str()) ||
      !copy_range_ok(src, count, src_device, (std::string(what) + " source").c_str())) {
    return fail(cudaErrorInvalidValue);
  }
  CUstream_st* s = resolve(stream);
  const int device = s->device;
  return enqueue(s, [=] {
    if (sticky_error(device) == cudaSuccess && count) std::memcpy(dst, src, count);
  }, what);
}

bool synchronize_device(int device) {
  std::vector<CUstream_st*> streams;
  {
    Machine& mm = machine();
    const QuietLock lock(mm.m);
    for (CUstream_st* s : mm.streams) {
      if (s->device == device) streams.push_back(s);
    }
  }
  bool ok = true;
  for (CUstream_st* s : streams) ok = s->drain() && ok;
  if (!ok) report("cudaDeviceSynchronize: a stream did not finish within the wait bound");
  return ok;
}

bool synchronize_all() {
  bool ok = true;
  for (int d = 0; d < device_count(); ++d) ok = synchronize_device(d) && ok;
  return ok;
}

}  // namespace

void reset(const Config& config) {
  Machine& mm = machine();
  std::vector<CUstream_st*> streams;
  std::map<uintptr_t, Allocation> allocations;
  {
    const QuietLock lock(mm.m);
    streams.swap(mm.streams);
    allocations.swap(mm.allocations);
  }
  for (CUstream_st* s : streams) destroy_stream(s);
  for (const auto& a : allocations) std::free(reinterpret_cast<void*>(a.first));
  const QuietLock lock(mm.m);
  mm.config = config;
  if (mm.config.devices < 1) mm.config.devices = 1;
  const int n = mm.config.devices;
  if (mm.config.peer.empty()) mm.config.peer.assign(n, std::vector<bool>(n, true));
  mm.enabled.assign(n, std::vector<bool>(n, false));
  mm.default_streams.assign(n, nullptr);
  mm.sticky.assign(n, cudaSuccess);
  mm.reports.clear();
  mm.drop_wait = -1;
  mm.waits = 0;
  mm.launches = 0;
  tl_device = 0;
  tl_last_error = cudaSuccess;
}

std::vector<std::string> reports() {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  return mm.reports;
}

void report(const std::string& what) {
  std::fprintf(stderr, "dpcuda-emu: %s\n", what.c_str());
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  mm.reports.push_back(what);
}

void drop_stream_wait(int index) {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  mm.drop_wait = index;
}

int stream_wait_count() {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  return mm.waits;
}

int64_t launch_count() {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  return mm.launches;
}

bool has_kernel_image(int device) {
  Machine& mm = machine();
  const QuietLock lock(mm.m);
  const std::vector<bool>& images = mm.config.kernel_image;
  return images.empty() || (device < static_cast<int>(images.size()) && images[device]);
}

cudaError_t launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   std::function<void()> body, std::vector<const void*> pointers,
                   const char* site) {
  // The hardware's limits (compute capability 8.0 and 9.0).
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 ||
      grid.z > 65535) {
    return fail(cudaErrorInvalidConfiguration);
  }
  // Without the opt-in attribute (which no dpcuda kernel sets) a block has 48 KiB.
  if (shared_bytes > 48 * 1024) return fail(cudaErrorInvalidValue);
  CUstream_st* s = resolve(stream);
  if (s->device != tl_device) return fail(cudaErrorInvalidResourceHandle);
  if (const cudaError_t e = sticky_error(s->device); e != cudaSuccess) return fail(e);
  if (!has_kernel_image(s->device)) return fail(cudaErrorNoKernelImageForDevice);
  Machine& mm = machine();
  uint64_t seed;
  {
    const QuietLock lock(mm.m);
    seed = mm.config.seed * 0xD1B54A32D192ED03ull + static_cast<uint64_t>(++mm.launches);
  }
  const int device = s->device;
  // The kernel's parameter list, out of the launching template's signature.
  std::string name(site);
  const size_t open = name.find("Params = {");
  if (open != std::string::npos) {
    const size_t close = name.find('}', open);
    name = "(" + name.substr(open + 10, close - open - 10) + ")";
  }
  return enqueue(s, [=, body = std::move(body), pointers = std::move(pointers)] {
    if (sticky_error(device) != cudaSuccess) return;
    Machine& m = machine();
    for (const void* p : pointers) {
      uintptr_t begin;
      Allocation a;
      if (!find_allocation(p, &begin, &a) || a.device == device) continue;
      bool enabled;
      {
        const QuietLock lock(m.m);
        enabled = m.enabled[device][a.device];
      }
      if (!enabled) {
        report("kernel " + name + " on device " + std::to_string(device) +
               " was given memory of device " + std::to_string(a.device) +
               " without peer access from " + std::to_string(device) + " to " +
               std::to_string(a.device) + " enabled (an illegal address on a GPU)");
        set_sticky(device, cudaErrorIllegalAddress);
        return;
      }
    }
    if (!run_grid(grid, block, body, name.c_str(), seed)) {
      set_sticky(device, cudaErrorLaunchFailure);
    }
  }, "a kernel launch");
}

}  // namespace emu
}  // namespace dpcuda

using dpcuda::emu::enqueue;
using dpcuda::emu::fail;
using dpcuda::emu::refuse_during_capture;
using dpcuda::emu::Quiet;
using dpcuda::emu::QuietLock;
using dpcuda::emu::machine;
using dpcuda::emu::resolve;
using dpcuda::emu::tl_device;
using dpcuda::emu::tl_last_error;

extern "C" {

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
  if (attr == nullptr || func == nullptr) return fail(cudaErrorInvalidValue);
  if (!dpcuda::emu::has_kernel_image(dpcuda::emu::tl_device)) {
    return fail(cudaErrorNoKernelImageForDevice);
  }
  *attr = cudaFuncAttributes{};
  attr->maxThreadsPerBlock = 1024;
  attr->ptxVersion = 80;
  attr->binaryVersion = 80;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = dpcuda::emu::device_count();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= dpcuda::emu::device_count()) return fail(cudaErrorInvalidDevice);
  tl_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = tl_device;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t sticky = dpcuda::emu::sticky_error(tl_device);
  const cudaError_t last = tl_last_error;
  tl_last_error = cudaSuccess;
  return sticky != cudaSuccess ? sticky : last;
}

cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t sticky = dpcuda::emu::sticky_error(tl_device);
  return sticky != cudaSuccess ? sticky : tl_last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorPeerAccessUnsupported: return "cudaErrorPeerAccessUnsupported";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessNotEnabled: return "cudaErrorPeerAccessNotEnabled";
    case cudaErrorTooManyPeers: return "cudaErrorTooManyPeers";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureMerge: return "cudaErrorStreamCaptureMerge";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
    case cudaErrorPeerAccessUnsupported:
      return "peer access is not supported between these two devices";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled";
    case cudaErrorTooManyPeers: return "peer mapping resources exhausted";
    case cudaErrorNoKernelImageForDevice:
      return "no kernel image is available for execution on the device";
    case cudaErrorIllegalState: return "operation not permitted when stream is in this state";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureMerge:
      return "operation would result in a merge of separate capture sequences";
    case cudaErrorStreamCaptureUnmatched: return "capture was not ended in the same stream";
    case cudaErrorStreamCaptureUnjoined:
      return "capturing stream has unjoined work";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorCapturedEvent:
      return "operation not permitted on an event last recorded in a capturing stream";
    default: return "unknown error";
  }
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (const cudaError_t e = refuse_during_capture("cudaMalloc")) return e;
  void* p = nullptr;
  // The runtime's 256-byte alignment; the allocation's exact size, so ASan's redzone starts at
  // its end. Fresh memory is all ones bits (NaN in every float type), never zeros by luck.
  if (posix_memalign(&p, 256, size == 0 ? 1 : size) != 0) return fail(cudaErrorMemoryAllocation);
  std::memset(p, 0xff, size);
  auto& mm = machine();
  const QuietLock lock(mm.m);
  mm.allocations[reinterpret_cast<uintptr_t>(p)] = {size == 0 ? 1 : size, tl_device};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  if (const cudaError_t e = refuse_during_capture("cudaFree")) return e;
  // cudaFree waits for the device, as the real one does.
  dpcuda::emu::synchronize_all();
  auto& mm = machine();
  {
    const QuietLock lock(mm.m);
    auto it = mm.allocations.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == mm.allocations.end()) return fail(cudaErrorInvalidValue);
    mm.allocations.erase(it);
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind) {
  // The legacy default stream: the copy waits for all work and is complete on return.
  if (const cudaError_t e = refuse_during_capture("cudaMemcpy")) return e;
  if (!dpcuda::emu::synchronize_all()) return fail(cudaErrorLaunchTimeout);
  if (!dpcuda::emu::copy_range_ok(dst, count, -1, "cudaMemcpy destination") ||
      !dpcuda::emu::copy_range_ok(src, count, -1, "cudaMemcpy source")) {
    return fail(cudaErrorInvalidValue);
  }
  if (count) std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind,
                            cudaStream_t stream) {
  return dpcuda::emu::copy_async(dst, -1, src, -1, count, stream, "cudaMemcpyAsync");
}

cudaError_t cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src, int src_device,
                                size_t count, cudaStream_t stream) {
  return dpcuda::emu::copy_async(dst, dst_device, src, src_device, count, stream,
                                 "cudaMemcpyPeerAsync");
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  if (!dpcuda::emu::copy_range_ok(ptr, count, tl_device, "cudaMemsetAsync")) {
    return fail(cudaErrorInvalidValue);
  }
  CUstream_st* s = resolve(stream);
  return enqueue(s, [=] { std::memset(ptr, value, count); }, "cudaMemsetAsync");
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  if (const cudaError_t e = refuse_during_capture("cudaMemset")) return e;
  const cudaError_t err = cudaMemsetAsync(ptr, value, count, nullptr);
  if (err != cudaSuccess) return err;
  return dpcuda::emu::synchronize_all() ? cudaSuccess : fail(cudaErrorLaunchTimeout);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  auto& mm = machine();
  const QuietLock lock(mm.m);
  *stream = dpcuda::emu::new_stream(mm, tl_device);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  auto& mm = machine();
  {
    const QuietLock lock(mm.m);
    auto it = std::find(mm.streams.begin(), mm.streams.end(), stream);
    if (it == mm.streams.end()) return fail(cudaErrorInvalidResourceHandle);
    mm.streams.erase(it);
  }
  dpcuda::emu::destroy_stream(stream);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st* s = resolve(stream);
  if (s->capture) {
    dpcuda::emu::invalidate(s->capture, cudaErrorStreamCaptureUnsupported,
                            "cudaStreamSynchronize of the capturing stream");
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  if (s->legacy) {
    if (const cudaError_t e = refuse_during_capture("cudaStreamSynchronize of the legacy stream",
                                                    cudaErrorStreamCaptureImplicit)) {
      return e;
    }
  }
  if (!s->drain()) {
    dpcuda::emu::report("cudaStreamSynchronize: the stream did not finish within the wait bound");
    return fail(cudaErrorLaunchTimeout);
  }
  return dpcuda::emu::sticky_error(s->device);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st* s = resolve(stream);
  if (s->capture) {
    dpcuda::emu::invalidate(s->capture, cudaErrorStreamCaptureUnsupported,
                            "cudaStreamQuery of the capturing stream");
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  bool done;
  {
    const QuietLock lock(s->m);
    done = s->queue.empty() && !s->busy;
  }
  if (!done) return cudaErrorNotReady;
  dpcuda::emu::tsan_acquire(&s->done_sync);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  if (const cudaError_t e = refuse_during_capture("cudaDeviceSynchronize")) return e;
  if (!dpcuda::emu::synchronize_device(tl_device)) return fail(cudaErrorLaunchTimeout);
  return dpcuda::emu::sticky_error(tl_device);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  const Quiet quiet;
  auto* e = new CUevent_st;
  e->device = tl_device;
  *event = e;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  // Work already queued that refers to the event keeps its state alive.
  const Quiet quiet;
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  CUstream_st* s = resolve(stream);
  if (s->device != event->device) return fail(cudaErrorInvalidResourceHandle);
  if (const auto cap = s->capture) {
    // In a capture a record makes no node: it names the stream's last nodes, for the streams
    // that wait on it (a fork, or a join back into the origin).
    if (cap->invalid != cudaSuccess) return fail(cudaErrorStreamCaptureInvalidated);
    const Quiet quiet;
    event->captured = cap;
    event->captured_tail = s->tail;
    return cudaSuccess;
  }
  if (s->legacy) {
    if (const cudaError_t e = refuse_during_capture("cudaEventRecord on the legacy stream",
                                                    cudaErrorStreamCaptureImplicit)) {
      return e;
    }
  }
  const uint64_t generation = ++event->recorded;
  std::shared_ptr<dpcuda::emu::EventState> state;
  {
    const Quiet quiet;
    state = event->state;
    event->captured = nullptr;
    event->captured_tail.clear();
  }
  // What the stream did so far happens before whatever waits on this record.
  s->push([state, generation] { dpcuda::emu::complete(state, generation); });
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  auto& mm = machine();
  {
    const QuietLock lock(mm.m);
    if (mm.waits++ == mm.drop_wait) return cudaSuccess;  // fault injection
  }
  CUstream_st* waiting = resolve(stream);
  if (const auto cap = event->captured) {
    bool active;
    {
      const QuietLock lock(mm.m);
      active = std::find(mm.captures.begin(), mm.captures.end(), cap) != mm.captures.end();
    }
    if (!active) return fail(cudaErrorCapturedEvent);  // (its capture has ended)
    if (cap->invalid != cudaSuccess) return fail(cudaErrorStreamCaptureInvalidated);
    if (waiting->capture == cap) {
      // A join within the capture: the stream's next node also waits for the event's nodes.
      for (size_t n : event->captured_tail) {
        if (std::find(waiting->tail.begin(), waiting->tail.end(), n) == waiting->tail.end()) {
          waiting->tail.push_back(n);
        }
      }
    } else if (waiting->capture == nullptr) {
      // A fork: the stream joins the capture as a lane of its own.
      if (waiting->legacy) {
        dpcuda::emu::invalidate(cap, cudaErrorStreamCaptureImplicit,
                                "the legacy stream waiting on a captured event");
        return fail(cudaErrorStreamCaptureImplicit);
      }
      waiting->capture = cap;
      waiting->tail = event->captured_tail;
      waiting->lane = static_cast<int>(cap->lane_device.size());
      cap->lane_device.push_back(waiting->device);
      cap->members.push_back(waiting);
    } else {
      dpcuda::emu::invalidate(cap, cudaErrorStreamCaptureMerge,
                              "a wait joining two captures");
      dpcuda::emu::invalidate(waiting->capture, cudaErrorStreamCaptureMerge,
                              "a wait joining two captures");
      return fail(cudaErrorStreamCaptureMerge);
    }
    return cudaSuccess;
  }
  // The wait is for the event's most recent record; an event never recorded is complete.
  const uint64_t generation = event->recorded;
  if (generation == 0) return cudaSuccess;
  if (waiting->capture) {
    // A dependency of the capture on work outside it.
    dpcuda::emu::invalidate(waiting->capture, cudaErrorStreamCaptureIsolation,
                            "a wait on an event recorded outside the capture");
    return fail(cudaErrorStreamCaptureIsolation);
  }
  std::shared_ptr<dpcuda::emu::EventState> state;
  {
    const Quiet quiet;
    state = event->state;
  }
  const int device = waiting->device;
  return enqueue(waiting, [state, generation, device] {
    dpcuda::emu::wait_on_worker(state, generation, device, "an event");
  }, "cudaStreamWaitEvent");
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event->captured) {
    dpcuda::emu::invalidate(event->captured, cudaErrorCapturedEvent,
                            "cudaEventSynchronize of an event recorded in the capture");
    return fail(cudaErrorCapturedEvent);
  }
  const uint64_t generation = event->recorded;
  bool done;
  {
    QuietLock q(event->state->m);
    done = event->state->cv.wait_for(q.lock, dpcuda::emu::kWaitBound,
                                     [&] { return event->state->completed >= generation; });
  }
  if (!done) {
    dpcuda::emu::report("cudaEventSynchronize: the event did not complete within the wait bound");
    return fail(cudaErrorLaunchTimeout);
  }
  dpcuda::emu::tsan_acquire(event->state.get());
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event->captured) {
    dpcuda::emu::invalidate(event->captured, cudaErrorCapturedEvent,
                            "cudaEventQuery of an event recorded in the capture");
    return fail(cudaErrorCapturedEvent);
  }
  bool done;
  {
    const QuietLock lock(event->state->m);
    done = event->state->completed >= event->recorded;
  }
  if (!done) return cudaErrorNotReady;
  dpcuda::emu::tsan_acquire(event->state.get());
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* can_access, int device, int peer) {
  const int n = dpcuda::emu::device_count();
  if (device < 0 || device >= n || peer < 0 || peer >= n) return fail(cudaErrorInvalidDevice);
  auto& mm = machine();
  const QuietLock lock(mm.m);
  *can_access = device != peer && mm.config.peer[device][peer] ? 1 : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int) {
  const int n = dpcuda::emu::device_count();
  if (peer < 0 || peer >= n || peer == tl_device) return fail(cudaErrorInvalidDevice);
  auto& mm = machine();
  const QuietLock lock(mm.m);
  if (!mm.config.peer[tl_device][peer]) return fail(cudaErrorPeerAccessUnsupported);
  if (mm.enabled[tl_device][peer]) return fail(cudaErrorPeerAccessAlreadyEnabled);
  // The hardware maps at most 8 peers per device.
  int count = 0;
  for (int e = 0; e < n; ++e) count += mm.enabled[tl_device][e] ? 1 : 0;
  if (count >= 8) return fail(cudaErrorTooManyPeers);
  mm.enabled[tl_device][peer] = true;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  if (mode != cudaStreamCaptureModeGlobal) return fail(cudaErrorInvalidValue);  // (only global)
  CUstream_st* s = resolve(stream);
  if (s->legacy) return fail(cudaErrorStreamCaptureUnsupported);
  if (s->capture) return fail(cudaErrorIllegalState);
  auto cap = std::make_shared<dpcuda::emu::CaptureState>();
  cap->origin = s;
  cap->members.push_back(s);
  cap->lane_device.push_back(s->device);
  s->capture = cap;
  s->tail.clear();
  s->lane = 0;
  auto& mm = machine();
  const QuietLock lock(mm.m);
  mm.captures.push_back(cap);
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  CUstream_st* s = resolve(stream);
  *status = s->capture == nullptr ? cudaStreamCaptureStatusNone
            : s->capture->invalid != cudaSuccess ? cudaStreamCaptureStatusInvalidated
                                                 : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  CUstream_st* s = resolve(stream);
  *graph = nullptr;
  const auto cap = s->capture;
  if (cap == nullptr) return fail(cudaErrorIllegalState);
  if (cap->origin != s) {
    dpcuda::emu::invalidate(cap, cudaErrorStreamCaptureUnmatched,
                            "cudaStreamEndCapture on a stream the capture forked into");
    return fail(cudaErrorStreamCaptureUnmatched);
  }
  // Every node a forked stream ended with must precede the origin's last nodes.
  std::vector<bool> before(cap->nodes.size(), false);
  std::vector<size_t> stack = s->tail;
  while (!stack.empty()) {
    const size_t n = stack.back();
    stack.pop_back();
    if (before[n]) continue;
    before[n] = true;
    for (size_t d : cap->nodes[n].deps) stack.push_back(d);
  }
  bool joined = true;
  for (CUstream_st* m : cap->members) {
    for (size_t n : m->tail) joined = joined && before[n];
    m->capture = nullptr;
    m->tail.clear();
    m->lane = 0;
  }
  {
    auto& mm = machine();
    const QuietLock lock(mm.m);
    mm.captures.erase(std::find(mm.captures.begin(), mm.captures.end(), cap));
  }
  if (cap->invalid != cudaSuccess) return fail(cudaErrorStreamCaptureInvalidated);
  if (!joined) {
    dpcuda::emu::report("cudaStreamEndCapture: a stream the capture forked into was not joined "
                        "back into the origin stream (cudaErrorStreamCaptureUnjoined)");
    return fail(cudaErrorStreamCaptureUnjoined);
  }
  const Quiet quiet;
  *graph = new CUgraph_st{cap->nodes, cap->lane_device};
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  if (graph == nullptr) return fail(cudaErrorInvalidValue);
  const Quiet quiet;
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long) {
  if (graph == nullptr || exec == nullptr) return fail(cudaErrorInvalidValue);
  auto& mm = machine();
  auto* e = [&] {
    const Quiet quiet;
    return new CUgraphExec_st;
  }();
  {
    const Quiet quiet;
    e->nodes = graph->nodes;
    for (size_t i = 0; i < e->nodes.size(); ++i) {
      e->done.push_back(std::make_shared<dpcuda::emu::EventState>());
    }
  }
  const QuietLock lock(mm.m);
  for (int device : graph->lane_device) e->lanes.push_back(dpcuda::emu::new_stream(mm, device));
  *exec = e;
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return fail(cudaErrorInvalidValue);
  CUstream_st* s = resolve(stream);
  if (s->capture) return fail(cudaErrorStreamCaptureUnsupported);  // (no child graphs)
  if (s->legacy) {
    if (const cudaError_t e = refuse_during_capture("cudaGraphLaunch on the legacy stream",
                                                    cudaErrorStreamCaptureImplicit)) {
      return e;
    }
  }
  using dpcuda::emu::complete;
  using dpcuda::emu::wait_on_worker;
  const uint64_t generation = ++exec->launches;
  const auto start = exec->start;
  // After the launching stream's earlier work ...
  s->push([start, generation] { complete(start, generation); });
  for (CUstream_st* lane : exec->lanes) {
    const int device = lane->device;
    lane->push([start, generation, device] {
      wait_on_worker(start, generation, device, "a graph launch's start");
    });
  }
  // ... each node on its lane, after the nodes it depends on in other lanes (in its own lane
  // the order does it) ...
  for (size_t i = 0; i < exec->nodes.size(); ++i) {
    const dpcuda::emu::CaptureNode& node = exec->nodes[i];
    std::vector<std::shared_ptr<dpcuda::emu::EventState>> deps;
    for (size_t d : node.deps) {
      if (exec->nodes[d].lane != node.lane) deps.push_back(exec->done[d]);
    }
    const auto done = exec->done[i];
    const int device = node.device;
    const std::function<void()>* task = &node.task;
    exec->lanes[node.lane]->push([deps, done, generation, device, task] {
      for (const auto& d : deps) wait_on_worker(d, generation, device, "a graph node");
      (*task)();
      complete(done, generation);
    });
  }
  // ... and before its later work: every lane's last node.
  std::vector<std::shared_ptr<dpcuda::emu::EventState>> last(exec->lanes.size());
  for (size_t i = 0; i < exec->nodes.size(); ++i) last[exec->nodes[i].lane] = exec->done[i];
  const int device = s->device;
  s->push([last, generation, device] {
    for (const auto& d : last) {
      if (d) wait_on_worker(d, generation, device, "a graph launch's end");
    }
  });
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  if (exec == nullptr) return fail(cudaErrorInvalidValue);
  auto& mm = machine();
  for (CUstream_st* lane : exec->lanes) {
    bool live;
    {
      const QuietLock lock(mm.m);
      auto it = std::find(mm.streams.begin(), mm.streams.end(), lane);
      live = it != mm.streams.end();
      if (live) mm.streams.erase(it);
    }
    if (live) dpcuda::emu::destroy_stream(lane);  // (waits for its launches to finish)
  }
  const Quiet quiet;
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaDeviceDisablePeerAccess(int peer) {
  const int n = dpcuda::emu::device_count();
  if (peer < 0 || peer >= n || peer == tl_device) return fail(cudaErrorInvalidDevice);
  auto& mm = machine();
  const QuietLock lock(mm.m);
  if (!mm.enabled[tl_device][peer]) return fail(cudaErrorPeerAccessNotEnabled);
  mm.enabled[tl_device][peer] = false;
  return cudaSuccess;
}

}  // extern "C"
