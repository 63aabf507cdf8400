// SPDX-License-Identifier: Apache-2.0
// The default policy and the tier controller: roles, hysteresis, dwell, planning order,
// memory pressure, shadows, and bookkeeping allocation failures.
#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "catch.hpp"
#include "incremental_run.hpp"
#include "policy_knobs.hpp"
#include "tiering_test_support.hpp"

using namespace tiering_test;
using tierkv::policy::recency_anchor;
using controller2 = tier_controller<storage2>;

namespace {

recency_anchor::options plain_knobs() {
  return tierkv_test::recency_knobs(1, 1, 1.0f, 4.0f, 2.0f, 0);
}

std::unique_ptr<storage2> make_storage(std::uint32_t t0, std::uint32_t t1, int layers = 2) {
  storage2::options o;
  o.num_layers = layers;
  o.max_sequences = 8;
  o.pages_per_tier = {t0, t1};
  o.codec_seed = 11;
  return std::move(storage2::create(o).value());
}

struct broken_policy {  // no keep_value
  struct page_state {
    float x = 0;
  };
  void observe(page_state&, float) const {}
  tier_role choose(const page_state&, const page_facts&) const { return tier_role::stale; }
  std::uint64_t min_dwell_steps() const { return 0; }
  status validate() const { return {}; }
};

}  // namespace

TEST_CASE("recency_anchor: roles, hysteresis and demotion order", "[tiering][policy]") {
  static_assert(tier_policy<recency_anchor>);
  static_assert(!tier_policy<broken_policy>);
  auto k = plain_knobs();
  k.recent_pages = 2;
  k.keep_first_layers = 1;
  k.keep_last_layers = 1;
  const recency_anchor p(k);
  REQUIRE(p.validate());
  recency_anchor::page_state s;
  page_facts f;
  f.num_layers = 4;
  f.layer = 1;
  f.position = 5;
  f.age = 7;
  f.holders = 1;
  CHECK(p.choose(s, f) == tier_role::stale);
  f.age = 1;
  CHECK(p.choose(s, f) == tier_role::recent);
  f.age = 7;
  f.position = 0;
  CHECK(p.choose(s, f) == tier_role::anchor);  // a sink
  f.position = 5;
  f.layer = 0;
  CHECK(p.choose(s, f) == tier_role::anchor);  // first layer
  f.layer = 3;
  CHECK(p.choose(s, f) == tier_role::anchor);  // last layer
  f.layer = 2;
  f.pinned = true;
  CHECK(p.choose(s, f) == tier_role::anchor);
  f.pinned = false;

  // Hysteresis: enter above 4, leave below 2; values in between keep the role.
  for (float m : {3.9f, 1.0f, 3.99f}) {
    p.observe(s, m);
    CHECK(!s.anchored);
  }
  p.observe(s, 4.5f);
  CHECK(s.anchored);
  CHECK(p.choose(s, f) == tier_role::anchor);
  for (float m : {2.0f, 3.0f, 2.5f, 39.0f, 2.01f}) {
    p.observe(s, m);
    CHECK(s.anchored);
  }
  p.observe(s, std::numeric_limits<float>::quiet_NaN());  // ignored
  p.observe(s, -1.0f);                                    // ignored
  CHECK(s.anchored);
  p.observe(s, 1.99f);
  CHECK(!s.anchored);

  // The EMA smooths: one spike does not make an anchor.
  auto smooth = plain_knobs();
  smooth.ema_alpha = 0.25f;
  const recency_anchor ps(smooth);
  recency_anchor::page_state e;
  ps.observe(e, 1.0f);
  ps.observe(e, 10.0f);  // ema = 1 + 0.25 * 9 = 3.25
  CHECK(e.ema == Approx(3.25f));
  CHECK(!e.anchored);
  ps.observe(e, 10.0f);  // 4.9375
  CHECK(e.anchored);

  // Demotion order under pressure: plain < anchored < sink < recent < sensitive layer; pinned
  // never.
  recency_anchor::page_state lo, hi;
  lo.ema = 0.5f;
  hi.ema = 5.0f;
  hi.anchored = true;
  page_facts plain = f, sink = f, recent = f, sens = f, pinned = f;
  sink.position = 0;
  recent.age = 0;
  sens.layer = 0;
  pinned.pinned = true;
  CHECK(p.keep_value(lo, plain) < p.keep_value(hi, plain));
  CHECK(p.keep_value(hi, plain) < p.keep_value(lo, sink));
  CHECK(p.keep_value(lo, sink) < p.keep_value(lo, recent));
  CHECK(p.keep_value(hi, recent) < p.keep_value(lo, sens));
  CHECK(std::isinf(p.keep_value(lo, pinned)));

  auto bad = plain_knobs();
  bad.enter_mass = 1.0f;  // below leave_mass
  CHECK(recency_anchor(bad).validate().code() == errc::invalid_argument);
  bad = plain_knobs();
  bad.ema_alpha = 0.0f;
  CHECK(recency_anchor(bad).validate().code() == errc::invalid_argument);
  auto st = make_storage(8, 8);
  CHECK(controller2::create(*st, recency_anchor(bad)).code() == errc::invalid_argument);
}

