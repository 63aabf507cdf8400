// SPDX-License-Identifier: Apache-2.0
// Soak (issue 24): 100000 simulated requests through one small cache, as an engine drives it.
// Requests arrive, start from a cached system prompt (prefix index), prefill their own tokens,
// decode a few tokens each step (one batched attend + one append per sequence), retier every
// step under memory pressure (tier 0 holds a third of what the live requests use), and finish.
// Pressure the cache cannot absorb is met as an engine would: evict prefix entries, then
// preempt the request. Every few hundred steps the invariants, the accounting and one
// sequence's attention against a float64 reference over its decoded tokens are checked; at the
// end, with every request finished and the prefix index cleared, every page is back in its pool.
#include <cmath>
#include <cstdint>
#include <deque>
#include <vector>

#include "catch.hpp"
#include "reliability_support.hpp"
#include "tierkv/cache.hpp"

using namespace reliability_test;

namespace {

using cache_t = tiered_cache<tiny, two_tiers>;
using storage_t = cache_t::storage_type;
constexpr int D = tiny::head_dim, QH = tiny::q_heads, T = tiny::page_tokens;
constexpr int prompts = 4, prompt_tokens = 2 * T;

// A token's content is a function of its id and position, so equal prefixes share pages.
std::uint64_t seed_of(std::int32_t id, std::size_t pos) {
  return mix64(std::uint64_t(std::uint32_t(id)) << 20 ^ pos);
}

struct request {
  seq_id seq;
  std::vector<std::int32_t> ids;  // every token id so far
  int decode_left = 0;
};

struct soak {
  std::unique_ptr<cache_t> c;
  std::unique_ptr<prefix_index<storage_t>> px;
  std::deque<request> live;
  std::uint64_t rng = 1, started = 0, finished = 0, preempted = 0, prefix_hits = 0, nonfinite = 0,
                refused = 0, checks = 0;
  double worst_rel = 0;

  std::uint64_t next() { return rng = mix64(rng); }

  status append_ids(request& r, std::size_t from) {
    std::vector<std::uint64_t> seeds;
    for (std::size_t i = from; i < r.ids.size(); ++i) seeds.push_back(seed_of(r.ids[i], i));
    std::vector<float> k, v;
    make_kv<storage_t>(1, seeds, k, v);
    return c->append(r.seq, std::int64_t(seeds.size()), k, v);
  }
  // Appends r.ids[from..]; under pressure frees prefix entries first, then gives up.
  bool grow(request& r, std::size_t from) {
    status st = append_ids(r, from);
    if (!st && st.code() == errc::capacity_exhausted) {
      ++refused;
      if (px->evict(8) > 0) st = append_ids(r, from);
    }
    if (!st) REQUIRE(st.code() == errc::capacity_exhausted);  // the only expected refusal
    return st.is_ok();
  }

  void admit(std::uint64_t total) {
    while (live.size() < 8 && started < total) {
      request r;
      const std::int32_t p = std::int32_t(next() % prompts);
      for (int i = 0; i < prompt_tokens; ++i) r.ids.push_back(p * 1000 + i);
      const int user = 1 + int(next() % 12);
      for (int i = 0; i < user; ++i) r.ids.push_back(std::int32_t(1000000 + (next() % 1000000)));
      r.decode_left = 1 + int(next() % 6);
      auto s = px->start_sequence(0, r.ids);
      if (!s) {
        REQUIRE(s.code() == errc::capacity_exhausted);
        return;  // no slot now: arrives again next step
      }
      ++started;
      r.seq = s->seq;
      if (s->cached_tokens > 0) ++prefix_hits;
      REQUIRE(c->length(r.seq).value() == s->cached_tokens);
      if (!grow(r, std::size_t(s->cached_tokens))) {
        ++preempted;
        REQUIRE(c->release(r.seq));
        continue;
      }
      REQUIRE(px->insert(r.seq, 0, std::span(r.ids).first(prompt_tokens)));
      live.push_back(std::move(r));
    }
  }

