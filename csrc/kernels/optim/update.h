// The element formulas of dpcuda's optimizers (dpcuda.optim: SGD, Adam, AdamW), shared by the
// CUDA kernels (optim.cu) and the CPU kernels (csrc/cpu/optim.cpp), so both backends compute the
// same bits: every product, quotient, sum and square root is rounded on its own, in the order
// torch.optim's single-tensor code writes it (no FMA: nvcc through the _rn intrinsics, the CPU
// build through -ffp-contract=off). Torch-free: plain C++ that nvcc and g++ both accept.
//
// The hyperparameters are read from memory (a float64 array of kHyper values, on the device
// that runs the update), so that a schedule changes them without a new kernel or a host read.
// The host writes the scalars that do not change from step to step in float64 as torch's Python
// computes them (1 - beta1, 1 - lr * weight_decay, ...). Adam's step count is a slot of its own
// (kStep), which a device may write (DataParallel's non-blocking step counts only the updates
// the device applied): the bias corrections are derived from it here, in float64, with
// pow_step's fixed order of rounded products, so every backend and every path (plain step,
// fused, non-blocking, graph replay) gives the same bits, those of torch's Python to within one
// unit in the last place of beta^step. The kernels round each scalar to the
// accumulation type (float for float, half and bfloat16 storage; double for float64), as torch
// rounds a Scalar argument.
#pragma once

#include <cmath>
#include <cstdint>

#include "../transcendental.h"

