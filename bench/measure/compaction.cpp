// SPDX-License-Identifier: Apache-2.0
// scripts/measure compaction [--heads H] [--n N] [--seed S]: Attention Matching compaction on
// synthetic attention data with realistic structure, at budgets 10% and 5%, against the full
// cache. Arms: keep (selected keys, original values, no bias), drop (refit values, no bias),
// am (NNLS bias, refit values, explicit-bias float64 attention), fold (the bias folded into
// the keys, plain attention), fold_fp8 / fold_tq3 (the folded prefix written as FP8 / TQ3
// pages of a tiered_cache and read by its attend), and full_fp8 / full_tq3 (the uncompacted
// prefix through the same pages: the codecs' own error); am_nv / fold_nv: AM's bias and its fold
// over the kept tokens' original values (no refit).
//
// Each head: n prefix tokens, a 64-token uncompacted suffix after it (the "question"), and
// 512 query tokens x 4 query heads (GQA group of 4, d = 64). Keys: a per-channel mean with 4
// outlier channels, 8 principal directions of decaying scale, noise, and 4 heavy hitters
// along the query mean; queries: the mean plus a mix of the same principal directions.
// The fit uses the first 256 query tokens (1024 reference queries); "fit" rows evaluate on
// those, "held-out" rows on the other 256 tokens.
//
// Metrics per query, against the full float64 attention over prefix + suffix:
//   kl  = KL(full || arm) of the attention distribution over the suffix tokens and the prefix
//         as one block (the suffix logits are exact, so this is the binary KL of the prefix's
//         share of the attention: it measures the prefix's attention mass, what the bias fits);
//   err = relative L2 of the attention output (prefix + suffix), pooled over queries and heads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "measure_common.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/compaction/attention_matching.hpp"
#include "tierkv/compaction/biased_attention.hpp"
#include "tierkv/compaction/fold.hpp"
#include "tierkv/compaction/write_prefix.hpp"

using namespace tierkv;
using namespace tierkv::compaction;

