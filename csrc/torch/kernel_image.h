// Whether dpcuda's CUDA kernels have an image a device can run (kernel_image.cpp).
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace dpcuda {

// "" when they can; otherwise a message naming the device, its compute capability, the
// architectures of this build and the fix.
std::string kernel_image_error(int device);

// Raises RuntimeError with that message; cheap after the first call on a device that can.
void check_kernel_image(c10::DeviceIndex device);

}  // namespace dpcuda