namespace dpcuda {
namespace optim {

// The order is part of the ABI between dpcuda/optim.py and the kernels.
enum class Kind : int { kSgd = 0, kAdam = 1 };

// The slots of the hyperparameter array.
enum Slot : int {
  kLr = 0,              // SGD: the step is p - lr * d
  kWeightDecay = 1,     // SGD and Adam (L2): g + weight_decay * p
  kMomentum = 2,        // SGD
  kOneMinusDampening = 3,
  kOneMinusBeta1 = 4,   // Adam: exp_avg.lerp_(g, 1 - beta1)
  kBeta2 = 5,           // Adam: exp_avg_sq * beta2 + (1 - beta2) * g * g
  kOneMinusBeta2 = 6,
  kEps = 7,
  kBeta1 = 8,           // Adam: the bias correction 1 - beta1^step
  kStep = 9,            // Adam: the step this update makes (1 for the first), a whole number
  kDecay = 10,          // AdamW: p * (1 - lr * weight_decay)
  kFlags = 11,          // the Flag bits, as a float64 integer
  kHyper = 16,          // the array's length (the rest is reserved)
};

enum Flag : int {
  kMaximize = 1,
  kNesterov = 2,       // SGD
  kAmsgrad = 4,        // Adam: the denominator from max(max_exp_avg_sq, exp_avg_sq)
  kFirst = 8,          // SGD: the momentum buffer starts as the (decayed) gradient
  kDecoupled = 16,     // AdamW: decay the weights, not the gradient
  kUseMomentum = 32,   // SGD: momentum != 0 (a momentum buffer is given)
};

// The formulas: emulated device code and the CPU kernels each have their own copy (see
// transcendental.h), while the enums above are one type for both.
DPCUDA_MATH_BEGIN

// Rounded one operation at a time (CUDA's _rn intrinsics on the device; IEEE operations on
// the host, compiled without contraction).
namespace rn {
#if defined(__CUDA_ARCH__)
DPCUDA_HD float mul(float a, float b) { return __fmul_rn(a, b); }
DPCUDA_HD double mul(double a, double b) { return __dmul_rn(a, b); }
DPCUDA_HD float add(float a, float b) { return __fadd_rn(a, b); }
DPCUDA_HD double add(double a, double b) { return __dadd_rn(a, b); }
DPCUDA_HD float sub(float a, float b) { return __fsub_rn(a, b); }
DPCUDA_HD double sub(double a, double b) { return __dsub_rn(a, b); }
DPCUDA_HD float div(float a, float b) { return __fdiv_rn(a, b); }
DPCUDA_HD double div(double a, double b) { return __ddiv_rn(a, b); }
DPCUDA_HD float sqrt(float a) { return __fsqrt_rn(a); }
DPCUDA_HD double sqrt(double a) { return __dsqrt_rn(a); }
#else
DPCUDA_HD float mul(float a, float b) { return a * b; }
DPCUDA_HD double mul(double a, double b) { return a * b; }
DPCUDA_HD float add(float a, float b) { return a + b; }
DPCUDA_HD double add(double a, double b) { return a + b; }
DPCUDA_HD float sub(float a, float b) { return a - b; }
DPCUDA_HD double sub(double a, double b) { return a - b; }
DPCUDA_HD float div(float a, float b) { return a / b; }
DPCUDA_HD double div(double a, double b) { return a / b; }
DPCUDA_HD float sqrt(float a) { return std::sqrt(a); }
DPCUDA_HD double sqrt(double a) { return std::sqrt(a); }
#endif
}  // namespace rn

// Double-double arithmetic without FMA (Dekker, Veltkamp): every operation an rn:: one, so the
// CPU and the GPU give the same bits.
struct DoubleDouble {
  double hi, lo;
};

DPCUDA_HD DoubleDouble two_prod(double a, double b) {
  const double p = rn::mul(a, b);
  const double ca = rn::mul(134217729.0, a), cb = rn::mul(134217729.0, b);  // 2^27 + 1
  const double ah = rn::sub(ca, rn::sub(ca, a)), al = rn::sub(a, ah);
  const double bh = rn::sub(cb, rn::sub(cb, b)), bl = rn::sub(b, bh);
  const double err = rn::add(
      rn::add(rn::add(rn::sub(rn::mul(ah, bh), p), rn::mul(ah, bl)), rn::mul(al, bh)),
      rn::mul(al, bl));
  return {p, err};
}

DPCUDA_HD DoubleDouble dd_mul(DoubleDouble a, DoubleDouble b) {
  DoubleDouble p = two_prod(a.hi, b.hi);
  const double e = rn::add(p.lo, rn::add(rn::mul(a.hi, b.lo), rn::mul(a.lo, b.hi)));
  const double s = rn::add(p.hi, e);
  return {s, rn::sub(e, rn::sub(s, p.hi))};
}

// beta^step for a whole step (a larger one than 2^53 counts as 2^53; below 1 or NaN as 0, so
// that 1 - beta^0 = 0 and the step size is infinite: a count that is no count shows), by
// repeated squaring in double-double, rounded to a double once at the end: torch's correctly
// rounded `beta ** step` to within one unit in the last place (equal for 99.9% of the 30,000
// (beta, step) pairs tried against Python's pow), with the same bits on every backend; then
// 1 - beta^step is exact (Sterbenz) where beta^step >= 0.5, as in torch's Python.
DPCUDA_HD double pow_step(double beta, double step) {
  uint64_t n = step >= 1.0 ? static_cast<uint64_t>(step < 9007199254740992.0 ? step
                                                                             : 9007199254740992.0)
                           : 0;
  DoubleDouble result{1.0, 0.0}, base{beta, 0.0};
  while (n != 0) {
    if (n & 1u) result = dd_mul(result, base);
    n >>= 1;
    if (n != 0) base = dd_mul(base, base);
  }
  return rn::add(result.hi, result.lo);
}

// Adam's step size -lr / (1 - beta1^step) and sqrt(1 - beta2^step), in float64 as torch's
// Python computes them (bias_correction2 ** 0.5 is the correctly rounded square root).
DPCUDA_HD double neg_step_size(const double* h) {
  return -rn::div(h[kLr], rn::sub(1.0, pow_step(h[kBeta1], h[kStep])));
}
DPCUDA_HD double bias2_sqrt(const double* h) {
  return rn::sqrt(rn::sub(1.0, pow_step(h[kBeta2], h[kStep])));
}

// torch.maximum: NaN when either is NaN.
template <typename A>
DPCUDA_HD A max_nan(A a, A b) {
  return (a != a || a > b) ? a : b;
}

// The hyperparameters in the accumulation type A, read once per thread. What the update
// writes is decided by the buffers it is given, never by values in memory: kUseMomentum (SGD) is
// set exactly when a momentum buffer is given (has_state1), kAmsgrad exactly when
// max_exp_avg_sq is (has_state3), whatever the array says.
template <typename A>
struct Hyper {
  A lr, weight_decay, momentum, one_minus_dampening, one_minus_beta1, beta1_complement,
      beta2, one_minus_beta2, eps, neg_step_size, bias2_sqrt, decay;
  int flags;

