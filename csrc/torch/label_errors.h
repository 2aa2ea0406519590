// Labels outside [0, classes) given to the CUDA loss kernel (cross_entropy.cpp): the kernel
// raises a flag on the device instead of the adapter synchronising to look, for callers that
// read the flag at a synchronisation they make anyway.
#pragma once

#include <ATen/ATen.h>

namespace dpcuda {

// A bad label's fields, as the ValueError that names it was raised: position (in the labels
// given to the call), label, classes, ignore_index. `raised` is false where none was.
struct LabelError {
  bool raised = false;
  int64_t position = 0;
  int64_t label = 0;
  int64_t classes = 0;
  int64_t ignore_index = 0;
};

// The fields of the last bad-label ValueError this thread raised since the last call, and
// forgets them: the error's fields for a caller that caught it (DataParallel's step), with no
// parsing of its message.
LabelError take_label_error();

// Turns the adapter's own check (a flag read and a synchronisation per call) off on this thread
// while `defer` is true; returns the previous setting. The CPU adapter always checks (free).
bool defer_label_checks(bool defer);

// Raises the ValueError of the first label of `labels` (int64, contiguous, in host memory)
// outside [0, classes) that is not ignore_index, naming its position.
void check_labels(const at::Tensor& labels, int64_t classes, int64_t ignore_index);

// Labels on a GPU that an eager loss call may read into host memory once, in place of the
// adapter's check: int64, 1 to 65536 of them, one per row of floating (batch, classes >= 1)
// logits on the same device, label_smoothing in [0, 1], not under a CUDA graph capture or
// deferred checks, neither tensor a subclass (fake, functional). Their copy there, or an
// undefined tensor where any of that does not hold (the adapter then checks, and raises).
at::Tensor labels_read_for_check(const at::Tensor& logits, const at::Tensor& labels,
                                 double label_smoothing);

// For the tests on machines without a GPU: while on, labels in host memory take that path too
// (as a copy). Returns the previous setting.
bool read_cpu_labels_for_tests(bool on);

#ifdef DPCUDA_WITH_CUDA
// The flag of CUDA device `device`: an int32 tensor of one element, 0 until a loss kernel there
// sees a bad label; the reader sets it back to 0.
at::Tensor label_error_flag(c10::DeviceIndex device);
#endif

}  // namespace dpcuda
