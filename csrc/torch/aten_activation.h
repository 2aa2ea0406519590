// The activations as torch's own ATen ops: what the fused ops stand in for. The create_graph
// backward and the composite path differentiate through them, and the CPU's half types run them
// (torch's vectorised half kernels compute in float and round once, as the float pass would, and
// keep the data in the half type).
#pragma once

#include <ATen/ATen.h>

#include "../kernels/activation.h"

namespace dpcuda {

inline at::Tensor aten_activation(const at::Tensor& z, Activation act) {
  switch (act) {
    case Activation::kNone: return z;
    case Activation::kRelu: return at::relu(z);
    case Activation::kGelu: return at::gelu(z, "none");
    case Activation::kGeluTanh: return at::gelu(z, "tanh");
    case Activation::kSilu: return at::silu(z);
    case Activation::kSigmoid: return at::sigmoid(z);
    case Activation::kTanh: return at::tanh(z);
  }
  TORCH_CHECK(false, "unknown activation");
}

// grad_out * act'(saved), saved as saved_for_backward(act) says: the output of relu, sigmoid
// and tanh, the pre-activation of the others (torch's threshold_backward and friends).
inline at::Tensor aten_activation_backward(const at::Tensor& grad_out, const at::Tensor& saved,
                                           Activation act) {
  switch (act) {
    case Activation::kNone: return grad_out;
    case Activation::kRelu: return at::threshold_backward(grad_out, saved, 0);
    case Activation::kGelu: return at::gelu_backward(grad_out, saved, "none");
    case Activation::kGeluTanh: return at::gelu_backward(grad_out, saved, "tanh");
    case Activation::kSilu: return at::silu_backward(grad_out, saved);
    case Activation::kSigmoid: return at::sigmoid_backward(grad_out, saved);
    case Activation::kTanh: return at::tanh_backward(grad_out, saved);
  }
  TORCH_CHECK(false, "unknown activation");
}

}  // namespace dpcuda
