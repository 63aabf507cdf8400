// SPDX-License-Identifier: Apache-2.0
// The Cold role (issue 52): tier_roles' default keeps every existing cache unchanged; the
// recency_anchor cold knobs (hysteresis, age, precedence, validation); the controller moving
// Stale pages to a TQ2 Cold tier and back by attention mass, with the content error of each
// tier against the original vectors; pressure demotions spilling into Cold once Stale is full
// (make_room and pressure_plan alike); the incremental plan against the full scan.
#include <algorithm>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "catch.hpp"
#include "incremental_run.hpp"
#include "policy_knobs.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/policies.hpp"

using namespace tiering_test;
using tierkv::policy::recency_anchor;

namespace {

// The default roles of the same list: Cold shares Stale's tier (the last).
static_assert(tier_roles<cold_tiers>::stale == 2 && tier_roles<cold_tiers>::cold == 2);
static_assert(tier_roles<two_tiers>::cold == tier_roles<two_tiers>::stale);
static_assert(cold_roles::tier_of(tier_role::recent) == 0);
static_assert(cold_roles::tier_of(tier_role::anchor) == 0);
static_assert(cold_roles::tier_of(tier_role::stale) == 1);
static_assert(cold_roles::tier_of(tier_role::cold) == 2);
static_assert(roles3::tier_of(tier_role::cold) == 2);  // tier_roles<three_tiers, 0, 1, 2>

std::unique_ptr<storage_c> make_storage(std::uint32_t t0, std::uint32_t t1, std::uint32_t t2,
                                        int layers = 2) {
  storage_c::options o;
  o.num_layers = layers;
  o.max_sequences = 8;
  o.pages_per_tier = {t0, t1, t2};
  o.codec_seed = 23;
  return std::move(storage_c::create(o).value());
}

// recent 1, sink 1, EMA weight 1 (the last observation), anchors above 4 / below 2; Cold below
// 0.5, back above 1, pages at least `after` old.
recency_anchor::options cold_knobs(int after = 0) {
  auto k = tierkv_test::recency_knobs(1, 1, 1.0f, 4.0f, 2.0f, 0);
  k.cold_enter_mass = 0.5f;
  k.cold_leave_mass = 1.0f;
  k.cold_after_pages = after;
  return k;
}

}  // namespace

TEST_CASE("cold: role names and tier_of", "[tiering][cold]") {
  CHECK(to_string(tier_role::cold) == "cold");
  CHECK(to_string(tier_role::stale) == "stale");
  CHECK(to_string(tier_role(9)) == "unknown");
  CHECK(tier_roles<two_tiers>::tier_of(tier_role(9)) == 1);  // not a role: Stale, as before
  std::ostringstream o;
  o << tier_role::cold;
  CHECK(o.str() == "cold");
}

