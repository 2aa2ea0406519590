// The CUDA execution model on the CPU, for dpcuda's own kernels and schedules: compiled as C++
// (g++ or clang) with DPCUDA_EMULATE, the very same .cu sources that nvcc builds run here.
// This header comes first in every emulated translation unit (the build force-includes it): it
// defines the execution-space keywords before the CUDA headers can, then includes those headers
// for their host paths (dim3, cudaError_t, the runtime API's declarations, __half and
// __nv_bfloat16 with their host conversions), then provides what only the device has:
// threadIdx and friends, __syncthreads and the warp shuffles.
//
// What runs where (csrc/emu/runtime.cpp, csrc/emu/block.cpp):
//   - every stream is a worker thread that runs its queue in order; events are counters with
//     a condition variable; N devices with their own memory and a peer-access matrix;
//   - a kernel launch runs its grid's blocks concurrently, on the stream's worker and a pool of
//     block workers (each takes the next block of a seeded random order); the threads of a block
//     are fibers under a seeded random schedule, switched at __syncthreads and at every warp
//     intrinsic, so a missing barrier gives a wrong result, and, under ThreadSanitizer (which is
//     told about the fibers), a race report; so does a block that reads another block's writes
//     without the fence and atomic that order them (see __threadfence below);
//   - static __shared__ variables are thread_local: one copy per worker thread, which is one
//     copy per running block, shared by that block's fibers and by nothing else.
#pragma once

#if !defined(DPCUDA_EMULATE)
#error "csrc/emu/cuda.h is the emulation prelude: build with -DDPCUDA_EMULATE"
#endif

// Defined before the CUDA headers, which keep a definition that exists (crt/host_defines.h).
#define __host__
#define __device__
#define __global__
#define __grid_constant__
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace dpcuda {
namespace emu {

// The built-in variables of the thread that is running on this worker (a fiber of a block).
struct ThreadBuiltins {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadBuiltins& builtins();

// The barrier and the warp exchange that the intrinsics below are made of (csrc/emu/block.cpp).
void sync_block();
// __syncthreads() at FILE:LINE: sync_block(), unless DPCUDA_EMU_REMOVE_BARRIER names this call
// site (a path ending, a colon, the line), which then runs as if the barrier were deleted and
// says so once on stderr (scripts/check_barriers_matter.sh: every barrier must matter).
void sync_block_at(const char* file, int line);
// The memory model of the device atomics and __threadfence for ThreadSanitizer, as C++'s fences
// order relaxed atomics: a fence before an atomic read-modify-write makes it a release; a fence
// after atomic reads makes them acquires (csrc/emu/block.cpp).
void before_atomic(void* address);
void after_atomic(void* address);
void thread_fence();
// Every lane of `mask` arrives with `bits` and the lane it reads; each gets the bits of its
// source lane back (own_on_invalid: the lane reads its own value, as the hardware does for a
// source outside the lane's segment). Lanes that `mask` names must all arrive; a lane that has
// exited, waits elsewhere or passes another mask is reported.
uint64_t warp_exchange(unsigned mask, uint64_t bits, int src_lane, const char* what);
int lane_id();

template <typename T>
T shuffle_as(unsigned mask, T value, int src_lane, const char* what) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "the emulated shuffles move values of up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_exchange(mask, bits, src_lane, what);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// The source lane of each shuffle, with the segment rules of the CUDA programming guide: width
// splits the warp into segments; a source outside the lane's own segment gives its own value.
int checked_width(int width, const char* what);

}  // namespace emu
}  // namespace dpcuda

#define threadIdx (::dpcuda::emu::builtins().thread_idx)
#define blockIdx (::dpcuda::emu::builtins().block_idx)
#define blockDim (::dpcuda::emu::builtins().block_dim)
#define gridDim (::dpcuda::emu::builtins().grid_dim)
#ifndef warpSize
#define warpSize 32
#endif

#define __syncthreads() ::dpcuda::emu::sync_block_at(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)::dpcuda::emu::warp_exchange(mask, 0, ::dpcuda::emu::lane_id(), "__syncwarp");
}

// Device atomics: relaxed read-modify-writes, as CUDA's (atomicOr and friends order nothing
// else), which ThreadSanitizer sees as atomics rather than races; a __threadfence around them
// orders what they publish (above).
inline int atomicOr(int* address, int value) {
  ::dpcuda::emu::before_atomic(address);
  const int old = __atomic_fetch_or(address, value, __ATOMIC_RELAXED);
  ::dpcuda::emu::after_atomic(address);
  return old;
}

inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  ::dpcuda::emu::before_atomic(address);
  const unsigned int old = __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
  ::dpcuda::emu::after_atomic(address);
  return old;
}

// A fence for the device's memory: a real fence between the workers that run blocks at once,
// and, for ThreadSanitizer, the release and acquire edges a fence gives the atomics around it.
inline void __threadfence() {
#if defined(__SANITIZE_THREAD__)
  __atomic_signal_fence(__ATOMIC_SEQ_CST);  // (TSan models no fences: thread_fence tells it)
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
  ::dpcuda::emu::thread_fence();
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  width = ::dpcuda::emu::checked_width(width, "__shfl_sync");
  const int lane = ::dpcuda::emu::lane_id();
  const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return ::dpcuda::emu::shuffle_as(mask, var, src, "__shfl_sync");
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  width = ::dpcuda::emu::checked_width(width, "__shfl_xor_sync");
  const int lane = ::dpcuda::emu::lane_id();
  // The hardware uses the low 5 bits of the lane mask. A lane may read from earlier segments
  // but not from later ones: those give its own value.
  int src = lane ^ (lane_mask & 31);
  if (src >= (lane & ~(width - 1)) + width) src = lane;
  return ::dpcuda::emu::shuffle_as(mask, var, src, "__shfl_xor_sync");
}

template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  width = ::dpcuda::emu::checked_width(width, "__shfl_down_sync");
  const int lane = ::dpcuda::emu::lane_id();
  const int src = (lane & (width - 1)) + static_cast<int64_t>(delta) < width
                      ? lane + static_cast<int>(delta)
                      : lane;
  return ::dpcuda::emu::shuffle_as(mask, var, src, "__shfl_down_sync");
}

template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  width = ::dpcuda::emu::checked_width(width, "__shfl_up_sync");
  const int lane = ::dpcuda::emu::lane_id();
  const int src = (lane & (width - 1)) >= static_cast<int64_t>(delta)
                      ? lane - static_cast<int>(delta)
                      : lane;
  return ::dpcuda::emu::shuffle_as(mask, var, src, "__shfl_up_sync");
}
