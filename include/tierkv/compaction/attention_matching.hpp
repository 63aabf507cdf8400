// SPDX-License-Identifier: Apache-2.0
// Attention Matching (AM) compaction of one (layer, KV head): from reference queries Q
// [n_q][d] (post-RoPE, every query head of the GQA group stacked) over a completed prefix's
// keys K [n][d] and values V [n][d], keep t = budget of the keys and fit
//   * the selection: the t keys with the highest attention mass summed over the reference
//     queries (full softmax over all n keys), kept in their original order;
//   * a bias beta_a = log B_a per kept key: with m_i = max_j s_ij (s_ij = scale q_i.k_j),
//     A_ia = exp(s_{i,j_a} - m_i) and the full mass Z_i = sum_j exp(s_ij - m_i), B solves the
//     non-negative least squares min_B sum_i (sum_a A_ia B_a - Z_i)^2, B >= 0 (nnls_gram), with
//     B held in [e^-beta_max, e^beta_max] (the lower bound exactly, by the shift B = lb + B'
//     with B' >= 0; the upper one by clipping afterwards);
//   * the values: with the compacted attention P_ia = A_ia B_a / sum_a' A_ia' B_a', the values
//     X [t][d] solve min ||P X - Y||^2 + lambda ||X - V_kept||^2, Y the full attention outputs
//     on the reference queries (lambda = value_ridge x the mean diagonal of P^T P: a ridge
//     towards the original values, which keeps t > n_q well posed).
// Everything runs in float64 through BLAS / LAPACK (compaction/lapack.hpp): this is the
// offline host path, run once per completed prefix. The first pass over all n keys (the
// n_q x n scores, the selection score, the full masses and outputs) depends on no option but
// the scale: am_prepare computes it once, and attention_match(h, ref, o) reuses it for every
// arm and budget of the same head. Arms of the paper: keep (fit_bias =
// false, refit_values = false), drop (fit_bias = false, refit_values = true), AM (both).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "tierkv/compaction/lapack.hpp"
#include "tierkv/compaction/nnls.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::compaction {

/// One (layer, KV head) of a completed prefix. Row-major float arrays.
struct head_data {
  std::span<const float> keys;     ///< [n][head_dim], post-RoPE
  std::span<const float> values;   ///< [n][head_dim]
  std::span<const float> queries;  ///< [n_q][head_dim], reference queries, post-RoPE
  int head_dim = 0;                ///< scalars per vector
};

/// The knobs of Attention Matching.
struct am_options {
  double budget = 0.1;        ///< fraction of the n tokens kept, in (0, 1]: t = ceil(budget n)
  std::int64_t keep = 0;      ///< > 0: keep exactly this many tokens (1 <= keep <= n) instead
  float softmax_scale = 0.f;  ///< the cache's logit scale; 0 = 1 / sqrt(head_dim)
  double beta_max = 3.0;      ///< |beta| <= beta_max, in (0, 80]; 3 is the paper's AM setting
  bool fit_bias = true;       ///< false: beta = 0 (the "drop" and "keep" arms)
  bool refit_values = true;   ///< false: the kept tokens' original values ("keep")
  double value_ridge = 1e-6;  ///< lambda / mean diag(P^T P), >= 0
  int query_block = 256;      ///< reference queries per BLAS block (memory: block x n doubles)
};

/// The compaction of one (layer, KV head): kept tokens, their bias and values, diagnostics.
struct head_compaction {
  int head_dim = 0;                ///< scalars per vector
  std::int64_t n = 0;              ///< tokens before
  std::int64_t n_q = 0;            ///< reference queries
  float softmax_scale = 0.f;       ///< the scale the fit used (resolved, never 0)
  std::vector<std::int64_t> kept;  ///< t indices into the prefix, ascending
  std::vector<float> keys;         ///< [t][d] the kept tokens' original keys
  std::vector<float> values;       ///< [t][d] refit (or original) values
  std::vector<float> beta;         ///< [t] logit bias, |beta| <= beta_max (0 without fit_bias)
  /// Diagnostics on the reference queries (the fitted objectives):
  double mass_error = 0;             ///< ||A B - Z|| / ||Z|| with the beta above
  double mass_error_no_bias = 0;     ///< the same with B = 1
  double output_error = 0;           ///< ||P X - Y||_F / ||Y||_F with the values above
  double output_error_original = 0;  ///< the same with the kept tokens' original values
  int nnls_iterations = 0;           ///< steps of the bias fit
  double nnls_kkt_violation = 0;     ///< the fit's remaining KKT violation
  std::int64_t clipped_high = 0;     ///< B clipped to e^beta_max
  std::int64_t at_lower_bound = 0;   ///< B at e^-beta_max (the NNLS put them at the bound)

