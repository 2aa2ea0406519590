// The one kernel launch path of dpcuda. Compiled by nvcc it is the ordinary launch; compiled as
// C++ with DPCUDA_EMULATE it hands the grid to the emulated runtime (csrc/emu), which runs it on
// the CPU. Kernels themselves never change between the two builds, and no other file launches
// a kernel.
#pragma once

#include <cuda_runtime.h>

#include <tuple>
#include <type_traits>
#include <utility>

#if defined(DPCUDA_EMULATE)
#include "../emu/emu.h"
#endif

namespace dpcuda {
namespace cuda {

// Launches kernel<<<grid, block, shared_bytes, stream>>>(args...) and returns the launch's error
// (cudaGetLastError), so every launch is checked. The arguments are converted to the kernel's
// parameter types here, as the <<<>>> syntax does.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
#if defined(DPCUDA_EMULATE)
  return emu::launch_kernel(
      kernel, grid, block, shared_bytes, stream,
      std::tuple<std::decay_t<Params>...>(std::decay_t<Params>(std::forward<Args>(args))...));
#else
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
#endif
}

}  // namespace cuda
}  // namespace dpcuda
