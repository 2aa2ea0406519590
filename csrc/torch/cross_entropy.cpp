// ATen adapters of loss_grad, the fused softmax cross-entropy: loss per row and gradient of the
// logits from one kernel. Registration for the CPU and CUDA keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/library.h>

#include <atomic>

#include "../cpu/cross_entropy.h"
#include "checks.h"
#include "label_errors.h"

#ifdef DPCUDA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <vector>

#include "../kernels/cross_entropy/cross_entropy.h"
#include "cuda_types.h"
#include "kernel_image.h"
#endif

namespace dpcuda {
namespace {

using at::Tensor;

// Per-row losses are kept in the accumulation type (float for the half types).
at::ScalarType loss_dtype(const Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The fields of the last bad label this thread raised for (take_label_error).
thread_local LabelError t_label_error;

void raise_bad_label(int64_t position, int64_t label, int64_t classes, int64_t ignore_index) {
  t_label_error = LabelError{true, position, label, classes, ignore_index};
  TORCH_CHECK_VALUE(false, "labels must be class indices in [0, ", classes,
                    ") or ignore_index (", ignore_index, "); got ", label, " at position ",
                    position);
}

std::tuple<Tensor, Tensor> loss_grad_cpu(const Tensor& logits, const Tensor& labels,
                                         double scale, double label_smoothing,
                                         int64_t ignore_index, bool compute_grad) {
  const LossShape s = check_loss(logits, labels, label_smoothing);
  check_cpu_layer_dtype(logits, "logits");
  if (is_half_type(logits)) {
    // The kernel in float (it checks the labels) gives the gradient, rounded once. The loss is
    // torch's own for these types, kept in float: its log_softmax is rounded to the half type,
    // so a log-probability below the type's range makes the loss Inf exactly where torch's is.
    auto [loss, grad] = loss_grad_cpu(logits.to(at::kFloat), labels, scale, label_smoothing,
                                      ignore_index, compute_grad);
    const Tensor torch_loss = at::cross_entropy_loss(logits, labels, c10::nullopt,
                                                     at::Reduction::None, ignore_index,
                                                     label_smoothing)
                                  .to(at::kFloat);
    return {torch_loss * scale, grad.to(logits.scalar_type())};
  }
  const Tensor z = logits.contiguous();
  const Tensor y = labels.contiguous();
  const int64_t* yp = y.data_ptr<int64_t>();
  check_labels(y, s.classes, ignore_index);
  Tensor loss = at::empty({s.rows}, z.options());
  Tensor grad = compute_grad ? at::empty_like(z) : at::empty({0}, z.options());
  const int64_t grain = std::max<int64_t>(1, 16384 / s.classes);
  AT_DISPATCH_FLOATING_TYPES(z.scalar_type(), "loss_grad_cpu", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    scalar_t* lp = loss.data_ptr<scalar_t>();
    scalar_t* gp = compute_grad ? grad.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, s.rows, grain, [&](int64_t begin, int64_t end) {
      cpu::cross_entropy_rows<scalar_t>(zp, yp, lp, gp, begin, end, s.classes, scale,
                                        label_smoothing, ignore_index);
    });
  });
  return {loss, grad};
}

// Set by a caller that reads label_error_flag itself at a synchronisation it makes anyway
// (DataParallel.step, on its replica threads): the CUDA adapter then checks labels in the kernel
// only. Per thread, as torch's own thread-local modes.
thread_local bool t_defer_label_checks = false;

#ifdef DPCUDA_WITH_CUDA

// One int per device, 0 until a loss kernel there sees a label outside [0, classes); never
// freed (a static tensor would outlive the CUDA context at exit). Made on first use, but not
// while a CUDA graph is captured (its zeroing would be recorded, not run): then null, and
// that capture's kernels flag nothing.
Tensor* label_flag(c10::DeviceIndex device, bool capturing) {
  static std::mutex mutex;
  static std::vector<Tensor*> flags;
  const std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<c10::DeviceIndex>(flags.size())) flags.resize(device + 1, nullptr);
  if (flags[device] == nullptr && !capturing) {
    flags[device] = new Tensor(at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(
                                                   at::Device(at::kCUDA, device))));
  }
  return flags[device];
}

