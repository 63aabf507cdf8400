// SPDX-License-Identifier: Apache-2.0
// The tier controller under a bit budget (tier_controller_options::bits_per_scalar_target,
// retier_planner::plan_budget): the movable pages end at or under the target, within one step of
// it, and the plan's bytes reconcile with the memory report; the pages of most attention mass
// get the better tiers; Recent, open, pinned and sink pages stay; a target under the cheapest
// tier puts every movable page there (and no sink); bad targets are refused.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "policy_knobs.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/report.hpp"
#include "tierkv/tiering/recency_anchor.hpp"

using namespace tiering_test;
using tierkv::policy::recency_anchor;

namespace {

// the Cold tier list of tiering_test_support.hpp: FP8, TQ3, TQ2
using storage_b = storage_c;
using controller_b = controller_c;

std::unique_ptr<storage_b> make_storage(int layers = 2) {
  storage_b::options o;
  o.num_layers = layers;
  o.max_sequences = 4;
  o.pages_per_tier = {64, 64, 64};
  o.codec_seed = 31;
  return std::move(storage_b::create(o).value());
}

// recent 2, sink 1, EMA weight 1 (the last observation), anchors by mass off, no dwell
recency_anchor knobs(std::uint64_t dwell = 0) {
  return recency_anchor(tierkv_test::recency_knobs(2, 1, 1.0f, 1e30f, 1e30f, dwell));
}

tier_controller_options budget(double bits) {
  tier_controller_options o;
  o.bits_per_scalar_target = bits;
  return o;
}

// Bytes of one page of tier t.
std::size_t page_bytes(const storage_b& s, int t) { return s.views()[std::size_t(t)].page_bytes; }

// Each page's tier, per layer.
std::vector<std::vector<int>> tiers_of(const storage_b& s, seq_id q, int pages, int layers) {
  std::vector<std::vector<int>> t(std::size_t(layers), std::vector<int>(std::size_t(pages), -1));
  for (int l = 0; l < layers; ++l)
    for (int p = 0; p < pages; ++p) t[l][p] = s.page(q, l, p).value().format;
  return t;
}

}  // namespace

TEST_CASE("budget: the live pages end at the target; mass decides who keeps bits",
          "[tiering][budget]") {
  const int layers = 2;
  auto s = make_storage(layers);
  const seq_id q = s->create_sequence().value();
  const auto tokens = seeds_from(500, 20 * 16 + 5);  // 20 sealed pages and an open tail
  REQUIRE(append_seeds(*s, q, tokens));
  const int pages = 21;
  // layer 0: mass rising with the page index (page 20 is open); layer 1: page 7 draws most
  std::vector<float> m0(pages), m1(pages, 0.01f);
  float sum = 0;
  for (int p = 0; p < pages; ++p) sum += (m0[p] = float(p + 1));
  for (float& x : m0) x /= sum;
  m1[7] = 1.0f - 0.01f * (pages - 1);

  for (const double target : {3.0, 3.6, 4.4, 6.0}) {
    INFO("target " << target);
    auto s2 = make_storage(layers);
    const seq_id q2 = s2->create_sequence().value();
    REQUIRE(append_seeds(*s2, q2, tokens));
    auto c = controller_b::create(*s2, knobs(), budget(target)).value();
    REQUIRE(c->observe_mass(q2, 0, m0));
    REQUIRE(c->observe_mass(q2, 1, m1));
    const auto plan = c->plan(1);
    const retier_stats st = c->apply(plan);
    CHECK(st.converted == plan.size());
    CHECK(st.failed == 0);
    REQUIRE(c->check_invariants());
    const memory_report r = make_report(*s2);
    // the plan's figure is the report's: the budget reconciles
    CHECK(c->last_budget().within);
    CHECK(c->last_budget().bytes == double(r.live_page_bytes()));
    // the movable pages (1..18: all but the sink, page 0, and the Recent window, pages 19 and
    // 20) store at most the target, and no page could take its next step: within one TQ3 ->
    // FP8 page of it
    const auto t = tiers_of(*s2, q2, pages, layers);
    const double scalars = 18.0 * 16 * layers * 2.0 * tiny::kv_heads * tiny::head_dim;
    double bytes = 0;
    for (int l = 0; l < layers; ++l)
      for (int p = 1; p < 19; ++p) bytes += double(page_bytes(*s2, t[l][p]));
    CHECK(8.0 * bytes / scalars <= target + 1e-12);
    CHECK(8.0 * bytes / scalars >
          target - 8.0 * double(page_bytes(*s2, 0) - page_bytes(*s2, 1)) / scalars);
    // Recent (pages 19, 20: the open tail and the newest sealed page) and the sink stay FP8
    for (int l = 0; l < layers; ++l) {
      CHECK(t[l][20] == 0);
      CHECK(t[l][19] == 0);
      CHECK(t[l][0] == 0);
    }
    // monotone in mass on layer 0 (pages 1..18)
    for (int p = 1; p + 1 < 19; ++p) CHECK(t[0][p] >= t[0][p + 1]);
    // layer 1: page 7 is never in a cheaper tier than another old page of layer 1
    for (int p = 1; p < 19; ++p)
      if (p != 7) CHECK(t[1][7] <= t[1][p]);
  }
  // a target under the cheapest tier: every movable page TQ2, the sinks still FP8 (an
  // unreachable budget must not code the pages every query attends to at its cheapest tier)
  auto c = controller_b::create(*s, knobs(), budget(2.0)).value();
  REQUIRE(c->apply(c->plan(1)).failed == 0);
  const memory_report r = make_report(*s);
  CHECK_FALSE(c->last_budget().within);  // TQ2 alone costs more than 2 bits
  const auto t = tiers_of(*s, q, pages, layers);
  for (int l = 0; l < layers; ++l) {
    CHECK(t[l][0] == 0);
    for (int p = 1; p < 19; ++p) CHECK(t[l][p] == 2);
  }
  CHECK(r.bits_per_scalar > 2.0);
  // a sensitive layer's pages (keep value 1e6) fill a tight budget before any other page; the
  // other layer's sink still stays FP8
  auto opt = tierkv_test::recency_knobs(2, 1, 1.0f, 1e30f, 1e30f, 0);
  opt.keep_first_layers = 1;
  auto s3 = make_storage(layers);
  const seq_id q3 = s3->create_sequence().value();
  REQUIRE(append_seeds(*s3, q3, tokens));
  auto c3 = controller_b::create(*s3, recency_anchor(opt), budget(3.0)).value();
  REQUIRE(c3->apply(c3->plan(1)).failed == 0);
  const auto t3 = tiers_of(*s3, q3, pages, layers);
  CHECK(t3[1][0] == 0);
  int cheapest = 0;
  for (int p = 1; p < 19; ++p) cheapest += t3[1][p] == 2;
  CHECK(cheapest > 0);  // the budget was tight: layer 1's other pages paid for layer 0
}

