// SPDX-License-Identifier: Apache-2.0
// The façade's contracts as an engine relies on them (issue 24): every option is checked at
// creation, and a refused operation changes nothing an engine can observe (report, page
// tables, refcounts, pool counts, controller totals), even under memory pressure.
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/cache.hpp"

using namespace tiering_test;

namespace {

using cache_t =
    tiered_cache<tiny, two_tiers, policy::recency_anchor, host_allocator, failing_allocator>;
constexpr int D = tiny::head_dim, QH = tiny::q_heads;

// 3 layers, two sequence slots, four logical pages of FP8: appends soon need make_room.
cache_t::options pressure_options() {
  cache_t::options opt;
  opt.storage.num_layers = 3;
  opt.storage.max_sequences = 2;
  opt.storage.pages_per_tier = {12, 64};
  opt.policy = policy::recency_anchor({.recent_pages = 1,
                                       .sink_pages = 0,
                                       .ema_alpha = 0.5f,
                                       .enter_mass = 3.0f,
                                       .leave_mass = 1.5f,
                                       .min_dwell_steps = 1,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  opt.max_batch = 2;
  opt.max_pages = 32;
  return opt;
}

}  // namespace

TEST_CASE(
    "tiered_cache::create refuses every bad option before allocating, naming it, its value and the "
    "limit",
    "[tiering][cache][contract]") {
  const auto base = [] {
    cache_t::options o;
    o.storage.num_layers = 2;
    o.storage.max_sequences = 2;
    o.storage.pages_per_tier = {8, 8};
    o.max_batch = 2;
    o.max_pages = 8;
    return o;
  };
  REQUIRE(cache_t::create(base()));
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  struct bad_option {
    std::string name, value;
    std::function<void(cache_t::options&)> set;
  };
  const std::vector<bad_option> cases = {
      {"soft_cap", "-1", [](auto& o) { o.soft_cap = -1.f; }},
      {"soft_cap", "nan", [&](auto& o) { o.soft_cap = nan; }},
      {"soft_cap", "inf", [&](auto& o) { o.soft_cap = inf; }},
      {"softmax_scale", "nan", [&](auto& o) { o.softmax_scale = nan; }},
      {"softmax_scale", "-0.5", [](auto& o) { o.softmax_scale = -0.5f; }},
      {"max_batch", "0", [](auto& o) { o.max_batch = 0; }},
      {"max_batch", "-3", [](auto& o) { o.max_batch = -3; }},
      {"max_pages", "-1", [](auto& o) { o.max_pages = -1; }},
      {"max_batch * max_pages", "4294967296", [](auto& o) { o.max_batch = o.max_pages = 1 << 16; }},
      {"threads", "4294967295", [](auto& o) { o.threads = unsigned(-1); }},  // an int -1 passed on
      {"num_layers", "0", [](auto& o) { o.storage.num_layers = 0; }},
      {"max_sequences", "0", [](auto& o) { o.storage.max_sequences = 0; }},
      {"pages_per_tier[1]", "0", [](auto& o) { o.storage.pages_per_tier[1] = 0; }},
      {"pages_per_tier[0]", "1", [](auto& o) { o.storage.pages_per_tier[0] = 1; }},
      {"head_base", "-1", [](auto& o) { o.storage.head_base = -1; }},
      {"ema_alpha", "nan", [&](auto& o) { o.policy = policy::recency_anchor({.ema_alpha = nan}); }},
      {"recent_pages", "-1",
       [](auto& o) { o.policy = policy::recency_anchor({.recent_pages = -1}); }},
      {"leave_mass", "5",
       [](auto& o) { o.policy = policy::recency_anchor({.enter_mass = 4.f, .leave_mass = 5.f}); }},
      {"promotion_reserve_percent", "101",
       [](auto& o) { o.tiering.promotion_reserve_percent = 101; }},
      {"shadow_slack_percent", "-1", [](auto& o) { o.tiering.shadow_slack_percent = -1; }},
  };
  for (const bad_option& c : cases) {
    INFO(c.name << " = " << c.value);
    cache_t::options o = base();
    c.set(o);
    failing_allocator meta;
    meta.fail_every();  // an option checked only after an allocation would surface as
                        // injected_fault
    auto r = cache_t::create(o, {}, std::move(meta));
    REQUIRE_FALSE(r);
    const status st = r.error_status();
    INFO(st);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find(c.name) != std::string::npos);
    CHECK(st.message().find(c.value) != std::string::npos);
  }
}

TEST_CASE("a refused fork changes nothing, even where it would have had to make room first",
          "[tiering][cache][contract]") {
  cache_t::options opt = pressure_options();
  opt.storage.max_sequences = 3;
  auto c = cache_t::create(opt).value();
  const seq_id a = c->create_sequence().value();
  const seq_id b = c->create_sequence().value();
  REQUIRE(append_tokens(*c, a, 1, 40));    // two sealed pages and an open tail: 9 FP8 pages
  REQUIRE(append_tokens(*c, b, 100, 10));  // one open page: tier 0 is full
  REQUIRE(c->storage().free_pages(0) == 0);

  SECTION("no free sequence slot") {
    REQUIRE(c->create_sequence());  // the last slot
    const std::string before = cache_snapshot(*c);
    const auto f = c->fork(a);
    REQUIRE_FALSE(f);
    CHECK(f.code() == errc::capacity_exhausted);
    CHECK(f.error_status().message().find("sequence slots") != std::string::npos);
    CHECK(cache_snapshot(*c) ==
          before);  // no page of a was demoted to TQ3 for a fork that never happened
  }
  SECTION("no bookkeeping memory for the child's page list") {
    const std::string before = cache_snapshot(*c);
    c->storage().meta_alloc().fail_on(1);
    const auto f = c->fork(a);
    REQUIRE_FALSE(f);
    CHECK(f.code() == errc::capacity_exhausted);
    CHECK(cache_snapshot(*c) == before);
    c->storage().meta_alloc().reset();
    REQUIRE(c->fork(a));  // the same fork, with memory: it makes room and succeeds
    CHECK(c->controller().totals().pressure_demoted > 0);
  }
  REQUIRE(c->check_invariants());
}

TEST_CASE("a refused append changes nothing, even where it would have had to make room first",
          "[tiering][cache][contract]") {
  auto c = cache_t::create(pressure_options()).value();
  const seq_id a = c->create_sequence().value();
  REQUIRE(append_tokens(*c, a, 1, 64));  // four sealed pages: tier 0 is full
  REQUIRE(c->storage().free_pages(0) == 0);
  const std::string before = cache_snapshot(*c);
  c->storage().meta_alloc().fail_on(1);  // the page list's growth
  const status st = append_tokens(*c, a, 65, 1);
  CHECK(st.code() == errc::capacity_exhausted);
  CHECK(cache_snapshot(*c) == before);
  c->storage().meta_alloc().reset();
  REQUIRE(append_tokens(*c, a, 65, 1));
  CHECK(c->controller().totals().pressure_demoted > 0);
  REQUIRE(c->check_invariants());
}

TEST_CASE("append with a zero count and non-empty buffers is refused, naming the count and sizes",
          "[tiering][cache][contract]") {
  // issue 56: the count is the caller's word for how many tokens its buffers hold; 0 tokens
  // with data disagrees with them (a caller's bug), refused like any other size mismatch.
  // 0 tokens with empty buffers stays a no-op (an engine may append an empty chunk).
  for (const bool center : {false, true}) {
    INFO("center = " << center);
    cache_t::options opt = pressure_options();
    opt.center = center;
    auto c = cache_t::create(opt).value();
    const seq_id s = c->create_sequence().value();
    REQUIRE(append_tokens(*c, s, 1, 3));
    const std::string before = cache_snapshot(*c);
    std::vector<float> k, v;
    make_kv<cache_t::storage_type>(opt.storage.num_layers, seeds_from(50, 2), k, v);
    const status st = c->append(s, 0, k, v);
    INFO(st);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("append: 0 tokens") != std::string::npos);
    CHECK(st.message().find(std::to_string(k.size())) != std::string::npos);
    CHECK(c->append(s, 0, k, {}).code() == errc::invalid_argument);  // one buffer with data
    CHECK(c->append(s, 0, {}, v).code() == errc::invalid_argument);
    CHECK(cache_snapshot(*c) == before);
    CHECK(c->append(s, 0, {}, {}));  // empty: accepted, nothing changes
    CHECK(
        c->append(s, 0, std::span<const float>(k.data(), 0), std::span<const float>(v.data(), 0)));
    CHECK(cache_snapshot(*c) == before);
    CHECK(c->length(s).value() == 3);
    REQUIRE(c->check_invariants());
  }
}

