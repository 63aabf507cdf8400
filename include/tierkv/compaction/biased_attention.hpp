// SPDX-License-Identifier: Apache-2.0
// Float64 attention with an explicit per-key logit bias, AM's own read path: for each query
// s_j = scale (q . k_j) + beta_j, out = softmax(s) V, lse = log sum_j exp(s_j) (natural log).
// The host reference the fold is measured against (the cache's attention has no bias input);
// an empty beta is plain attention. Rows are row-major [n][d] floats.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "tierkv/core/status.hpp"

namespace tierkv::compaction {

/// Float64 attention with a per-key logit bias beta (see the file comment); out [n_q][d],
/// optional lse [n_q].
inline status biased_attention(std::span<const float> queries, std::span<const float> keys,
                               std::span<const float> values, std::span<const float> beta,
                               int head_dim, double softmax_scale, std::span<double> out,
                               std::span<double> lse = {}) {
  if (head_dim < 1)
    return status::make(errc::invalid_argument, "biased_attention: head_dim = ", head_dim,
                        " must be >= 1");
  const auto D = std::size_t(head_dim);
  const std::size_t n = keys.size() / D, nq = queries.size() / D;
  if (keys.size() % D || queries.size() % D || values.size() != keys.size())
    return status::make(errc::invalid_argument, "biased_attention: keys (", keys.size(),
                        "), values (", values.size(), ") and queries (", queries.size(),
                        ") are not matching whole rows of head_dim = ", D);
  if (!beta.empty() && beta.size() != n)
    return status::make(errc::invalid_argument, "biased_attention: ", beta.size(), " biases for ",
                        n, " keys");
  if (out.size() != nq * D || (!lse.empty() && lse.size() != nq))
    return status::make(errc::invalid_argument, "biased_attention: out holds ", out.size(),
                        " and lse ", lse.size(), " values; ", nq * D, " and ", nq,
                        " (or 0) needed");
  std::vector<double> s(n);
  for (std::size_t i = 0; i < nq; ++i) {
    double mx = -std::numeric_limits<double>::infinity();
    for (std::size_t j = 0; j < n; ++j) {
      double dot = 0;
      for (std::size_t k = 0; k < D; ++k)
        dot += double(queries[i * D + k]) * double(keys[j * D + k]);
      s[j] = softmax_scale * dot + (beta.empty() ? 0.0 : double(beta[j]));
      mx = std::max(mx, s[j]);
    }
    double z = 0;
    for (std::size_t j = 0; j < n; ++j) z += (s[j] = n ? std::exp(s[j] - mx) : 0.0);
    for (std::size_t k = 0; k < D; ++k) out[i * D + k] = 0;
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t k = 0; k < D; ++k) out[i * D + k] += s[j] / z * double(values[j * D + k]);
    if (!lse.empty()) lse[i] = n ? mx + std::log(z) : -std::numeric_limits<double>::infinity();
  }
  return {};
}

}  // namespace tierkv::compaction