namespace {

constexpr int D = 64, G = 4, suffix_tokens = 64, query_tokens = 512, fit_tokens = 256;
using geo = geometry<head_dim<D>, kv_heads<1>, group_size<G>, page_tokens<16>>;
using fp8_cache = tiered_cache<geo, tiers<tier<fp8_e4m3, fp8_e4m3>>>;
using tq3_cache = tiered_cache<geo, tiers<tier<tq3_key, tq3_value>>>;

struct head {
  std::vector<float> k, v;    // prefix [n][D]
  std::vector<float> sk, sv;  // suffix [suffix_tokens][D]
  std::vector<float> q;       // [query_tokens][G][D]
};

std::vector<std::vector<double>> orthonormal(std::mt19937_64& rng, int r) {
  std::normal_distribution<double> g;
  std::vector<std::vector<double>> e;
  while (int(e.size()) < r) {
    std::vector<double> x(static_cast<std::size_t>(D));
    for (auto& v : x) v = g(rng);
    for (const auto& b : e) {
      double d = 0;
      for (int c = 0; c < D; ++c) d += x[std::size_t(c)] * b[std::size_t(c)];
      for (int c = 0; c < D; ++c) x[std::size_t(c)] -= d * b[std::size_t(c)];
    }
    double nn = 0;
    for (double v : x) nn += v * v;
    for (auto& v : x) v /= std::sqrt(nn);
    e.push_back(x);
  }
  return e;
}

struct data_options {
  double query_mean = 4.0, query_spread = 3.0;
};

head make_head(std::uint64_t seed, int n, const data_options& dopt) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g;
  constexpr int R = 8;
  const auto E = orthonormal(rng, R), EV = orthonormal(rng, R);
  std::vector<double> mu(static_cast<std::size_t>(D));
  for (auto& x : mu) x = 0.5 * g(rng);
  for (int o = 0; o < 4; ++o) mu[std::size_t((o * 17 + int(seed % 7)) % D)] += (o % 2 ? -4.0 : 4.0);
  auto key = [&](std::vector<float>& out, std::size_t at, bool heavy) {
    std::vector<double> x(mu);
    for (int r = 0; r < R; ++r) {
      const double c = g(rng) * 2.0 * std::pow(0.8, r);
      for (int d = 0; d < D; ++d) x[std::size_t(d)] += c * E[std::size_t(r)][std::size_t(d)];
    }
    if (heavy)
      for (int d = 0; d < D; ++d) x[std::size_t(d)] += 6.0 * E[0][std::size_t(d)];
    for (int d = 0; d < D; ++d) out[at + std::size_t(d)] = float(x[std::size_t(d)] + 0.4 * g(rng));
  };
  auto value = [&](std::vector<float>& out, std::size_t at) {
    std::vector<double> x(static_cast<std::size_t>(D), 0.0);
    for (int r = 0; r < R; ++r) {
      const double c = g(rng) * 1.5 * std::pow(0.8, r);
      for (int d = 0; d < D; ++d) x[std::size_t(d)] += c * EV[std::size_t(r)][std::size_t(d)];
    }
    for (int d = 0; d < D; ++d) out[at + std::size_t(d)] = float(x[std::size_t(d)] + 0.5 * g(rng));
  };
  head h;
  h.k.resize(std::size_t(n) * D);
  h.v.resize(h.k.size());
  for (int j = 0; j < n; ++j) {
    const bool heavy = j == 0 || j == n / 7 || j == n / 2 || j == 5 * n / 6;
    key(h.k, std::size_t(j) * D, heavy);
    value(h.v, std::size_t(j) * D);
  }
  h.sk.resize(std::size_t(suffix_tokens) * D);
  h.sv.resize(h.sk.size());
  for (int j = 0; j < suffix_tokens; ++j) {
    key(h.sk, std::size_t(j) * D, false);
    value(h.sv, std::size_t(j) * D);
  }
  h.q.resize(std::size_t(query_tokens) * G * D);
  for (int i = 0; i < query_tokens; ++i) {
    std::vector<double> a(R);
    for (auto& x : a) x = g(rng);
    for (int hh = 0; hh < G; ++hh) {
      std::vector<double> x(static_cast<std::size_t>(D), 0.0);
      for (int d = 0; d < D; ++d)
        x[std::size_t(d)] = dopt.query_mean * E[0][std::size_t(d)] + 0.3 * g(rng);
      for (int r = 0; r < R; ++r) {
        const double c = dopt.query_spread * (a[std::size_t(r)] + 0.5 * g(rng));
        for (int d = 0; d < D; ++d) x[std::size_t(d)] += c * E[std::size_t(r)][std::size_t(d)];
      }
      for (int d = 0; d < D; ++d)
        h.q[(std::size_t(i) * G + std::size_t(hh)) * D + std::size_t(d)] = float(x[std::size_t(d)]);
    }
  }
  return h;
}

// Accumulates one arm's metrics.
struct stat {
  double kl = 0, err2 = 0, ref2 = 0;
  std::int64_t count = 0;
  double kl_mean() const { return kl / double(count); }
  double err() const { return std::sqrt(err2 / ref2); }
};

// A prefix partial state per query (out [nq][D], lse [nq]) merged with the exact suffix.
struct partial {
  std::vector<double> out, lse;
};

