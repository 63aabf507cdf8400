// SPDX-License-Identifier: Apache-2.0
// The host façade's step verbs (begin_step / append / decode / prefill / end_step, the GPU
// façade's names) against the same steps through reserve / write_layer / prefill / commit /
// retier: bit-identical outputs and the same tiers, centred, over prefill chunks and decode
// steps; refusals name the value and leave the cache as it was.
#include <cstdint>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/cache.hpp"

using namespace tiering_test;

namespace {

using cache_t =
    tiered_cache<tiny, two_tiers, policy::recency_anchor, host_allocator, failing_allocator>;
constexpr std::size_t kv_row = std::size_t(tiny::kv_heads) * tiny::head_dim;
constexpr std::size_t q_row = std::size_t(tiny::q_heads) * tiny::head_dim;

std::unique_ptr<cache_t> make_cache(std::uint32_t tier0_pages = 80) {
  cache_t::options opt;
  opt.storage.num_layers = 2;
  opt.storage.max_sequences = 4;
  opt.storage.pages_per_tier = {tier0_pages, 80};
  opt.storage.codec_seed = 7;
  opt.policy = policy::recency_anchor({.recent_pages = 2,
                                       .sink_pages = 1,
                                       .min_dwell_steps = 0,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  opt.max_batch = 4;
  opt.max_pages = 32;
  opt.center = true;
  return std::move(cache_t::create(opt).value());
}

// The tier of each page of s at one layer.
std::vector<int> tiers_of(const cache_t& c, seq_id s, int layer) {
  std::vector<int> t;
  c.storage().for_each_page(s, layer, [&](std::int64_t, page_id p) { t.push_back(int(p.format)); });
  return t;
}

std::vector<float> randn(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> d;
  std::vector<float> x(n);
  for (auto& e : x) e = d(rng);
  return x;
}

}  // namespace

TEST_CASE("step verbs: the same steps as reserve / write_layer / prefill / commit / retier",
          "[tiering][cache][steps]") {
  auto a = make_cache();  // step verbs
  auto b = make_cache();  // the finer calls
  const std::vector<seq_id> sa{a->create_sequence().value(), a->create_sequence().value()};
  const std::vector<seq_id> sb{b->create_sequence().value(), b->create_sequence().value()};
  std::mt19937_64 rng(3);
  std::uint64_t planned = 0;
  for (std::uint64_t step = 1; step <= 14; ++step) {
    // three prefill chunks of uneven lengths, then decode steps
    const std::vector<std::int32_t> n =
        step <= 3 ? std::vector<std::int32_t>{37, 21} : std::vector<std::int32_t>{1, 1};
    const std::size_t tokens = std::size_t(n[0] + n[1]);
    const std::vector<std::int32_t> indptr{0, n[0], n[0] + n[1]};
    REQUIRE(a->begin_step(sa, n));
    for (std::size_t i = 0; i < 2; ++i) REQUIRE(b->reserve(sb[i], n[i]));
    for (int layer = 0; layer < 2; ++layer) {
      const auto k = randn(rng, tokens * kv_row), v = randn(rng, tokens * kv_row);
      const auto q = randn(rng, tokens * q_row);
      REQUIRE(a->append(layer, k, v));
      (void)b->estimate_centering(layer, k, v);
      for (std::size_t i = 0; i < 2; ++i) {
        const std::size_t first = std::size_t(indptr[i]) * kv_row;
        const std::size_t len = std::size_t(n[i]) * kv_row;
        REQUIRE(b->write_layer(sb[i], layer, std::span<const float>(k).subspan(first, len),
                               std::span<const float>(v).subspan(first, len)));
      }
      std::vector<float> oa(q.size()), ob(q.size()), la(tokens * tiny::q_heads), lb(la.size());
      if (step <= 3)
        REQUIRE(a->prefill(layer, q, oa, la));
      else
        REQUIRE(a->decode(layer, q, oa, la));
      REQUIRE(b->prefill(layer, sb, indptr, q, ob, lb));
      CHECK(oa == ob);
      CHECK(la == lb);
    }
    const auto stats = a->end_step(step);
    REQUIRE(stats.has_value());
    for (std::size_t i = 0; i < 2; ++i) REQUIRE(b->commit(sb[i], n[i]));
    const retier_stats sbs = b->retier(step);
    CHECK(stats->converted == sbs.converted);
    planned += sbs.planned;
    for (std::size_t i = 0; i < 2; ++i)
      for (int layer = 0; layer < 2; ++layer) {
        CHECK(*a->length(sa[i]) == *b->length(sb[i]));
        CHECK(tiers_of(*a, sa[i], layer) == tiers_of(*b, sb[i], layer));
      }
  }
  CHECK(planned > 0);  // pages moved tiers along the way, the same ones on both
  REQUIRE(a->check_invariants());
}

TEST_CASE("step verbs: refusals name the value and change nothing", "[tiering][cache][steps]") {
  auto c = make_cache(6);  // tier 0 holds 6 pages of a layer
  const seq_id s0 = c->create_sequence().value(), s1 = c->create_sequence().value();
  const std::vector<seq_id> batch{s0, s1};
  std::vector<float> none;
  CHECK(c->append(0, none, none).message().find("no step is open") != std::string::npos);
  CHECK(c->decode(0, none, none).message().find("no step is open") != std::string::npos);
  CHECK_FALSE(c->end_step(1).has_value());
  const std::int32_t two[] = {2, 1}, neg[] = {1, -1}, one[] = {1};
  CHECK(c->begin_step(batch, one).message().find("2 sequences but 1 token counts") !=
        std::string::npos);
  CHECK(c->begin_step(batch, neg).message().find("new_tokens[1] = -1") != std::string::npos);
  const std::vector<seq_id> twice{s0, s0};
  CHECK(c->begin_step(twice, two).message().find("in the batch twice") != std::string::npos);
  // all or none: the second sequence's reservation cannot be had, the first's is given back
  const std::int32_t big[] = {16, 200};
  const status refused = c->begin_step(batch, big);
  CHECK_FALSE(refused.is_ok());
  CHECK(*c->reserved(s0) == 0);
  CHECK(*c->reserved(s1) == 0);
  REQUIRE(c->begin_step(batch, two));
  CHECK(c->begin_step(batch, two).message().find("a step is open") != std::string::npos);
  std::vector<float> k(3 * kv_row, 0.5f), small(kv_row);
  CHECK(c->append(0, small, small).message().find("need " + std::to_string(3 * kv_row)) !=
        std::string::npos);
  REQUIRE(c->append(0, k, k));
  std::vector<float> q(2 * q_row, 0.1f), out(q.size());
  CHECK(c->decode(0, q, out).message().find("added 2 tokens this step") != std::string::npos);
  std::vector<float> q3(3 * q_row, 0.1f), out3(q3.size());
  REQUIRE(c->prefill(0, q3, out3));
  REQUIRE(c->append(1, k, k));
  REQUIRE(c->end_step(1).has_value());
  CHECK(*c->length(s0) == 2);
  CHECK(*c->length(s1) == 1);
  REQUIRE(c->check_invariants());
}