TEST_CASE("max_pages is enforced at append: a sequence never grows past what attend reads",
          "[tiering][cache][contract]") {
  cache_t::options opt = pressure_options();
  opt.max_pages = 4;  // = tier 0's four logical pages: the fifth would need make_room
  auto c = cache_t::create(opt).value();
  const seq_id s = c->create_sequence().value();
  REQUIRE(append_tokens(*c, s, 1, 60));
  const std::string before = cache_snapshot(*c);
  const status st = append_tokens(*c, s, 61, 5);  // 65 tokens = 5 pages
  CHECK(st.code() == errc::out_of_range);
  CHECK(st.message().find("max_pages") != std::string::npos);
  CHECK(st.message().find('5') != std::string::npos);
  CHECK(cache_snapshot(*c) == before);   // refused before make_room demoted anything
  REQUIRE(append_tokens(*c, s, 61, 4));  // exactly max_pages pages
  std::vector<float> q(QH * D, 0.5f), out(q.size());
  CHECK(c->attend(0, std::vector<seq_id>{s}, q, out));
  CHECK(append_tokens(*c, s, 65, 1).code() == errc::out_of_range);
  // A fresh sequence, in one append.
  const seq_id t = c->create_sequence().value();
  CHECK(append_tokens(*c, t, 1000, 65).code() == errc::out_of_range);
  CHECK(c->length(t).value() == 0);
  REQUIRE(c->check_invariants());
}

