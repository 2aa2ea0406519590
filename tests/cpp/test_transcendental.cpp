// The CPU's float exp, tanh and normal CDF (csrc/kernels/transcendental.h) against libm in double,
// over every 997th float of the ranges that matter and at the special values.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "check.h"
#include "kernels/activation.h"
#include "kernels/transcendental.h"

namespace {

namespace poly = dpcuda::poly;

float ulp(float x) {
  const float a = std::fabs(x);
  return std::nextafter(a, std::numeric_limits<float>::infinity()) - a;
}

// Every 997th float from lo to hi (lo < 0 < hi), walking the bit patterns of each sign.
template <typename F>
void for_floats(float lo, float hi, F&& f) {
  uint32_t hi_bits, lo_bits;
  std::memcpy(&hi_bits, &hi, sizeof hi_bits);
  const float neg = -lo;
  std::memcpy(&lo_bits, &neg, sizeof lo_bits);
  for (uint32_t sign : {0u, 0x80000000u}) {
    const uint32_t last = sign ? lo_bits : hi_bits;
    for (uint32_t b = 0; b <= last; b += 997) {
      const uint32_t bits = b | sign;
      float x;
      std::memcpy(&x, &bits, sizeof x);
      f(x);
    }
  }
}

double worst_exp = 0, worst_tanh = 0;

void check_exp(float x) {
  const double want = std::exp(double(x));
  const double err = std::fabs(poly::exp(x) - want) / ulp(float(want));
  worst_exp = std::max(worst_exp, err);
}

void check_tanh(float x) {
  const double want = std::tanh(double(x));
  const double err = std::fabs(poly::tanh(x) - want) / ulp(float(want));
  worst_tanh = std::max(worst_tanh, err);
}

float worst_cdf_at = 0;
double worst_cdf = 0;

// Phi(z) = erfc(-z / sqrt 2) / 2 in double.
void check_cdf(float z) {
  const double want = 0.5 * std::erfc(-double(z) / std::sqrt(2.0));
  const float e = std::exp(-0.5 * double(z) * double(z));
  const double err = std::fabs(poly::normal_cdf_from_exp(z, e) - want);
  if (err > worst_cdf) worst_cdf_at = z;
  worst_cdf = std::max(worst_cdf, err);
}

}  // namespace

