// SPDX-License-Identifier: Apache-2.0
// Randomized long runs of append / decode (attention-mass feedback) / retier / fork /
// release / make_room under random policies and injected faults, checked against a
// plain model after every step: no live page lost or duplicated, every page readable,
// contents within their tier's error bound, refcounts and page counts conserved.
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "catch.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/paging/index_builder.hpp"

using namespace tiering_test;
using tierkv::policy::recency_anchor;
using controller2 = tier_controller<storage2>;

namespace {

struct run_totals {
  std::uint64_t steps = 0, conversions = 0, promotions = 0, demotions = 0, pressure = 0,
                shadow_hits = 0;
  std::uint64_t faults = 0, faulted_kept = 0, lost = 0, refused_appends = 0, decodes = 0,
                content_checks = 0;
  double worst_fp8 = 0, worst_tq3_mean = 0;
};

// One (block, layer) that has been stored in TQ3 at some point: its error bound is TQ3's.
using page_key = std::tuple<std::uint32_t, std::uint32_t, int>;

struct runner {
  std::mt19937_64 rng;
  std::unique_ptr<storage2> s;
  std::unique_ptr<controller2> c;
  std::map<std::uint32_t, std::pair<seq_id, std::vector<std::uint64_t>>> model;  // by seq id value
  std::set<page_key> lossy;
  host_attention_workspace ws{1};
  std::vector<std::uint8_t> index_buf;
  index_layout<2> layout{1, 64};
  std::uint64_t next_token = 1, step = 0;
  run_totals& t;

  runner(std::uint64_t seed, run_totals& totals) : rng(seed), t(totals) {
    storage2::options o;
    o.num_layers = 2;
    o.max_sequences = 8;
    o.pages_per_tier = {40, 64};
    o.codec_seed = seed;
    s = std::move(storage2::create(o).value());
    recency_anchor::options k;
    k.recent_pages = int(rng() % 3) + 1;
    k.sink_pages = int(rng() % 3);
    k.ema_alpha = float(0.1 + 0.9 * double(rng() % 1000) / 1000.0);
    k.enter_mass = float(1.5 + double(rng() % 450) / 100.0);
    k.leave_mass = k.enter_mass * float(0.2 + 0.8 * double(rng() % 1000) / 1000.0);
    k.min_dwell_steps = rng() % 6;
    k.keep_first_layers = int(rng() % 2);
    k.keep_last_layers = int(rng() % 4 == 0);
    tier_controller_options co;
    co.keep_shadows = rng() % 2 == 0;
    co.shadow_slack_percent = int(rng() % 40);
    co.promotion_reserve_percent = int(rng() % 25);
    c = std::move(controller2::create(*s, recency_anchor(k), co).value());
    index_buf.resize(layout.bytes() + 16);
  }

  std::uint64_t pick(std::uint64_t n) { return rng() % n; }
  seq_id* random_seq() {
    if (model.empty()) return nullptr;
    auto it = model.begin();
    std::advance(it, std::ptrdiff_t(pick(model.size())));
    return &it->second.first;
  }
  std::vector<std::uint64_t>& tokens_of(seq_id q) { return model.at(q.value).second; }

  // Marks every page stored in TQ3 now (conversions happen only inside the calls we scan after).
  void scan_lossy() {
    s->for_each_block([&](block_ref b, int, std::uint32_t) {
      for (int l = 0; l < s->num_layers(); ++l)
        if (s->block_page(b, l).format == 1) lossy.insert({b.index, b.generation, l});
    });
  }

  void check_page_content(seq_id q, int layer, std::int64_t i) {
    const block_ref b = s->block_of(q, i).value();
    const page_error e = page_error_of(*s, q, layer, i, tokens_of(q));
    ++t.content_checks;
    bool ok = e.finite;
    if (lossy.count({b.index, b.generation, layer})) {
      // TQ3 now, or reconstructed from TQ3 into FP8.
      ok = ok && e.mean <= tq3_page_bound + fp8_vector_bound && e.max <= tq3_vector_bound;
      t.worst_tq3_mean = std::max(t.worst_tq3_mean, e.mean);
    } else {
      ok = ok && s->block_page(b, layer).format == 0 && e.max <= fp8_vector_bound;
      t.worst_fp8 = std::max(t.worst_fp8, e.max);
    }
    if (!ok)
      FAIL("page " << i << " layer " << layer << " of " << q << ": error mean " << e.mean
                   << ", max " << e.max);
  }
  void check_all_content() {
    for (auto& [id, entry] : model) {
      const auto pages = s->logical_pages(entry.first).value();
      for (int l = 0; l < s->num_layers(); ++l)
        for (std::int64_t i = 0; i < pages; ++i) check_page_content(entry.first, l, i);
    }
  }