TEST_CASE("budget: pinned pages stay, and the budget holds as the sequence grows",
          "[tiering][budget]") {
  const int layers = 2;
  auto s = make_storage(layers);
  // a dwell of 3 steps: pages that just moved are charged where they are, so what they spend
  // under the target goes to the others (the budget stays filled)
  auto c = controller_b::create(*s, knobs(3), budget(3.5)).value();
  const seq_id q = s->create_sequence().value();
  const auto tokens = seeds_from(900, 30 * 16);
  REQUIRE(append_seeds(*s, q, std::vector<std::uint64_t>(tokens.begin(), tokens.begin() + 320)));
  REQUIRE(c->pin(q, 3, 1));
  std::uint64_t step = 1;
  for (std::size_t at = 320; at <= tokens.size(); at += 48) {
    if (at > 320)
      REQUIRE(append_seeds(*s, q,
                           std::vector<std::uint64_t>(tokens.begin() + std::ptrdiff_t(at - 48),
                                                      tokens.begin() + std::ptrdiff_t(at))));
    const auto plan = c->plan(step++);
    REQUIRE(c->apply(plan).failed == 0);
    REQUIRE(c->check_invariants());
    const memory_report r = make_report(*s);
    INFO(at << " tokens");
    CHECK(c->last_budget().within);
    CHECK(c->last_budget().bytes == double(r.live_page_bytes()));
    // the movable pages: every sealed page but the sink, the pinned one and the newest two
    // (Recent)
    const std::int64_t sealed = std::int64_t(at) / 16;
    double bytes = 0, scalars = 0;
    for (int l = 0; l < layers; ++l)
      for (std::int64_t p = 1; p + 2 < sealed; ++p)
        if (p != 3) {
          bytes += double(page_bytes(*s, s->page(q, l, p).value().format));
          scalars += 16.0 * 2 * tiny::kv_heads * tiny::head_dim;
        }
    CHECK(8.0 * bytes / scalars <= 3.5 + 1e-12);
    CHECK(8.0 * bytes / scalars > 3.5 - 0.25);
    for (int l = 0; l < layers; ++l) CHECK(s->page(q, l, 3).value().format == 0);  // pinned
  }
}

