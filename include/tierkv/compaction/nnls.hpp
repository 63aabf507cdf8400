// SPDX-License-Identifier: Apache-2.0
// Non-negative least squares in Gram form: min_x ||A x - b||^2 subject to x >= 0, given
// G = A^T A (n x n) and c = A^T b. Lawson-Hanson active set, warm-started from the
// unconstrained solution (negative entries dropped until the passive set's solution is
// positive), every inner solve a LAPACK Cholesky of the passive block (lapack::solve_spd).
// The optimum satisfies the KKT conditions x >= 0, w = c - G x <= tol where x = 0, and
// w ~ 0 where x > 0; `nnls_result::kkt_violation` reports max(w_j over x_j = 0, |w_j| over
// x_j > 0) so callers (and tests) can check it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/compaction/lapack.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::compaction {

/// The outcome of a non-negative least-squares solve.
struct nnls_result {
  std::vector<double> x;     ///< the solution, >= 0
  int iterations = 0;        ///< outer + inner steps
  bool converged = false;    ///< KKT met before the iteration limit
  double kkt_violation = 0;  ///< see the header comment, in units of c
};

/// g: n x n column-major (symmetric), c: n. max_iterations 0 means 10 n + 50.
inline result<nnls_result> nnls_gram(std::span<const double> g, std::span<const double> c,
                                     int max_iterations = 0) {
  const std::size_t n = c.size();
  if (g.size() != n * n)
    return status::make(errc::invalid_argument, "nnls_gram: G holds ", g.size(), " entries, c has ",
                        n, " (G must be n x n = ", n * n, ")");
  if (auto st = lapack::check_dim("nnls_gram: n", std::int64_t(n)); !st) return st;
  for (std::size_t i = 0; i < g.size(); ++i)
    if (!std::isfinite(g[i]))
      return status::make(errc::non_finite_input, "nnls_gram: G[", i, "] = ", g[i],
                          " is not finite");
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(c[i]))
      return status::make(errc::non_finite_input, "nnls_gram: c[", i, "] = ", c[i],
                          " is not finite");
  nnls_result r;
  r.x.assign(n, 0.0);
  if (n == 0) {
    r.converged = true;
    return r;
  }
  if (max_iterations <= 0) max_iterations = int(10 * n + 50);
  double cmax = 0;
  for (double v : c) cmax = std::max(cmax, std::abs(v));
  double gmax = 0;
  for (std::size_t i = 0; i < n; ++i) gmax = std::max(gmax, g[i * n + i]);
  const double tol = 1e-10 * std::max(cmax, 1e-300) * double(n);

  std::vector<char> passive(n, 1);
  std::vector<std::size_t> idx;
  std::vector<double> sub, rhs, z(n, 0.0);
  // z = argmin over the passive set (zeros elsewhere).
  auto solve_passive = [&]() -> status {
    idx.clear();
    for (std::size_t j = 0; j < n; ++j)
      if (passive[j]) idx.push_back(j);
    std::fill(z.begin(), z.end(), 0.0);
    const std::size_t p = idx.size();
    if (p == 0) return {};
    sub.resize(p * p);
    rhs.resize(p);
    for (std::size_t b = 0; b < p; ++b) {
      rhs[b] = c[idx[b]];
      for (std::size_t a = 0; a < p; ++a) sub[b * p + a] = g[idx[b] * n + idx[a]];
    }
    if (auto st = lapack::solve_spd(int(p), 1, sub.data(), rhs.data(), 1e-13 * gmax); !st)
      return st;
    for (std::size_t b = 0; b < p; ++b) z[idx[b]] = rhs[b];
    return {};
  };

  // Warm start: the passive set's solution, dropping non-positive entries until it is positive.
  for (;;) {
    if (auto st = solve_passive(); !st) return st;
    ++r.iterations;
    bool dropped = false;
    for (std::size_t j = 0; j < n; ++j)
      if (passive[j] && z[j] <= 0) passive[j] = 0, dropped = true;
    if (!dropped) break;
  }
  r.x = z;

  std::vector<double> w(n);
  auto gradient = [&]() {  // w = c - G x
    for (std::size_t i = 0; i < n; ++i) {
      double s = c[i];
      for (std::size_t j = 0; j < n; ++j)
        if (r.x[j] != 0) s -= g[j * n + i] * r.x[j];
      w[i] = s;
    }
  };
  while (r.iterations < max_iterations) {
    gradient();
    std::size_t best = n;
    double wbest = tol;
    for (std::size_t j = 0; j < n; ++j)
      if (!passive[j] && w[j] > wbest) wbest = w[j], best = j;
    if (best == n) {
      r.converged = true;
      break;
    }
    passive[best] = 1;
    for (;;) {  // inner loop: step back to feasibility
      if (auto st = solve_passive(); !st) return st;
      ++r.iterations;
      bool feasible = true;
      double alpha = 1.0;
      std::size_t blocking = n;
      for (std::size_t j = 0; j < n; ++j)
        if (passive[j] && z[j] <= 0) {
          feasible = false;
          const double den = r.x[j] - z[j];  // x_j >= 0 >= z_j: den = 0 only at x_j = z_j = 0
          const double a = den > 0 ? r.x[j] / den : 0.0;  // in [0, 1]
          if (blocking == n || a < alpha) alpha = a, blocking = j;
        }
      if (feasible) {
        r.x = z;
        break;
      }
      // Step towards z until the first passive entry reaches zero; it (and any other entry
      // at zero) leaves the passive set.
      for (std::size_t j = 0; j < n; ++j)
        if (passive[j]) r.x[j] += alpha * (z[j] - r.x[j]);
      r.x[blocking] = 0;
      for (std::size_t j = 0; j < n; ++j)
        if (passive[j] && r.x[j] <= 0) r.x[j] = 0, passive[j] = 0;
      if (r.iterations >= max_iterations) break;
    }
  }
  gradient();
  double viol = 0;
  for (std::size_t j = 0; j < n; ++j)
    viol = std::max(viol, r.x[j] > 0 ? std::abs(w[j]) : std::max(w[j], 0.0));
  r.kkt_violation = viol / std::max(cmax, 1e-300);
  return r;
}

}  // namespace tierkv::compaction
