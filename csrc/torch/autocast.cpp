// Autocast kernels of the fused ops: under torch.autocast they cast their arguments as torch's
// own autocast policy casts the ops they stand in for, then run below autocast.
//   full_forward                 as linear: to the autocast dtype (lower precision)
//   loss_grad, softmax_cross_entropy   as cross_entropy_loss: to float32
// Double tensors and tensors on another device type are left alone (cached_cast's rule), and
// casts of leaf weights are cached for the autocast region, as torch's are. full_backward and
// the collectives have no kernel here: autocast falls through for them.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "dispatch.h"

namespace dpcuda {
namespace {

using at::Tensor;
using at::autocast::cached_cast;

template <c10::DeviceType kDevice>
std::tuple<Tensor, Tensor> full_forward_autocast(const Tensor& input, const Tensor& weight,
                                                 const c10::optional<Tensor>& bias,
                                                 c10::string_view activation) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const auto dtype = at::autocast::get_lower_precision_fp_from_device_type(kDevice);
  return call_full_forward(cached_cast(dtype, input, kDevice), cached_cast(dtype, weight, kDevice),
                           cached_cast(dtype, bias, kDevice), activation);
}

template <c10::DeviceType kDevice>
std::tuple<Tensor, Tensor> loss_grad_autocast(const Tensor& logits, const Tensor& labels,
                                              double scale, double label_smoothing,
                                              int64_t ignore_index, bool compute_grad) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  return call_loss_grad(cached_cast(at::kFloat, logits, kDevice), labels, scale,
                        label_smoothing, ignore_index, compute_grad);
}

template <c10::DeviceType kDevice>
Tensor softmax_cross_entropy_autocast(const Tensor& logits, const Tensor& labels,
                                      c10::string_view reduction, double label_smoothing,
                                      int64_t ignore_index) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  return call_softmax_cross_entropy(cached_cast(at::kFloat, logits, kDevice), labels, reduction,
                                    label_smoothing, ignore_index);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpcuda, AutocastCPU, m) {
  m.impl("full_forward", &full_forward_autocast<c10::DeviceType::CPU>);
  m.impl("loss_grad", &loss_grad_autocast<c10::DeviceType::CPU>);
  m.impl("softmax_cross_entropy", &softmax_cross_entropy_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(dpcuda, AutocastCUDA, m) {
  m.impl("full_forward", &full_forward_autocast<c10::DeviceType::CUDA>);
  m.impl("loss_grad", &loss_grad_autocast<c10::DeviceType::CUDA>);
  m.impl("softmax_cross_entropy", &softmax_cross_entropy_autocast<c10::DeviceType::CUDA>);
}

}  // namespace dpcuda