  /// Tokens kept.
  std::int64_t size() const noexcept { return std::int64_t(kept.size()); }
};

namespace detail {

inline status check_finite_rows(std::span<const float> x, int d, const char* what) {
  for (std::size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]))
      return status::make(errc::non_finite_input, "attention_match: ", what, "[",
                          i / std::size_t(d), "][", i % std::size_t(d), "] = ", x[i],
                          " is not finite; nothing was compacted");
  return {};
}

}  // namespace detail

/// Checks shapes and options; returns the number of tokens kept.
inline result<std::int64_t> am_budget(const head_data& h, const am_options& o) {
  if (h.head_dim < 1)
    return status::make(errc::invalid_argument, "attention_match: head_dim = ", h.head_dim,
                        " must be >= 1");
  const auto d = std::size_t(h.head_dim);
  if (h.keys.size() % d || h.values.size() % d || h.queries.size() % d)
    return status::make(errc::invalid_argument, "attention_match: keys (", h.keys.size(),
                        "), values (", h.values.size(), ") and queries (", h.queries.size(),
                        " floats) must be whole rows of head_dim = ", d);
  const auto n = std::int64_t(h.keys.size() / d);
  if (n < 1)
    return status::make(errc::invalid_argument,
                        "attention_match: n = 0 tokens; nothing to compact");
  if (h.values.size() != h.keys.size())
    return status::make(errc::invalid_argument, "attention_match: ", h.values.size() / d,
                        " value rows for ", n, " key rows");
  if (h.queries.empty())
    return status::make(errc::invalid_argument,
                        "attention_match: n_q = 0 reference queries; the fit needs at least 1");
  if (auto st = lapack::check_dim("attention_match: n", n); !st) return st;
  if (auto st = lapack::check_dim("attention_match: n_q", std::int64_t(h.queries.size() / d)); !st)
    return st;
  if (!(o.beta_max > 0.0) || !(o.beta_max <= 80.0))
    return status::make(errc::invalid_argument, "attention_match: beta_max = ", o.beta_max,
                        " is outside (0, 80]");
  if (!(o.value_ridge >= 0.0) || !std::isfinite(o.value_ridge))
    return status::make(errc::invalid_argument, "attention_match: value_ridge = ", o.value_ridge,
                        " must be finite and >= 0");
  if (!(o.softmax_scale >= 0.f) || !std::isfinite(o.softmax_scale))
    return status::make(errc::invalid_argument,
                        "attention_match: softmax_scale = ", o.softmax_scale,
                        " must be finite and >= 0 (0 = 1 / sqrt(head_dim))");
  if (o.query_block < 1)
    return status::make(errc::invalid_argument, "attention_match: query_block = ", o.query_block,
                        " must be >= 1");
  if (o.keep != 0) {
    if (o.keep < 1 || o.keep > n)
      return status::make(errc::out_of_range, "attention_match: keep = ", o.keep,
                          " is outside [1, n = ", n, "]");
    return o.keep;
  }
  if (!(o.budget > 0.0) || !(o.budget <= 1.0))
    return status::make(errc::out_of_range, "attention_match: budget = ", o.budget,
                        " is outside (0, 1] (the fraction of the ", n, " tokens kept)");
  return std::clamp<std::int64_t>(std::int64_t(std::ceil(o.budget * double(n) - 1e-9)), 1, n);
}