TEST_CASE("controller: recency and sinks demote, attention mass promotes, dwell holds moved pages",
          "[tiering][controller]") {
  auto s = make_storage(32, 32);
  auto knobs = plain_knobs();
  knobs.min_dwell_steps = 3;
  auto c = controller2::create(*s, recency_anchor(knobs)).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 88)));  // 5 sealed pages + an open tail (6 pages)
  // The dwell holds only a page that has moved: the pages are first seen at step 4 and leave
  // tier 0 at once (a chunked prefill's step is a whole chunk; the dwell must not keep a
  // chunk's pages in tier 0 past the policy's Recent window).
  const auto plan = c->plan(4);
  // Pages 1..4 at both layers leave tier 0 (page 0 is a sink, page 5 is recent and open).
  REQUIRE(plan.size() == 8);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    CHECK(plan[i].from == 0);
    CHECK(plan[i].to == 1);
    if (i > 0)  // deterministic order: value, then block, then layer
      CHECK(std::tie(plan[i - 1].value, plan[i - 1].block.index, plan[i - 1].layer) <
            std::tie(plan[i].value, plan[i].block.index, plan[i].layer));
  }
  const retier_stats st = c->apply(plan);
  CHECK(st.converted == 8);
  CHECK(st.demoted == 8);
  CHECK(st.first_error.is_ok());
  REQUIRE(c->check_invariants());
  CHECK(s->page(q, 0, 0).value().format == 0);
  CHECK(s->page(q, 1, 3).value().format == 1);

  // Page 2 of layer 0 draws most attention: it becomes an Anchor after the dwell.
  std::vector<float> mass(6, 0.02f);
  mass[2] = 0.9f;  // 5.4x a uniform share
  REQUIRE(c->observe_mass(q, 0, mass));
  CHECK(c->plan(5).empty());  // dwell: demoted at 4, may move from step 7
  REQUIRE(c->observe_mass(q, 0, mass));
  const auto promote = c->plan(7);
  REQUIRE(promote.size() == 1);
  CHECK(promote[0].layer == 0);
  CHECK(promote[0].to == 0);
  CHECK(promote[0].block == s->block_of(q, 2).value());
  CHECK(c->apply(promote).promoted == 1);
  CHECK(s->page(q, 0, 2).value().format == 0);
  CHECK(s->page(q, 1, 2).value().format == 1);

  // Between the thresholds it stays; below leave_mass it goes back after its dwell.
  mass[2] = 0.5f;  // 3x
  REQUIRE(c->observe_mass(q, 0, mass));
  CHECK(c->plan(10).empty());
  mass[2] = 0.1f;  // 0.6x
  REQUIRE(c->observe_mass(q, 0, mass));
  const auto back = c->plan(11);
  REQUIRE(back.size() == 1);
  CHECK(back[0].to == 1);
  CHECK(c->apply(back).demoted == 1);

  // Bad mass input is refused or ignored, never applied.
  CHECK(c->observe_mass(q, 0, std::vector<float>(3, 0.f)).code() == errc::invalid_argument);
  CHECK(c->observe_mass(q, 5, mass).code() == errc::out_of_range);
  REQUIRE(c->check_invariants());
}

