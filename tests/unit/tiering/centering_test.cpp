// SPDX-License-Identifier: Apache-2.0
// Centring in the host façade (options.center, centering.hpp): exact on lossless pages (outputs,
// LSE and page masses equal the uncentred cache's), far closer to float64 on FP8 + TQ3 pages
// when keys and values carry per-channel offsets, the same through reserve / write_layer as
// through append, and every refusal (soft-cap, late set_centering, bad means, NaN input, a
// refused append) leaves the means and the cache as they were.
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "catch.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/dense.hpp"

using namespace tiering_test;

namespace {

constexpr int D = tiny::head_dim, QH = tiny::q_heads;
using dense_tier = tier<dense_f32, dense_f32>;
using dense_cache = tiered_cache<tiny, tiers<dense_tier, dense_tier>>;
using quant_cache = tiered_cache<tiny, two_tiers>;

template <class Cache>
typename Cache::options options(bool center, int layers = 2) {
  typename Cache::options o;
  o.storage.num_layers = layers;
  o.storage.max_sequences = 4;
  o.storage.pages_per_tier = {64, 64};
  o.policy = policy::recency_anchor({.recent_pages = 1,
                                     .sink_pages = 0,
                                     .min_dwell_steps = 0,
                                     .keep_first_layers = 0,
                                     .keep_last_layers = 0});
  o.max_batch = 4;
  o.max_pages = 32;
  o.center = center;
  return o;
}

// Tokens [layer][token][kv_head][dim]: N(0, 1) plus a per-(layer, channel) offset of
// `offset` times N(0, 1) (the same for every token: what centring removes).
struct tokens {
  std::vector<float> k, v;
};
tokens make_tokens(int layers, int n, float offset, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> ok(std::size_t(layers) * D), ov(ok.size());
  for (auto& x : ok) x = offset * g(rng);
  for (auto& x : ov) x = offset * g(rng);
  tokens t;
  t.k.resize(std::size_t(layers) * std::size_t(n) * D);
  t.v.resize(t.k.size());
  for (int l = 0; l < layers; ++l)
    for (int i = 0; i < n; ++i)
      for (int d = 0; d < D; ++d) {
        const std::size_t at = (std::size_t(l) * std::size_t(n) + std::size_t(i)) * D + d;
        t.k[at] = ok[std::size_t(l) * D + d] + g(rng);
        t.v[at] = ov[std::size_t(l) * D + d] + g(rng);
      }
  return t;
}

std::vector<float> queries(int batch, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> q(std::size_t(batch) * QH * D);
  for (auto& x : q) x = g(rng);
  return q;
}

// float64 attention of one query row set over layer `layer` of `t` (n tokens).
std::vector<double> reference(const tokens& t, int n, int layer, const float* q) {
  std::vector<double> out, mass;
  reference_attend(
      q, n,
      [&](std::int64_t i, int, float* k, float* v) {
        const std::size_t at = (std::size_t(layer) * std::size_t(n) + std::size_t(i)) * D;
        for (int d = 0; d < D; ++d) k[d] = t.k[at + d], v[d] = t.v[at + d];
      },
      out, mass);
  return out;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

TEST_CASE("centring is exact on lossless pages: outputs, LSE and page masses",
          "[tiering][centering]") {
  const int n = 70;
  const tokens t = make_tokens(2, n, 5.f, 1);
  auto plain = dense_cache::create(options<dense_cache>(false)).value();
  auto centred = dense_cache::create(options<dense_cache>(true)).value();
  const seq_id a = plain->create_sequence().value(), b = centred->create_sequence().value();
  REQUIRE(plain->append(a, n, t.k, t.v));
  REQUIRE(centred->append(b, n, t.k, t.v));
  REQUIRE(centred->centering()->known(0));
  CHECK(centred->report().scratch > 0);
  CHECK(centred->report().reconciles());
  const auto q = queries(1, 2);
  for (int layer = 0; layer < 2; ++layer) {
    INFO("layer " << layer);
    std::vector<float> o1(q.size()), o2(q.size()), m1(32), m2(32), l1(QH), l2(QH);
    REQUIRE(plain->attend(layer, std::span(&a, 1), q, o1, m1, l1));
    REQUIRE(centred->attend(layer, std::span(&b, 1), q, o2, m2, l2));
    CHECK(max_rel_diff(o2, o1) < 1e-5);
    for (int h = 0; h < QH; ++h) CHECK(std::abs(l2[std::size_t(h)] - l1[std::size_t(h)]) < 1e-3);
    for (int p = 0; p < 5; ++p) CHECK(std::abs(m2[std::size_t(p)] - m1[std::size_t(p)]) < 1e-5);
    // and both are float64 attention over the original vectors
    const auto ref = reference(t, n, layer, q.data());
    CHECK(rel_l2(o2.data(), ref) < 1e-5);
  }
  SECTION("a sequence with no token keeps its zero output") {
    const seq_id e = centred->create_sequence().value();
    std::vector<float> o(q.size(), 7.f);
    REQUIRE(centred->attend(0, std::span(&e, 1), q, o));
    for (float x : o) REQUIRE(x == 0.f);
  }
}

TEST_CASE("centring keeps FP8 + TQ3 pages close to float64 under per-channel offsets",
          "[tiering][centering]") {
  // Keys and values with a per-channel offset 5x their per-token spread (as QK biases and
  // massive activations give real models): uncentred, the codecs spend their range and norm
  // on the offset.
  const int n = 160;  // ten pages: nine Stale (TQ3) after retier, the newest FP8
  double err[2] = {0, 0};
  for (const bool center : {false, true}) {
    for (std::uint64_t trial = 0; trial < 4; ++trial) {
      const tokens t = make_tokens(1, n, 5.f, 10 + trial);
      auto c = quant_cache::create(options<quant_cache>(center, 1)).value();
      const seq_id s = c->create_sequence().value();
      REQUIRE(c->append(s, n, t.k, t.v));
      const retier_stats st = c->retier(1);
      REQUIRE(st.demoted == 9);
      const auto q = queries(1, 100 + trial);
      std::vector<float> o(q.size());
      REQUIRE(c->attend(0, std::span(&s, 1), q, o));
      err[center] += rel_l2(o.data(), reference(t, n, 0, q.data())) / 4;
    }
  }
  INFO("decode rel. L2 vs float64: uncentred " << err[0] << ", centred " << err[1]);
  CHECK(err[1] < 0.5 * err[0]);
  CHECK(err[1] < 0.15);
  std::printf(
      "centring, offsets 5x the spread, FP8 + TQ3 (9 of 10 pages TQ3): decode rel. L2 "
      "vs float64 %.3f uncentred, %.3f centred\n",
      err[0], err[1]);
}

TEST_CASE("centring through reserve / write_layer equals centring through append",
          "[tiering][centering]") {
  const int n = 40;
  const tokens t = make_tokens(2, n, 3.f, 5);
  auto x = quant_cache::create(options<quant_cache>(true)).value();
  auto y = quant_cache::create(options<quant_cache>(true)).value();
  const seq_id a = x->create_sequence().value(), b = y->create_sequence().value();
  REQUIRE(x->append(a, n, t.k, t.v));
  REQUIRE(y->reserve(b, n));
  for (int l = 0; l < 2; ++l) {
    const std::size_t at = std::size_t(l) * std::size_t(n) * D;
    REQUIRE(y->write_layer(b, l, std::span(t.k).subspan(at, std::size_t(n) * D),
                           std::span(t.v).subspan(at, std::size_t(n) * D)));
  }
  REQUIRE(y->commit(b, n));
  const auto q = queries(1, 6);
  for (int l = 0; l < 2; ++l) {
    std::vector<float> o1(q.size()), o2(q.size());
    REQUIRE(x->attend(l, std::span(&a, 1), q, o1));
    REQUIRE(y->attend(l, std::span(&b, 1), q, o2));
    CHECK(o1 == o2);
  }
}

TEST_CASE("estimate_centering: a batch's first write estimates its means from every sequence",
          "[tiering][centering]") {
  // Two sequences whose keys and values sit at different offsets (3 and -1): the batch's means
  // are those of both (what the GPU façade's first append of the batch estimates), not the first
  // sequence's (what write_layer alone, one sequence at a time, would take).
  const int n = 32;
  const tokens t1 = make_tokens(1, n, 3.f, 5), t2 = make_tokens(1, n, -1.f, 9);
  std::vector<float> k(t1.k), v(t1.v);
  k.insert(k.end(), t2.k.begin(), t2.k.end());
  v.insert(v.end(), t2.v.begin(), t2.v.end());
  auto c = quant_cache::create(options<quant_cache>(true, 1)).value();
  const seq_id a = c->create_sequence().value(), b = c->create_sequence().value();
  REQUIRE(c->reserve(a, n));
  REQUIRE(c->reserve(b, n));
  REQUIRE(c->estimate_centering(0, k, v));
  CHECK(!c->estimate_centering(0, k, v));  // known now: nothing changes
  const std::size_t half = std::size_t(n) * D;
  REQUIRE(c->write_layer(a, 0, std::span(k).first(half), std::span(v).first(half)));
  REQUIRE(c->write_layer(b, 0, std::span(k).subspan(half), std::span(v).subspan(half)));
  const auto mu = c->centering()->keys(0);
  for (int d = 0; d < D; ++d) {
    double sum = 0;
    for (int i = 0; i < 2 * n; ++i) sum += double(k[std::size_t(i) * D + std::size_t(d)]);
    CHECK(mu[std::size_t(d)] == float(sum / double(2 * n)));
  }
  // refused without centring, for a bad layer, and for rows that are not whole tokens
  auto plain = quant_cache::create(options<quant_cache>(false, 1)).value();
  CHECK(!plain->estimate_centering(0, k, v));
  auto fresh = quant_cache::create(options<quant_cache>(true, 1)).value();
  CHECK(!fresh->estimate_centering(1, k, v));
  CHECK(!fresh->estimate_centering(0, std::span(k).first(D - 1), std::span(v).first(D - 1)));
  CHECK(!fresh->centering()->known(0));
}

TEST_CASE("centring refusals change nothing", "[tiering][centering][contract]") {
  SECTION("with a soft-cap, at create") {
    auto o = options<quant_cache>(true);
    o.soft_cap = 30.f;
    const auto c = quant_cache::create(o);
    REQUIRE(c.code() == errc::invalid_argument);
    CHECK(c.error_status().message().find("soft_cap") != std::string::npos);
  }
  SECTION("set_centering: off, bad sizes, non-finite, or after pages exist") {
    auto plain = quant_cache::create(options<quant_cache>(false)).value();
    std::vector<float> mu(D, 1.f), nan(D, 1.f), short_(D - 1, 1.f);
    nan[3] = std::nanf("");
    CHECK(plain->set_centering(0, mu, mu).code() == errc::invalid_argument);
    auto c = quant_cache::create(options<quant_cache>(true)).value();
    CHECK(c->set_centering(0, short_, mu).code() == errc::invalid_argument);
    CHECK(c->set_centering(0, mu, nan).code() == errc::non_finite_input);
    CHECK(c->set_centering(2, mu, mu).code() == errc::out_of_range);
    CHECK_FALSE(c->centering()->known(0));
    REQUIRE(c->set_centering(0, mu, mu));
    REQUIRE(c->centering()->keys(0)[5] == 1.f);
    const seq_id s = c->create_sequence().value();
    const tokens t = make_tokens(2, 20, 2.f, 7);
    REQUIRE(c->append(s, 20, t.k, t.v));
    CHECK(c->centering()->keys(0)[5] == 1.f);  // layer 0 kept the given means
    CHECK(c->centering()->known(1));           // layer 1 estimated them
    const std::vector<float> two(D, 2.f);
    CHECK(c->set_centering(1, two, two).code() == errc::invalid_argument);
    CHECK(c->centering()->keys(1)[0] != 2.f);
    REQUIRE(c->release(s));
    REQUIRE(c->set_centering(1, two, two));  // no page left
  }
  SECTION("a NaN input and a refused append estimate nothing") {
    auto o = options<quant_cache>(true);
    o.storage.pages_per_tier = {4, 4};  // 2 layers: two pages of tokens
    auto c = quant_cache::create(o).value();
    const seq_id s = c->create_sequence().value();
    tokens t = make_tokens(2, 20, 2.f, 8);
    t.k[25] = std::nanf("");
    const std::string before = cache_snapshot(*c);
    CHECK(c->append(s, 20, t.k, t.v).code() == errc::non_finite_input);
    CHECK_FALSE(c->centering()->known(0));
    const tokens big = make_tokens(2, 60, 2.f, 9);  // 4 pages a layer: tier 0 has 4 in all
    CHECK(c->append(s, 60, big.k, big.v).code() == errc::capacity_exhausted);
    CHECK_FALSE(c->centering()->known(0));
    CHECK_FALSE(c->centering()->known(1));
    CHECK(cache_snapshot(*c) == before);
    // a later append estimates from its own tokens
    const tokens ok = make_tokens(2, 20, 2.f, 10);
    REQUIRE(c->append(s, 20, ok.k, ok.v));
    double mean0 = 0;
    for (int i = 0; i < 20; ++i) mean0 += ok.k[std::size_t(i) * D];
    CHECK(std::abs(c->centering()->keys(0)[0] - mean0 / 20) < 1e-5);
  }
  SECTION("an input whose centring overflows float is refused") {
    auto c = quant_cache::create(options<quant_cache>(true, 1)).value();
    const std::vector<float> zero(D, 0.f);
    std::vector<float> mu(D, 0.f);
    mu[0] = -3e38f;
    REQUIRE(c->set_centering(0, mu, zero));
    const seq_id s = c->create_sequence().value();
    std::vector<float> k(D, 0.f), v(D, 0.f);
    k[0] = 3e38f;  // 3e38 - (-3e38) overflows
    const std::string before = cache_snapshot(*c);
    CHECK(c->append(s, 1, k, v).code() == errc::out_of_range);
    CHECK(cache_snapshot(*c) == before);
  }
}