  DPCUDA_HD Hyper(const double* h, bool has_state1, bool has_state3)
      : lr(static_cast<A>(h[kLr])),
        weight_decay(static_cast<A>(h[kWeightDecay])),
        momentum(static_cast<A>(h[kMomentum])),
        one_minus_dampening(static_cast<A>(h[kOneMinusDampening])),
        one_minus_beta1(static_cast<A>(h[kOneMinusBeta1])),
        // torch's lerp with a weight of 0.5 or more: end - (end - self) * (1 - weight), with
        // 1 - weight computed in the accumulation type.
        beta1_complement(rn::sub(A(1), static_cast<A>(h[kOneMinusBeta1]))),
        beta2(static_cast<A>(h[kBeta2])),
        one_minus_beta2(static_cast<A>(h[kOneMinusBeta2])),
        eps(static_cast<A>(h[kEps])),
        // (SGD leaves kStep 0 and reads neither)
        neg_step_size(static_cast<A>(optim::neg_step_size(h))),
        bias2_sqrt(static_cast<A>(optim::bias2_sqrt(h))),
        decay(static_cast<A>(h[kDecay])),
        flags((flag_bits(h[kFlags]) & ~(kUseMomentum | kAmsgrad)) |
              (has_state1 ? kUseMomentum : 0) | (has_state3 ? kAmsgrad : 0)) {}

  // The flags slot as bits; a value that is no flag set (NaN, negative, huge) is none.
  static DPCUDA_HD int flag_bits(double v) {
    return v >= 0.0 && v < 1024.0 ? static_cast<int>(v) : 0;
  }

  DPCUDA_HD bool has(int flag) const { return (flags & flag) != 0; }
};

// torch.optim.SGD (single-tensor form), one element: returns the new parameter; `buf` holds
// the momentum buffer and receives the new one (with kUseMomentum).
//   d = maximize ? -g : g;  d = d + weight_decay * p
//   buf = first ? d : buf * momentum + (1 - dampening) * d
//   d = nesterov ? d + momentum * buf : buf;  p = p + (-lr) * d
template <typename A>
DPCUDA_HD A sgd(A g, A p, A& buf, const Hyper<A>& h) {
  A d = h.has(kMaximize) ? -g : g;
  if (h.weight_decay != A(0)) d = rn::add(d, rn::mul(h.weight_decay, p));
  if (h.has(kUseMomentum)) {
    buf = h.has(kFirst) ? d
                        : rn::add(rn::mul(buf, h.momentum), rn::mul(h.one_minus_dampening, d));
    d = h.has(kNesterov) ? rn::add(d, rn::mul(h.momentum, buf)) : buf;
  }
  return rn::add(p, rn::mul(-h.lr, d));
}

// torch.optim.Adam / AdamW (single-tensor form), one element: returns the new parameter;
// m, v and vmax (with kAmsgrad) hold exp_avg, exp_avg_sq and max_exp_avg_sq and receive the
// new values.
//   g = maximize ? -g : g
//   AdamW: p = p * (1 - lr * weight_decay);   Adam: g = g + weight_decay * p
//   m = lerp(m, g, 1 - beta1);  v = v * beta2 + ((1 - beta2) * g) * g
//   vmax = max(vmax, v);  denom = sqrt(amsgrad ? vmax : v) / sqrt(1 - beta2^step) + eps
//   p = p + (-lr / (1 - beta1^step)) * (m / denom)
template <typename A>
DPCUDA_HD A adam(A g, A p, A& m, A& v, A& vmax, const Hyper<A>& h) {
  if (h.has(kMaximize)) g = -g;
  if (h.weight_decay != A(0)) {
    if (h.has(kDecoupled)) {
      p = rn::mul(p, h.decay);
    } else {
      g = rn::add(g, rn::mul(h.weight_decay, p));
    }
  }
  const A diff = rn::sub(g, m);
  m = h.one_minus_beta1 < A(0.5) ? rn::add(m, rn::mul(h.one_minus_beta1, diff))
                                 : rn::sub(g, rn::mul(diff, h.beta1_complement));
  v = rn::add(rn::mul(v, h.beta2), rn::mul(rn::mul(h.one_minus_beta2, g), g));
  A second = v;
  if (h.has(kAmsgrad)) {
    vmax = max_nan(vmax, v);
    second = vmax;
  }
  const A denom = rn::add(rn::div(rn::sqrt(second), h.bias2_sqrt), h.eps);
  return rn::add(p, rn::mul(h.neg_step_size, rn::div(m, denom)));
}

DPCUDA_MATH_END
}  // namespace optim
}  // namespace dpcuda
