// SPDX-License-Identifier: Apache-2.0
// The fold: AM's per-key logit bias beta moved into the keys along one direction u per head,
// so that plain attention (no bias input) over the folded keys approximates biased attention.
//
// tierkv's logits are s = scale (q . k) (scale = softmax_scale, usually 1 / sqrt(d)). With
//   k' = k + (beta / scale) u                       (= k + beta sqrt(d) u at scale 1 / sqrt(d))
// the folded logit is scale (q . k') = scale (q . k) + beta (q . u), so its error against the
// biased logit scale (q . k) + beta is exactly beta (q . u - 1): zero for a query on the
// hyperplane q . u = 1 and at most |beta| |q . u - 1| otherwise. The direction is fitted on the
// reference queries:
//   ridge (default): u = argmin ||Q u - 1||^2 + lambda ||u||^2 = (Q^T Q + lambda I)^-1 Q^T 1,
//                    lambda = ridge x trace(Q^T Q) / d;
//   mean:            u = mu / ||mu||^2, mu the mean reference query (q . u = 1 at q = mu).
// The fold reports, per reference query, the bound max_a |beta_a| |q . u - 1| on its logit
// error (logit units: natural log of the attention weights); the attention weights of a query
// with bound e then lie within a factor e^{2e} of the biased ones, and its output within
// (e^{2e} - 1) max_a ||v_a|| of the biased output.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/compaction/attention_matching.hpp"
#include "tierkv/compaction/lapack.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::compaction {

/// The direction u the bias is folded along: a ridge fit of q . u = 1 over the reference
/// queries, or mu / ||mu||^2 of their mean mu (see the file comment).
enum class fold_direction { ridge, mean };

/// The knobs of the fold.
struct fold_options {
  fold_direction direction = fold_direction::ridge;  ///< how u is chosen
  double ridge = 1e-3;  ///< lambda / (trace(Q^T Q) / d), > 0 (ridge direction only)
};

/// A head_compaction with its bias folded into the keys (k + (beta / scale) u).
struct folded_head {
  int head_dim = 0;                 ///< scalars per vector
  std::int64_t n = 0;               ///< tokens of the prefix before compaction
  float softmax_scale = 0.f;        ///< the scale the keys were folded for
  std::vector<float> u;             ///< [d]
  std::vector<float> keys;          ///< [t][d] k + (beta / scale) u
  std::vector<float> values;        ///< [t][d] the compaction's values
  std::vector<double> logit_bound;  ///< [n_q] max_a |beta_a| |q_i . u - 1| per reference query
  double max_logit_bound = 0;       ///< max of logit_bound
  double mean_logit_bound = 0;      ///< mean of logit_bound
  double mean_abs_qu_minus_1 = 0;   ///< mean_i |q_i . u - 1|

  /// Tokens kept.
  std::int64_t size() const noexcept { return std::int64_t(keys.size() / std::size_t(head_dim)); }
};