TEST_CASE(
    "controller: observe_mass folds a page one sequence holds at once, a shared page's "
    "largest mass at plan",
    "[tiering][controller]") {
  auto s = make_storage(64, 64);
  auto c =
      controller2::create(*s, recency_anchor(tierkv_test::recency_knobs(1, 1, 0.5f, 4.0f, 2.0f, 0)))
          .value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 64)));  // 4 sealed pages
  (void)c->plan(1);                                 // the controller has seen the holders
  const block_ref b2 = s->block_of(q, 2).value();
  std::vector<float> mass(4, 0.1f);
  mass[2] = 0.5f;  // 2x a uniform share
  // Unshared: every call is one EMA step, before any plan (0.5: 2 -> 2 + 0.5 (0.4 - 2) = 1.2).
  REQUIRE(c->observe_mass(q, 0, mass));
  CHECK(c->page_state_of(b2, 0).ema == Approx(2.0f));
  mass[2] = 0.1f;
  REQUIRE(c->observe_mass(q, 0, mass));
  CHECK(c->page_state_of(b2, 0).ema == Approx(1.2f));
  CHECK(c->page_state_of(b2, 1).ema == 0.0f);  // the other layer was not observed
  // A fork shares the pages: until a plan sees the new holders, and while shared, the largest
  // of the holders' masses is kept and folded once by the plan.
  const seq_id f = s->fork(q).value();
  mass[2] = 1.0f;  // 4x
  REQUIRE(c->observe_mass(q, 0, mass));
  mass[2] = 0.5f;  // 2x
  REQUIRE(c->observe_mass(f, 0, mass));
  CHECK(c->page_state_of(b2, 0).ema == Approx(1.2f));  // pending
  (void)c->plan(2);
  CHECK(c->page_state_of(b2, 0).ema == Approx(1.2f + 0.5f * (4.0f - 1.2f)));
  REQUIRE(c->observe_mass(f, 0, mass));  // the plan saw 2 holders: pending again
  CHECK(c->page_state_of(b2, 0).ema == Approx(2.6f));
  (void)c->plan(3);
  CHECK(c->page_state_of(b2, 0).ema == Approx(2.6f + 0.5f * (2.0f - 2.6f)));
  REQUIRE(c->check_invariants());
}

TEST_CASE("controller: sensitive layers, pinned pages and forks", "[tiering][controller]") {
  auto s = make_storage(64, 64, 3);
  auto knobs = plain_knobs();
  knobs.keep_first_layers = 1;
  knobs.keep_last_layers = 1;
  auto c = controller2::create(*s, recency_anchor(knobs)).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 96)));  // 6 sealed pages
  REQUIRE(c->pin(q, 1, 2));
  CHECK(c->pin(q, 5, 2).code() == errc::out_of_range);
  // A fork appending its own pages makes the shared pages old for it, but the parent still sees
  // page 5 as its newest page: shared pages take the youngest age of their holders.
  const seq_id f = s->fork(q).value();
  REQUIRE(append_seeds(*s, f, seeds_from(500, 48)));
  REQUIRE(c->apply(c->plan(1)).first_error.is_ok());
  for (std::int64_t i = 0; i < 6; ++i) {
    CHECK(s->page(q, 0, i).value().format == 0);  // first layer
    CHECK(s->page(q, 2, i).value().format == 0);  // last layer
    const bool stale = i == 3 || i == 4;          // 0 sink, 1-2 pinned, 5 newest of q
    CHECK(s->page(q, 1, i).value().format == (stale ? 1 : 0));
  }
  for (std::int64_t i = 6; i < 9; ++i) CHECK(s->page(f, 1, i).value().format == (i < 8 ? 1 : 0));
  REQUIRE(c->check_invariants());
}

