// Typed handles of the dpcuda ops, for C++ callers: the autograd formulas (which call the ops
// below autograd) and the Python fast path of dpcuda._C (which calls them at the top, so
// autograd, the CPU/CUDA kernels and every other key behave exactly as through torch.ops).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>
#include <utility>

namespace torch::autograd {
class SavedVariable;
}  // namespace torch::autograd

namespace dpcuda {

inline std::tuple<at::Tensor, at::Tensor> call_full_forward(
    const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    c10::string_view activation) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpcuda::full_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const c10::optional<at::Tensor>&,
                                                    c10::string_view)>();
  return op.call(input, weight, bias, activation);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_full_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& saved, c10::string_view activation, std::array<bool, 3> mask) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpcuda::full_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              c10::string_view, std::array<bool, 3>)>();
  return op.call(grad_output, input, weight, saved, activation, mask);
}

inline at::Tensor call_full_backward_into(const at::Tensor& grad_output, const at::Tensor& input,
                                         const at::Tensor& weight, const at::Tensor& saved,
                                         c10::string_view activation, std::array<bool, 3> mask,
                                         at::Tensor& grad_weight, at::Tensor& grad_bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpcuda::full_backward_into", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, c10::string_view, std::array<bool, 3>,
                            at::Tensor&, at::Tensor&)>();
  return op.call(grad_output, input, weight, saved, activation, mask, grad_weight, grad_bias);
}

// The int32 elements of step_status's workspace on a CUDA device (csrc/torch/all_reduce.cpp).
int64_t step_status_workspace_ints();

// The CPU bfloat16 full_forward's activation: by dpcuda's pass (1), by ATen's kernel (0), or as
// measured best per activation (-1); gelu's is ATen's whatever is set (csrc/torch/
// fused_linear.cpp). Returns the previous setting.
int set_bfloat16_forward_route(int route);

// The CPU float full_forward's bias, with an activation: in the GEMM (at::addmm, 1), added by
// dpcuda's pass after at::mm (0), or by the layer's size as measured (-1) (csrc/torch/
// fused_linear.cpp). Returns the previous setting.
int set_float_bias_route(int route);

// The CPU bfloat16 backward's g over a column-major (transposed) upstream gradient, where
// dpcuda's pass makes it: row-major (0), column-major (1, torch's layout there), or by the
// layer's size as measured (-1) (csrc/torch/fused_linear.cpp). Returns the previous setting.
int set_bfloat16_g_layout(int layout);

// Whether torch's bfloat16 GEMM spreads a NaN to a neighbouring row (fused_linear.cpp); g then
// takes the upstream gradient's layout.
bool bfloat16_gemm_spreads_nan();

// Tests only: whether that backward writes g column-major for a gradient of these strides and
// this shape, as set_bfloat16_g_layout and the measured rule decide.
bool bfloat16_g_by_columns_for_tests(int64_t row_stride, int64_t col_stride, int64_t rows,
                                     int64_t cols, bool relu);

// While one is alive on a thread, a full_forward that builds an autograd node there hands the
// node these destinations for its weight and bias gradients (csrc/torch/autograd.cpp).
class GradientsInto {
 public:
  GradientsInto(const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias);
  ~GradientsInto();
  GradientsInto(const GradientsInto&) = delete;
  GradientsInto& operator=(const GradientsInto&) = delete;
  // The destinations set on this thread, or nullptr.
  static const GradientsInto* current();
  at::Tensor weight, bias;  // undefined where not given

 private:
  const GradientsInto* previous_;
};

// While one is alive on a thread, the CPU full_backward drops the autograd node's references
// to its `saved` (the node's saved variable and the call's own tensor, where that is `saved`'s
// tensor and no other) as soon as its activation pass has made g, before the GEMMs: where the
// graph is not kept and nothing else holds it (a pre-activation; a layer's output stays with
// whoever holds it), its memory is then free for the GEMMs' results, as torch's two nodes (the
// activation's, then the linear's) free it (issue #27: in torch's order glibc's heap faulted
// fewer pages a step). The kernel must not read its `saved` argument after it has called
// release, which may have been that very tensor. Elsewhere (CUDA, a call that is not the
// kernel's) nothing is dropped: the engine releases the node's after the call as usual.
class SavedReleasedAfterPass {
 public:
  SavedReleasedAfterPass(at::Tensor* saved, torch::autograd::SavedVariable* node_saved);
  ~SavedReleasedAfterPass();
  SavedReleasedAfterPass(const SavedReleasedAfterPass&) = delete;
  SavedReleasedAfterPass& operator=(const SavedReleasedAfterPass&) = delete;
  // Drops the references set on this thread where they are to `saved`'s tensor (once).
  static void release(const at::Tensor& saved);
  // Tests only: on this thread, how many times release has dropped the references, and how
  // many of those freed the memory (nothing else held it).
  static std::pair<int64_t, int64_t> released_for_tests();

 private:
  at::Tensor* saved_;
  torch::autograd::SavedVariable* node_saved_;
  SavedReleasedAfterPass* previous_;
};

inline std::tuple<at::Tensor, at::Tensor> call_loss_grad(const at::Tensor& logits,
                                                         const at::Tensor& labels, double scale,
                                                         double label_smoothing,
                                                         int64_t ignore_index,
                                                         bool compute_grad) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpcuda::loss_grad", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double,
                                                    double, int64_t, bool)>();
  return op.call(logits, labels, scale, label_smoothing, ignore_index, compute_grad);
}

inline at::Tensor call_softmax_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                             c10::string_view reduction, double label_smoothing,
                                             int64_t ignore_index) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dpcuda::softmax_cross_entropy", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               c10::string_view, double, int64_t)>();
  return op.call(logits, labels, reduction, label_smoothing, ignore_index);
}

}  // namespace dpcuda