TEST_CASE("budget: bad targets are refused, naming the value", "[tiering][budget]") {
  auto s = make_storage();
  for (const double bad : {-1.0, 65.0, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    const auto c = controller_b::create(*s, knobs(), budget(bad));
    CHECK(c.code() == errc::invalid_argument);
    CHECK(c.error_status().message().find("bits_per_scalar_target") != std::string::npos);
  }
  CHECK(controller_b::create(*s, knobs(), budget(0.0)).has_value());  // 0: off
  auto off = controller_b::create(*s, knobs(), budget(0.0)).value();
  CHECK(off->last_budget().bytes == 0);
}

namespace {
// FP8, TQ4 keys / TQ2 values, TQ3 keys / TQ2 values (values with the keys' unbiased alpha): by
// the measured figures TQ4 / TQ2 sits above the chord of its neighbours (its TQ4 keys save less
// error per byte than the next step's 8-bit values), so a budget skips it; weighting key error
// by the model's logit scale puts it on the ladder.
using key_ladder = tiers<fp8_tier, tier<tq4_key, tq2_key>, tier<tq3_key, tq2_key>>;
using storage_k = paged_storage<tiny, key_ladder, host_allocator, failing_allocator>;
using controller_k = tier_controller<storage_k, recency_anchor, tier_roles<key_ladder, 0, 0, 1, 2>>;

std::unique_ptr<storage_k> make_storage_k(int layers, std::uint32_t pages) {
  storage_k::options so;
  so.num_layers = layers;
  so.max_sequences = 2;
  so.pages_per_tier = {pages, pages, pages};
  so.codec_seed = 31;
  return std::move(storage_k::create(so).value());
}
}  // namespace

TEST_CASE("budget: the key weight decides whether TQ4 keys / TQ2 values is on the ladder",
          "[tiering][budget]") {
  const int layers = 2, pages = 21;
  const auto tokens = seeds_from(700, 20 * 16 + 5);
  std::vector<float> mass(pages);
  float sum = 0;
  for (int p = 0; p < pages; ++p) sum += (mass[p] = float(p + 1));
  for (float& x : mass) x /= sum;
  // The tier each page ends in ([layer][page]), under a 3.0-bit budget and key weight w.
  const auto placed = [&](double w) {
    auto s = make_storage_k(layers, 64);
    const seq_id q = s->create_sequence().value();
    REQUIRE(append_seeds(*s, q, tokens));
    tier_controller_options o;
    o.bits_per_scalar_target = 3.0;
    o.budget_key_weight = w;
    auto c = controller_k::create(*s, knobs(), o).value();
    for (int l = 0; l < layers; ++l) REQUIRE(c->observe_mass(q, l, mass));
    REQUIRE(c->apply(c->plan(1)).failed == 0);
    REQUIRE(c->check_invariants());
    CHECK(c->last_budget().within);
    std::vector<std::vector<int>> t(layers, std::vector<int>(pages));
    for (int l = 0; l < layers; ++l)
      for (int p = 0; p < pages; ++p)
        t[std::size_t(l)][std::size_t(p)] = s->page(q, l, p).value().format;
    return t;
  };
  const auto count = [](const std::vector<std::vector<int>>& t, int tier) {
    int n = 0;
    for (const auto& layer : t)
      for (int p = 1; p < 19; ++p) n += layer[std::size_t(p)] == tier;  // the movable pages
    return n;
  };
  const auto measured = placed(1.0);
  CHECK(count(measured, 1) == 0);  // skipped: FP8 for the pages of most mass, TQ3 / TQ2 else
  CHECK(count(measured, 0) > 0);
  const auto keyed = placed(16.0);
  CHECK(count(keyed, 1) > 0);  // TQ4 keys for the pages of most mass first
  CHECK(count(keyed, 1) > count(keyed, 0));
  for (const auto& layer : keyed)  // monotone in mass
    for (int p = 1; p + 1 < 19; ++p) CHECK(layer[std::size_t(p)] >= layer[std::size_t(p + 1)]);

  // bad weights are refused, naming the value
  auto s = make_storage_k(1, 4);
  for (const double bad : {0.0, -2.0, 2e6, std::numeric_limits<double>::quiet_NaN()}) {
    tier_controller_options o;
    o.budget_key_weight = bad;
    const auto c = controller_k::create(*s, knobs(), o);
    CHECK(c.code() == errc::invalid_argument);
    CHECK(c.error_status().message().find("budget_key_weight") != std::string::npos);
  }
}
