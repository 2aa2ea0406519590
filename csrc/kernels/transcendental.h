// The transcendental functions the activations and the loss use, for the host and the device.
// On a GPU they are CUDA's own (hardware-assisted) functions. On the CPU, float uses the
// branch-free polynomial forms below instead of libm: written with selects and bit operations
// only, the per-element loops that call them vectorise (libm's expf/erff/tanhf are opaque calls
// that keep those loops scalar, about 10x slower). double keeps libm's exp, erf and tanh.
// Torch-free: plain C++ that nvcc and g++ both accept.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DPCUDA_HD __host__ __device__ __forceinline__
#else
// Forced, so the per-element calls in the CPU loops fold into the loops compiled for them.
#define DPCUDA_HD inline __attribute__((always_inline))
#endif

// Emulated device code (DPCUDA_EMULATE: csrc/emu) computes with the device's functions, the CPU
// kernels with the polynomials. A program that links both (the emulation tests compare them)
// keeps the two sets of inline functions apart by an inline namespace around the emulated ones.
#if defined(DPCUDA_EMULATE)
#define DPCUDA_MATH_BEGIN inline namespace emulated_device {
#define DPCUDA_MATH_END }
#else
#define DPCUDA_MATH_BEGIN
#define DPCUDA_MATH_END
#endif

