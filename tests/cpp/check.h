// A minimal assertion helper for the C++ kernel tests: counts failures, prints each with its
// location, and main() returns non-zero if any check failed.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace dpcuda_test {

inline int& failures() {
  static int count = 0;
  return count;
}

// One more failure. With DPCUDA_TEST_FAIL_FAST set the test ends at its first failure, with
// status 1 (scripts/check_barriers_matter.sh: a run with a barrier removed needs one failure,
// not the whole suite's).
inline void fail() {
  ++failures();
  static const bool fast = std::getenv("DPCUDA_TEST_FAIL_FAST") != nullptr;
  if (fast) {
    std::printf("(DPCUDA_TEST_FAIL_FAST: stopped at the first failure)\n");
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
}

inline void check_close(double got, double want, double tol, const char* what, const char* file,
                        int line) {
  if (!(std::fabs(got - want) <= tol * (1.0 + std::fabs(want)))) {
    std::printf("%s:%d: %s: got %.17g, want %.17g\n", file, line, what, got, want);
    fail();
  }
}

}  // namespace dpcuda_test

#define CHECK_CLOSE(got, want, tol) \
  dpcuda_test::check_close((got), (want), (tol), #got, __FILE__, __LINE__)
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::printf("%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      dpcuda_test::fail();                                            \
    }                                                                 \
  } while (0)
