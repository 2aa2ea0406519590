// Labels outside [0, classes) given to the CUDA loss kernel (cross_entropy.cpp): the kernel
// raises a flag on the device instead of the adapter synchronising to look, for callers that
// read the flag at a synchronisation they make anyway.
#pragma once

#include <ATen/ATen.h>

namespace dpcuda {

// Turns the adapter's own check (a reduction and a synchronisation per call) off on this thread
// while `defer` is true; returns the previous setting. The CPU adapter always checks (free).
bool defer_label_checks(bool defer);

#ifdef DPCUDA_WITH_CUDA
// The flag of CUDA device `device`: an int32 tensor of one element, 0 until a loss kernel there
// sees a bad label; the reader sets it back to 0.
at::Tensor label_error_flag(c10::DeviceIndex device);
#endif

}  // namespace dpcuda