struct evaluator {
  const head& h;
  int first_token, tokens;  // the evaluated query tokens
  std::vector<float> qs;    // their queries [tokens * G][D]
  partial suffix, full;     // suffix attention, full prefix attention (float64)
  evaluator(const head& hh, int first, int count) : h(hh), first_token(first), tokens(count) {
    qs.assign(h.q.begin() + std::ptrdiff_t(first) * G * D,
              h.q.begin() + std::ptrdiff_t(first + count) * G * D);
    const std::size_t nq = std::size_t(count) * G;
    suffix.out.resize(nq * D);
    suffix.lse.resize(nq);
    full.out.resize(nq * D);
    full.lse.resize(nq);
    const double scale = 1.0 / std::sqrt(double(D));
    biased_attention(qs, h.sk, h.sv, {}, D, scale, suffix.out, suffix.lse).throw_if_error();
    biased_attention(qs, h.k, h.v, {}, D, scale, full.out, full.lse).throw_if_error();
  }
  void add(const partial& p, stat& s) const {
    const std::size_t nq = full.lse.size();
    for (std::size_t i = 0; i < nq; ++i) {
      auto merged = [&](double lse_p, const double* out_p, double* o) {
        const double L =
            std::max(lse_p, suffix.lse[i]) + std::log1p(std::exp(-std::abs(lse_p - suffix.lse[i])));
        const double wp = std::exp(lse_p - L), ws = std::exp(suffix.lse[i] - L);
        for (int d = 0; d < D; ++d) o[d] = wp * out_p[d] + ws * suffix.out[i * D + std::size_t(d)];
        return wp;
      };
      double of[D], oa[D];
      const double pf = merged(full.lse[i], full.out.data() + i * D, of);
      const double pa = merged(p.lse[i], p.out.data() + i * D, oa);
      auto term = [](double a, double b) {
        return a > 0 ? a * std::log(a / std::max(b, 1e-300)) : 0.0;
      };
      s.kl += term(pf, pa) + term(1 - pf, 1 - pa);
      for (int d = 0; d < D; ++d) {
        s.err2 += (oa[d] - of[d]) * (oa[d] - of[d]);
        s.ref2 += of[d] * of[d];
      }
      ++s.count;
    }
  }
  partial plain(std::span<const float> k, std::span<const float> v,
                std::span<const float> beta = {}) const {
    partial p;
    p.out.resize(qs.size());
    p.lse.resize(qs.size() / D);
    biased_attention(qs, k, v, beta, D, 1.0 / std::sqrt(double(D)), p.out, p.lse).throw_if_error();
    return p;
  }
  template <class Cache>
  partial through(Cache& c, seq_id s, int layer) const {
    partial p;
    p.out.resize(qs.size());
    p.lse.resize(qs.size() / D);
    std::vector<float> out(std::size_t(G) * D), lse(static_cast<std::size_t>(G));
    const seq_id batch[] = {s};
    for (int i = 0; i < tokens; ++i) {
      std::span<const float> q(qs.data() + std::size_t(i) * G * D, std::size_t(G) * D);
      c.attend(layer, batch, q, out, {}, lse).throw_if_error();
      for (int e = 0; e < G * D; ++e)
        p.out[std::size_t(i) * G * D + std::size_t(e)] = out[std::size_t(e)];
      for (int e = 0; e < G; ++e) p.lse[std::size_t(i) * G + std::size_t(e)] = lse[std::size_t(e)];
    }
    return p;
  }
};

template <class Cache>
std::unique_ptr<Cache> make_cache(int layers, int n) {
  typename Cache::options opt;
  opt.storage.num_layers = layers;
  opt.storage.pages_per_tier = {std::uint32_t(layers * (n / 16 + 2) * 4)};
  opt.max_batch = 1;
  opt.max_pages = n / 16 + 2;
  auto c = Cache::create(opt);
  c.error_status().throw_if_error();
  return std::move(*c);
}