TEST_CASE(
    "controller: memory pressure demotes the least valuable pages, or refuses without a change",
    "[tiering][controller]") {
  auto s = make_storage(12, 6);
  auto knobs = plain_knobs();
  knobs.recent_pages = 2;
  auto c = controller2::create(*s, recency_anchor(knobs)).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 80)));  // 5 pages x 2 layers = 10 of 12 tier-0 pages
  std::vector<float> mass{0.1f, 0.1f, 0.5f, 0.1f, 0.2f};
  REQUIRE(c->observe_mass(q, 0, mass));
  REQUIRE(c->observe_mass(q, 1, mass));
  REQUIRE(c->pin(q, 1, 1));
  (void)c->plan(
      0);  // folds the masses; the policy wants pages 1..2 stale only after dwell 0: apply nothing
  // 4 free pages needed, 2 free: two demotions. Candidates by value: page 2 (mass 2.5, not
  // anchored), then sink page 0; page 1 is pinned, pages 3-4 are recent.
  REQUIRE(c->make_room(4));
  CHECK(s->free_pages(0) == 4);
  CHECK(s->page(q, 0, 2).value().format == 1);
  CHECK(s->page(q, 1, 2).value().format == 1);
  CHECK(s->page(q, 0, 1).value().format == 0);
  CHECK(c->totals().pressure_demoted == 2);
  REQUIRE(c->check_invariants());

  // Needing more than can be freed refuses and changes nothing.
  const std::uint32_t free0 = s->free_pages(0), free1 = s->free_pages(1);
  std::vector<page_id> before;
  for (int l = 0; l < 2; ++l)
    for (std::int64_t i = 0; i < 5; ++i) before.push_back(s->page(q, l, i).value());
  const status refused = c->make_room(12);
  CHECK(refused.code() == errc::capacity_exhausted);
  CHECK(refused.message().find("nothing was changed") != std::string::npos);
  CHECK(s->free_pages(0) == free0);
  CHECK(s->free_pages(1) == free1);
  std::vector<page_id> after;
  for (int l = 0; l < 2; ++l)
    for (std::int64_t i = 0; i < 5; ++i) after.push_back(s->page(q, l, i).value());
  CHECK(after == before);
  REQUIRE(c->check_invariants());
}

TEST_CASE("controller: pressure_plan names make_room's demotions, and refuses as it does",
          "[tiering][controller]") {
  // Two identical storages and controllers: one frees tier 0 with make_room (host codecs), the
  // other stages pressure_plan's demotions and fills them on the host, as the GPU façade does
  // through its retier driver. Both end with the same tiers and free pages.
  struct setup {
    std::unique_ptr<storage2> s;
    std::unique_ptr<controller2> c;
    seq_id q;
  };
  auto make = [] {
    auto s = make_storage(12, 6);
    auto knobs = plain_knobs();
    knobs.recent_pages = 2;
    auto c = controller2::create(*s, recency_anchor(knobs)).value();
    const seq_id q = s->create_sequence().value();
    REQUIRE(append_seeds(*s, q, seeds_from(1, 80)));
    std::vector<float> mass{0.1f, 0.1f, 0.5f, 0.1f, 0.2f};
    REQUIRE(c->observe_mass(q, 0, mass));
    REQUIRE(c->observe_mass(q, 1, mass));
    REQUIRE(c->pin(q, 1, 1));
    (void)c->plan(0);
    return setup{std::move(s), std::move(c), q};
  };
  // Members go in reverse order: the controller before the storage it holds.
  auto [s1, c1, q1] = make();
  auto [s2, c2, q2] = make();
  REQUIRE(c1->make_room(4));
  auto todo = c2->pressure_plan(4);
  REQUIRE(todo.has_value());
  CHECK(todo->size() == 2);  // 2 free, 4 needed: exactly the deficit
  std::vector<staged_conversion> staged(todo->size());
  retier_stats st;
  REQUIRE(c2->stage(*todo, std::span<staged_conversion>(staged), st) == 2);
  // The staged target pages are live but no block names them yet: the invariants hold only
  // when the caller counts them (a GPU retier driver's batch in flight).
  CHECK(c2->check_invariants().code() == errc::corrupt_data);
  CHECK(c2->check_invariants(2).is_ok());
  bool filled[2];
  for (int i = 0; i < 2; ++i) {
    conversion_counters cc;
    filled[i] = fill_conversion_on_host(*s2, staged[std::size_t(i)], cc).is_ok();
  }
  c2->commit(std::span<staged_conversion>(staged), std::span<const bool>(filled, 2), st);
  CHECK(st.demoted == 2);
  CHECK(s2->free_pages(0) == s1->free_pages(0));
  CHECK(s2->free_pages(1) == s1->free_pages(1));
  for (int l = 0; l < 2; ++l)
    for (std::int64_t i = 0; i < 5; ++i) {
      CHECK(s2->page(q2, l, i).value().format == s1->page(q1, l, i).value().format);
      CHECK(bytes_of(*s2, s2->page(q2, l, i).value()) == bytes_of(*s1, s1->page(q1, l, i).value()));
    }
  // Enough free already: nothing to do. Too much: the same refusal, nothing changed.
  auto none = c2->pressure_plan(s2->free_pages(0));
  REQUIRE(none.has_value());
  CHECK(none->empty());
  const std::uint32_t free0 = s2->free_pages(0), free1 = s2->free_pages(1);
  auto refused = c2->pressure_plan(12);
  CHECK(refused.code() == errc::capacity_exhausted);
  CHECK(refused.error_status().message().find("nothing was changed") != std::string::npos);
  CHECK(c1->make_room(12).code() == errc::capacity_exhausted);
  CHECK(s2->free_pages(0) == free0);
  CHECK(s2->free_pages(1) == free1);
  REQUIRE(c2->check_invariants());
}