/// u from reference queries [n_q][d] (see the header comment). Errors: a shape that is not
/// whole rows, NaN / Inf (non_finite_input naming row and dim), ridge <= 0, and reference
/// queries that are all zero (no u can give q . u = 1; for the mean direction: a zero mean).
inline result<std::vector<double>> fit_fold_direction(std::span<const float> queries, int head_dim,
                                                      const fold_options& o = {}) {
  if (head_dim < 1)
    return status::make(errc::invalid_argument, "fold: head_dim = ", head_dim, " must be >= 1");
  const auto D = std::size_t(head_dim);
  if (queries.empty() || queries.size() % D)
    return status::make(errc::invalid_argument, "fold: ", queries.size(),
                        " query floats are not >= 1 whole rows of head_dim = ", D);
  if (auto st = detail::check_finite_rows(queries, head_dim, "queries"); !st) return st;
  const std::size_t nq = queries.size() / D;
  if (auto st = lapack::check_dim("fold: n_q", std::int64_t(nq)); !st) return st;
  std::vector<double> Q(queries.begin(), queries.end()), sum(D, 0.0);
  for (std::size_t i = 0; i < nq; ++i)
    for (std::size_t k = 0; k < D; ++k) sum[k] += Q[i * D + k];
  if (o.direction == fold_direction::mean) {
    double nn = 0;
    for (double& v : sum) {
      v /= double(nq);
      nn += v * v;
    }
    if (!(nn > 0))
      return status::make(errc::invalid_argument, "fold: the mean reference query of ", nq,
                          " has norm 0; no u = mu / |mu|^2 (use fold_direction::ridge)");
    for (double& v : sum) v /= nn;
    return sum;
  }
  if (!(o.ridge > 0) || !std::isfinite(o.ridge))
    return status::make(errc::invalid_argument, "fold: ridge = ", o.ridge,
                        " must be finite and > 0");
  std::vector<double> G(D * D);
  lapack::gemm('N', 'T', head_dim, head_dim, int(nq), 1.0, Q.data(), head_dim, Q.data(), head_dim,
               0.0, G.data(), head_dim);  // sum_i q_i q_i^T
  double tr = 0;
  for (std::size_t k = 0; k < D; ++k) tr += G[k * D + k];
  if (!(tr > 0))
    return status::make(errc::invalid_argument, "fold: all ", nq,
                        " reference queries have norm 0; no u gives q . u = 1");
  const double lambda = o.ridge * tr / double(D);
  if (auto st = lapack::solve_spd(head_dim, 1, G.data(), sum.data(), lambda); !st) return st;
  return sum;
}

/// Folds a compaction's bias into its keys for the reference queries it was fitted on (or any
/// query set the caller wants the bound for). The compaction's softmax_scale is the one folded.
inline result<folded_head> fold(const head_compaction& c, std::span<const float> queries,
                                const fold_options& o = {}) {
  auto u = fit_fold_direction(queries, c.head_dim, o);
  if (!u) return u.error_status();
  const auto D = std::size_t(c.head_dim);
  if (c.keys.size() != c.beta.size() * D || c.values.size() != c.keys.size())
    return status::make(errc::invalid_argument, "fold: the compaction holds ", c.keys.size(),
                        " key and ", c.values.size(), " value floats for ", c.beta.size(),
                        " biases of head_dim ", D);
  if (!(c.softmax_scale > 0.f))
    return status::make(errc::invalid_argument, "fold: softmax_scale = ", c.softmax_scale,
                        " must be > 0");
  folded_head f;
  f.head_dim = c.head_dim;
  f.n = c.n;
  f.softmax_scale = c.softmax_scale;
  f.u.assign(u->begin(), u->end());
  f.values = c.values;
  f.keys.resize(c.keys.size());
  double bmax = 0;
  for (std::size_t a = 0; a < c.beta.size(); ++a) {
    const double g = double(c.beta[a]) / double(c.softmax_scale);
    bmax = std::max(bmax, std::abs(double(c.beta[a])));
    for (std::size_t k = 0; k < D; ++k)
      f.keys[a * D + k] = float(double(c.keys[a * D + k]) + g * double(f.u[k]));
  }
  const std::size_t nq = queries.size() / D;
  f.logit_bound.resize(nq);
  double sum_b = 0, sum_e = 0;
  for (std::size_t i = 0; i < nq; ++i) {
    double qu = 0;
    for (std::size_t k = 0; k < D; ++k) qu += double(queries[i * D + k]) * double(f.u[k]);
    const double e = std::abs(qu - 1.0);
    f.logit_bound[i] = bmax * e;
    f.max_logit_bound = std::max(f.max_logit_bound, f.logit_bound[i]);
    sum_b += f.logit_bound[i];
    sum_e += e;
  }
  f.mean_logit_bound = sum_b / double(nq);
  f.mean_abs_qu_minus_1 = sum_e / double(nq);
  return f;
}

}  // namespace tierkv::compaction
