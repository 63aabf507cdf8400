// SPDX-License-Identifier: Apache-2.0
// Test data for the compaction tests: Gaussian keys / values / queries, and a structured
// variant (a per-channel key mean, outlier channels, a few heavy-hitter keys, queries that
// share a common direction), plus float64 helpers.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace compaction_test {

struct head_set {
  int d = 0;
  std::int64_t n = 0, nq = 0;
  std::vector<float> k, v, q;  // [n][d], [n][d], [nq][d]
};

inline head_set gaussian(int d, std::int64_t n, std::int64_t nq, std::uint64_t seed,
                         double qscale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g;
  head_set h{d, n, nq, {}, {}, {}};
  h.k.resize(std::size_t(n * d));
  h.v.resize(h.k.size());
  h.q.resize(std::size_t(nq * d));
  for (auto& x : h.k) x = float(g(rng));
  for (auto& x : h.v) x = float(g(rng));
  for (auto& x : h.q) x = float(qscale * g(rng));
  return h;
}

// Keys: mean 0.5 in every channel plus 4 outlier channels x 6, 3 heavy hitters (tokens 0, n/3,
// 2n/3) +2.5 along the common query direction (about +3.75 nats of logit); queries: 1.5 sqrt(d)
// x a common unit direction + unit noise.
inline head_set structured(int d, std::int64_t n, std::int64_t nq, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g;
  head_set h{d, n, nq, {}, {}, {}};
  std::vector<double> dir(static_cast<std::size_t>(d));
  double nn = 0;
  for (auto& x : dir) {
    x = g(rng);
    nn += x * x;
  }
  for (auto& x : dir) x /= std::sqrt(nn);
  h.k.resize(std::size_t(n * d));
  h.v.resize(h.k.size());
  h.q.resize(std::size_t(nq * d));
  for (std::int64_t j = 0; j < n; ++j)
    for (int c = 0; c < d; ++c) {
      double x = 0.5 + g(rng) + (c % (d / 4) == 1 ? 6.0 : 0.0);
      if (j == 0 || j == n / 3 || j == 2 * n / 3) x += 2.5 * dir[std::size_t(c)];
      h.k[std::size_t(j * d + c)] = float(x);
      h.v[std::size_t(j * d + c)] = float(g(rng));
    }
  for (std::int64_t i = 0; i < nq; ++i)
    for (int c = 0; c < d; ++c)
      h.q[std::size_t(i * d + c)] =
          float(1.5 * std::sqrt(double(d)) * dir[std::size_t(c)] + g(rng));
  return h;
}

inline double rel_l2(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace compaction_test