namespace dpcuda {
DPCUDA_MATH_BEGIN
namespace poly {

DPCUDA_HD float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

DPCUDA_HD uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// a * b + c rounded once. Where the CPU has FMA units (the x86-64-v3 and v4 clones, aarch64)
// it is one instruction and vectorises; the baseline x86 clone calls libm's fmaf, slow but
// correctly rounded too, so every clone computes the same bits (csrc/cpu/target.h). The
// polynomials below take it for their Horner steps: half the operations, one rounding each.
DPCUDA_HD float fma(float a, float b, float c) { return std::fma(a, b, c); }

DPCUDA_HD float copy_sign(float magnitude, float sign) {
  return from_bits((to_bits(magnitude) & 0x7fffffffu) | (to_bits(sign) & 0x80000000u));
}

// exp(x) for x in [-87, 88.37], with no range handling: Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2 / 2, Cephes' expf polynomial for exp(r), and 2^n assembled from its exponent bits.
// From 88.38 n is 128, whose 2^n is past the float range: kToMax (x in [-86, ln FLT_MAX =
// 88.72]) multiplies by 2^(n-1) and then by 2, both exact while the value is a normal float
// (the same bits as the one scaling; one multiply more). exp() below is exp_in_range with its
// clamps and selects; tanh's large branch, whose argument is in [0, 20], calls it as it is, and
// gaussian() and sigmoid() with their own clamps (the same bits, without the compares and
// blends they do not need).
template <bool kToMax>
DPCUDA_HD float exp_scaled(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * 1.44269504088896341f + kMagic;
  const float n = shifted - kMagic;
  // The integer n sits in the low mantissa bits of `shifted`: 2^n without a float-to-int
  // conversion (undefined for NaN).
  const uint32_t scale = (to_bits(shifted) - to_bits(kMagic) + (kToMax ? 126u : 127u)) << 23;
  const float r = fma(n, 2.12194440e-4f, fma(n, -0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = fma(p, r, 1.3981999507e-3f);
  p = fma(p, r, 8.3334519073e-3f);
  p = fma(p, r, 4.1665795894e-2f);
  p = fma(p, r, 1.6666665459e-1f);
  p = fma(p, r, 5.0000001201e-1f);
  const float er = fma(p, r * r, r) + 1.0f;
  return kToMax ? er * from_bits(scale) * 2.0f : er * from_bits(scale);
}

DPCUDA_HD float exp_in_range(float x) { return exp_scaled<false>(x); }

// exp(x) within 2 ulp for x in [-87, 88.37]; +inf above, 0 below (where the true result is
// below 1.7e-38), NaN for NaN. The lower bound keeps every intermediate a normal float:
// subnormal operands cost x86 cores a microcode assist, tens of times an ordinary multiply.
DPCUDA_HD float exp(float in) {
  constexpr float kHi = 88.3762626647949f, kLo = -87.0f;
  // Comparisons with NaN are false, so NaN passes through the clamps and the result.
  float x = in > kHi ? kHi : in;
  x = x < kLo ? kLo : x;
  const float y = exp_in_range(x);
  return in > kHi ? from_bits(0x7f800000u) : (in < kLo ? 0.0f : y);
}

// tanh(x) within 2 ulp: an odd polynomial for |x| < 0.625 (Cephes' tanhf), where
// 1 - 2 / (exp(2|x|) + 1) would cancel, and that form elsewhere; both on |x|, with the sign of x
// put back last (so tanh(-0) = -0).
DPCUDA_HD float tanh(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = fma(p, z, 2.06390887954e-2f);
  p = fma(p, z, -5.37397155531e-2f);
  p = fma(p, z, 1.33314422036e-1f);
  p = fma(p, z, -3.33332819422e-1f);
  const float small = fma(ax * z, p, ax);
  // tanh(10) rounds to 1 in float; the clamp keeps exp's result and the quotient normal.
  // (NaN: ax > 10 is false, so NaN reaches the exp and the result, as before)
  const float large =
      1.0f - 2.0f / (exp_in_range(2.0f * (ax > 10.0f ? 10.0f : ax)) + 1.0f);
  return copy_sign(ax < 0.625f ? small : large, x);
}

// Phi(z) = (1 + erf(z / sqrt 2)) / 2, the standard normal CDF that exact gelu multiplies by,
// given e = exp(-z^2 / 2) (the gelu derivative has it at hand already). The erf is Abramowitz
// and Stegun 7.1.26, the form of ATen's vectorised CPU gelu: erf(x) = 1 - t P(t) exp(-x^2),
// t = 1 / (1 + 0.3275911 |x|), 1.5e-7 absolute in exact arithmetic, 3.2e-7 as evaluated in
// float. Taken as Phi(z) = t P(t) e / 2 for z < 0 and 1 - t P(t) e / 2 otherwise, it never forms
// 1 + erf with erf near -1, so the left tail keeps its digits.
DPCUDA_HD float normal_cdf_from_exp(float z, float e) {
  const float t = 1.0f / (1.0f + 0.3275911f * 0.70710678118654752f * std::fabs(z));
  float p = 1.061405429f;
  p = fma(p, t, -1.453152027f);
  p = fma(p, t, 1.421413741f);
  p = fma(p, t, -0.284496736f);
  p = fma(p, t, 0.254829592f);
  const float half_tail = 0.5f * (p * t * e);
  return z < 0.0f ? half_tail : 1.0f - half_tail;
}

// exp(-z^2 / 2), the Gaussian that exact gelu's CDF and density are formed from, as 0 below
// 2^-120 (|z| > 12.90, where Phi(z) < 3e-38): the CDF's products formed from a smaller value
// (as small as 0.035 times it) would be subnormal floats, which x86 cores compute through a
// microcode assist, about a hundred times an ordinary multiply. 2^-120 is the smallest such
// bound but one: at 2^-122 intermediates are subnormal again (test_transcendental checks the
// results). Before it, the exp's own bound (-87) left |z| in (12.9, 13.2) to the slow path: a
// 128x4096 gelu layer whose pre-activations spread to +-30 ran its forward and backward at 1.7x
// torch's time. NaN stays NaN (the comparison is false).
// Its argument is never above 0 (or NaN), so only exp's lower clamp is taken (the same bits as
// exp()): the upper clamp and exp's two result selects cost 30% of a vectorised gelu loop
// (0.57 against 0.40 ns an element on one AVX-512 core; every float checked for the same bits).
DPCUDA_HD float gaussian(float z) {
  float x = -0.5f * z * z;
  x = x < -87.0f ? -87.0f : x;  // (NaN passes: the comparison is false)
  const float e = exp_in_range(x);
  return e < 0x1p-120f ? 0.0f : e;
}

// 1 / (1 + exp(-z)) with exp's clamps taken once and one select for the result, not exp's two:
// the same bits as that form with exp() (every float checked) for -z up to 88.37, and less time
// in a vectorised sigmoid loop. Past 88.37 exp() is +Inf, but the true exp(-z) is finite up to
// ln FLT_MAX = 88.72 and the sigmoid a subnormal (3e-39 to 4e-39), as torch's is: the upper
// clamp is there, with exp_scaled's 2^128 (0 for 88.38 <= -z <= 88.72 made an infinite upstream
// gradient a NaN where torch's is +-Inf: Inf * 0). Past the upper clamp exp(-z) is +Inf and the
// quotient 0. Below -z = -80 exp(-z) is below 2^-115 and the quotient 1 either way (1 + e
// rounds to 1 below 2^-24), so the lower clamp sits there, where exp_scaled<true> is exact.
DPCUDA_HD float sigmoid(float z) {
  constexpr float kHi = 88.72283935546875f, kLo = -80.0f;  // (kHi: exp(kHi) > FLT_MAX)
  const float x = -z;
  float clamped = x > kHi ? kHi : x;
  clamped = clamped < kLo ? kLo : clamped;
  const float r = 1.0f / (1.0f + exp_scaled<true>(clamped));
  return x > kHi ? 0.0f : r;
}

}  // namespace poly

// Overloads that pick the single-precision functions for float: an unqualified exp(float) on
// the host could silently widen to double.
#if defined(__CUDA_ARCH__) || defined(DPCUDA_EMULATE)
DPCUDA_HD float math_exp(float x) { return expf(x); }
DPCUDA_HD float math_tanh(float x) { return tanhf(x); }
DPCUDA_HD float math_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }
#else
DPCUDA_HD float math_exp(float x) { return poly::exp(x); }
DPCUDA_HD float math_tanh(float x) { return poly::tanh(x); }
DPCUDA_HD float math_sigmoid(float z) { return poly::sigmoid(z); }
#endif
DPCUDA_HD double math_sigmoid(double z) { return 1.0 / (1.0 + ::exp(-z)); }
// exp(-z^2 / 2) for gelu: on the CPU in float without the subnormal tail (poly::gaussian);
// elsewhere as it was computed before it had a name.
#if defined(__CUDA_ARCH__) || defined(DPCUDA_EMULATE)
DPCUDA_HD float math_gaussian(float z) { return expf(-0.5f * z * z); }
#else
DPCUDA_HD float math_gaussian(float z) { return poly::gaussian(z); }
#endif
DPCUDA_HD double math_gaussian(double z) { return ::exp(-0.5 * z * z); }
// Phi(z) given exp(-z^2 / 2): the CPU's float path reuses it; CUDA and double use erf.
#if defined(__CUDA_ARCH__) || defined(DPCUDA_EMULATE)
DPCUDA_HD float math_normal_cdf_from_exp(float z, float) {
  return 0.5f * (1.0f + erff(z * 0.70710678118654752f));
}
#else
DPCUDA_HD float math_normal_cdf_from_exp(float z, float e) {
  return poly::normal_cdf_from_exp(z, e);
}
#endif
DPCUDA_HD double math_normal_cdf_from_exp(double z, double) {
  return 0.5 * (1.0 + ::erf(z * 0.70710678118654752440));
}
DPCUDA_HD double math_exp(double x) { return ::exp(x); }
DPCUDA_HD double math_tanh(double x) { return ::tanh(x); }
DPCUDA_HD float math_log(float x) { return logf(x); }
DPCUDA_HD double math_log(double x) { return ::log(x); }

DPCUDA_MATH_END
}  // namespace dpcuda
