// Tests of the CPU cross-entropy kernel against a direct double-precision computation
// (log of a sum of exponentials, no shifting), and its gradient against central differences.
#include <cmath>
#include <random>
#include <vector>

#include "check.h"
#include "cpu/cross_entropy.h"

namespace {

double direct_loss(const double* z, int64_t classes, int64_t y, double eps) {
  double sum = 0, zsum = 0;
  for (int64_t c = 0; c < classes; ++c) {
    sum += std::exp(z[c]);
    zsum += z[c];
  }
  const double lse = std::log(sum);
  return (1 - eps) * (lse - z[y]) + eps * (lse - zsum / classes);
}

void test_rows(int64_t rows, int64_t classes, double eps, double scale, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 3.0);
  std::uniform_int_distribution<int64_t> label(0, classes - 1);
  std::vector<double> z(rows * classes), loss(rows, NAN), grad(rows * classes, NAN);
  std::vector<int64_t> y(rows);
  for (auto& v : z) v = dist(rng);
  for (int64_t r = 0; r < rows; ++r) y[r] = (r % 5 == 4) ? -100 : label(rng);
  dpcuda::cpu::cross_entropy_rows<double>(z.data(), y.data(), loss.data(), grad.data(), 0, rows,
                                          classes, scale, eps, -100);
  for (int64_t r = 0; r < rows; ++r) {
    double* zr = z.data() + r * classes;
    if (y[r] == -100) {
      CHECK(loss[r] == 0.0);
      for (int64_t c = 0; c < classes; ++c) CHECK(grad[r * classes + c] == 0.0);
      continue;
    }
    CHECK_CLOSE(loss[r], scale * direct_loss(zr, classes, y[r], eps), 1e-12);
    double gsum = 0;
    for (int64_t c = 0; c < classes; ++c) {
      const double keep = zr[c];
      const double h = 1e-6;
      zr[c] = keep + h;
      const double up = direct_loss(zr, classes, y[r], eps);
      zr[c] = keep - h;
      const double down = direct_loss(zr, classes, y[r], eps);
      zr[c] = keep;
      CHECK_CLOSE(grad[r * classes + c], scale * (up - down) / (2 * h), 1e-6);
      gsum += grad[r * classes + c];
    }
    // Softmax minus a distribution that sums to one: each row's gradient sums to zero.
    CHECK_CLOSE(gsum, 0.0, 1e-12);
  }
}

void test_large_logits() {
  // Logits far beyond exp's range must still give a finite loss (log-sum-exp).
  std::vector<float> z = {1000.f, 0.f, -1000.f};
  std::vector<int64_t> y = {1};
  float loss = NAN;
  std::vector<float> grad(3, NAN);
  dpcuda::cpu::cross_entropy_rows<float>(z.data(), y.data(), &loss, grad.data(), 0, 1, 3, 1.0,
                                         0.0, -100);
  CHECK_CLOSE(loss, 1000.0, 1e-6);
  CHECK_CLOSE(grad[0], 1.0, 1e-6);
  CHECK_CLOSE(grad[1], -1.0, 1e-6);
  CHECK(std::isfinite(grad[2]));
}

}  // namespace

int main() {
  std::mt19937 rng(99);
  const int64_t rows[] = {1, 3, 17};
  const int64_t classes[] = {1, 3, 17, 1000};
  for (int64_t r : rows) {
    for (int64_t c : classes) {
      test_rows(r, c, 0.0, 1.0, rng);
      test_rows(r, c, 0.1, 0.25, rng);
    }
  }
  test_large_logits();
  std::printf("test_cross_entropy: %d failures\n", dpcuda_test::failures());
  return dpcuda_test::failures() == 0 ? 0 : 1;
}