/// Pass 1 of attention_match, which every arm and budget over the same head and reference
/// queries shares (it is most of the cost: an n_q x n score matrix): per reference query the
/// row maximum m_i, the full mass Z_i = sum_j exp(s_ij - m_i) and the full attention output Y_i,
/// and per key its attention mass summed over the queries (the selection score).
struct am_reference {
  int head_dim = 0;           ///< scalars per vector
  std::int64_t n = 0;         ///< prefix tokens
  std::int64_t n_q = 0;       ///< reference queries
  double softmax_scale = 0;   ///< the scale used (resolved, never 0)
  std::vector<double> m;      ///< [n_q] row maxima of the logits
  std::vector<double> Z;      ///< [n_q] full masses relative to m
  std::vector<double> Y;      ///< [n_q][d] full attention outputs
  std::vector<double> score;  ///< [n] attention mass per key, summed over the queries
};

/// Computes pass 1 (am_reference) for h with o's softmax_scale and query_block; checks shapes,
/// options and finiteness as attention_match does. The result may be passed to
/// attention_match(h, ref, o) with any budget, keep, beta_max, fit_bias, refit_values or
/// value_ridge, for the same h (the same arrays: only the shapes and the scale are checked).
inline result<am_reference> am_prepare(const head_data& h, const am_options& o = {}) {
  if (auto tb = am_budget(h, o); !tb) return tb.error_status();
  if (auto st = detail::check_finite_rows(h.keys, h.head_dim, "keys"); !st) return st;
  if (auto st = detail::check_finite_rows(h.values, h.head_dim, "values"); !st) return st;
  if (auto st = detail::check_finite_rows(h.queries, h.head_dim, "queries"); !st) return st;

  const int d = h.head_dim;
  const int n = int(h.keys.size() / std::size_t(d));
  const int nq = int(h.queries.size() / std::size_t(d));
  const double scale = o.softmax_scale > 0.f ? double(o.softmax_scale) : 1.0 / std::sqrt(double(d));
  const auto D = std::size_t(d);

  // Column-major [d x n] is row-major [n][d]: one column per key / query.
  std::vector<double> K(h.keys.begin(), h.keys.end()), V(h.values.begin(), h.values.end()),
      Q(h.queries.begin(), h.queries.end());

  am_reference r;
  r.head_dim = d;
  r.n = n;
  r.n_q = nq;
  r.softmax_scale = scale;
  // Over query blocks: row maxima m, full masses Z, outputs Y [d x nq], mass per key.
  r.m.resize(static_cast<std::size_t>(nq));
  r.Z.resize(static_cast<std::size_t>(nq));
  r.Y.resize(D * std::size_t(nq));
  r.score.assign(std::size_t(n), 0.0);
  const int nb_max = std::min(o.query_block, nq);
  std::vector<double> S(static_cast<std::size_t>(nb_max) * std::size_t(n));
  for (int i0 = 0; i0 < nq; i0 += nb_max) {
    const int nb = std::min(nb_max, nq - i0);
    lapack::gemm('T', 'N', nb, n, d, scale, Q.data() + std::size_t(i0) * D, d, K.data(), d, 0.0,
                 S.data(), nb);
    for (int i = 0; i < nb; ++i) {
      double mx = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < n; ++j) mx = std::max(mx, S[std::size_t(j) * nb + i]);
      double z = 0;
      for (int j = 0; j < n; ++j)
        z += (S[std::size_t(j) * nb + i] = std::exp(S[std::size_t(j) * nb + i] - mx));
      for (int j = 0; j < n; ++j) {
        S[std::size_t(j) * nb + i] /= z;
        r.score[std::size_t(j)] += S[std::size_t(j) * nb + i];
      }
      r.m[std::size_t(i0) + std::size_t(i)] = mx;
      r.Z[std::size_t(i0) + std::size_t(i)] = z;
    }
    lapack::gemm('N', 'T', d, nb, n, 1.0, V.data(), d, S.data(), nb, 0.0,
                 r.Y.data() + std::size_t(i0) * D, d);
  }
  return r;
}