  // One decode step of every live request; checks the attention of one against float64.
  void decode(bool check) {
    if (live.empty()) return;
    std::vector<seq_id> batch;
    for (const request& r : live) batch.push_back(r.seq);
    std::vector<float> q(batch.size() * QH * D), out(q.size());
    const std::uint64_t qs = next();
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = gauss(qs, 0, int(i / D), 2, int(i % D));
    REQUIRE(c->attend(0, batch, q, out));
    for (float x : out) nonfinite += std::isfinite(x) ? 0 : 1;
    if (check) {
      const std::size_t b = next() % batch.size();
      const std::int64_t len = c->length(batch[b]).value();
      std::vector<double> ref, mass;
      reference_attend(
          q.data() + b * QH * D, len,
          [&](std::int64_t t, int h, float* k, float* v) {
            REQUIRE(c->storage().read_token(batch[b], 0, t, h, k, v));
          },
          ref, mass);
      worst_rel = std::max(worst_rel, rel_l2(out.data() + b * QH * D, ref));
      ++checks;
    }
    for (std::size_t i = 0; i < live.size();) {
      request& r = live[i];
      r.ids.push_back(std::int32_t(2000000 + (next() % 1000000)));
      const bool ok = grow(r, r.ids.size() - 1);
      if (!ok) ++preempted;
      if (!ok || --r.decode_left == 0) {
        REQUIRE(c->release(r.seq));
        ++finished;
        live.erase(live.begin() + std::ptrdiff_t(i));
        continue;
      }
      ++i;
    }
  }
};

}  // namespace

TEST_CASE("soak: 100000 requests with shared prefixes under memory pressure leak no page",
          "[reliability][soak]") {
  constexpr std::uint64_t total = 100000;
  cache_t::options opt;
  opt.storage.num_layers = 1;
  opt.storage.max_sequences = 9;
  opt.storage.pages_per_tier = {8, 22};
  opt.policy = policy::recency_anchor({.recent_pages = 1,
                                       .sink_pages = 1,
                                       .min_dwell_steps = 1,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  opt.max_batch = 8;
  opt.max_pages = 8;
  soak s;
  s.c = cache_t::create(opt).value();
  s.px = std::make_unique<prefix_index<storage_t>>(s.c->storage());
  std::uint64_t step = 0;
  while (s.started < total || !s.live.empty()) {
    s.admit(total);
    s.decode(step % 211 == 0);
    (void)s.c->retier(++step);
    if (step % 997 == 0) {
      REQUIRE(s.c->check_invariants());
      REQUIRE(s.px->check_invariants());
      REQUIRE(s.c->report().reconciles());
    }
  }
  REQUIRE(s.c->check_invariants());
  const retier_stats tot = s.c->controller().totals();
  s.px->clear();
  std::uint64_t leaked = 0;
  for (int t = 0; t < cache_t::num_tiers; ++t)
    leaked += opt.storage.pages_per_tier[std::size_t(t)] - s.c->storage().free_pages(t);
  std::printf(
      "soak: %llu requests, %llu steps, %llu prefix hits, %llu refused appends, %llu preempted, "
      "%llu pressure demotions, %llu conversions, %llu attention checks (worst rel. L2 %.2e)\n",
      (unsigned long long)s.started, (unsigned long long)step, (unsigned long long)s.prefix_hits,
      (unsigned long long)s.refused, (unsigned long long)s.preempted,
      (unsigned long long)tot.pressure_demoted, (unsigned long long)tot.converted,
      (unsigned long long)s.checks, s.worst_rel);
  CHECK(s.started == total);
  CHECK(s.live.empty());
  CHECK(s.prefix_hits > total / 2);    // the prompts are shared
  CHECK(tot.pressure_demoted > 1000);  // the run was under pressure
  CHECK(s.preempted < total / 100);    // and it was absorbed, mostly
  CHECK(s.nonfinite == 0);
  CHECK(s.worst_rel < 1e-4);  // attention over whatever tiers the pages are in
  CHECK(leaked == 0);
  CHECK(s.c->storage().live_blocks() == 0);
  CHECK(s.c->storage().live_sequences() == 0);
  REQUIRE(s.c->check_invariants());
  print_metric("soak_requests", double(s.started));
  print_metric("soak_steps", double(step));
  print_metric("soak_preempted", double(s.preempted));
  print_metric("soak_pressure_demotions", double(tot.pressure_demoted));
  print_metric("pages_leaked_idle", double(leaked));
  print_metric("soak_nan_outputs", double(s.nonfinite));
}