TEST_CASE("controller: pressure_plan skips pages someone else holds, and refuses when they are all",
          "[tiering][controller]") {
  auto s = make_storage(12, 6);
  auto knobs = plain_knobs();
  knobs.recent_pages = 2;
  auto c = controller2::create(*s, recency_anchor(knobs)).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 80)));  // 5 pages x 2 layers: 10 of 12 tier-0 pages
  (void)c->plan(0);
  auto all = c->pressure_plan(4);
  REQUIRE(all.has_value());
  REQUIRE(all->size() == 2);
  // A retained page (as the retier driver holds one for decodes in flight) frees nothing when
  // demoted: the plan names others in its place.
  const conversion first = (*all)[0];
  const page_id held = s->block_page(first.block, first.layer);
  REQUIRE(s->retain_page(held));
  auto other = c->pressure_plan(4);
  REQUIRE(other.has_value());
  REQUIRE(other->size() == 2);
  for (const conversion& x : *other) CHECK(s->block_page(x.block, x.layer) != held);
  // Every demotable page held: refused, nothing changed.
  std::vector<page_id> retained{held};
  for (const conversion& x : *other) {
    const page_id p = s->block_page(x.block, x.layer);
    REQUIRE(s->retain_page(p));
    retained.push_back(p);
  }
  bool refused = false;
  for (int round = 0; round < 12 && !refused; ++round) {  // 10 tier-0 pages: at most 5 rounds
    auto more = c->pressure_plan(4);
    if (!more.has_value()) {
      refused = true;
      CHECK(more.code() == errc::capacity_exhausted);
      CHECK(more.error_status().message().find("nothing was changed") != std::string::npos);
      break;
    }
    REQUIRE(!more->empty());
    for (const conversion& x : *more)  // never a page already held
      CHECK(std::find(retained.begin(), retained.end(), s->block_page(x.block, x.layer)) ==
            retained.end());
    for (const conversion& x : *more) {
      const page_id p = s->block_page(x.block, x.layer);
      REQUIRE(s->retain_page(p));
      retained.push_back(p);
    }
  }
  REQUIRE(refused);
  const std::uint32_t free0 = s->free_pages(0), free1 = s->free_pages(1);
  CHECK(c->pressure_plan(4).code() == errc::capacity_exhausted);
  CHECK(s->free_pages(0) == free0);
  CHECK(s->free_pages(1) == free1);
  for (const page_id p : retained) REQUIRE(s->release_page(p));
  REQUIRE(c->check_invariants());
}