std::tuple<Tensor, Tensor> loss_grad_cuda(const Tensor& logits, const Tensor& labels,
                                          double scale, double label_smoothing,
                                          int64_t ignore_index, bool compute_grad) {
  const LossShape s = check_loss(logits, labels, label_smoothing);
  check_cuda_dtype(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  check_kernel_image(logits.device().index());
  const Tensor z = logits.contiguous();
  const Tensor y = labels.contiguous();
  // A label out of range must raise, not crash the context with a device-side assert as
  // F.cross_entropy does. The kernel flags one on the device (and makes its row NaN). An eager
  // call gives the kernel a flag of its own and reads it after the launch (a 4-byte copy and a
  // synchronisation), so that the error comes from the call that made it; the position is then
  // looked up. Not while a CUDA graph is captured (no synchronisation is allowed), and not for a
  // caller that reads the device's shared flag itself (DataParallel.step).
  const bool capturing =
      at::cuda::currentStreamCaptureStatusMayInitCtx() != at::cuda::CaptureStatus::None;
  const bool check_now = !t_defer_label_checks && !capturing && s.rows > 0;
  const Tensor call_flag =
      check_now ? at::zeros({1}, y.options().dtype(at::kInt)) : Tensor();
  Tensor* shared_flag = check_now ? nullptr : label_flag(logits.device().index(), capturing);
  int* flag = check_now ? call_flag.data_ptr<int>()
              : shared_flag != nullptr ? shared_flag->data_ptr<int>() : nullptr;
  Tensor loss = at::empty({s.rows}, z.options().dtype(loss_dtype(z)));
  Tensor grad = compute_grad ? at::empty_like(z) : at::empty({0}, z.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "loss_grad_cuda",
                                  [&] {
    using cuda_t = typename CudaType<scalar_t>::type;
    using acc = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const cudaError_t err = cuda::cross_entropy_forward_backward<cuda_t, acc>(
        reinterpret_cast<const cuda_t*>(z.data_ptr<scalar_t>()), y.data_ptr<int64_t>(),
        loss.data_ptr<acc>(),
        compute_grad ? reinterpret_cast<cuda_t*>(grad.data_ptr<scalar_t>()) : nullptr, s.rows,
        s.classes, scale, label_smoothing, ignore_index,
        flag, at::cuda::getCurrentCUDAStream());
    check_cuda(err, "cross_entropy launch");
  });
  if (check_now && call_flag.item<int>() != 0) {
    check_labels(y.to(at::kCPU).contiguous(), s.classes, ignore_index);  // raises, naming it
  }
  return {loss, grad};
}

#endif  // DPCUDA_WITH_CUDA

}  // namespace

LabelError take_label_error() {
  const LabelError error = t_label_error;
  t_label_error = LabelError{};
  return error;
}

bool defer_label_checks(bool defer) {
  const bool previous = t_defer_label_checks;
  t_defer_label_checks = defer;
  return previous;
}

void check_labels(const Tensor& labels, int64_t classes, int64_t ignore_index) {
  const int64_t* y = labels.const_data_ptr<int64_t>();
  for (int64_t r = 0, n = labels.numel(); r < n; ++r) {
    if (y[r] != ignore_index && (y[r] < 0 || y[r] >= classes)) {
      raise_bad_label(r, y[r], classes, ignore_index);
    }
  }
}

// For the tests, on machines without a GPU: CPU labels take the GPU labels' path (copied).
std::atomic<bool> g_read_cpu_labels{false};

bool read_cpu_labels_for_tests(bool on) { return g_read_cpu_labels.exchange(on); }

Tensor labels_read_for_check(const Tensor& logits, const Tensor& labels,
                             double label_smoothing) {
  // Tensor subclasses (fake and functional tensors under torch.compile, with symbolic sizes
  // that numel() must not be asked for) are ruled out before any size is read. Arguments the
  // adapter would refuse are left to it, so that its error, not a label's, is the one raised.
  if (t_defer_label_checks || at::isTensorSubclassLike(labels) ||
      at::isTensorSubclassLike(logits) ||
      !(labels.is_cuda() || (labels.is_cpu() && g_read_cpu_labels.load())) ||
      labels.device() != logits.device() || labels.scalar_type() != at::kLong ||
      !at::isFloatingType(logits.scalar_type()) || !(label_smoothing >= 0.0) ||
      !(label_smoothing <= 1.0) || logits.dim() != 2 || labels.dim() != 1 ||
      labels.size(0) != logits.size(0) || labels.size(0) == 0 || logits.size(1) < 1) {
    return Tensor();
  }
  constexpr int64_t kMaxRows = 65536;  // a copy of at most 512 KiB; more keep the flag read
  if (labels.size(0) > kMaxRows) return Tensor();
  if (labels.is_cpu()) return labels.clone().contiguous();  // (the tests' switch)
#ifdef DPCUDA_WITH_CUDA
  const c10::cuda::CUDAGuard guard(labels.device());
  if (at::cuda::currentStreamCaptureStatusMayInitCtx() == at::cuda::CaptureStatus::None) {
    return labels.to(at::kCPU).contiguous();
  }
#endif
  return Tensor();
}

#ifdef DPCUDA_WITH_CUDA
Tensor label_error_flag(c10::DeviceIndex device) { return *label_flag(device, false); }
#endif

TORCH_LIBRARY_IMPL(dpcuda, CPU, m) { m.impl("loss_grad", &loss_grad_cpu); }

#ifdef DPCUDA_WITH_CUDA
TORCH_LIBRARY_IMPL(dpcuda, CUDA, m) { m.impl("loss_grad", &loss_grad_cuda); }
#endif

}  // namespace dpcuda
