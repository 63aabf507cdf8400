// SPDX-License-Identifier: Apache-2.0
// nnls_gram against an exhaustive float64 reference: for small n every passive set is tried
// (unconstrained least squares on it, kept when non-negative), the best objective wins.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tierkv/compaction/nnls.hpp"

using namespace tierkv;
using namespace tierkv::compaction;

namespace {

// Least squares on the columns in mask by Gaussian elimination (float64, normal equations).
double best_exhaustive(const std::vector<double>& A, const std::vector<double>& b, int m, int n) {
  double best = 0;
  for (double v : b) best += v * v;  // x = 0
  for (std::uint32_t mask = 1; mask < (1u << n); ++mask) {
    std::vector<int> cols;
    for (int j = 0; j < n; ++j)
      if (mask >> j & 1) cols.push_back(j);
    const int p = int(cols.size());
    std::vector<double> M(static_cast<std::size_t>(p * (p + 1)));
    for (int a = 0; a < p; ++a) {
      for (int c = 0; c < p; ++c) {
        double s = 0;
        for (int i = 0; i < m; ++i)
          s += A[std::size_t(cols[a] * m + i)] * A[std::size_t(cols[c] * m + i)];
        M[std::size_t(a * (p + 1) + c)] = s;
      }
      double s = 0;
      for (int i = 0; i < m; ++i) s += A[std::size_t(cols[a] * m + i)] * b[std::size_t(i)];
      M[std::size_t(a * (p + 1) + p)] = s;
    }
    for (int a = 0; a < p; ++a) {  // elimination with partial pivoting
      int piv = a;
      for (int r = a + 1; r < p; ++r)
        if (std::abs(M[std::size_t(r * (p + 1) + a)]) > std::abs(M[std::size_t(piv * (p + 1) + a)]))
          piv = r;
      for (int c = 0; c <= p; ++c)
        std::swap(M[std::size_t(a * (p + 1) + c)], M[std::size_t(piv * (p + 1) + c)]);
      for (int r = 0; r < p; ++r) {
        if (r == a) continue;
        const double f = M[std::size_t(r * (p + 1) + a)] / M[std::size_t(a * (p + 1) + a)];
        for (int c = 0; c <= p; ++c)
          M[std::size_t(r * (p + 1) + c)] -= f * M[std::size_t(a * (p + 1) + c)];
      }
    }
    std::vector<double> x(static_cast<std::size_t>(n), 0.0);
    bool feasible = true;
    for (int a = 0; a < p; ++a) {
      x[std::size_t(cols[a])] = M[std::size_t(a * (p + 1) + p)] / M[std::size_t(a * (p + 1) + a)];
      feasible = feasible && x[std::size_t(cols[a])] >= 0;
    }
    if (!feasible) continue;
    double obj = 0;
    for (int i = 0; i < m; ++i) {
      double s = -b[std::size_t(i)];
      for (int j = 0; j < n; ++j) s += A[std::size_t(j * m + i)] * x[std::size_t(j)];
      obj += s * s;
    }
    best = std::min(best, obj);
  }
  return best;
}

}  // namespace

TEST_CASE("nnls_gram: x >= 0, KKT met, objective equal to the exhaustive optimum",
          "[compaction][nnls]") {
  for (std::uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> g;
    const int m = 20, n = 7;
    std::vector<double> A(static_cast<std::size_t>(m * n)), b(static_cast<std::size_t>(m));
    for (auto& x : A) x = g(rng);
    for (auto& x : b) x = g(rng);  // random b: the unconstrained solution has negative entries
    std::vector<double> G(static_cast<std::size_t>(n * n)), c(static_cast<std::size_t>(n));
    for (int a = 0; a < n; ++a) {
      for (int e = 0; e < n; ++e) {
        double s = 0;
        for (int i = 0; i < m; ++i) s += A[std::size_t(a * m + i)] * A[std::size_t(e * m + i)];
        G[std::size_t(e * n + a)] = s;
      }
      double s = 0;
      for (int i = 0; i < m; ++i) s += A[std::size_t(a * m + i)] * b[std::size_t(i)];
      c[std::size_t(a)] = s;
    }
    auto r = nnls_gram(G, c);
    REQUIRE(r);
    CHECK(r->converged);
    CHECK(r->kkt_violation < 1e-8);
    double obj = 0;
    for (int i = 0; i < m; ++i) {
      double s = -b[std::size_t(i)];
      for (int j = 0; j < n; ++j) s += A[std::size_t(j * m + i)] * r->x[std::size_t(j)];
      obj += s * s;
    }
    int zeros = 0;
    for (double x : r->x) {
      CHECK(x >= 0);
      zeros += x == 0;
    }
    const double best = best_exhaustive(A, b, m, n);
    INFO("seed " << seed << " objective " << obj << " exhaustive " << best << " zeros " << zeros);
    CHECK(obj <= best * (1 + 1e-9) + 1e-12);
  }
}

TEST_CASE("nnls_gram refuses mismatched shapes and non-finite input", "[compaction][nnls]") {
  std::vector<double> G{1, 0, 0, 1}, c{1, 2, 3};
  auto r = nnls_gram(G, c);
  REQUIRE(!r);
  CHECK(r.error_status().code() == errc::invalid_argument);
  std::vector<double> c2{1, std::nan("")};
  auto r2 = nnls_gram(G, c2);
  REQUIRE(!r2);
  CHECK(r2.error_status().code() == errc::non_finite_input);
  CHECK(r2.error_status().message().find("c[1]") != std::string::npos);
}