  // The model and the storage agree; every live logical page is published and readable.
  void check_structure() {
    REQUIRE(c->check_invariants());
    REQUIRE(s->live_sequences() == model.size());
    // Plain conditions, one assertion per step: this runs 10^5 times.
    bool ok = true;
    for (auto& [id, entry] : model) {
      ok = ok && s->length(entry.first).value() == std::int64_t(entry.second.size());
      const std::int64_t pages = s->logical_pages(entry.first).value();
      ok = ok && pages == (std::int64_t(entry.second.size()) + 15) / 16;
      for (int l = 0; l < s->num_layers(); ++l)
        for (std::int64_t i = 0; i < pages; ++i) {
          const page_id p = s->page(entry.first, l, i).value();
          ok = ok && s->check_page(p).is_ok() && s->page_published(p);
        }
    }
    REQUIRE(ok);
  }

  void do_append() {
    seq_id* q = random_seq();
    if (q == nullptr || (model.size() < 8 && pick(4) == 0)) {
      auto n = s->create_sequence();
      if (!n) return;
      model[n->value] = {*n, {}};
      q = &model[n->value].first;
    }
    const int n = int(pick(24)) + 1;
    std::vector<std::uint64_t> seeds(static_cast<std::size_t>(n));
    for (auto& x : seeds) x = next_token++;
    const std::int64_t len = s->length(*q).value();
    const std::int64_t fresh = (len + n + 15) / 16 - (len + 15) / 16;
    status st = c->make_room(std::uint32_t(fresh * s->num_layers()));
    scan_lossy();
    if (st) st = append_seeds(*s, *q, seeds);
    if (!st) {
      REQUIRE(st.code() == errc::capacity_exhausted);
      REQUIRE(s->length(*q).value() == len);  // nothing appended
      ++t.refused_appends;
      return;
    }
    auto& tok = tokens_of(*q);
    tok.insert(tok.end(), seeds.begin(), seeds.end());
    // New and converted-for-room pages are checked now.
    const std::int64_t pages = s->logical_pages(*q).value();
    for (std::int64_t i = len / 16; i < pages; ++i) check_page_content(*q, int(pick(2)), i);
  }

  void do_decode() {
    seq_id* q = random_seq();
    if (q == nullptr || tokens_of(*q).empty()) return;
    const int layer = int(pick(2));
    const seq_id batch[1] = {*q};
    auto view = build_batch_index(*s, layer, std::span<const seq_id>(batch, 1), layout,
                                  std::span<std::uint8_t>(index_buf.data(), layout.bytes()));
    REQUIRE(view);
    constexpr int D = tiny::head_dim, QH = tiny::q_heads;
    float query[QH * D], out[QH * D];
    // Queries aligned with one random earlier token's key make its page draw mass.
    const auto& tok = tokens_of(*q);
    const std::uint64_t target = tok[std::size_t(pick(tok.size()))];
    for (int h = 0; h < QH; ++h)
      for (int d = 0; d < D; ++d)
        query[h * D + d] = 3.0f * gauss(target, layer, h / tiny::group_size, 0, d);
    std::vector<float> mass(64, -1.0f);
    const auto pools = s->views();
    host_decode_args<2> a;
    a.queries = query;
    a.index = *view;
    a.pools = pools.data();
    a.source = layer_source{s->config().codec_seed, layer, s->config().head_base};
    a.logits.softmax_scale = 0.125f;
    a.out = out;
    a.page_mass = mass.data();
    a.mass_stride = 64;
    REQUIRE(host_decode<tiny, two_tiers>(ws, a));
    double sum = 0;
    for (float m : mass) sum += m;
    REQUIRE(sum == Approx(1.0).margin(1e-4));
    bool finite = true;
    for (float o : out) finite = finite && std::isfinite(o);
    REQUIRE(finite);  // never NaN from poisoned or converted slots
    REQUIRE(c->observe_mass(*q, layer, mass));
    ++t.decodes;
  }