TEST_CASE("cold: recency_anchor's cold knobs: off by default, hysteresis, age, precedence",
          "[tiering][cold][policy]") {
  page_facts f;
  f.num_layers = 4;
  f.layer = 1;
  f.position = 5;
  f.age = 7;
  f.holders = 1;
  SECTION("defaults: no mass makes a page Cold") {
    const recency_anchor p;  // tierkv's defaults
    REQUIRE(p.validate());
    CHECK(!p.cold_enabled());
    recency_anchor::page_state s;
    for (float m : {0.0f, 1e-9f, 0.3f, 3.0f, 0.0f}) {
      p.observe(s, m);
      CHECK(!s.cold);
      CHECK(p.choose(s, f) == tier_role::stale);
    }
  }
  SECTION("enter below cold_enter_mass, leave above cold_leave_mass") {
    const recency_anchor p(cold_knobs());
    REQUIRE(p.validate());
    CHECK(p.cold_enabled());
    recency_anchor::page_state s;
    CHECK(p.choose(s, f) == tier_role::stale);  // never observed: no evidence, Stale
    for (float m : {0.5f, 0.9f, 3.0f}) {        // not below 0.5
      p.observe(s, m);
      CHECK(!s.cold);
    }
    p.observe(s, 0.49f);
    CHECK(s.cold);
    CHECK(p.choose(s, f) == tier_role::cold);
    for (float m : {0.6f, 1.0f, 0.0f, 0.99f}) {  // between: stays Cold
      p.observe(s, m);
      CHECK(s.cold);
    }
    p.observe(s, std::numeric_limits<float>::quiet_NaN());  // ignored
    p.observe(s, -5.0f);                                    // ignored
    CHECK(s.cold);
    p.observe(s, 1.01f);
    CHECK(!s.cold);
    CHECK(p.choose(s, f) == tier_role::stale);
    // A spike makes an anchor; anchors and every other rule come before Cold.
    p.observe(s, 0.1f);
    CHECK(p.choose(s, f) == tier_role::cold);
    page_facts g = f;
    g.age = 0;
    CHECK(p.choose(s, g) == tier_role::recent);
    g = f;
    g.position = 0;
    CHECK(p.choose(s, g) == tier_role::anchor);
    g = f;
    g.pinned = true;
    CHECK(p.choose(s, g) == tier_role::anchor);
    p.observe(s, 5.0f);
    CHECK(s.anchored);
    CHECK(!s.cold);
    CHECK(p.choose(s, f) == tier_role::anchor);
  }
  SECTION("cold_after_pages: the newest pages are never Cold") {
    const recency_anchor p(cold_knobs(6));
    recency_anchor::page_state s;
    p.observe(s, 0.0f);
    REQUIRE(s.cold);
    f.age = 5;
    CHECK(p.choose(s, f) == tier_role::stale);
    f.age = 6;
    CHECK(p.choose(s, f) == tier_role::cold);
    // same_choice sees the age crossing; same_state_choice the flag.
    page_facts a = f, b = f;
    a.age = 5;
    CHECK(!p.same_choice(a, b));
    a.age = 9;
    CHECK(p.same_choice(a, b));
    recency_anchor::page_state t = s;
    CHECK(p.same_state_choice(s, t));
    t.cold = false;
    CHECK(!p.same_state_choice(s, t));
  }
  SECTION("cold_layers: a Cold layer's would-be Stale pages are Cold without mass") {
    auto k = tierkv_test::recency_knobs(1, 1, 1.0f, 4.0f, 2.0f, 0);  // Cold by mass off
    k.cold_layers = (std::uint64_t(1) << 1) | (std::uint64_t(1) << 63);
    k.cold_after_pages = 6;
    const recency_anchor p(k);
    REQUIRE(p.validate());
    CHECK(p.cold_enabled());
    CHECK(p.cold_layer(1));
    CHECK(p.cold_layer(63));
    CHECK(!p.cold_layer(0));
    CHECK(!p.cold_layer(2));
    CHECK(!p.cold_layer(64));  // past the mask: never Cold, no undefined shift
    CHECK(!p.cold_layer(-1));
    recency_anchor::page_state s;  // never observed: Cold all the same (the layer decides)
    CHECK(p.choose(s, f) == tier_role::cold);
    page_facts g = f;
    g.layer = 2;
    CHECK(p.choose(s, g) == tier_role::stale);
    g = f;
    g.age = 5;  // younger than cold_after_pages
    CHECK(p.choose(s, g) == tier_role::stale);
    g = f;
    g.position = 0;  // a sink: Anchor first
    CHECK(p.choose(s, g) == tier_role::anchor);
    g = f;
    g.age = 0;
    CHECK(p.choose(s, g) == tier_role::recent);
    p.observe(s, 6.0f);  // an anchor by mass: Anchor first
    CHECK(p.choose(s, f) == tier_role::anchor);
    // The knob by name, as the bindings set it (a double: bits 0-52 exactly).
    const std::vector<tierkv::policy_knob> ten = {{"cold_layers", 10.0}};
    auto named = tierkv::make_named_policy<recency_anchor>(ten);
    REQUIRE(named.has_value());
    CHECK(named->knobs().cold_layers == 10u);
    const std::vector<tierkv::policy_knob> half = {{"cold_layers", 0.5}};
    CHECK(tierkv::make_named_policy<recency_anchor>(half).error_status().code() ==
          errc::invalid_argument);
  }
  SECTION("bad knobs: invalid_argument naming the values") {
    auto k = cold_knobs();
    k.cold_leave_mass = 0.25f;  // below cold_enter_mass
    status st = recency_anchor(k).validate();
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("cold_leave_mass = 0.25") != std::string::npos);
    k = cold_knobs();
    k.cold_enter_mass = -1.0f;
    CHECK(recency_anchor(k).validate().code() == errc::invalid_argument);
    k = cold_knobs();
    k.cold_leave_mass = 3.0f;  // above leave_mass: a page could be Cold and an anchor
    st = recency_anchor(k).validate();
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("leave_mass = 2") != std::string::npos);
    k = cold_knobs();
    k.cold_enter_mass = std::numeric_limits<float>::quiet_NaN();
    CHECK(recency_anchor(k).validate().code() == errc::invalid_argument);
    k = cold_knobs();
    k.cold_after_pages = -1;
    st = recency_anchor(k).validate();
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("cold_after_pages = -1") != std::string::npos);
    auto s = make_storage(8, 8, 8);
    CHECK(controller_c::create(*s, recency_anchor(k)).code() == errc::invalid_argument);
  }
}