template <class Cache>
seq_id write_full(Cache& c, const std::vector<head>& hs, int n) {
  const int L = int(hs.size());
  std::vector<float> k(std::size_t(L) * std::size_t(n) * D), v(k.size());
  for (int l = 0; l < L; ++l) {
    std::copy(hs[std::size_t(l)].k.begin(), hs[std::size_t(l)].k.end(),
              k.begin() + std::ptrdiff_t(l) * n * D);
    std::copy(hs[std::size_t(l)].v.begin(), hs[std::size_t(l)].v.end(),
              v.begin() + std::ptrdiff_t(l) * n * D);
  }
  auto s = c.create_sequence().value();
  c.append(s, n, k, v).throw_if_error();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int heads = 8, n = 2048;
  std::uint64_t seed = 1;
  data_options dopt;
  double value_ridge = am_options{}.value_ridge;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--heads")
      heads = std::atoi(argv[i + 1]);
    else if (a == "--n")
      n = std::atoi(argv[i + 1]);
    else if (a == "--seed")
      seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--query-mean")
      dopt.query_mean = std::atof(argv[i + 1]);
    else if (a == "--query-spread")
      dopt.query_spread = std::atof(argv[i + 1]);
    else if (a == "--value-ridge")
      value_ridge = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "usage: measure_compaction [--heads H] [--n N] [--seed S] [--query-mean M] "
                   "[--query-spread S] [--value-ridge R]\n");
      return 2;
    }
  }
  if (heads < 1 || n < 64) {
    std::fprintf(stderr, "measure_compaction: --heads %d must be >= 1 and --n %d >= 64\n", heads,
                 n);
    return 2;
  }
  std::vector<head> hs;
  for (int l = 0; l < heads; ++l) hs.push_back(make_head(seed * 1000 + std::uint64_t(l), n, dopt));
  std::vector<evaluator> ev_fit, ev_held;
  for (const auto& h : hs) {
    ev_fit.emplace_back(h, 0, fit_tokens);
    ev_held.emplace_back(h, fit_tokens, query_tokens - fit_tokens);
  }
  const char* splits[] = {"fit", "held-out"};
  std::map<std::string, stat> st;  // "arm/budget/split"
  auto fp8 = make_cache<fp8_cache>(heads, n);
  auto tq3 = make_cache<tq3_cache>(heads, n);
  {  // the codecs alone: the full prefix as FP8 / TQ3 pages
    const auto s8 = write_full(*fp8, hs, n), s3 = write_full(*tq3, hs, n);
    for (int l = 0; l < heads; ++l)
      for (int sp = 0; sp < 2; ++sp) {
        const auto& e = sp ? ev_held[std::size_t(l)] : ev_fit[std::size_t(l)];
        e.add(e.through(*fp8, s8, l), st[std::string("full_fp8/-/") + splits[sp]]);
        e.add(e.through(*tq3, s3, l), st[std::string("full_tq3/-/") + splits[sp]]);
      }
    fp8->release(s8).throw_if_error();
    tq3->release(s3).throw_if_error();
  }
  const double budgets[] = {0.10, 0.05};
  const char* bname[] = {"10pct", "5pct"};
  std::map<std::string, double> diag;
  double fit_seconds = 0;
  for (int b = 0; b < 2; ++b) {
    std::vector<folded_head> folded;
    double top_mass = 0, bound_fit = 0, bound_held = 0, qu_fit = 0, qu_held = 0, clipped = 0,
           lower = 0, iters = 0, kept = 0;
    for (int l = 0; l < heads; ++l) {
      const auto& h = hs[std::size_t(l)];
      const std::span<const float> ref(h.q.data(), std::size_t(fit_tokens) * G * D);
      am_options o;
      o.budget = budgets[b];
      o.value_ridge = value_ridge;
      am_options ok = o, od = o;
      ok.fit_bias = ok.refit_values = false;
      od.fit_bias = false;
      const auto t0 = std::chrono::steady_clock::now();
      auto am = attention_match({h.k, h.v, ref, D}, o).value();
      auto f = fold(am, ref).value();
      fit_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto keep = attention_match({h.k, h.v, ref, D}, ok).value();
      auto drop = attention_match({h.k, h.v, ref, D}, od).value();
      am_options onv = o;  // AM's bias over the original values (the paper's Table 9 ablation)
      onv.refit_values = false;
      auto am_nv = attention_match({h.k, h.v, ref, D}, onv).value();
      auto f_nv = fold(am_nv, ref).value();
      clipped += double(am.clipped_high);
      lower += double(am.at_lower_bound);
      iters += am.nnls_iterations;
      kept = double(am.size());
      for (int sp = 0; sp < 2; ++sp) {
        const auto& e = sp ? ev_held[std::size_t(l)] : ev_fit[std::size_t(l)];
        const std::string tail = std::string("/") + bname[b] + "/" + splits[sp];
        e.add(e.plain(keep.keys, keep.values), st["keep" + tail]);
        e.add(e.plain(drop.keys, drop.values), st["drop" + tail]);
        e.add(e.plain(am.keys, am.values, am.beta), st["am" + tail]);
        e.add(e.plain(f.keys, f.values), st["fold" + tail]);
        e.add(e.plain(am_nv.keys, am_nv.values, am_nv.beta), st["am_nv" + tail]);
        e.add(e.plain(f_nv.keys, f_nv.values), st["fold_nv" + tail]);
        double bsum = 0, qsum = 0, bmax = 0;
        for (float x : am.beta) bmax = std::max(bmax, std::abs(double(x)));
        for (std::size_t i = 0; i < e.qs.size() / D; ++i) {
          double qu = 0;
          for (int d = 0; d < D; ++d)
            qu += double(e.qs[i * D + std::size_t(d)]) * f.u[std::size_t(d)];
          qsum += std::abs(qu - 1);
          bsum += bmax * std::abs(qu - 1);
        }
        const double nq = double(e.qs.size() / D);
        (sp ? bound_held : bound_fit) += bsum / nq / heads;
        (sp ? qu_held : qu_fit) += qsum / nq / heads;
        if (sp == 0) {  // share of the full attention mass the kept keys carry
          double share = 0;
          for (std::size_t i = 0; i < e.full.lse.size(); ++i) {
            double z = 0;
            for (std::int64_t j : am.kept) {
              double dot = 0;
              for (int d = 0; d < D; ++d)
                dot +=
                    double(e.qs[i * D + std::size_t(d)]) * h.k[std::size_t(j) * D + std::size_t(d)];
              z += std::exp(dot / std::sqrt(double(D)) - e.full.lse[i]);
            }
            share += z / double(e.full.lse.size());
          }
          top_mass += share / heads;
        }
      }
      folded.push_back(std::move(f));
    }
    auto pre = assemble_prefix(folded, heads, 1).value();
    const auto s8 = fp8->create_sequence().value(), s3 = tq3->create_sequence().value();
    write_prefix(*fp8, s8, pre).throw_if_error();
    write_prefix(*tq3, s3, pre).throw_if_error();
    for (int l = 0; l < heads; ++l)
      for (int sp = 0; sp < 2; ++sp) {
        const auto& e = sp ? ev_held[std::size_t(l)] : ev_fit[std::size_t(l)];
        const std::string tail = std::string("/") + bname[b] + "/" + splits[sp];
        e.add(e.through(*fp8, s8, l), st["fold_fp8" + tail]);
        e.add(e.through(*tq3, s3, l), st["fold_tq3" + tail]);
      }
    const std::string bn = bname[b];
    diag["kept_tokens_" + bn] = kept;
    diag["kept_mass_share_" + bn] = top_mass;
    diag["fold_bound_mean_" + bn] = bound_fit;
    diag["fold_bound_mean_" + bn + "_heldout"] = bound_held;
    diag["abs_qu_minus_1_" + bn] = qu_fit;
    diag["abs_qu_minus_1_" + bn + "_heldout"] = qu_held;
    diag["beta_clipped_high_per_head_" + bn] = clipped / heads;
    diag["beta_at_lower_bound_per_head_" + bn] = lower / heads;
    diag["nnls_iterations_per_head_" + bn] = iters / heads;
  }

  std::printf(
      "compaction: %d heads x %d prefix tokens, d = %d, GQA group %d, %d-token suffix; "
      "fit on %d query tokens (%d reference queries per head), held-out on the next %d\n",
      heads, n, D, G, suffix_tokens, fit_tokens, fit_tokens * G, query_tokens - fit_tokens);
  std::printf(
      "kl: KL(full || arm) of the attention over {prefix block, suffix tokens}; err: rel. L2 "
      "of the attention output\n\n");
  std::printf("%-9s | %-22s | %-22s | %-22s | %-22s\n", "arm", "10% fit  kl / err",
              "10% held-out kl / err", "5% fit  kl / err", "5% held-out kl / err");
  const char* arms[] = {"keep", "drop", "am", "fold", "fold_fp8", "fold_tq3", "am_nv", "fold_nv"};
  tierkv::measure::report rep("compaction");
  for (const char* a : arms) {
    std::printf("%-9s", a);
    for (int b = 0; b < 2; ++b)
      for (int sp = 0; sp < 2; ++sp) {
        const auto& s = st[std::string(a) + "/" + bname[b] + "/" + splits[sp]];
        std::printf(" | %9.5f / %9.5f", s.kl_mean(), s.err());
        const std::string key = std::string(a) + "_" + bname[b] + (sp ? "_heldout" : "");
        rep.metric("kl_" + key, s.kl_mean());
        rep.metric("err_" + key, s.err());
      }
    std::printf("\n");
  }
  for (const char* a : {"full_fp8", "full_tq3"}) {
    std::printf("%-9s", a);
    for (int sp = 0; sp < 2; ++sp) {
      const auto& s = st[std::string(a) + "/-/" + splits[sp]];
      std::printf(" | %9.5f / %9.5f", s.kl_mean(), s.err());
      rep.metric(std::string("kl_") + a + (sp ? "_heldout" : ""), s.kl_mean());
      rep.metric(std::string("err_") + a + (sp ? "_heldout" : ""), s.err());
    }
    std::printf("   (uncompacted prefix, all budgets)\n");
  }
  std::printf("\n");
  for (const auto& [k, v] : diag) {
    std::printf("%-40s %.6g\n", k.c_str(), v);
    rep.metric(k, v);
  }
  std::printf("%-40s %.3f\n", "am_plus_fold_seconds_per_head", fit_seconds / (2.0 * heads));
  rep.metric("am_plus_fold_seconds_per_head", fit_seconds / (2.0 * heads));
  rep.emit();
  return 0;
}
