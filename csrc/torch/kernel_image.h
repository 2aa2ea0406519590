// Whether dpcuda's CUDA kernels have an image a device can run (kernel_image.cpp).
#pragma once

#include <c10/core/Device.h>

namespace dpcuda {

// Raises RuntimeError, naming the device, its compute capability, the architectures of this
// build and the fix, when they cannot; cheap after the first call on a device that can.
void check_kernel_image(c10::DeviceIndex device);

// The TORCH_CUDA_ARCH_LIST the CUDA kernels were built for (from setup.py).
const char* cuda_archs();

}  // namespace dpcuda