TEST_CASE(
    "cold: low-mass pages move Stale -> Cold (TQ2) and back; content within each codec's band",
    "[tiering][cold][controller]") {
  auto s = make_storage(32, 32, 32);
  auto c = controller_c::create(*s, recency_anchor(cold_knobs(2))).value();
  const seq_id q = s->create_sequence().value();
  const auto tokens = seeds_from(100, 104);  // 6 sealed pages + an open tail (7 pages)
  REQUIRE(append_seeds(*s, q, tokens));
  // No mass yet: pages 1..5 leave tier 0 for Stale (page 0 is a sink, page 6 recent).
  auto plan = c->plan(1);
  REQUIRE(plan.size() == 10);
  for (const conversion& m : plan) CHECK(m.to == 1);
  REQUIRE(c->apply(plan).converted == 10);
  // Layer 0: pages 1, 2 and 5 draw little attention (0.35x a uniform share), the rest the
  // remainder; layer 1 uniform. Page 5 is only 1 page old: not Cold (cold_after_pages = 2).
  std::vector<float> mass(7, 0.05f);
  for (int i : {0, 3, 4, 6}) mass[std::size_t(i)] = (1.0f - 3 * 0.05f) / 4;
  REQUIRE(c->observe_mass(q, 0, mass));
  REQUIRE(c->observe_mass(q, 1, std::vector<float>(7, 1.0f / 7)));
  plan = c->plan(2);
  REQUIRE(plan.size() == 2);
  for (const conversion& m : plan) {
    CHECK(m.layer == 0);
    CHECK(m.from == 1);
    CHECK(m.to == 2);
  }
  CHECK(plan[0].block == s->block_of(q, 1).value());
  CHECK(plan[1].block == s->block_of(q, 2).value());
  REQUIRE(c->apply(plan).converted == 2);
  REQUIRE(c->check_invariants());
  CHECK(s->page(q, 0, 1).value().format == 2);
  CHECK(s->page(q, 0, 2).value().format == 2);
  CHECK(s->page(q, 0, 5).value().format == 1);
  CHECK(s->page(q, 1, 1).value().format == 1);
  // Content: Cold pages decode within TQ2's band (a TQ3 -> TQ2 conversion decodes the TQ3
  // page and encodes it again: TQ3's error plus TQ2's), Stale within TQ3's.
  const double tq2_mean = codec_error_traits<tq2_key>::rel_mse + tq3_page_bound;
  for (std::int64_t p : {1, 2}) {
    const page_error e = page_error_of(*s, q, 0, p, tokens);
    CHECK(e.finite);
    CHECK(e.mean < 1.3 * tq2_mean);
    CHECK(e.mean > codec_error_traits<tq3_key>::rel_mse);  // lossier than Stale: really TQ2
    CHECK(e.max < 0.5);
  }
  for (std::int64_t p : {3, 4, 5}) {
    const page_error e = page_error_of(*s, q, 0, p, tokens);
    CHECK(e.mean < tq3_page_bound);
    CHECK(e.max < tq3_vector_bound);
  }
  // Page 1's mass rises between the thresholds: it stays Cold; above cold_leave_mass it goes
  // back to Stale (re-encoded from its Cold codes); far above, to tier 0 as an anchor.
  mass[1] = 0.7f / 7;  // 0.7x
  REQUIRE(c->observe_mass(q, 0, mass));
  CHECK(c->plan(3).empty());
  mass[1] = 1.5f / 7;  // 1.5x
  REQUIRE(c->observe_mass(q, 0, mass));
  plan = c->plan(4);
  REQUIRE(plan.size() == 1);
  CHECK(plan[0].from == 2);
  CHECK(plan[0].to == 1);
  REQUIRE(c->apply(plan).converted == 1);
  mass[2] = 0.8f;  // 5.6x
  REQUIRE(c->observe_mass(q, 0, mass));
  plan = c->plan(5);
  REQUIRE(plan.size() == 1);
  CHECK(plan[0].from == 2);
  CHECK(plan[0].to == 0);
  REQUIRE(c->apply(plan).promoted == 1);
  CHECK(page_error_of(*s, q, 0, 2, tokens).finite);
  REQUIRE(c->check_invariants());
}

