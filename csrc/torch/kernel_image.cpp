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
#include <string>

#include "../kernels/fused_linear/epilogue.h"

#ifndef DPCUDA_CUDA_ARCHS
#define DPCUDA_CUDA_ARCHS "unknown"
#endif

namespace dpcuda {
namespace {

// "" when the kernels run on `device`, else the message.
std::string kernel_image_error(int device) {
  // Devices known to run them; any other (one that cannot, or past the table) is asked again.
  static std::array<std::atomic<bool>, 64> runs{};
  const bool cached = device >= 0 && device < static_cast<int>(runs.size());
  if (cached && runs[device].load()) return "";
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaError_t err = cuda::kernel_image_status();
  if (err == cudaSuccess) {
    if (cached) runs[device].store(true);
    return "";
  }
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  std::ostringstream msg;
  msg << "dpcuda's CUDA kernels cannot run on cuda:" << device << " (" << prop->name
      << ", compute capability " << prop->major << "." << prop->minor << "): "
      << cudaGetErrorString(err) << ". This build has TORCH_CUDA_ARCH_LIST=\""
      << cuda_archs() << "\"; rebuild with TORCH_CUDA_ARCH_LIST=\"" << prop->major << "."
      << prop->minor << "\" (pip install --no-build-isolation -e .), or use the CPU";
  return msg.str();
}

}  // namespace

const char* cuda_archs() { return DPCUDA_CUDA_ARCHS; }

void check_kernel_image(c10::DeviceIndex device) {
  const std::string error = kernel_image_error(device);
  TORCH_CHECK(error.empty(), error);
}

}  // namespace dpcuda

#endif  // DPCUDA_WITH_CUDA
