// SPDX-License-Identifier: Apache-2.0
// attention_match against float64 recomputations: exact at a 100% budget, the NNLS bias beats
// no bias on the fitted mass objective, refit values beat the original ones on the output,
// and adversarial inputs are refused with the value and the limit named.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "compaction_data.hpp"
#include "tierkv/compaction/attention_matching.hpp"
#include "tierkv/compaction/biased_attention.hpp"

using namespace tierkv;
using namespace tierkv::compaction;
using namespace compaction_test;

namespace {

head_data view(const head_set& h) { return {h.k, h.v, h.q, h.d}; }

// Float64 outputs of the full head and of the compaction, on the reference queries.
struct outputs {
  std::vector<double> full, comp, comp_lse, full_lse;
};
outputs attend_both(const head_set& h, const head_compaction& c) {
  outputs o;
  const double scale = 1.0 / std::sqrt(double(h.d));
  o.full.resize(h.q.size());
  o.comp.resize(h.q.size());
  o.full_lse.resize(std::size_t(h.nq));
  o.comp_lse.resize(std::size_t(h.nq));
  REQUIRE(biased_attention(h.q, h.k, h.v, {}, h.d, scale, o.full, o.full_lse));
  REQUIRE(biased_attention(h.q, c.keys, c.values, c.beta, h.d, scale, o.comp, o.comp_lse));
  return o;
}

// ||A B - Z|| / ||Z|| recomputed from the kept keys and beta (independent of the fit's arrays).
double mass_error(const head_set& h, const head_compaction& c, bool with_bias) {
  const double scale = 1.0 / std::sqrt(double(h.d));
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < h.nq; ++i) {
    std::vector<double> s(static_cast<std::size_t>(h.n));
    double mx = -1e300;
    for (std::int64_t j = 0; j < h.n; ++j) {
      double dot = 0;
      for (int k = 0; k < h.d; ++k)
        dot += double(h.q[std::size_t(i * h.d + k)]) * h.k[std::size_t(j * h.d + k)];
      mx = std::max(mx, s[std::size_t(j)] = scale * dot);
    }
    double z = 0, zc = 0;
    for (double x : s) z += std::exp(x - mx);
    for (std::size_t a = 0; a < c.kept.size(); ++a)
      zc += std::exp(s[std::size_t(c.kept[a])] - mx + (with_bias ? double(c.beta[a]) : 0.0));
    num += (zc - z) * (zc - z);
    den += z * z;
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("attention_match at a 100% budget is exact on the reference queries",
          "[compaction][am]") {
  for (std::uint64_t seed : {1u, 2u}) {
    const auto h = seed == 1 ? gaussian(16, 48, 160, seed) : structured(16, 48, 160, seed);
    am_options o;
    o.budget = 1.0;
    auto c = attention_match(view(h), o);
    REQUIRE(c);
    REQUIRE(c->size() == 48);
    for (std::int64_t j = 0; j < 48; ++j) CHECK(c->kept[std::size_t(j)] == j);
    for (float b : c->beta) CHECK(std::abs(b) < 1e-6f);
    CHECK(c->mass_error < 1e-9);
    CHECK(c->output_error < 1e-5);
    const auto o2 = attend_both(h, *c);
    CHECK(rel_l2(o2.comp, o2.full) < 1e-5);
    for (std::size_t i = 0; i < o2.full_lse.size(); ++i)
      CHECK(std::abs(o2.comp_lse[i] - o2.full_lse[i]) < 1e-6);
  }
}

TEST_CASE("attention_match: NNLS bias beats no bias on the mass, refit values beat originals",
          "[compaction][am]") {
  for (int kind = 0; kind < 2; ++kind) {
    const auto h = kind == 0 ? gaussian(32, 400, 300, 7, 1.5) : structured(32, 400, 300, 8);
    for (double budget : {0.1, 0.05}) {
      INFO("data " << (kind ? "structured" : "gaussian") << " budget " << budget);
      am_options o;
      o.budget = budget;
      auto am = attention_match(view(h), o);
      REQUIRE(am);
      CHECK(am->size() == std::int64_t(std::ceil(budget * 400)));
      CHECK(am->nnls_kkt_violation < 1e-6);
      for (float b : am->beta) {
        CHECK(b >= -3.0f);
        CHECK(b <= 3.0f);
      }
      // The fit's reported objective is the recomputed one, and it beats B = 1.
      CHECK(std::abs(mass_error(h, *am, true) - am->mass_error) < 1e-6 * (1 + am->mass_error));
      CHECK(std::abs(mass_error(h, *am, false) - am->mass_error_no_bias) < 1e-6);
      CHECK(am->mass_error < am->mass_error_no_bias);
      // Refit values: lower output error than the kept tokens' own values, as recomputed.
      CHECK(am->output_error < am->output_error_original);
      const auto oa = attend_both(h, *am);
      CHECK(std::abs(rel_l2(oa.comp, oa.full) - am->output_error) < 1e-4);
      // Keep (no bias, original values) and drop (no bias, refit) on the same selection.
      am_options ok = o, od = o;
      ok.fit_bias = ok.refit_values = false;
      od.fit_bias = false;
      auto keep = attention_match(view(h), ok);
      auto drop = attention_match(view(h), od);
      REQUIRE(keep);
      REQUIRE(drop);
      CHECK(keep->kept == am->kept);
      CHECK(drop->kept == am->kept);
      for (float b : drop->beta) CHECK(b == 0.f);
      const auto ok2 = attend_both(h, *keep), od2 = attend_both(h, *drop);
      CHECK(rel_l2(od2.comp, od2.full) < rel_l2(ok2.comp, ok2.full));
      CHECK(rel_l2(oa.comp, oa.full) < rel_l2(ok2.comp, ok2.full));
      // The biased LSE tracks the full one better than without the bias.
      double e_am = 0, e_keep = 0;
      for (std::size_t i = 0; i < oa.full_lse.size(); ++i) {
        e_am += std::abs(oa.comp_lse[i] - oa.full_lse[i]);
        e_keep += std::abs(ok2.comp_lse[i] - ok2.full_lse[i]);
      }
      CHECK(e_am < e_keep);
    }
  }
}

TEST_CASE("attention_match: a wide beta range keeps B >= 0 at the NNLS optimum",
          "[compaction][am]") {
  const auto h = structured(32, 300, 200, 11);
  am_options o;
  o.budget = 0.1;
  o.beta_max = 30;
  auto c = attention_match(view(h), o);
  REQUIRE(c);
  for (float b : c->beta) CHECK(std::isfinite(b));
  CHECK(c->nnls_kkt_violation < 1e-6);
  CHECK(c->clipped_high == 0);
  am_options o3 = o;
  o3.beta_max = 3;
  auto c3 = attention_match(view(h), o3);
  REQUIRE(c3);
  CHECK(c->mass_error <= c3->mass_error + 1e-12);  // the wider box can only fit better
}

TEST_CASE("attention_match handles n = 1 and zero-norm queries", "[compaction][am]") {
  auto h = gaussian(8, 1, 5, 3);
  auto c = attention_match(view(h), {});
  REQUIRE(c);
  REQUIRE(c->size() == 1);
  CHECK(std::abs(c->beta[0]) < 1e-6f);
  CHECK(c->output_error < 1e-6);
  auto z = gaussian(16, 64, 40, 4);
  for (int i = 0; i < 10 * 16; ++i) z.q[std::size_t(i)] = 0.f;  // the first 10 queries are zero
  auto cz = attention_match(view(z), {});
  REQUIRE(cz);
  CHECK(std::isfinite(cz->mass_error));
  CHECK(std::isfinite(cz->output_error));
  for (float v : cz->values) CHECK(std::isfinite(v));
}

TEST_CASE("attention_match refuses bad input, naming the value and the limit", "[compaction][am]") {
  auto h = gaussian(16, 10, 8, 5);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto expect = [](const result<head_compaction>& r, errc code, const char* text) {
    REQUIRE(!r);
    CHECK(r.error_status().code() == code);
    INFO(r.error_status().message());
    CHECK(r.error_status().message().find(text) != std::string::npos);
  };
  {
    auto b = h;
    b.k[3 * 16 + 5] = nan;
    expect(attention_match(view(b), {}), errc::non_finite_input, "keys[3][5]");
  }
  {
    auto b = h;
    b.q[7 * 16 + 2] = std::numeric_limits<float>::infinity();
    expect(attention_match(view(b), {}), errc::non_finite_input, "queries[7][2]");
  }
  {
    auto b = h;
    b.v[0] = nan;
    expect(attention_match(view(b), {}), errc::non_finite_input, "values[0][0]");
  }
  am_options o;
  o.budget = 0;
  expect(attention_match(view(h), o), errc::out_of_range, "budget = 0 is outside (0, 1]");
  o.budget = 1.5;
  expect(attention_match(view(h), o), errc::out_of_range, "budget = 1.5 is outside (0, 1]");
  o = {};
  o.keep = 11;
  expect(attention_match(view(h), o), errc::out_of_range, "keep = 11 is outside [1, n = 10]");
  o.keep = -1;
  expect(attention_match(view(h), o), errc::out_of_range, "keep = -1");
  o = {};
  o.beta_max = 0;
  expect(attention_match(view(h), o), errc::invalid_argument, "beta_max = 0");
  head_data bad = view(h);
  bad.queries = {};
  expect(attention_match(bad, {}), errc::invalid_argument, "n_q = 0");
  bad = view(h);
  bad.keys = {};
  bad.values = {};
  expect(attention_match(bad, {}), errc::invalid_argument, "n = 0");
  bad = view(h);
  bad.head_dim = 0;
  expect(attention_match(bad, {}), errc::invalid_argument, "head_dim = 0");
  bad = view(h);
  bad.values = bad.values.subspan(0, 16 * 9);
  expect(attention_match(bad, {}), errc::invalid_argument, "9 value rows for 10 key rows");
}

TEST_CASE("am_prepare: one first pass serves every arm and budget, bit for bit",
          "[compaction][am]") {
  const auto h = structured(32, 300, 240, 21);
  const double scale = 1.0 / std::sqrt(32.0);
  auto ref = am_prepare(view(h));
  REQUIRE(ref);
  CHECK(ref->n == 300);
  CHECK(ref->n_q == 240);
  CHECK(ref->softmax_scale == scale);
  // Its arrays against float64 recomputations: the full mass and output of each query, the
  // selection score (attention summed over the queries).
  std::vector<double> score(300, 0.0);
  double worst_z = 0, worst_y = 0;
  for (std::int64_t i = 0; i < h.nq; ++i) {
    std::vector<double> s(300);
    double mx = -1e300;
    for (std::size_t j = 0; j < 300; ++j) {
      double dot = 0;
      for (int k = 0; k < 32; ++k)
        dot += double(h.q[std::size_t(i * 32 + k)]) * h.k[j * 32 + std::size_t(k)];
      mx = std::max(mx, s[j] = scale * dot);
    }
    double z = 0;
    for (double x : s) z += std::exp(x - mx);
    CHECK(ref->m[std::size_t(i)] == Approx(mx).epsilon(1e-12));
    worst_z = std::max(worst_z, std::abs(ref->Z[std::size_t(i)] - z) / z);
    for (int k = 0; k < 32; ++k) {
      double y = 0;
      for (std::size_t j = 0; j < 300; ++j)
        y += std::exp(s[j] - mx) / z * h.v[j * 32 + std::size_t(k)];
      worst_y = std::max(worst_y, std::abs(ref->Y[std::size_t(i * 32 + k)] - y));
    }
    for (std::size_t j = 0; j < 300; ++j) score[j] += std::exp(s[j] - mx) / z;
  }
  CHECK(worst_z < 1e-10);
  CHECK(worst_y < 1e-10);
  for (std::size_t j = 0; j < 300; ++j) CHECK(ref->score[j] == Approx(score[j]).epsilon(1e-10));
  // Every arm and budget from the shared pass equals the one-call result exactly.
  for (double budget : {0.1, 0.05, 1.0})
    for (int arm = 0; arm < 4; ++arm) {
      am_options o;
      o.budget = budget;
      o.fit_bias = arm == 0 || arm == 3;
      o.refit_values = arm != 2;
      if (arm == 3) o.beta_max = 1.0;
      INFO("budget " << budget << " arm " << arm);
      auto a = attention_match(view(h), *ref, o);
      auto b = attention_match(view(h), o);
      REQUIRE(a);
      REQUIRE(b);
      CHECK(a->kept == b->kept);
      CHECK(a->keys == b->keys);
      CHECK(a->values == b->values);
      CHECK(a->beta == b->beta);
      CHECK(a->mass_error == b->mass_error);
      CHECK(a->output_error == b->output_error);
    }
}

TEST_CASE("attention_match refuses a reference prepared for another head or scale",
          "[compaction][am]") {
  const auto h = gaussian(16, 40, 30, 31);
  auto ref = am_prepare(view(h));
  REQUIRE(ref);
  auto expect_refused = [](const result<head_compaction>& r) {
    REQUIRE(!r);
    CHECK(r.error_status().code() == errc::invalid_argument);
    INFO(r.error_status().message());
    CHECK(r.error_status().message().find("the reference was prepared for 40 tokens, 30 "
                                          "queries") != std::string::npos);
  };
  head_data fewer_keys = view(h);
  fewer_keys.keys = fewer_keys.keys.subspan(0, 16 * 39);
  fewer_keys.values = fewer_keys.values.subspan(0, 16 * 39);
  expect_refused(attention_match(fewer_keys, *ref, {}));
  head_data fewer_queries = view(h);
  fewer_queries.queries = fewer_queries.queries.subspan(0, 16 * 29);
  expect_refused(attention_match(fewer_queries, *ref, {}));
  am_options other_scale;
  other_scale.softmax_scale = 0.5f;
  expect_refused(attention_match(view(h), *ref, other_scale));
  // am_prepare refuses what attention_match refuses.
  auto bad = h;
  bad.q[2 * 16 + 3] = std::numeric_limits<float>::quiet_NaN();
  auto r = am_prepare(view(bad));
  REQUIRE(!r);
  CHECK(r.error_status().code() == errc::non_finite_input);
  CHECK(r.error_status().message().find("queries[2][3]") != std::string::npos);
}