TEST_CASE("cold: the default knobs leave a Cold tier empty (existing caches are unchanged)",
          "[tiering][cold][controller]") {
  auto s = make_storage(32, 32, 32);
  auto c = controller_c::create(
               *s, recency_anchor(tierkv_test::recency_knobs(1, 1, 1.0f, 4.0f, 2.0f, 0)))
               .value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 104)));
  std::vector<float> mass(7, 0.0f);
  mass[0] = 1.0f;  // every other page gets nothing
  for (std::uint64_t step = 1; step <= 4; ++step) {
    REQUIRE(c->observe_mass(q, 0, mass));
    REQUIRE(c->observe_mass(q, 1, mass));
    for (const conversion& m : c->plan(step)) CHECK(m.to != 2);
    c->retier(step);
  }
  CHECK(s->free_pages(2) == 32);
  REQUIRE(c->check_invariants());
}

TEST_CASE("cold: pressure demotions spill into Cold once Stale is full; pressure_plan agrees",
          "[tiering][cold][controller]") {
  struct setup {
    std::unique_ptr<storage_c> s;
    std::unique_ptr<controller_c> c;
    seq_id q;
  };
  // Tier 0 holds 12 pages, Stale 1, Cold 4. 5 pages x 2 layers fill 10 of tier 0. Knobs: no
  // page leaves tier 0 by itself (everything Recent), so only pressure moves pages.
  auto make = [] {
    auto s = make_storage(12, 1, 4);
    auto k = cold_knobs();
    k.recent_pages = 100;
    auto c = controller_c::create(*s, recency_anchor(k)).value();
    const seq_id q = s->create_sequence().value();
    REQUIRE(append_seeds(*s, q, seeds_from(1, 80)));
    REQUIRE(c->plan(1).empty());
    return setup{std::move(s), std::move(c), q};
  };
  auto [s1, c1, q1] = make();
  auto [s2, c2, q2] = make();
  // 5 free pages needed, 2 free: three demotions, the first into Stale, the others into Cold.
  REQUIRE(c1->make_room(5));
  CHECK(s1->free_pages(0) == 5);
  CHECK(s1->free_pages(1) == 0);
  CHECK(s1->free_pages(2) == 2);
  CHECK(c1->totals().pressure_demoted == 3);
  REQUIRE(c1->check_invariants());
  auto todo = c2->pressure_plan(5);
  REQUIRE(todo.has_value());
  REQUIRE(todo->size() == 3);
  CHECK((*todo)[0].to == 1);
  CHECK((*todo)[1].to == 2);
  CHECK((*todo)[2].to == 2);
  std::vector<staged_conversion> staged(todo->size());
  retier_stats st;
  REQUIRE(c2->stage(*todo, std::span<staged_conversion>(staged), st) == 3);
  bool filled[3];
  for (int i = 0; i < 3; ++i) {
    conversion_counters cc;
    filled[i] = fill_conversion_on_host(*s2, staged[std::size_t(i)], cc).is_ok();
  }
  c2->commit(std::span<staged_conversion>(staged), std::span<const bool>(filled, 3), st);
  for (int t = 0; t < 3; ++t) CHECK(s2->free_pages(t) == s1->free_pages(t));
  for (int l = 0; l < 2; ++l)
    for (std::int64_t i = 0; i < 5; ++i) {
      CHECK(s2->page(q2, l, i).value().format == s1->page(q1, l, i).value().format);
      CHECK(bytes_of(*s2, s2->page(q2, l, i).value()) == bytes_of(*s1, s1->page(q1, l, i).value()));
    }
  // Stale full, 2 Cold pages left: 3 more demotions cannot be had; nothing changes, and the
  // message names both tiers.
  const std::uint32_t free0 = s1->free_pages(0);
  const status refused = c1->make_room(free0 + 3);
  CHECK(refused.code() == errc::capacity_exhausted);
  CHECK(refused.message().find("Stale and Cold") != std::string::npos);
  CHECK(refused.message().find("nothing was changed") != std::string::npos);
  CHECK(s1->free_pages(0) == free0);
  CHECK(s1->free_pages(2) == 2);
  CHECK(c2->pressure_plan(free0 + 3).code() == errc::capacity_exhausted);
  REQUIRE(c1->check_invariants());
  REQUIRE(c2->check_invariants());
}

