// The emulated CUDA runtime's own controls (for tests) and its kernel launch, which
// csrc/kernels/launch.cuh calls in emulation builds. See csrc/emu/cuda.h for the model.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace dpcuda {
namespace emu {

struct Config {
  int devices = 1;
  // peer[d][e]: whether device d can access device e's memory (cudaDeviceCanAccessPeer).
  // Empty means every pair can.
  std::vector<std::vector<bool>> peer;
  // Seeds the block order, the fiber schedule and the stream delays.
  uint64_t seed = 1;
  // Each stream sleeps a random 0..max_delay_us microseconds before each operation.
  int max_delay_us = 0;
  // kernel_image[d]: whether the build has a kernel image device d can run (false: a GPU older
  // than every architecture compiled in). Launches there, and cudaFuncGetAttributes, fail with
  // cudaErrorNoKernelImageForDevice, not sticky. Empty means every device can.
  std::vector<bool> kernel_image;
};

// Starts a fresh emulated machine: waits for and destroys every stream, frees every allocation,
// clears errors and reports, and applies `config`.
void reset(const Config& config);

// Everything the emulator found wrong since the last reset (misused barriers and shuffles,
// illegal peer accesses, timeouts), each also printed to stderr as "dpcuda-emu: ...".
std::vector<std::string> reports();

// Fault injection for the tests that prove the race checker bites: the index-th
// cudaStreamWaitEvent call after the last reset (0-based) is ignored. -1 turns it off.
void drop_stream_wait(int index);
// The number of cudaStreamWaitEvent calls since the last reset.
int stream_wait_count();
// Kernel launches since the last reset.
int64_t launch_count();

// Reports a misuse found while running a kernel or a stream operation.
void report(const std::string& what);

// The launch: checks the configuration as the hardware does (the error comes back from the
// call and from cudaGetLastError), then queues the grid on the stream. `site` names the kernel's
// signature.
cudaError_t launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   std::function<void()> body, std::vector<const void*> pointers,
                   const char* site);

// The words of an argument that may be device pointers, for the peer-access check.
template <typename T>
void collect_pointers(const T& arg, std::vector<const void*>* out) {
  if constexpr (std::is_pointer<T>::value) {
    out->push_back(reinterpret_cast<const void*>(arg));
  } else if constexpr (sizeof(T) % sizeof(void*) == 0 && alignof(T) >= alignof(void*)) {
    const void* const* words = reinterpret_cast<const void* const*>(&arg);
    for (size_t i = 0; i < sizeof(T) / sizeof(void*); ++i) out->push_back(words[i]);
  }
}

template <typename... Params>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                          cudaStream_t stream, std::tuple<std::decay_t<Params>...> args) {
  std::vector<const void*> pointers;
  std::apply([&](const auto&... a) { (collect_pointers(a, &pointers), ...); }, args);
  return launch(
      grid, block, shared_bytes, stream,
      [kernel, args]() { std::apply(kernel, args); }, std::move(pointers), __PRETTY_FUNCTION__);
}

}  // namespace emu
}  // namespace dpcuda