TEST_CASE("controller: shadows make quick promotions lossless and give tier 0 back under pressure",
          "[tiering][controller]") {
  auto s = make_storage(24, 16, 1);
  auto knobs = plain_knobs();
  knobs.enter_mass = 3.0f;
  tier_controller_options opt;
  opt.keep_shadows = true;
  opt.shadow_slack_percent = 10;
  opt.promotion_reserve_percent = 0;
  auto c = controller2::create(*s, recency_anchor(knobs), opt).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 64)));  // pages 0..3; 1 and 2 go stale
  const auto fp8_bytes = bytes_of(*s, s->page(q, 0, 2).value());
  auto st = c->retier(1);
  CHECK(st.demoted == 2);
  CHECK(st.shadows_made == 2);
  CHECK(c->shadow_pages() == 2);
  REQUIRE(c->check_invariants());
  std::vector<float> mass{0.05f, 0.05f, 0.85f, 0.05f};
  REQUIRE(c->observe_mass(q, 0, mass));
  st = c->retier(2);
  CHECK(st.shadow_promotions == 1);
  CHECK(bytes_of(*s, s->page(q, 0, 2).value()) == fp8_bytes);  // lossless: the original FP8 bytes
  CHECK(c->shadow_pages() == 1);
  REQUIRE(c->check_invariants());
  // Pressure takes shadows back before it demotes anything.
  const std::uint32_t need = s->free_pages(0) + 1;
  REQUIRE(c->make_room(need));
  CHECK(c->shadow_pages() == 0);
  CHECK(c->totals().pressure_demoted == 0);
  REQUIRE(c->check_invariants());
  // Released sequences take their shadows with them.
  REQUIRE(c->apply(c->plan(3)).first_error.is_ok());
  REQUIRE(s->release(q));
  (void)c->plan(4);
  CHECK(c->shadow_pages() == 0);
  CHECK(s->template pool<0>().live_count() == 0);
  CHECK(s->template pool<1>().live_count() == 0);
}

TEST_CASE("controller: faults at every conversion step of a retier keep every page",
          "[tiering][controller][faults]") {
  auto s = make_storage(64, 64);
  auto c = controller2::create(*s, recency_anchor(plain_knobs())).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 96)));
  // A dry run counts the hook calls of this step's conversions.
  fault_injector count;
  const auto plan = std::vector<conversion>(c->plan(1).begin(), c->plan(1).end());
  REQUIRE(!plan.empty());
  std::uint64_t injected = 0, lost = 0, kept = 0, total_calls = 0;
  {
    auto probe = make_storage(64, 64);
    auto pc = controller2::create(*probe, recency_anchor(plain_knobs())).value();
    const seq_id pq = probe->create_sequence().value();
    REQUIRE(append_seeds(*probe, pq, seeds_from(1, 96)));
    (void)pc->retier(1, count);
    total_calls = count.calls;
    CHECK(total_calls == plan.size() * conversion_steps);
  }
  for (std::uint64_t k = 1; k <= total_calls; ++k) {
    std::vector<page_id> before;
    for (int l = 0; l < 2; ++l)
      for (std::int64_t i = 0; i < 6; ++i) before.push_back(s->page(q, l, i).value());
    fault_injector f{0, k, 0};
    const retier_stats st = c->apply(plan, f);
    injected += f.injected;
    CHECK(st.injected_faults == f.injected);
    CHECK(st.failed == 1);
    // The faulted page is the one at (k - 1) / steps in the plan; it kept its id.
    const conversion& hit = plan[(k - 1) / conversion_steps];
    const std::int64_t hit_index = [&] {
      for (std::int64_t i = 0; i < 6; ++i)
        if (s->block_of(q, i).value() == hit.block) return i;
      return std::int64_t(-1);
    }();
    const page_id old = before[std::size_t(hit.layer * 6 + hit_index)];
    const bool ok = s->page(q, hit.layer, hit_index).value() == old && s->page_published(old);
    kept += ok;
    lost += !ok;
    REQUIRE(c->check_invariants());
    // Put everything back in tier 0 for the next round.
    for (int l = 0; l < 2; ++l)
      for (std::int64_t i = 0; i < 6; ++i)
        if (s->page(q, l, i).value().format != 0) {
          conversion_counters cc;
          REQUIRE(convert_page(*s, s->block_of(q, i).value(), l, 0, cc));
        }
  }
  CHECK(injected == total_calls);
  CHECK(lost == 0);
  CHECK(kept == injected);
}

