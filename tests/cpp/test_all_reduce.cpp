// C++ tests of the CPU all-reduce kernels: the fixed summation order, the ring's chain giving
// the same bits as the one-pass reduction, the fused SGD step against torch.optim.SGD's
// formula, and shard boundaries that cover a buffer exactly once.
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "check.h"
#include "cpu/all_reduce.h"

using dpcuda::cpu::Sgd;

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int R : {1, 2, 3, 5, 8}) {
    for (int64_t n : {1, 7, 2048, 4099}) {
      std::vector<std::vector<float>> bufs(R, std::vector<float>(n));
      for (auto& b : bufs)
        for (auto& v : b) v = normal(rng) * 1000.0f;
      // The order the kernels promise: x0 + x1 + ... left to right, then / R.
      std::vector<float> want(n), want_mean(n);
      for (int64_t i = 0; i < n; ++i) {
        float acc = bufs[0][i];
        for (int r = 1; r < R; ++r) acc = acc + bufs[r][i];
        want[i] = acc;
        want_mean[i] = acc / static_cast<float>(R);
      }
      for (bool mean : {false, true}) {
        auto work = bufs;
        std::vector<const float*> in;
        std::vector<float*> out;
        for (auto& b : work) {
          in.push_back(b.data());
          out.push_back(b.data());
        }
        dpcuda::cpu::reduce_range<float>(in.data(), R, out.data(), R, 0, n, mean);
        for (int r = 0; r < R; ++r)
          for (int64_t i = 0; i < n; ++i) CHECK(work[r][i] == (mean ? want_mean[i] : want[i]));
        // The ring's chain: partial sums handed from replica to replica.
        auto chain = bufs;
        for (int r = 1; r < R; ++r) {
          dpcuda::cpu::chain_accumulate<float>(chain[r - 1].data(), chain[r].data(), 0, n,
                                               r == R - 1 && mean ? R : 0);
        }
        if (R == 1 && mean) continue;
        for (int64_t i = 0; i < n; ++i) CHECK(chain[R - 1][i] == (mean ? want_mean[i] : want[i]));
      }
      // Shards cover [0, n) once, in order, on 4-element boundaries.
      int64_t next = 0;
      for (int k = 0; k < R; ++k) {
        int64_t b, e;
        dpcuda::cpu::shard_range(n, R, k, 4, &b, &e);
        CHECK(b == next || b == n);
        CHECK(b % 4 == 0 || b == n);
        next = e > b ? e : next;
      }
      CHECK(next == n);
    }
  }
  // Fused SGD: momentum 0.9, weight decay 0.01, lr 0.1, against the formula in double.
  const int R = 3;
  const int64_t n = 5000;
  std::vector<std::vector<double>> g(R, std::vector<double>(n));
  for (auto& b : g)
    for (auto& v : b) v = normal(rng);
  std::vector<double> p0(n), m0(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[i] = normal(rng);
    m0[i] = normal(rng);
  }
  std::vector<std::vector<double>> p(R, p0), m(R, m0);
  std::vector<const double*> gp;
  std::vector<double*> pp, mp;
  for (int r = 0; r < R; ++r) {
    gp.push_back(g[r].data());
    pp.push_back(p[r].data());
    mp.push_back(m[r].data());
  }
  const Sgd sgd{0.1, 0.9, 0.01};
  dpcuda::cpu::reduce_sgd_range<double>(gp.data(), R, pp.data(), R, mp.data(), R, 0, n, false,
                                        sgd);
  for (int64_t i = 0; i < n; ++i) {
    const double grad = g[0][i] + g[1][i] + g[2][i] + 0.01 * p0[i];
    const double buf = 0.9 * m0[i] + grad;
    for (int r = 0; r < R; ++r) {
      CHECK_CLOSE(m[r][i], buf, 1e-14);
      CHECK_CLOSE(p[r][i], p0[i] - 0.1 * buf, 1e-14);
      CHECK(p[r][i] == p[0][i]);
    }
  }
  // sgd_range on a reduced gradient gives the fused step's bits.
  std::vector<double> gsum(n), p1 = p0, m1 = m0;
  for (int64_t i = 0; i < n; ++i) gsum[i] = (g[0][i] + g[1][i]) + g[2][i];
  dpcuda::cpu::sgd_range<double>(gsum.data(), p1.data(), m1.data(), 0, n, sgd);
  for (int64_t i = 0; i < n; ++i) CHECK(p1[i] == p[0][i] && m1[i] == m[0][i]);

  // The algorithms (csrc/cpu/all_reduce.h), on a serial parallel-for that runs the pieces in
  // reverse order: every algorithm ends with the fixed-order bits on every replica, plain and
  // with SGD fused, for buffers long enough for the ring to use several chunks.
  const dpcuda::cpu::ParallelFor reversed =
      [](int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& body) {
        for (int64_t i = end - 1; i >= begin; --i) body(i, i + 1);
      };
  for (auto algo : {dpcuda::AllReduceAlgorithm::kOneShot, dpcuda::AllReduceAlgorithm::kTwoShot,
                    dpcuda::AllReduceAlgorithm::kRing}) {
    for (int R2 : {1, 2, 3, 7}) {
      for (int64_t n2 : {int64_t(1), int64_t(1001), 3 * dpcuda::kRingMinChunk + 9}) {
        std::vector<std::vector<float>> x(R2, std::vector<float>(n2));
        for (auto& b : x)
          for (auto& v : b) v = normal(rng);
        std::vector<float> want(n2), p0f(n2), want_p(n2);
        for (int64_t i = 0; i < n2; ++i) {
          float acc = x[0][i];
          for (int r = 1; r < R2; ++r) acc = acc + x[r][i];
          want[i] = acc / static_cast<float>(R2);
          p0f[i] = normal(rng);
          want_p[i] = p0f[i] - 0.5f * want[i];
        }
        std::vector<float> scratch(dpcuda::cpu::all_reduce_scratch(algo, R2, n2) + 1);
        auto bufs = x;
        std::vector<float*> ptrs;
        for (auto& b : bufs) ptrs.push_back(b.data());
        dpcuda::cpu::all_reduce<float>(ptrs.data(), R2, n2, true, algo, scratch.data(), reversed);
        for (int r = 0; r < R2; ++r) CHECK(bufs[r] == want);
        auto grads = x;
        std::vector<std::vector<float>> params(R2, p0f);
        std::vector<float*> gptr, pptr;
        for (int r = 0; r < R2; ++r) {
          gptr.push_back(grads[r].data());
          pptr.push_back(params[r].data());
        }
        dpcuda::cpu::reduce_sgd<float>(pptr.data(), gptr.data(), nullptr, R2, n2, true, algo,
                                       {0.5, 0.0, 0.0}, scratch.data(), reversed);
        for (int r = 0; r < R2; ++r) CHECK(params[r] == want_p);
      }
    }
  }

  if (dpcuda_test::failures()) {
    std::printf("%d failures\n", dpcuda_test::failures());
    return 1;
  }
  std::printf("all-reduce kernels: ok\n");
  return 0;
}
