// Activation functions and their derivatives, shared by the CUDA kernels and the CPU kernels so
// both backends compute the same formulas. Torch-free: plain C++ that nvcc and g++ both accept.
#pragma once

#include <cstring>
#include <type_traits>

#include "transcendental.h"

namespace dpcuda {

// The order is part of the ABI between the adapters and the kernels; the Python side only ever
// passes names, which parse_activation maps to these values.
enum class Activation : int {
  kNone = 0,
  kRelu = 1,
  kGelu = 2,      // exact: x * Phi(x) with the error function
  kGeluTanh = 3,  // tanh approximation, as torch's approximate="tanh"
  kSilu = 4,
  kSigmoid = 5,
  kTanh = 6,
};

// Returns false for unknown names so the caller can raise an error that names the argument.
inline bool parse_activation(const char* name, Activation* out) {
  static const struct { const char* name; Activation act; } kTable[] = {
      {"none", Activation::kNone},       {"relu", Activation::kRelu},
      {"gelu", Activation::kGelu},       {"gelu_tanh", Activation::kGeluTanh},
      {"silu", Activation::kSilu},       {"sigmoid", Activation::kSigmoid},
      {"tanh", Activation::kTanh},
  };
  for (const auto& entry : kTable) {
    if (std::strcmp(entry.name, name) == 0) {
      *out = entry.act;
      return true;
    }
  }
  return false;
}

// What the backward pass needs from the forward pass. relu, sigmoid and tanh have derivatives
// that are functions of their output, so the output itself is saved and nothing extra is
// stored; the smooth ones with no such closed form keep the pre-activation.
enum class Saved : int { kNothing = 0, kOutput = 1, kPreActivation = 2 };

DPCUDA_MATH_BEGIN

DPCUDA_HD Saved saved_for_backward(Activation act) {
  switch (act) {
    case Activation::kNone: return Saved::kNothing;
    case Activation::kRelu:
    case Activation::kSigmoid:
    case Activation::kTanh: return Saved::kOutput;
    default: return Saved::kPreActivation;
  }
}

template <typename acc_t>
DPCUDA_HD acc_t sigmoid_of(acc_t z) {
  return math_sigmoid(z);  // 1 / (1 + exp(-z))
}

// Forward activation of the pre-activation z, in the accumulation type.
template <typename acc_t>
DPCUDA_HD acc_t activate(Activation act, acc_t z) {
  constexpr acc_t kSqrt2OverPi = acc_t(0.79788456080286535588);
  constexpr acc_t kCoeff = acc_t(0.044715);
  switch (act) {
    case Activation::kNone: return z;
    // torch's relu: NaN passes (a NaN input must not become a confident 0), -0 stays -0.
    case Activation::kRelu: return z < acc_t(0) ? acc_t(0) : z;
    case Activation::kGelu: return z * math_normal_cdf_from_exp(z, math_gaussian(z));
    case Activation::kGeluTanh:
      return acc_t(0.5) * z * (acc_t(1) + math_tanh(kSqrt2OverPi * (z + kCoeff * z * z * z)));
    case Activation::kSilu: return z * sigmoid_of(z);
    case Activation::kSigmoid: return sigmoid_of(z);
    case Activation::kTanh: return math_tanh(z);
  }
  return z;
}

// Derivative of the activation, from whatever saved_for_backward(act) says was kept:
// the output y for relu/sigmoid/tanh, the pre-activation z for gelu/gelu_tanh/silu.
template <typename acc_t>
DPCUDA_HD acc_t activation_grad(Activation act, acc_t s) {
  constexpr acc_t kInvSqrt2Pi = acc_t(0.39894228040143267794);
  constexpr acc_t kSqrt2OverPi = acc_t(0.79788456080286535588);
  constexpr acc_t kCoeff = acc_t(0.044715);
  switch (act) {
    case Activation::kNone: return acc_t(1);
    case Activation::kRelu: return s <= acc_t(0) ? acc_t(0) : acc_t(1);
    case Activation::kSigmoid: return s * (acc_t(1) - s);
    case Activation::kTanh: return acc_t(1) - s * s;
    case Activation::kGelu: {
      // exp(-s^2 / 2) serves the density and the CDF.
      const acc_t e = math_gaussian(s);
      return math_normal_cdf_from_exp(s, e) + s * (kInvSqrt2Pi * e);
    }
    case Activation::kGeluTanh: {
      const acc_t inner = kSqrt2OverPi * (s + kCoeff * s * s * s);
      const acc_t t = math_tanh(inner);
      const acc_t dinner = kSqrt2OverPi * (acc_t(1) + acc_t(3) * kCoeff * s * s);
      return acc_t(0.5) * (acc_t(1) + t) + acc_t(0.5) * s * (acc_t(1) - t * t) * dinner;
    }
    case Activation::kSilu: {
      const acc_t sig = sigmoid_of(s);
      return sig * (acc_t(1) + s * (acc_t(1) - sig));
    }
  }
  return acc_t(1);
}

// The gradient of the pre-activation, grad_out * act'(saved), for one element: what the CPU
// and CUDA kernels both compute. relu is a select, as torch's threshold_backward (output <= 0
// ? 0 : grad): a dead unit passes 0 even when grad_out is Inf or NaN (a product would give
// NaN); a live one, or a NaN output, passes grad_out as it is. On the CPU, a select of values
// loaded unconditionally also vectorises.
template <typename acc_t>
DPCUDA_HD acc_t activation_backward_value(Activation act, acc_t grad_out, acc_t saved) {
  if (act == Activation::kRelu) return saved <= acc_t(0) ? acc_t(0) : grad_out;
  return grad_out * activation_grad<acc_t>(act, saved);
}

// Calls f(std::integral_constant<Activation, A>{}) for the runtime value act, so the loops of a
// kernel are compiled once per activation and the switch is hoisted out of them.
template <typename F>
inline void with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kNone: f(std::integral_constant<Activation, Activation::kNone>{}); break;
    case Activation::kRelu: f(std::integral_constant<Activation, Activation::kRelu>{}); break;
    case Activation::kGelu: f(std::integral_constant<Activation, Activation::kGelu>{}); break;
    case Activation::kGeluTanh:
      f(std::integral_constant<Activation, Activation::kGeluTanh>{});
      break;
    case Activation::kSilu: f(std::integral_constant<Activation, Activation::kSilu>{}); break;
    case Activation::kSigmoid: f(std::integral_constant<Activation, Activation::kSigmoid>{}); break;
    case Activation::kTanh: f(std::integral_constant<Activation, Activation::kTanh>{}); break;
  }
}

DPCUDA_MATH_END
}  // namespace dpcuda