TEST_CASE("controller: a page whose data is non-finite is quarantined, so it stalls nothing",
          "[tiering][controller][faults]") {
  auto s = make_storage(64, 64);
  auto c = controller2::create(*s, recency_anchor(plain_knobs())).value();
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(1, 96)));
  const auto first = c->plan(1);
  const std::vector<conversion> plan(first.begin(), first.end());
  REQUIRE(plan.size() > 1);
  // A NaN value scale in the first planned page (memory corruption, or a bug upstream)
  const conversion bad = plan[0];
  const page_id victim = s->block_page(bad.block, bad.layer);
  const bf16_bits nan = bf16_quiet_nan;
  std::memcpy(s->page_bytes(victim).value().data() + storage2::layout<0>::value_meta(0, 3), &nan,
              sizeof nan);
  const auto planned = [&](std::span<const conversion> p) {
    return std::any_of(p.begin(), p.end(), [&](const conversion& x) {
      return x.block == bad.block && x.layer == bad.layer;
    });
  };
  const retier_stats st = c->apply(plan);
  CHECK(st.converted == plan.size() - 1);  // the rest of the plan went through
  CHECK(st.failed == 1);
  CHECK(st.quarantined == 1);
  CHECK(st.first_error.code() == errc::non_finite_input);
  CHECK(s->block_page(bad.block, bad.layer) == victim);  // kept, published, in its tier
  CHECK(s->page_published(victim));
  // Reported once: never planned again, so never retried, and never a pressure candidate.
  for (std::uint64_t step = 2; step < 6; ++step) {
    CHECK(!planned(c->plan(step)));
    const retier_stats again = c->retier(step);
    CHECK(again.failed == 0);
    CHECK(again.quarantined == 0);
  }
  auto pressure = c->pressure_plan(s->free_pages(0) + 1);
  REQUIRE(pressure);
  CHECK(!planned(*pressure));
  CHECK(c->totals().quarantined == 1);
  REQUIRE(c->check_invariants());
  // The quarantine ends with the page: a new sequence in the freed block slot plans as usual.
  REQUIRE(s->release(q));
  const seq_id r = s->create_sequence().value();
  REQUIRE(append_seeds(*s, r, seeds_from(1, 96)));
  CHECK(c->plan(7).size() == plan.size());
  REQUIRE(c->check_invariants());
}

TEST_CASE("controller: bookkeeping allocation failures leak nothing",
          "[tiering][controller][faults]") {
  auto s = make_storage(16, 16);
  const std::size_t base = s->meta_alloc().bytes_allocated();
  const std::size_t line = s->lines().page_tables;
  int failures = 0;
  for (std::uint64_t k = 1; k < 20; ++k) {
    s->meta_alloc().fail_on(k);
    auto c = controller2::create(*s, recency_anchor(plain_knobs()));
    s->meta_alloc().reset();
    if (c) break;
    ++failures;
    CHECK(c.code() == errc::injected_fault);
    CHECK(s->meta_alloc().bytes_allocated() == base);
    CHECK(s->lines().page_tables == line);
  }
  CHECK(failures >= 4);  // every allocation of create() was failed once
  CHECK(s->meta_alloc().bytes_allocated() == base);
}

