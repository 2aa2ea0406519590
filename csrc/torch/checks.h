// Argument checks shared by the CPU and CUDA adapters. Messages name the argument and what was
// expected; TORCH_CHECK_VALUE and TORCH_CHECK_TYPE surface in Python as ValueError and TypeError.
#pragma once

#include <cstdlib>

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "../kernels/activation.h"

namespace dpcuda {

inline Activation check_activation(c10::string_view name) {
  Activation act;
  const std::string s(name);
  TORCH_CHECK_VALUE(parse_activation(s.c_str(), &act), "activation must be one of none, relu, ",
                    "gelu, gelu_tanh, silu, sigmoid, tanh; got '", s, "'");
  return act;
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " must be on the same device as ",
                    ref_name, " (", ref.device(), "), got ", t.device());
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ",
                   ref_name, " (", ref.scalar_type(), "), got ", t.scalar_type());
}

// The CPU kernels are compiled for float32 and float64; half types are a CUDA feature.
inline void check_cpu_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
                   "dpcuda's CPU kernels take float32 or float64; ", name, " is ",
                   t.scalar_type());
}

// The layer and loss ops also take bfloat16 and half on the CPU, as nn.Linear and
// F.cross_entropy do: stored in the half type, computed in float (the float kernels run on
// upcast copies and each result is rounded once).
inline bool is_half_type(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

inline void check_cpu_layer_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ||
                       is_half_type(t),
                   "dpcuda's CPU layer kernels take float32, float64, bfloat16 or float16; ",
                   name, " is ", t.scalar_type());
}

inline void check_cuda_dtype(const at::Tensor& t, const char* name) {
  const auto s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16,
                   "dpcuda's CUDA kernels take float32, float64, float16 or bfloat16; ", name,
                   " is ", s);
}

// Shapes of a fused linear call: x of shape (..., in) flattened to (rows, in).
struct LinearShape {
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
  at::DimVector out_sizes;  // (no heap allocation up to 5 dimensions)
};

inline LinearShape check_linear(const at::Tensor& input, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(input.dim() >= 1, "input must have shape (..., in_features), got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 2,
                    "weight must have shape (out_features, in_features), got ", weight.dim(),
                    " dimensions ", weight.sizes());
  LinearShape s;
  s.in_features = weight.size(1);
  s.out_features = weight.size(0);
  TORCH_CHECK_VALUE(input.size(-1) == s.in_features, "input must have ", s.in_features,
                    " features in its last dimension to match weight of shape ", weight.sizes(),
                    ", got input of shape ", input.sizes());
  check_same_dtype(weight, "weight", input, "input");
  check_same_device(weight, "weight", input, "input");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == s.out_features,
                      "bias must have shape (out_features,) = (", s.out_features, ",), got ",
                      bias->sizes());
    check_same_dtype(*bias, "bias", input, "input");
    check_same_device(*bias, "bias", input, "input");
  }
  s.rows = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) s.rows *= input.size(d);
  s.out_sizes = at::DimVector(input.sizes());
  s.out_sizes.back() = s.out_features;
  return s;
}

// The gradient of the output and the tensor the forward saved must both have the output's
// shape (the saved tensor is unused, and may be empty, for activation "none").
inline void check_backward(const at::Tensor& grad_output, const at::Tensor& saved,
                           const LinearShape& s, Activation act) {
  TORCH_CHECK_VALUE(grad_output.sizes() == at::IntArrayRef(s.out_sizes),
                    "grad_output must have shape ", at::IntArrayRef(s.out_sizes), ", got ",
                    grad_output.sizes());
  if (act != Activation::kNone) {
    TORCH_CHECK_VALUE(saved.numel() == s.rows * s.out_features, "saved must have ",
                      s.rows * s.out_features, " elements (the forward's output or ",
                      "pre-activation), got shape ", saved.sizes());
    check_same_dtype(saved, "saved", grad_output, "grad_output");
    check_same_device(saved, "saved", grad_output, "grad_output");
  }
}

struct LossShape {
  int64_t rows;
  int64_t classes;
};

inline LossShape check_loss(const at::Tensor& logits, const at::Tensor& labels,
                            double label_smoothing) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must have shape (batch, classes), got ",
                    logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) >= 1, "logits must have at least one class, got shape ",
                    logits.sizes());
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == logits.size(0),
                    "labels must have shape (batch,) = (", logits.size(0), ",), got ",
                    labels.sizes());
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong, "labels must be int64 class indices, got ",
                   labels.scalar_type());
  check_same_device(labels, "labels", logits, "logits");
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0,
                    "label_smoothing must be in [0, 1], got ", label_smoothing);
  return {logits.size(0), logits.size(1)};
}

// Whether the byte ranges two tensors span (from their first element to their last, any
// strides) meet: exact for contiguous tensors, conservative for views interleaved in one storage.
inline bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device() || a.numel() == 0 || b.numel() == 0) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::abs(t.stride(d));
    return (last + 1) * static_cast<int64_t>(t.element_size());
  };
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + span(b) && pb < pa + span(a);
}

// No two tensors of the named lists share memory (a kernel that reads one and writes another
// takes them as distinct buffers): "state2[0] and state1[0] share memory".
inline void check_disjoint(
    const std::vector<std::pair<const char*, const std::vector<at::Tensor>*>>& lists) {
  std::vector<std::pair<const at::Tensor*, std::string>> all;
  for (const auto& [name, list] : lists) {
    for (size_t i = 0; i < list->size(); ++i) {
      all.emplace_back(&(*list)[i], std::string(name) + "[" + std::to_string(i) + "]");
    }
  }
  for (size_t i = 0; i < all.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(!overlap(*all[i].first, *all[j].first), all[i].second, " and ",
                        all[j].second, " share memory; every buffer must be its own");
    }
  }
}

}  // namespace dpcuda
