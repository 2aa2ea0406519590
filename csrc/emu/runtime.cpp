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

struct CUevent_st {
  std::shared_ptr<dpcuda::emu::EventState> state = std::make_shared<dpcuda::emu::EventState>();
  uint64_t recorded = 0;
  int device = 0;
};

struct CUstream_st {
  int device = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool busy = false;
  bool stop = false;
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
    if (s == nullptr) s = new_stream(mm, tl_device);
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

// Queues a copy on the stream after checking both ranges (device -1: any memory).
cudaError_t copy_async(void* dst, int dst_device, const void* src, int src_device, size_t count,
                       cudaStream_t stream, const char* what) {
  if (!copy_range_ok(dst, count, dst_device, (std::string(what) + " destination").c_str()) ||
      !copy_range_ok(src, count, src_device, (std::string(what) + " source").c_str())) {
    return fail(cudaErrorInvalidValue);
  }
  CUstream_st* s = resolve(stream);
  const int device = s->device;
  s->push([=] {
    if (sticky_error(device) == cudaSuccess && count) std::memcpy(dst, src, count);
  });
  return cudaSuccess;
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
  s->push([=, body = std::move(body), pointers = std::move(pointers)] {
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
  });
  return cudaSuccess;
}

}  // namespace emu
}  // namespace dpcuda

using dpcuda::emu::fail;
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
    default: return "unknown error";
  }
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
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
  s->push([=] { std::memset(ptr, value, count); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
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
  if (!s->drain()) {
    dpcuda::emu::report("cudaStreamSynchronize: the stream did not finish within the wait bound");
    return fail(cudaErrorLaunchTimeout);
  }
  return dpcuda::emu::sticky_error(s->device);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st* s = resolve(stream);
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
  const uint64_t generation = ++event->recorded;
  std::shared_ptr<dpcuda::emu::EventState> state;
  {
    const Quiet quiet;
    state = event->state;
  }
  s->push([state, generation] {
    // What the stream did so far happens before whatever waits on this record.
    dpcuda::emu::tsan_release(state.get());
    {
      const QuietLock lock(state->m);
      if (state->completed < generation) state->completed = generation;
    }
    dpcuda::emu::notify(state->cv);
  });
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  auto& mm = machine();
  {
    const QuietLock lock(mm.m);
    if (mm.waits++ == mm.drop_wait) return cudaSuccess;  // fault injection
  }
  // The wait is for the event's most recent record; an event never recorded is complete.
  const uint64_t generation = event->recorded;
  if (generation == 0) return cudaSuccess;
  std::shared_ptr<dpcuda::emu::EventState> state;
  {
    const Quiet quiet;
    state = event->state;
  }
  CUstream_st* s = resolve(stream);
  const int device = s->device;
  s->push([state, generation, device] {
    bool done;
    {
      QuietLock q(state->m);
      done = state->cv.wait_for(q.lock, dpcuda::emu::kWaitBound,
                                [&] { return state->completed >= generation; });
    }
    if (done) {
      dpcuda::emu::tsan_acquire(state.get());
    } else {
      dpcuda::emu::report("a stream of device " + std::to_string(device) +
                          " waited on an event past the wait bound");
      dpcuda::emu::set_sticky(device, cudaErrorLaunchTimeout);
    }
  });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
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