  void do_retier() {
    ++step;
    const auto planned = c->plan(step);
    const std::vector<conversion> plan(planned.begin(), planned.end());
    std::vector<page_id> before(plan.size());
    for (std::size_t i = 0; i < plan.size(); ++i)
      before[i] = s->block_page(plan[i].block, plan[i].layer);
    fault_injector f;
    if (!plan.empty() && pick(4) == 0) f.fail_at = pick(plan.size() * conversion_steps) + 1;
    const retier_stats st = c->apply(plan, f);
    scan_lossy();
    REQUIRE(st.injected_faults == f.injected);
    t.faults += f.injected;
    t.conversions += st.converted;
    t.promotions += st.promoted;
    t.demotions += st.demoted;
    t.shadow_hits += st.shadow_promotions;
    std::uint64_t kept = 0;
    for (std::size_t i = 0; i < plan.size(); ++i) {
      const page_id now = s->block_page(plan[i].block, plan[i].layer);
      const bool converted = int(now.format) == plan[i].to && !(now == before[i]);
      const bool unchanged = now == before[i];
      if (!converted && !unchanged) ++t.lost;
      if (unchanged) ++kept;
    }
    REQUIRE(t.lost == 0);
    // Every conversion either completed or (the faulted one, or one deferred by the reserve) kept
    // its page.
    REQUIRE(plan.size() - kept == st.converted);
    if (f.injected) ++t.faulted_kept;  // checked above: the faulted page is among the unchanged
    // Converted pages: their content against the originals.
    for (std::size_t i = 0; i < plan.size(); ++i) {
      if (s->block_page(plan[i].block, plan[i].layer) == before[i]) continue;
      for (auto& [id, entry] : model) {
        const auto pages = s->logical_pages(entry.first).value();
        for (std::int64_t j = 0; j < pages; ++j)
          if (s->block_of(entry.first, j).value() == plan[i].block) {
            check_page_content(entry.first, plan[i].layer, j);
            goto next;
          }
      }
    next:;
    }
  }

  void do_fork() {
    seq_id* q = random_seq();
    if (q == nullptr) return;
    const std::int64_t len = s->length(*q).value();
    if (len % 16 != 0 && !c->make_room(std::uint32_t(s->num_layers()))) return;
    scan_lossy();
    auto f = s->fork(*q);
    if (!f) {
      REQUIRE(f.code() == errc::capacity_exhausted);
      return;
    }
    model[f->value] = {*f, tokens_of(*q)};
  }

  void do_release() {
    seq_id* q = random_seq();
    if (q == nullptr) return;
    const seq_id id = *q;
    REQUIRE(s->release(id));
    model.erase(id.value);
  }

  void run(std::uint64_t steps) {
    for (std::uint64_t i = 0; i < steps; ++i) {
      const std::uint64_t op = pick(100);
      if (op < 35)
        do_append();
      else if (op < 65)
        do_decode();
      else if (op < 85)
        do_retier();
      else if (op < 93)
        do_fork();
      else
        do_release();
      check_structure();
      if (i % 2500 == 2499) check_all_content();
      ++t.steps;
    }
    check_all_content();
    // Releasing everything returns every page: nothing leaked, nothing double-freed.
    for (auto& [id, entry] : model) REQUIRE(s->release(entry.first));
    model.clear();
    (void)c->plan(++step);
    REQUIRE(c->shadow_pages() == 0);
    REQUIRE(s->template pool<0>().live_count() == 0);
    REQUIRE(s->template pool<1>().live_count() == 0);
    REQUIRE(c->check_invariants());
  }
};

}  // namespace

TEST_CASE("randomized long runs keep every live page, its content and the page counts",
          "[tiering][random]") {
  run_totals t;
  constexpr int runs = 8;
  constexpr std::uint64_t steps_per_run = 12500;  // 10^5 steps in total
  for (int r = 0; r < runs; ++r) {
    runner x(0xC0FFEEull + std::uint64_t(r) * 7919, t);
    x.run(steps_per_run);
  }
  INFO("conversions " << t.conversions << ", promotions " << t.promotions << ", demotions "
                      << t.demotions << ", shadow hits " << t.shadow_hits << ", faults " << t.faults
                      << ", refused appends " << t.refused_appends << ", decodes " << t.decodes
                      << ", content checks " << t.content_checks << ", worst fp8 " << t.worst_fp8
                      << ", worst tq3 page mean " << t.worst_tq3_mean);
  CHECK(t.steps == runs * steps_per_run);
  CHECK(t.lost == 0);
  CHECK(t.faulted_kept == t.faults);
  // The run exercised what it claims to: conversions both ways, faults, pressure refusals.
  CHECK(t.conversions > 1000);
  CHECK(t.promotions > 50);
  CHECK(t.faults > 100);
  CHECK(t.refused_appends > 0);
  CHECK(t.content_checks > 10000);
  WARN("random runs: conversions " << t.conversions << ", promotions " << t.promotions
                                   << ", shadow hits " << t.shadow_hits << ", faults " << t.faults
                                   << ", worst tq3 page mean " << t.worst_tq3_mean
                                   << ", worst fp8 vector " << t.worst_fp8);
}