/// Compacts one head from its prepared pass 1 (am_prepare(h, ...) on the same arrays). Refuses
/// (invalid_argument) a reference whose head_dim, n, n_q or softmax scale differs from h and o.
inline result<head_compaction> attention_match(const head_data& h, const am_reference& ref,
                                               const am_options& o) {
  auto tb = am_budget(h, o);
  if (!tb) return tb.error_status();
  const std::int64_t t = *tb;
  const int d = h.head_dim;
  const int n = int(h.keys.size() / std::size_t(d));
  const int nq = int(h.queries.size() / std::size_t(d));
  const int ti = int(t);
  const double scale = o.softmax_scale > 0.f ? double(o.softmax_scale) : 1.0 / std::sqrt(double(d));
  const auto D = std::size_t(d);
  if (ref.head_dim != d || ref.n != n || ref.n_q != nq || ref.softmax_scale != scale ||
      ref.m.size() != std::size_t(nq) || ref.Z.size() != std::size_t(nq) ||
      ref.Y.size() != std::size_t(nq) * D || ref.score.size() != std::size_t(n))
    return status::make(errc::invalid_argument, "attention_match: the reference was prepared for ",
                        ref.n, " tokens, ", ref.n_q, " queries, head_dim ", ref.head_dim,
                        ", scale ", ref.softmax_scale, "; this head has ", n, ", ", nq, ", ", d,
                        ", ", scale);
  const std::vector<double>&m = ref.m, &Z = ref.Z, &Y = ref.Y, &score = ref.score;
  std::vector<double> Q(h.queries.begin(), h.queries.end());

  head_compaction r;
  r.head_dim = d;
  r.n = n;
  r.n_q = nq;
  r.softmax_scale = float(scale);
  {  // the t keys of highest mass (ties: the earlier token), in order
    std::vector<std::int64_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + t, order.end(),
                      [&](std::int64_t a, std::int64_t b) {
                        const double sa = score[std::size_t(a)], sb = score[std::size_t(b)];
                        return sa > sb || (sa == sb && a < b);
                      });
    r.kept.assign(order.begin(), order.begin() + t);
    std::sort(r.kept.begin(), r.kept.end());
  }
  const auto T = std::size_t(t);
  std::vector<double> Ks(D * T), Vs(T * D);  // Ks: [d x t]; Vs: column-major [t x d]
  r.keys.resize(T * D);
  for (std::size_t a = 0; a < T; ++a) {
    const std::size_t j = std::size_t(r.kept[a]);
    for (std::size_t k = 0; k < D; ++k) {
      Ks[a * D + k] = double(h.keys[j * D + k]);
      Vs[k * T + a] = double(h.values[j * D + k]);
      r.keys[a * D + k] = h.keys[j * D + k];
    }
  }
  // A [nq x t] column-major: exp(s_{i, j_a} - m_i).
  std::vector<double> A(static_cast<std::size_t>(nq) * T);
  lapack::gemm('T', 'N', nq, ti, d, scale, Q.data(), d, Ks.data(), d, 0.0, A.data(), nq);
  for (std::size_t a = 0; a < T; ++a)
    for (std::size_t i = 0; i < std::size_t(nq); ++i)
      A[a * std::size_t(nq) + i] = std::exp(A[a * std::size_t(nq) + i] - m[i]);

  auto mass_error = [&](const std::vector<double>& B) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < std::size_t(nq); ++i) {
      double s = 0;
      for (std::size_t a = 0; a < T; ++a) s += A[a * std::size_t(nq) + i] * B[a];
      num += (s - Z[i]) * (s - Z[i]);
      den += Z[i] * Z[i];
    }
    return std::sqrt(num / den);
  };
  std::vector<double> B(T, 1.0);
  r.mass_error_no_bias = mass_error(B);
  if (o.fit_bias) {
    std::vector<double> G(T * T), c(T);
    lapack::gram(ti, nq, A.data(), nq, G.data());
    lapack::gemm('T', 'N', ti, 1, nq, 1.0, A.data(), nq, Z.data(), nq, 0.0, c.data(), ti);
    const double lb = std::exp(-o.beta_max), ub = std::exp(o.beta_max);
    for (std::size_t a = 0; a < T; ++a) {  // c' = c - lb G 1: the shift B = lb + B'
      double s = 0;
      for (std::size_t b = 0; b < T; ++b) s += G[b * T + a];
      c[a] -= lb * s;
    }
    auto fit = nnls_gram(G, c);
    if (!fit) return fit.error_status();
    r.nnls_iterations = fit->iterations;
    r.nnls_kkt_violation = fit->kkt_violation;
    for (std::size_t a = 0; a < T; ++a) {
      B[a] = lb + fit->x[a];
      if (fit->x[a] == 0) ++r.at_lower_bound;
      if (B[a] > ub) B[a] = ub, ++r.clipped_high;
    }
  }
  r.mass_error = mass_error(B);
  r.beta.resize(T);
  for (std::size_t a = 0; a < T; ++a) r.beta[a] = o.fit_bias ? float(std::log(B[a])) : 0.f;
  // beta as stored (float) is what attention will see: rebuild B from it for the values.
  for (std::size_t a = 0; a < T; ++a) B[a] = std::exp(double(r.beta[a]));

  // P [nq x t]: the compacted attention on the reference queries.
  std::vector<double> P(A);
  for (std::size_t i = 0; i < std::size_t(nq); ++i) {
    double s = 0;
    for (std::size_t a = 0; a < T; ++a) s += (P[a * std::size_t(nq) + i] *= B[a]);
    const double inv = s > 0 ? 1.0 / s : 0.0;  // s = 0 only by underflow: the row drops out
    for (std::size_t a = 0; a < T; ++a) P[a * std::size_t(nq) + i] *= inv;
  }
  auto output_error = [&](const std::vector<double>& X) {     // X column-major [t x d]
    std::vector<double> O(static_cast<std::size_t>(nq) * D);  // [nq x d]
    lapack::gemm('N', 'N', nq, d, ti, 1.0, P.data(), nq, X.data(), ti, 0.0, O.data(), nq);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < std::size_t(nq); ++i)
      for (std::size_t k = 0; k < D; ++k) {
        const double y = Y[i * D + k], e = O[k * std::size_t(nq) + i] - y;
        num += e * e;
        den += y * y;
      }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  };
  r.output_error_original = output_error(Vs);
  std::vector<double> X(Vs);
  if (o.refit_values) {
    std::vector<double> G(T * T);
    lapack::gram(ti, nq, P.data(), nq, G.data());
    double tr = 0;
    for (std::size_t a = 0; a < T; ++a) tr += G[a * T + a];
    const double lambda = o.value_ridge * std::max(tr / double(T), 1e-300);
    // rhs = P^T Y^T + lambda V_kept  ([t x d])
    lapack::gemm('T', 'T', ti, d, nq, 1.0, P.data(), nq, Y.data(), d, 0.0, X.data(), ti);
    for (std::size_t i = 0; i < X.size(); ++i) X[i] += lambda * Vs[i];
    if (auto st = lapack::solve_spd(ti, d, G.data(), X.data(), lambda); !st) return st;
  }
  r.output_error = output_error(X);
  r.values.resize(T * D);
  for (std::size_t a = 0; a < T; ++a)
    for (std::size_t k = 0; k < D; ++k) r.values[a * D + k] = float(X[k * T + a]);
  return r;
}

/// Compacts one head (see the header comment): am_prepare, then attention_match(h, ref, o).
/// Errors name the value and its limit: invalid_argument / out_of_range for shapes and
/// options, non_finite_input for a NaN or Inf in keys, values or queries (named by row and
/// dim). Zero-norm queries are valid (they attend uniformly).
inline result<head_compaction> attention_match(const head_data& h, const am_options& o = {}) {
  auto ref = am_prepare(h, o);
  if (!ref) return ref.error_status();
  return attention_match(h, *ref, o);
}

}  // namespace tierkv::compaction