TEST_CASE(
    "controller: two-phase stage / commit (a device fill) equals apply, and an unfilled batch "
    "changes nothing",
    "[tiering][controller]") {
  auto a = make_storage(32, 32);
  auto b = make_storage(32, 32);
  auto knobs = plain_knobs();
  auto ca = controller2::create(*a, recency_anchor(knobs)).value();
  auto cb = controller2::create(*b, recency_anchor(knobs)).value();
  const seq_id qa = a->create_sequence().value();
  const seq_id qb = b->create_sequence().value();
  REQUIRE(append_seeds(*a, qa, seeds_from(1, 88)));
  REQUIRE(append_seeds(*b, qb, seeds_from(1, 88)));
  const auto plan_a = ca->plan(1);
  const auto plan_b = cb->plan(1);
  REQUIRE(plan_a.size() == 8);
  REQUIRE(plan_b.size() == 8);

  SECTION("filled: the same pages move as with apply, and the bytes match") {
    const retier_stats sa = ca->apply(plan_a);
    std::vector<staged_conversion> staged(plan_b.size());
    retier_stats sb;
    const std::size_t n = cb->stage(plan_b, staged, sb);
    REQUIRE(n == 8);
    for (std::size_t i = 0; i < n; ++i)
      CHECK(b->page_published(staged[i].from));  // nothing published yet
    conversion_counters counters;
    for (std::size_t i = 0; i < n; ++i) REQUIRE(fill_conversion_on_host(*b, staged[i], counters));
    // A holder of an old page (a device driver) keeps its slot alive past the publication.
    REQUIRE(b->retain_page(staged[0].from));
    const page_id held = staged[0].from;
    const bool filled[8] = {true, true, true, true, true, true, true, true};
    cb->commit(std::span<staged_conversion>(staged.data(), n), filled, sb);
    CHECK(sb.converted == sa.converted);
    CHECK(sb.demoted == sa.demoted);
    CHECK(sb.first_error.is_ok());
    CHECK(!b->page_published(held));
    CHECK(b->check_page(held));  // still live: held by us
    REQUIRE(b->check_invariants(1));
    REQUIRE(b->release_page(held));
    CHECK(!b->check_page(held));  // back in its pool
    REQUIRE(b->check_invariants());
    for (int l = 0; l < 2; ++l)
      for (std::int64_t p = 0; p < 6; ++p) {
        const page_id pa = a->page(qa, l, p).value(), pb = b->page(qb, l, p).value();
        REQUIRE(pa.format == pb.format);
        const auto ba = a->page_bytes(pa).value(), bb = b->page_bytes(pb).value();
        CHECK(std::equal(ba.begin(), ba.end(), bb.begin()));
      }
    REQUIRE(cb->check_invariants());
  }
  SECTION("unfilled: every old page stays published, every reserved page goes back") {
    std::vector<page_id> before;
    for (int l = 0; l < 2; ++l)
      for (std::int64_t p = 0; p < 6; ++p) before.push_back(b->page(qb, l, p).value());
    const std::uint32_t free0 = b->free_pages(0), free1 = b->free_pages(1);
    std::vector<staged_conversion> staged(plan_b.size());
    retier_stats sb;
    const std::size_t n = cb->stage(plan_b, staged, sb);
    REQUIRE(n == 8);
    CHECK(b->free_pages(1) == free1 - 8);
    const bool filled[8] = {};
    cb->commit(std::span<staged_conversion>(staged.data(), n), filled, sb);
    CHECK(sb.converted == 0);
    CHECK(sb.failed == 8);
    std::size_t i = 0;
    for (int l = 0; l < 2; ++l)
      for (std::int64_t p = 0; p < 6; ++p) CHECK(b->page(qb, l, p).value() == before[i++]);
    CHECK(b->free_pages(0) == free0);
    CHECK(b->free_pages(1) == free1);
    // A published page's own reference cannot be dropped through release_page.
    CHECK(b->release_page(before[0]).code() == errc::not_writable);
    REQUIRE(b->check_invariants());
    REQUIRE(cb->check_invariants());
  }
}

TEST_CASE("controller: the incremental plan equals the full scan over a random run",
          "[tiering][controller]") {
  // Two identical storages, one controller planning incrementally (the default), one visiting
  // every page; the same appends, forks, releases, pins, masses, pressure and applied plans.
  // Every plan must be the same list in the same order, with dwell and a tight tier 0.
  const auto knobs = tierkv_test::recency_knobs(2, 1, 0.5f, 2.0f, 1.0f, 2);
  tier_controller_options full_opt;
  full_opt.incremental_plan = false;
  auto s1 = make_storage(60, 200, 3);
  auto s2 = make_storage(60, 200, 3);
  auto c1 = controller2::create(*s1, recency_anchor(knobs)).value();
  auto c2 = controller2::create(*s2, recency_anchor(knobs), full_opt).value();
  CHECK(incremental_equals_full_run(*s1, *s2, *c1, *c2, 7) > 200);
}