TEST_CASE("attend refuses a NaN or Inf query, naming the batch row and head, and writes nothing",
          "[tiering][cache][contract]") {
  cache_t::options opt = pressure_options();
  opt.soft_cap = 30.f;  // a capped Inf logit would otherwise be finite
  auto c = cache_t::create(opt).value();
  const std::vector<seq_id> batch{c->create_sequence().value(), c->create_sequence().value()};
  REQUIRE(append_tokens(*c, batch[0], 1, 20));
  REQUIRE(append_tokens(*c, batch[1], 100, 20));
  std::vector<float> q(batch.size() * QH * D, 0.25f), out(q.size(), 7.f),
      mass(batch.size() * 32, 7.f), lse(batch.size() * QH, 7.f);
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    INFO("query value " << bad);
    std::vector<float> qb = q;
    qb[(1 * QH + 1) * D + 5] = bad;  // batch row 1, query head 1, dim 5
    const status st = c->attend(0, batch, qb, out, mass, lse);
    INFO(st);
    CHECK(st.code() == errc::non_finite_input);
    CHECK(st.message().find("batch row 1") != std::string::npos);
    CHECK(st.message().find("query head 1") != std::string::npos);
    for (float x : out) REQUIRE(x == 7.f);
    for (float x : mass) REQUIRE(x == 7.f);
    for (float x : lse) REQUIRE(x == 7.f);
  }
  REQUIRE(c->attend(0, batch, q, out, mass, lse));
  for (float x : out) REQUIRE(std::isfinite(x));
}