int main() {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();

  for_floats(-87.0f, 88.37f, check_exp);
  std::printf("exp: worst error %.2f ulp\n", worst_exp);
  CHECK(worst_exp <= 2.0);
  CHECK(poly::exp(0.0f) == 1.0f);
  CHECK(poly::exp(89.0f) == inf);
  CHECK(poly::exp(inf) == inf);
  CHECK(poly::exp(-87.5f) == 0.0f);
  CHECK(std::isnormal(poly::exp(-87.0f)));
  CHECK(poly::exp(-inf) == 0.0f);
  CHECK(std::isnan(poly::exp(nan)));

  for_floats(-12.0f, 12.0f, check_tanh);
  std::printf("tanh: worst error %.2f ulp\n", worst_tanh);
  CHECK(worst_tanh <= 2.0);
  CHECK(poly::tanh(20.0f) == 1.0f);
  CHECK(poly::tanh(10.0f) == 1.0f && poly::tanh(-44.0f) == -1.0f);
  CHECK(poly::tanh(-inf) == -1.0f);
  CHECK(poly::tanh(inf) == 1.0f);
  CHECK(poly::tanh(1e-30f) == 1e-30f);
  CHECK(std::signbit(poly::tanh(-0.0f)));
  CHECK(std::isnan(poly::tanh(nan)));

  for_floats(-12.0f, 12.0f, check_cdf);
  std::printf("normal cdf: worst absolute error %.3g at %g\n", worst_cdf, worst_cdf_at);
  CHECK(worst_cdf <= 4e-7);
  CHECK(poly::normal_cdf_from_exp(0.0f, 1.0f) > 0.4999999f);
  CHECK(poly::normal_cdf_from_exp(0.0f, 1.0f) < 0.5000001f);
  // The left tail is a product, not 1 + erf: Phi(-5) = 2.87e-7 within 1% (not 0).
  CHECK(std::fabs(poly::normal_cdf_from_exp(-5.0f, std::exp(-12.5f)) / 2.8665157e-7 - 1) < 0.01);
  CHECK(poly::normal_cdf_from_exp(-20.0f, 0.0f) == 0.0f);
  CHECK(poly::normal_cdf_from_exp(20.0f, 0.0f) == 1.0f);
  CHECK(std::isnan(poly::normal_cdf_from_exp(nan, nan)));

  // The Gaussian of exact gelu: 0 past |z| = 12.90 rather than a value whose products are
  // subnormal (x86's slow path); gelu's value and derivative are then never subnormal (but
  // for z itself near subnormal, where gelu(z) = z / 2 is).
  CHECK(poly::gaussian(12.85f) >= 0x1p-120f && poly::gaussian(-12.85f) >= 0x1p-120f);
  CHECK(poly::gaussian(12.95f) == 0.0f && poly::gaussian(-inf) == 0.0f);
  CHECK(poly::gaussian(0.0f) == 1.0f);
  CHECK(std::isnan(poly::gaussian(nan)));
  int subnormal = 0;
  const auto no_subnormal = [&](float z) {
    if (std::fabs(z) < 0x1p-60f) return;
    const float e = poly::gaussian(z);
    const float y = dpcuda::activate<float>(dpcuda::Activation::kGelu, z);
    const float d = dpcuda::activation_grad<float>(dpcuda::Activation::kGelu, z);
    // (and the CDF and the density, the smallest products the two are made of)
    const float cdf = poly::normal_cdf_from_exp(z, e), density = 0.39894228f * e;
    for (const float v : {y, d, cdf, density}) subnormal += std::fpclassify(v) == FP_SUBNORMAL;
  };
  for_floats(-20.0f, 20.0f, no_subnormal);
  // every float where the tail ends: 12 <= |z| <= 14
  for (const float sign : {1.0f, -1.0f}) {
    for (float a = 12.0f; a <= 14.0f; a = std::nextafter(a, 15.0f)) no_subnormal(sign * a);
  }
  std::printf("gelu: %d subnormal values, derivatives or their parts for 2^-60 <= |z| <= 20\n",
              subnormal);
  CHECK(subnormal == 0);

  // gaussian and sigmoid take exp's clamps once, without its selects: the same bits as the
  // forms with exp() (every float was checked once, in the AVX-512 and baseline clones), here
  // every 997th float of each sign and every float where the clamps and the bounds switch.
  int differ = 0;
  const auto same = [](float a, float b) {
    return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
  };
  // (past -z = 88.37, where exp() is +Inf and the form 0, the sigmoid is 1 / (1 + exp(-z)) in
  // double within 2 of the smallest subnormals, as torch's float sigmoid, up to ln FLT_MAX =
  // 88.72, and 0 from the float past it, 88.7228394, where torch's float exp overflows)
  int tail = 0, tail_nonzero = 0;
  const auto both = [&](float z) {
    const float e = poly::exp(-0.5f * z * z);
    differ += !same(poly::gaussian(z), e < 0x1p-120f ? 0.0f : e);
    if (!(-z > 88.3762626647949f)) {
      differ += !same(poly::sigmoid(z), 1.0f / (1.0f + poly::exp(-z)));
      return;
    }
    const double want = -z >= 88.72283935546875f ? 0.0 : 1.0 / (1.0 + std::exp(-double(z)));
    tail += !(std::fabs(poly::sigmoid(z) - want) <= 2 * 0x1p-149);
    tail_nonzero += poly::sigmoid(z) != 0.0f;
  };
  for_floats(-inf, inf, both);
  for (const float edge : {13.19f, 12.90f, 88.37f, 88.72f, 87.0f, 80.0f}) {  // (clamps, bounds)
    for (const float sign : {1.0f, -1.0f}) {
      float z = sign * edge;
      for (int i = 0; i < 20000; ++i, z = std::nextafter(z, 0.0f)) both(z);
      z = sign * edge;
      for (int i = 0; i < 20000; ++i, z = std::nextafter(z, sign * 200.0f)) both(z);
    }
  }
  for (const float special : {nan, -nan, inf, -inf, 0.0f, -0.0f, 0x1p-149f, -0x1p-149f}) {
    both(special);
  }
  std::printf("gaussian, sigmoid: %d values differ from the exp() forms\n", differ);
  CHECK(differ == 0);
  std::printf("sigmoid past -z = 88.37: %d values off, %d of them nonzero\n", tail,
              tail_nonzero);
  CHECK(tail == 0);
  CHECK(tail_nonzero > 1000);  // (the band holds 45426 floats; the checks reach 39597)

  if (dpcuda_test::failures()) std::printf("%d failures\n", dpcuda_test::failures());
  return dpcuda_test::failures() ? 1 : 0;
}
