// Whether this build's CUDA kernels can run on a device, asked once per device: a GPU older than
// every architecture compiled in (DPCUDA_CUDA_ARCHS, from setup.py) gets an error that says so
// and what to do, instead of "no kernel image is available" at its first launch.
#ifdef DPCUDA_WITH_CUDA

#include "kernel_image.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <atomic>
#include <sstream>

#include "../kernels/fused_linear/epilogue.h"

#ifndef DPCUDA_CUDA_ARCHS
#define DPCUDA_CUDA_ARCHS "unknown"
#endif

namespace dpcuda {

std::string kernel_image_error(int device) {
  // 0: not asked yet, 1: runs, 2: does not. Devices past the table are asked every time.
  static std::array<std::atomic<int>, 64> known{};
  const bool cached = device >= 0 && device < static_cast<int>(known.size());
  if (cached && known[device].load() == 1) return "";
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaError_t err = cuda::kernel_image_status();
  if (err == cudaSuccess) {
    if (cached) known[device].store(1);
    return "";
  }
  if (cached) known[device].store(2);
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  std::ostringstream msg;
  msg << "dpcuda's CUDA kernels cannot run on cuda:" << device << " (" << prop->name
      << ", compute capability " << prop->major << "." << prop->minor << "): "
      << cudaGetErrorString(err) << ". This build has TORCH_CUDA_ARCH_LIST=\""
      << DPCUDA_CUDA_ARCHS << "\"; rebuild with TORCH_CUDA_ARCH_LIST=\"" << prop->major << "."
      << prop->minor << "\" (pip install --no-build-isolation -e .), or use the CPU";
  return msg.str();
}

void check_kernel_image(c10::DeviceIndex device) {
  const std::string error = kernel_image_error(device);
  TORCH_CHECK(error.empty(), error);
}

}  // namespace dpcuda

#endif  // DPCUDA_WITH_CUDA
