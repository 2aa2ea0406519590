// The activations in float64 from their textbook definitions, written out independently of
// csrc/kernels/activation.h: the oracle of the C++ kernel tests (CPU and emulated CUDA).
#pragma once

#include <cmath>

#include "kernels/activation.h"

namespace dpcuda_test {

inline double activation_reference(dpcuda::Activation act, double z) {
  using dpcuda::Activation;
  switch (act) {
    case Activation::kNone: return z;
    case Activation::kRelu: return z < 0 ? 0 : z;  // NaN passes, as torch.relu
    case Activation::kGelu: return 0.5 * z * std::erfc(-z / std::sqrt(2.0));
    case Activation::kGeluTanh:
      return 0.5 * z * (1 + std::tanh(std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
    case Activation::kSilu: return z / (1 + std::exp(-z));
    case Activation::kSigmoid: return 1 / (1 + std::exp(-z));
    case Activation::kTanh: return std::tanh(z);
  }
  return 0;
}

inline const dpcuda::Activation kAllActivations[] = {
    dpcuda::Activation::kNone,     dpcuda::Activation::kRelu, dpcuda::Activation::kGelu,
    dpcuda::Activation::kGeluTanh, dpcuda::Activation::kSilu, dpcuda::Activation::kSigmoid,
    dpcuda::Activation::kTanh};

}  // namespace dpcuda_test