TEST_CASE("cold: the incremental plan equals the full scan with a Cold tier",
          "[tiering][cold][controller]") {
  auto k = tierkv_test::recency_knobs(2, 1, 0.5f, 2.0f, 1.0f, 2);
  k.cold_enter_mass = 0.6f;
  k.cold_leave_mass = 0.9f;
  k.cold_after_pages = 3;
  tier_controller_options full_opt;
  full_opt.incremental_plan = false;
  auto s1 = make_storage(60, 120, 120, 3);
  auto s2 = make_storage(60, 120, 120, 3);
  auto c1 = controller_c::create(*s1, recency_anchor(k)).value();
  auto c2 = controller_c::create(*s2, recency_anchor(k), full_opt).value();
  CHECK(incremental_equals_full_run(*s1, *s2, *c1, *c2, 11) > 200);
  CHECK(s1->free_pages(2) < 120);  // the run used the Cold tier
}

TEST_CASE("cold: a tiered_cache with a Cold tier attends over all three formats",
          "[tiering][cold][cache]") {
  using cache_c =
      tiered_cache<tiny, cold_tiers, recency_anchor, host_allocator, host_allocator, cold_roles>;
  cache_c::options o;
  o.storage.num_layers = 2;
  o.storage.max_sequences = 2;
  o.storage.pages_per_tier = {32, 32, 32};
  o.max_pages = 16;
  o.policy = recency_anchor(cold_knobs(3));
  auto c = cache_c::create(o).value();
  const seq_id q = c->create_sequence().value();
  REQUIRE(append_tokens(*c, q, 1, 120));  // 8 pages (7 sealed); token t has seed 1 + t
  // Each query head points at its KV head's key of token 40 (page 2): page 2 takes nearly all
  // the mass and becomes an Anchor; the other pages at least 3 pages old fall below half a
  // uniform share and go Cold; pages 5 and 6 stay Stale (too new), page 7 is Recent.
  std::vector<float> query(std::size_t(tiny::q_heads) * tiny::head_dim), out(query.size());
  const auto point_at = [&](int layer) {
    for (int h = 0; h < tiny::q_heads; ++h)
      for (int d = 0; d < tiny::head_dim; ++d)
        query[std::size_t(h * tiny::head_dim + d)] =
            3.0f * gauss(41, layer, h / tiny::group_size, 0, d);
  };
  std::vector<float> page_mass(16);
  for (std::uint64_t step = 1; step <= 3; ++step) {
    for (int l = 0; l < 2; ++l) {
      point_at(l);
      REQUIRE(c->attend(l, {&q, 1}, query, out, page_mass));
    }
    c->retier(step);
  }
  for (int l = 0; l < 2; ++l) {
    CHECK(c->storage().page(q, l, 0).value().format == 0);  // the sink
    CHECK(c->storage().page(q, l, 2).value().format == 0);  // the anchor
    for (std::int64_t p : {1, 3, 4}) CHECK(c->storage().page(q, l, p).value().format == 2);
    for (std::int64_t p : {5, 6}) CHECK(c->storage().page(q, l, p).value().format == 1);
    CHECK(c->storage().page(q, l, 7).value().format == 0);
  }
  const memory_report r = c->report();
  REQUIRE(r.tiers.size() == 3);
  CHECK(r.tiers[0].live_pages == 6);
  CHECK(r.tiers[1].live_pages == 4);
  CHECK(r.tiers[2].live_pages == 6);
  CHECK(r.tiers[2].name == "tq2_key / tq2_value");
  CHECK(r.tiers[2].bits_per_scalar == Approx(2.25));
  // bits over every live page (the open one counted whole): 6 FP8, 4 TQ3, 6 TQ2 pages of 16
  // slots, over 120 tokens x 2 layers
  const double bits = (6.0 * 16 * 8.25 + 4.0 * 16 * 3.25 + 6.0 * 16 * 2.25) / 240.0;
  CHECK(r.bits_per_scalar == Approx(bits).epsilon(1e-9));
  REQUIRE(c->check_invariants());
  // The output against float64 attention over the pages as stored (decoded): the math is exact.
  for (int l = 0; l < 2; ++l) {
    REQUIRE(c->attend(l, {&q, 1}, query, out));
    std::vector<double> ref, mass;
    reference_attend(
        query.data(), 120,
        [&](std::int64_t t, int h, float* k, float* v) {
          REQUIRE(c->storage().read_token(q, l, t, h, k, v));
        },
        ref, mass);
    CHECK(rel_l2(out.data(), ref) < 1e-5);
  }
}