namespace {

// One sequence of a 30-page tier 0, recent_pages 1 and no dwell: after six sealed pages, pages
// 0-4 are Stale (15 demotions over three layers); stale_pages in the Stale tier.
cache_t::options six_pages_options(std::uint32_t stale_pages) {
  cache_t::options opt = pressure_options();
  opt.storage.max_sequences = 1;
  opt.storage.pages_per_tier = {30, stale_pages};
  opt.policy = policy::recency_anchor({.recent_pages = 1,
                                       .sink_pages = 0,
                                       .min_dwell_steps = 0,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  return opt;
}

}  // namespace

TEST_CASE("retier with the Stale pool full reports deferred conversions, not failures",
          "[tiering][cache][contract]") {
  // room for one layer of one logical page in TQ3
  auto c = cache_t::create(six_pages_options(3)).value();
  const seq_id s = c->create_sequence().value();
  REQUIRE(append_tokens(*c, s, 1, 6 * 16));  // six sealed pages: pages 0-4 are Stale, 15 demotions

  SECTION("apply") {
    const retier_stats st = c->retier(1);
    INFO(st.first_error);
    CHECK(st.planned == 15);
    CHECK(st.converted == 3);
    CHECK(st.deferred_full == 12);
    CHECK(st.failed == 0);
    CHECK(st.first_error.is_ok());
    CHECK(c->controller().totals().deferred_full == 12);
  }
  SECTION("stage") {
    auto& ctl = c->controller();
    const auto todo = ctl.plan(1);
    REQUIRE(todo.size() == 15);
    std::vector<staged_conversion> staged(todo.size());
    retier_stats st;
    const std::size_t n = ctl.stage(todo, staged, st);
    CHECK(n == 3);
    CHECK(st.deferred_full == 12);
    CHECK(st.failed == 0);
    for (std::size_t i = 0; i < n; ++i) abort_conversion(c->storage(), staged[i]);
  }
  REQUIRE(c->check_invariants());
}

TEST_CASE("commit_all publishes a staged batch whole or not at all",
          "[tiering][contract][faults]") {
  // The GPU façade's make_room publishes its demotion batch through commit_all, so that a
  // refused step changes nothing (tests/cuda/tiered_cache.cpp sweeps it on the device).
  auto c = cache_t::create(six_pages_options(64)).value();
  const seq_id s = c->create_sequence().value();
  REQUIRE(append_tokens(*c, s, 1, 6 * 16));  // pages 0-4 Stale: 15 demotions
  auto& ctl = c->controller();
  const std::string before = cache_snapshot(*c);
  // stage and fill everything plan(1) wants; filled[i] as given
  auto stage_all = [&](std::vector<staged_conversion>& staged, std::unique_ptr<bool[]>& filled) {
    const auto todo = ctl.plan(1);
    staged.resize(todo.size());
    retier_stats st;
    REQUIRE(ctl.stage(todo, staged, st) == todo.size());
    filled.reset(new bool[staged.size()]);
    for (std::size_t i = 0; i < staged.size(); ++i) {
      conversion_counters k;
      filled[i] = fill_conversion_on_host(c->storage(), staged[i], k).is_ok();
    }
  };
  std::vector<staged_conversion> staged;
  std::unique_ptr<bool[]> filled;
  for (const std::uint64_t fail_at : {1u, 8u, 15u}) {  // a publish fault: first, middle, last
    INFO("publish fault at conversion " << fail_at);
    stage_all(staged, filled);
    REQUIRE(staged.size() == 15);
    fault_injector faults;
    faults.fail_at = fail_at;
    retier_stats st;
    const status r =
        ctl.commit_all(staged, std::span<const bool>(filled.get(), staged.size()), st, faults);
    CHECK(r.code() == errc::injected_fault);
    CHECK(r.message().find("none of the 15") != std::string::npos);
    CHECK(st.converted == 0);
    CHECK(cache_snapshot(*c) == before);
    REQUIRE(c->check_invariants());
  }
  SECTION("a fill that failed refuses the batch") {
    stage_all(staged, filled);
    filled[3] = false;
    retier_stats st;
    CHECK(ctl.commit_all(staged, std::span<const bool>(filled.get(), staged.size()), st).code() ==
          errc::non_finite_input);
    CHECK(cache_snapshot(*c) == before);
  }
  SECTION("abandon gives every reserved page back") {
    stage_all(staged, filled);
    ctl.abandon(staged);
    CHECK(cache_snapshot(*c) == before);
  }
  SECTION("no fault: all 15 published") {
    stage_all(staged, filled);
    retier_stats st;
    REQUIRE(ctl.commit_all(staged, std::span<const bool>(filled.get(), staged.size()), st));
    CHECK(st.converted == 15);
    CHECK(st.demoted == 15);
    CHECK(ctl.totals().converted == 15);
    CHECK(c->storage().free_pages(0) == 30 - 3);  // the recent page's three layers stay
  }
  REQUIRE(c->check_invariants());
}

TEST_CASE("a refused prefix start_sequence leaves the LRU order as it was",
          "[tiering][prefix][contract]") {
  storage2::options so;
  so.num_layers = 1;
  so.max_sequences = 2;
  so.pages_per_tier = {16, 16};
  auto st = storage2::create(so).value();
  prefix_index<storage2> idx(*st);
  std::vector<std::int32_t> ids_a(16), ids_b(16);
  for (int i = 0; i < 16; ++i) ids_a[std::size_t(i)] = i, ids_b[std::size_t(i)] = 100 + i;
  for (const auto* ids : {&ids_a, &ids_b}) {  // a first: a is the least recently used entry
    const seq_id s = st->create_sequence().value();
    REQUIRE(append_seeds(*st, s, seeds_from(std::uint64_t((*ids)[0]), 16)));
    REQUIRE(idx.insert(s, 7, *ids).value() == 1);
    REQUIRE(st->release(s));
  }
  const seq_id x = st->create_sequence().value();
  const seq_id y = st->create_sequence().value();
  const auto r = idx.start_sequence(7, ids_a);  // no free slot
  CHECK(r.code() == errc::capacity_exhausted);
  REQUIRE(st->release(x));
  REQUIRE(st->release(y));
  REQUIRE(idx.evict(1) == 1);
  CHECK(idx.lookup(7, ids_a).tokens == 0);  // a was still the least recently used: evicted
  CHECK(idx.lookup(7, ids_b).tokens == 16);
  REQUIRE(idx.check_invariants());
  REQUIRE(st->check_invariants());
}

TEST_CASE("a conversion fault inside make_room refuses the append with nothing changed",
          "[tiering][cache][contract][faults]") {
  // make_room stages all its demotions before publishing any: a fault at any step of any of
  // them used to leave the earlier demotions published under a refused append.
  using faulty_t = tiered_cache<tiny, two_tiers, policy::recency_anchor, host_allocator,
                                failing_allocator, tier_roles<two_tiers>, fault_injector>;
  // pinned = 3: page 0's three layers are the only candidates, exactly the three demotions
  // the append needs, so every fault refuses it; pinned = 0: nine candidates, and make_room
  // tries the next one after a faulted one.
  const std::int64_t pinned = GENERATE(3, 0);
  INFO("pinned pages " << pinned);
  std::uint64_t refused = 0, absorbed = 0;
  for (std::uint64_t k = 1;; ++k) {
    faulty_t::options opt = pressure_options();
    opt.storage.max_sequences = 1;
    auto c = faulty_t::create(opt).value();
    const seq_id a = c->create_sequence().value();
    REQUIRE(append_tokens(*c, a, 1, 64));  // four sealed pages x 3 layers: tier 0 is full
    REQUIRE(c->pin(a, 1, pinned));
    const std::string before = cache_snapshot(*c);
    c->faults() = fault_injector{0, k, 0};
    const status st = append_tokens(*c, a, 65, 1);  // 3 demotions x 3 steps
    const bool injected = c->faults().injected != 0;
    c->faults() = fault_injector{};
    REQUIRE(c->check_invariants());
    if (!injected) {
      REQUIRE(st);
      CHECK(k == 3 * 3 + 1);
      break;
    }
    INFO("fault at conversion step " << k << ": " << st);
    if (st) {
      ++absorbed;
      CHECK(c->controller().totals().pressure_demoted == 3);
      CHECK(c->controller().totals().injected_faults == 1);
    } else {
      ++refused;
      CHECK(st.code() == errc::injected_fault);
      CHECK(cache_snapshot(*c) == before);
    }
  }
  CHECK(refused == (pinned == 3 ? 9u : 0u));
  CHECK(absorbed == (pinned == 3 ? 0u : 9u));
}
