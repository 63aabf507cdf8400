// SPDX-License-Identifier: Apache-2.0
// cuda::tiered_cache, the cache wholly on the GPU, against a host twin (paged_storage and
// tier_controller over host memory, host codecs, host_decode) driven by the same operations:
// >= 1000 scheduler steps over up to 8 sequences with prefill chunks, single-token decode steps
// and short multi-token (speculative-size) steps, forks, releases, prefix reuse (insert, start
// from a cached prefix, evict; the twin with its own prefix_index) and memory pressure. The twin
// is fed the page masses the GPU decode produced, so both policies see the same input. After
// every step: every logical page of every layer has the same tier and the same token bytes in
// both (0 divergences), the device mirror's index arrays equal build_batch_index over the GPU
// storage's page tables, the GPU decode equals host_decode over the twin within the decode
// tests' tolerance, both pass their invariants, and the façade moved no page bytes over PCIe.
// TIERKV_E2E_STEPS overrides the step count (the sanitizer runs use fewer).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "policy_knobs.hpp"
#include "tiered_cache_kernels.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/attention/host_workspace.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/bf16.hpp"
#include "tierkv/compaction/document_index.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/prefix_index.hpp"
#include "tierkv/tiering/conversion.hpp"

namespace {

using namespace tierkv;
using G = cuda_test::e2e_geometry;
using TL = cuda_test::e2e_tiers;
using host_storage = paged_storage<G, TL, host_allocator>;
using host_ctl = tier_controller<host_storage>;
constexpr int D = G::head_dim, KVH = G::kv_heads, QH = G::q_heads, T = G::page_tokens;
constexpr int layers = 3;
constexpr std::uint32_t tier0_pages = 90;  // 30 blocks of 3 layers

policy::recency_anchor knobs() {
  return policy::recency_anchor(tierkv_test::recency_knobs(2, 1, 1.0f, 3.0f, 1.5f, 2));
}

storage_options<2> storage_opts() {
  storage_options<2> o;
  o.num_layers = layers;
  o.max_sequences = 12;
  o.pages_per_tier = {tier0_pages,
                      1500};  // tier 0 runs short under prefill bursts: make_room demotes
  o.codec_seed = 91;
  o.head_base = 0;
  return o;
}

// Token bytes (payload and meta of every head's key and value) of the first `tokens` tokens.
template <class Layout, class K, class V>
bool same_tokens(const std::uint8_t* a, const std::uint8_t* b, int tokens) {
  for (int h = 0; h < KVH; ++h)
    for (int t = 0; t < tokens; ++t) {
      if (std::memcmp(a + Layout::key_payload(h, t), b + Layout::key_payload(h, t),
                      K::payload_bytes) != 0 ||
          std::memcmp(a + Layout::value_payload(h, t), b + Layout::value_payload(h, t),
                      V::payload_bytes) != 0 ||
          std::memcmp(a + Layout::key_meta(h, t), b + Layout::key_meta(h, t), K::meta_bytes) != 0 ||
          std::memcmp(a + Layout::value_meta(h, t), b + Layout::value_meta(h, t), V::meta_bytes) !=
              0)
        return false;
    }
  return true;
}

template <int F>
bool same_page(const std::vector<std::uint8_t>& gpu_pool, page_id gp, host_storage& twin,
               page_id tp, int tokens) {
  using tier = tier_at_t<TL, F>;
  using K = typename tier::template key_codec<D>;
  using V = typename tier::template value_codec<D>;
  using L = page_layout<G, K, V>;
  const std::uint8_t* a = gpu_pool.data() + std::size_t(gp.slot) * L::page_bytes;
  const std::uint8_t* b = twin.page_bytes(tp)->data();
  return same_tokens<L, K, V>(a, b, tokens);
}

// n standard normal floats a call, from one seeded stream.
struct normal_source {
  explicit normal_source(std::uint64_t seed) : rng(seed) {}
  std::vector<float> operator()(std::size_t n) {
    std::vector<float> x(n);
    for (auto& e : x) e = normal(rng);
    return x;
  }
  std::mt19937_64 rng;
  std::normal_distribution<float> normal{0.f, 1.f};
};

struct pair_seq {
  seq_id gpu, twin;
};

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The twin's retier: the controller's two-phase path (stage every conversion, fill on the host,
// commit in the driver's (from, to) order), which the GPU batch runs. Not apply(): there each
// demotion frees its tier-0 page before the next promotion is checked against the tier-0
// reserve, while a batch stages all its pages before any old page is released.
void twin_retier(host_storage& twin, host_ctl& ctl, std::uint64_t step) {
  const auto todo = ctl.plan(step);
  std::vector<staged_conversion> staged(todo.size());
  retier_stats st;
  const std::size_t n = ctl.stage(todo, std::span<staged_conversion>(staged), st);
  staged.resize(n);
  std::stable_sort(staged.begin(), staged.end(), [](const auto& a, const auto& b) {
    return std::pair(int(a.from.format), int(a.to.format)) <
           std::pair(int(b.from.format), int(b.to.format));
  });
  std::unique_ptr<bool[]> filled(new bool[n + 1]);
  for (std::size_t i = 0; i < n; ++i) {
    conversion_counters c;
    filled[i] = fill_conversion_on_host(twin, staged[i], c).is_ok();
  }
  ctl.commit(std::span<staged_conversion>(staged), std::span<const bool>(filled.get(), n), st);
  REQUIRE(st.failed == 0);
}

int steps_to_run() {
  if (const char* e = std::getenv("TIERKV_E2E_STEPS")) return std::max(1, std::atoi(e));
  return 1000;
}

}  // namespace

TEST_CASE("cuda::tiered_cache runs 1000 steps on device pools with 0 divergences from a host twin",
          "[cuda][cache][e2e]") {
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = knobs();
  auto gpu = std::move(cuda_test::e2e_cache::create(o).value());
  auto twin = std::move(host_storage::create(storage_opts()).value());
  auto tctl = std::move(host_ctl::create(*twin, knobs()).value());
  auto twin_room = [&](std::uint32_t pages) { return tctl->make_room(pages); };
  host_attention_workspace ws(1);
  const index_layout<2> layout{o.max_batch, o.max_pages};
  std::vector<std::uint8_t> host_index(layout.bytes() + 16);
  std::span<std::uint8_t> hbuf(
      host_index.data() + (16 - reinterpret_cast<std::uintptr_t>(host_index.data()) % 16) % 16,
      layout.bytes());
  std::vector<float> mass(std::size_t(o.max_batch) * o.max_pages);

  std::mt19937_64 rng(20261202);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<pair_seq> live;
  std::map<std::uint32_t, seq_id> twin_of;                 // gpu seq value -> twin seq
  std::map<std::uint32_t, std::vector<std::int32_t>> ids;  // gpu seq value -> its token ids
  prefix_index<host_storage> twin_prefixes(*twin);
  constexpr std::uint64_t salt = 7;
  std::uint64_t prefix_inserted = 0, prefix_starts = 0, prefix_tokens = 0, prefix_evicted = 0;
  gpu->set_mass_observer([&](seq_id s, int layer, std::span<const float> m) {
    REQUIRE(tctl->observe_mass(twin_of.at(s.value), layer, m).is_ok());
  });

  const int steps = steps_to_run();
  std::uint64_t divergences = 0, pages_compared = 0, forks = 0, releases = 0, prefills = 0;
  std::uint64_t decodes = 0, tokens_appended = 0;
  double worst_decode = 0, worst_prefill = 0;
  std::uint64_t prefill_calls = 0;
  for (int step = 1; step <= steps; ++step) {
    // ---- structural operations between steps, the same on both ----
    std::vector<std::uint32_t> fresh;  // new sequences this step (prefilled), gpu ids
    auto add_new = [&]() {
      const seq_id g = gpu->create_sequence().value();
      const seq_id t = twin->create_sequence().value();
      twin_of[g.value] = t;
      ids[g.value] = {};
      live.push_back({g, t});
      fresh.push_back(g.value);
    };
    auto drop = [&](std::size_t i) {
      REQUIRE(gpu->release(live[i].gpu).is_ok());
      REQUIRE(twin->release(live[i].twin).is_ok());
      ids.erase(live[i].gpu.value);
      live.erase(live.begin() + std::ptrdiff_t(i));
      ++releases;
    };
    if (live.size() < 2 || (live.size() < 8 && rng() % 25 == 0)) add_new();
    if (live.size() < 8 && live.size() >= 1 && rng() % 31 == 0) {
      const pair_seq p = live[rng() % live.size()];
      auto g = gpu->fork(p.gpu);
      auto t = twin->fork(p.twin, twin_room);
      REQUIRE(g.has_value() == t.has_value());
      if (g.has_value()) {
        twin_of[g->value] = *t;
        ids[g->value] = ids.at(p.gpu.value);
        live.push_back({*g, *t});
        ++forks;
      }
    }
    // Prefix reuse: cache a live sequence's full pages; start a sequence from a cached prefix
    // (a live sequence's token ids cut at a random point, with a new tail); evict now and then
    // (and when the entries would crowd the Stale pool).
    if (!live.empty() && rng() % 17 == 0) {
      const pair_seq p = live[rng() % live.size()];
      const std::vector<std::int32_t>& toks = ids.at(p.gpu.value);
      auto g = gpu->insert_prefix(p.gpu, salt, toks);
      auto t = twin_prefixes.insert(p.twin, salt, toks);
      REQUIRE(g.has_value() == t.has_value());
      if (g.has_value()) {
        REQUIRE(*g == *t);
        prefix_inserted += *g;
      }
    }
    if (live.size() < 8 && !live.empty() && rng() % 23 == 0) {
      const pair_seq p = live[rng() % live.size()];
      std::vector<std::int32_t> query(ids.at(p.gpu.value));
      // at most 700 tokens cached: its prefill chunk (<= 196) keeps it under max_pages
      query.resize(std::min<std::size_t>(query.size() * std::size_t(rng() % 101) / 100, 700));
      for (int i = 0; i < 20; ++i) query.push_back(std::int32_t(rng() % 50000));
      auto g = gpu->start_from_prefix(salt, query);
      auto t = twin_prefixes.start_sequence(salt, query);
      REQUIRE(g.has_value() == t.has_value());
      if (g.has_value()) {
        REQUIRE(g->second == t->cached_tokens);
        twin_of[g->first.value] = t->seq;
        ids[g->first.value].assign(query.begin(), query.begin() + std::ptrdiff_t(g->second));
        live.push_back({g->first, t->seq});
        fresh.push_back(g->first.value);
        ++prefix_starts;
        prefix_tokens += std::uint64_t(g->second);
      }
    }
    if (rng() % 41 == 0 || twin_prefixes.size() > 90) {
      const std::size_t n = 1 + rng() % 8;
      auto g = gpu->evict_prefixes(n);
      REQUIRE(g.has_value());
      REQUIRE(*g == twin_prefixes.evict(n));
      prefix_evicted += *g;
    }
    if (live.size() > 2 && rng() % 29 == 0) drop(rng() % live.size());
    // Sequences near max_pages are released (and a new one opened next step).
    for (std::size_t i = 0; i < live.size();) {
      if (*twin->length(live[i].twin) > (o.max_pages - 4) * T)
        drop(i);
      else
        ++i;
    }

    // ---- the step's tokens: a prefill chunk for new sequences, 1 token (sometimes 2-8) else ----
    std::vector<seq_id> gb, tb;
    std::vector<std::int32_t> counts;
    for (std::size_t i = 0; i < live.size(); ++i) {
      gb.push_back(live[i].gpu);
      tb.push_back(live[i].twin);
      std::int32_t n = rng() % 9 == 0 ? std::int32_t(2 + rng() % 7) : 1;
      if (std::find(fresh.begin(), fresh.end(), live[i].gpu.value) != fresh.end()) {
        n = std::int32_t(16 + rng() % 180);
        ++prefills;
      }
      if (rng() % 13 == 0) n = 0;  // a sequence that only decodes this step
      counts.push_back(n);
    }
    std::int32_t total = 0;
    for (auto n : counts) total += n;
    for (std::size_t b = 0; b < gb.size(); ++b)  // the step's token ids
      for (std::int32_t i = 0; i < counts[b]; ++i)
        ids.at(gb[b].value).push_back(std::int32_t(rng() % 50000));
    tokens_appended += std::uint64_t(total);
    const std::size_t vec = std::size_t(KVH) * D;
    std::vector<std::vector<float>> k(layers), v(layers);
    for (int l = 0; l < layers; ++l) {
      k[l].resize(std::size_t(total) * vec);
      v[l].resize(std::size_t(total) * vec);
      for (auto& x : k[l]) x = normal(rng);
      for (auto& x : v[l]) x = normal(rng);
    }

    INFO("step " << step << ", " << live.size() << " sequences, " << total << " new tokens");
    REQUIRE(gpu->begin_step(gb, counts).is_ok());
    // Twin: one make_room for the step, reserve all, write all, commit all (the GPU's order, so
    // make_room sees the same).
    std::uint64_t need = 0;
    for (std::size_t b = 0; b < tb.size(); ++b)
      need += twin->pages_to_open(tb[b], counts[b]).value();
    if (need > 0) REQUIRE(twin_room(std::uint32_t(need)).is_ok());
    for (std::size_t b = 0; b < tb.size(); ++b)
      if (counts[b] > 0) REQUIRE(twin->reserve(tb[b], counts[b], {}, twin_room).is_ok());
    for (int l = 0; l < layers; ++l) {
      std::size_t at = 0;
      for (std::size_t b = 0; b < tb.size(); ++b) {
        if (counts[b] == 0) continue;
        const std::size_t n = std::size_t(counts[b]) * vec;
        REQUIRE(twin->write_layer(tb[b], l, std::span<const float>(k[l].data() + at, n),
                                  std::span<const float>(v[l].data() + at, n))
                    .is_ok());
        at += n;
      }
    }
    for (std::size_t b = 0; b < tb.size(); ++b)
      if (counts[b] > 0) REQUIRE(twin->commit(tb[b], counts[b]).is_ok());

    // ---- the forward pass: append and decode per layer; the twin decodes on the host ----
    for (int l = 0; l < layers; ++l) {
      REQUIRE(gpu->append(l, k[l], v[l]).is_ok());
      std::vector<float> q(gb.size() * std::size_t(QH) * D);
      for (auto& x : q) x = normal(rng);
      std::vector<float> out;
      if (step % 25 == 0) {  // a soft-capped sliding-window layer's decode vs the host's (before
                             // the plain decode below, whose page mass the step keeps)
        const int window = 1 + (step * 7 + l) % 150;
        REQUIRE(gpu->decode(l, q, out, 30.f, window).is_ok());
        auto wv = build_batch_index(*twin, l, tb, layout, hbuf);
        REQUIRE(wv.has_value());
        const auto wpools = twin->views();
        host_decode_args<2> wa;
        wa.queries = q.data();
        wa.index = *wv;
        wa.pools = wpools.data();
        wa.source = layer_source{twin->config().codec_seed, l, twin->config().head_base};
        wa.logits = logit_params{1.f / std::sqrt(float(D)), 30.f};
        wa.window = window;
        std::vector<float> wref(q.size());
        wa.out = wref.data();
        REQUIRE(host_decode<G, TL>(ws, wa).is_ok());
        INFO("layer " << l << " window " << window << " soft-capped decode rel_l2 vs host "
                      << rel_l2(out, wref));
        REQUIRE(rel_l2(out, wref) < 2e-3);
      }
      REQUIRE(gpu->decode(l, q, out).is_ok());
      ++decodes;
      // The device mirror's index arrays equal the host builder over the GPU storage.
      const auto dev = gpu->index_bytes(l);
      auto hv = build_batch_index(gpu->storage(), l, gb, layout, hbuf);
      REQUIRE(hv.has_value());
      for (std::size_t b = 0; b < gb.size(); ++b)
        REQUIRE(reinterpret_cast<const std::int32_t*>(dev.data())[b] == hv->seq_len[b]);
      for (int f = 0; f < 2; ++f) {
        const auto* di =
            reinterpret_cast<const std::int32_t*>(dev.data() + layout.indptr_offset(f));
        const auto* ds = reinterpret_cast<const std::int32_t*>(dev.data() + layout.slot_offset(f));
        const auto* dl =
            reinterpret_cast<const std::int32_t*>(dev.data() + layout.logical_offset(f));
        for (std::size_t b = 0; b <= gb.size(); ++b) REQUIRE(di[b] == hv->formats[f].indptr[b]);
        for (std::int32_t e = 0; e < hv->formats[f].indptr[gb.size()]; ++e) {
          REQUIRE(ds[e] == hv->formats[f].slot[e]);
          REQUIRE(dl[e] == hv->formats[f].logical[e]);
        }
      }
      // Host decode over the twin.
      auto tv = build_batch_index(*twin, l, tb, layout, hbuf);
      REQUIRE(tv.has_value());
      const auto pools = twin->views();
      host_decode_args<2> a;
      a.queries = q.data();
      a.index = *tv;
      a.pools = pools.data();
      a.source = layer_source{twin->config().codec_seed, l, twin->config().head_base};
      a.logits = logit_params{1.f / std::sqrt(float(D)), 0.f};
      std::vector<float> ref(q.size());
      a.out = ref.data();
      a.page_mass = mass.data();
      a.mass_stride = o.max_pages;
      REQUIRE(host_decode<G, TL>(ws, a).is_ok());
      const double err = rel_l2(out, ref);
      worst_decode = std::max(worst_decode, err);
      INFO("layer " << l << " decode rel_l2 vs host " << err);
      REQUIRE(err < 2e-3);

      // Chunked prefill of the step's new tokens on the GPU vs host_prefill over the twin.
      if (total > 0) {
        std::vector<float> pq(std::size_t(total) * QH * D), pout;
        for (auto& x : pq) x = normal(rng);
        REQUIRE(gpu->prefill(l, pq, pout).is_ok());
        ++prefill_calls;
        std::vector<std::int32_t> qo(1, 0);
        for (auto n : counts) qo.push_back(qo.back() + n);
        host_prefill_args<2> pa;
        pa.queries = pq.data();
        pa.q_indptr = qo.data();
        pa.index = *tv;
        pa.pools = pools.data();
        pa.source = a.source;
        pa.logits = a.logits;
        std::vector<float> pref(pq.size());
        pa.out = pref.data();
        REQUIRE(host_prefill<G, TL>(ws, pa).is_ok());
        const double perr = rel_l2(pout, pref);
        worst_prefill = std::max(worst_prefill, perr);
        if (perr >= 4e-3) {  // which sequences' rows differ
          for (std::size_t b = 0; b < gb.size(); ++b) {
            const std::size_t r0 = std::size_t(qo[b]) * QH * D,
                              r1 = std::size_t(qo[b + 1]) * QH * D;
            std::vector<float> got(pout.begin() + std::ptrdiff_t(r0),
                                   pout.begin() + std::ptrdiff_t(r1));
            std::vector<float> want(pref.begin() + std::ptrdiff_t(r0),
                                    pref.begin() + std::ptrdiff_t(r1));
            std::size_t nans = 0;
            for (float x : got) nans += std::isnan(x) ? 1 : 0;
            UNSCOPED_INFO("  seq " << b << " n " << counts[b] << " len " << *twin->length(tb[b])
                                   << " rel " << (got.empty() ? 0.0 : rel_l2(got, want)) << " nans "
                                   << nans);
          }
        }
        INFO("layer " << l << " prefill rel_l2 vs host " << perr);
        REQUIRE(perr < 4e-3);
      }
    }
    REQUIRE(gpu->device_error().is_ok());

    // ---- end of step: masses -> policy, retier (blocking, so the twin's retier lines up) ----
    auto st = gpu->end_step(std::uint64_t(step), /*wait=*/true);
    REQUIRE(st.has_value());
    REQUIRE(st->failed == 0);
    twin_retier(*twin, *tctl, std::uint64_t(step));

    // ---- compare every page of every layer ----
    const auto pool0 = gpu->pool_bytes(0), pool1 = gpu->pool_bytes(1);
    for (const pair_seq& p : live) {
      const std::int64_t len = *twin->length(p.twin);
      REQUIRE(*gpu->storage().length(p.gpu) == len);
      const std::int64_t pages = *twin->logical_pages(p.twin);
      for (int l = 0; l < layers; ++l)
        for (std::int64_t i = 0; i < pages; ++i) {
          const page_id gp = *gpu->storage().page(p.gpu, l, i);
          const page_id tp = *twin->page(p.twin, l, i);
          const int tokens = int(std::min<std::int64_t>(T, len - i * T));
          ++pages_compared;
          bool same = gp.format == tp.format;
          if (same)
            same = gp.format == 0 ? same_page<0>(pool0, gp, *twin, tp, tokens)
                                  : same_page<1>(pool1, gp, *twin, tp, tokens);
          if (!same) {
            ++divergences;
            UNSCOPED_INFO("divergence: step " << step << " layer " << l << " page " << i << " gpu "
                                              << gp << " twin " << tp);
          }
        }
    }
    REQUIRE(divergences == 0);
    REQUIRE(gpu->check_invariants().is_ok());
    REQUIRE(tctl->check_invariants().is_ok());
    REQUIRE(twin_prefixes.check_invariants().is_ok());
    REQUIRE(gpu->storage().free_pages(0) == twin->free_pages(0));
    REQUIRE(gpu->storage().free_pages(1) == twin->free_pages(1));
  }
  const auto c = gpu->counters();
  CHECK(c.page_bytes == 0);
  if (steps >= 1000) {  // coverage of the full run (the sanitizer runs are shorter)
    CHECK(c.converted > 0);
    CHECK(c.pressure_demoted > 0);  // the pressure path ran
    CHECK(forks > 0);
    CHECK(prefix_starts > 0);
    CHECK(prefix_tokens > 0);  // some started from a cached prefix
    CHECK(prefix_evicted > 0);
  }
  std::printf(
      "e2e: steps %d, sequences <= 8, decodes %llu, tokens %llu, prefills %llu, forks %llu, "
      "releases %llu, pages compared %llu, host_twin_divergences %llu, conversions %llu "
      "(pressure %llu), worst decode rel_l2 vs host %.2e, prefill calls %llu, worst prefill "
      "rel_l2 vs host %.2e, metadata h2d %.1f B/step d2h %.1f B/step, page bytes over PCIe %llu, "
      "prefix entries inserted %llu, sequences started from a prefix %llu (%llu cached tokens), "
      "entries evicted %llu\n",
      steps, (unsigned long long)decodes, (unsigned long long)tokens_appended,
      (unsigned long long)prefills, (unsigned long long)forks, (unsigned long long)releases,
      (unsigned long long)pages_compared, (unsigned long long)divergences,
      (unsigned long long)c.converted, (unsigned long long)c.pressure_demoted, worst_decode,
      (unsigned long long)prefill_calls, worst_prefill, double(c.h2d) / steps,
      double(c.d2h) / steps, (unsigned long long)c.page_bytes, (unsigned long long)prefix_inserted,
      (unsigned long long)prefix_starts, (unsigned long long)prefix_tokens,
      (unsigned long long)prefix_evicted);
  for (const pair_seq& p : live) {
    REQUIRE(gpu->release(p.gpu).is_ok());
    REQUIRE(twin->release(p.twin).is_ok());
  }
  REQUIRE(*gpu->evict_prefixes(SIZE_MAX) == twin_prefixes.evict(SIZE_MAX));  // every entry now
  REQUIRE(twin_prefixes.size() == 0);
  REQUIRE(gpu->storage().free_pages(0) == tier0_pages);
  REQUIRE(gpu->storage().free_pages(1) == 1500);
}

TEST_CASE("cuda::tiered_cache refuses bad steps without changing anything", "[cuda][cache]") {
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = knobs();
  o.max_step_tokens = 1024;
  auto gpu = std::move(cuda_test::e2e_cache::create(o).value());
  const seq_id a = gpu->create_sequence().value();
  const seq_id b = gpu->create_sequence().value();
  std::vector<seq_id> batch{a, b};
  SECTION("mismatched counts, negative counts, a sequence twice, a stale id") {
    std::vector<std::int32_t> one{1};
    CHECK(gpu->begin_step(batch, one).code() == errc::invalid_argument);
    std::vector<std::int32_t> neg{1, -1};
    CHECK(gpu->begin_step(batch, neg).code() == errc::invalid_argument);
    std::vector<seq_id> twice{a, a};
    std::vector<std::int32_t> two{1, 1};
    CHECK(gpu->begin_step(twice, two).code() == errc::invalid_argument);
    REQUIRE(gpu->release(b).is_ok());
    CHECK(gpu->begin_step(batch, two).code() == errc::stale_id);
    CHECK(*gpu->storage().length(a) == 0);
  }
  SECTION("past max_pages, past max_step_tokens: nothing added") {
    std::vector<std::int32_t> big{o.max_pages * T + 1, 1};
    CHECK(gpu->begin_step(batch, big).code() == errc::out_of_range);
    std::vector<std::int32_t> many{o.max_step_tokens, 1};
    CHECK(gpu->begin_step(batch, many).code() == errc::capacity_exhausted);
    CHECK(*gpu->storage().length(a) == 0);
    CHECK(*gpu->storage().length(b) == 0);
  }
  SECTION("a step that tier 0 cannot hold even after demotion is refused whole") {
    // 90 tier-0 pages = 30 blocks of 3 layers; nothing is sealed yet, so nothing can be demoted.
    std::vector<std::int32_t> fill{15 * T, 16 * T};
    CHECK(gpu->begin_step(batch, fill).code() == errc::capacity_exhausted);
    CHECK(*gpu->storage().length(a) == 0);
    CHECK(*gpu->storage().length(b) == 0);
    CHECK(gpu->storage().free_pages(0) == tier0_pages);
    REQUIRE(gpu->check_invariants().is_ok());
  }
  SECTION("calls out of order") {
    std::vector<float> none;
    CHECK(gpu->append(0, none, none).code() == errc::invalid_argument);
    CHECK(gpu->end_step(1, false).error_status().code() == errc::invalid_argument);
    std::vector<std::int32_t> two{1, 1};
    REQUIRE(gpu->begin_step(batch, two).is_ok());
    CHECK(gpu->release(a).code() == errc::invalid_argument);
    CHECK(gpu->fork(a).error_status().code() == errc::invalid_argument);
    CHECK(gpu->begin_step(batch, two).code() == errc::invalid_argument);
    std::vector<float> kv(2 * std::size_t(KVH) * D, 0.5f);
    for (int l = 0; l < layers; ++l) REQUIRE(gpu->append(l, kv, kv).is_ok());
    CHECK(gpu->append(layers, kv, kv).code() == errc::out_of_range);
    REQUIRE(gpu->end_step(1, true).has_value());
    CHECK(*gpu->storage().length(a) == 1);
  }
}

namespace {

// The [nan] cases' cache (room for a prefill burst) and K/V rows of `tokens` tokens with
// distinct finite values.
std::unique_ptr<cuda_test::e2e_cache> nan_test_cache() {
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = knobs();
  o.max_step_tokens = 1024;
  return std::move(cuda_test::e2e_cache::create(o).value());
}
std::pair<std::vector<float>, std::vector<float>> distinct_kv(int tokens) {
  std::vector<float> k(std::size_t(tokens) * KVH * D), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = 0.01f * float(int(i % 97) - 48);
    v[i] = 0.02f * float(int(i % 89) - 44);
  }
  return {std::move(k), std::move(v)};
}

}  // namespace

TEST_CASE("cuda::tiered_cache: a NaN in appended K/V is reported, never a silent output",
          "[cuda][cache][nan]") {
  auto gpu = nan_test_cache();
  const seq_id a = gpu->create_sequence().value();
  const seq_id b = gpu->create_sequence().value();
  std::vector<seq_id> batch{a, b};
  std::vector<std::int32_t> counts{4, 4};
  // a prefill of 4 tokens each: one NaN in a's token 1, layer 1, KV head 0, dim 3 (key)
  REQUIRE(gpu->begin_step(batch, counts).is_ok());
  std::vector<float> q(2 * std::size_t(QH) * D, 0.25f), out;
  for (int l = 0; l < layers; ++l) {
    auto [k, v] = distinct_kv(8);
    if (l == 1) k[(1 * std::size_t(KVH) + 0) * D + 3] = std::numeric_limits<float>::quiet_NaN();
    REQUIRE(gpu->append(l, k, v).is_ok());  // enqueued: the device finds the NaN
  }
  REQUIRE(gpu->end_step(1, true).error_status().code() == errc::non_finite_input);
  counts = {1, 1};
  REQUIRE(gpu->begin_step(std::vector<seq_id>{b}, std::vector<std::int32_t>{1}).is_ok());
  std::vector<float> qb(std::size_t(QH) * D, 0.25f), kb(std::size_t(KVH) * D, 0.1f), ob;
  for (int l = 0; l < layers; ++l) {
    REQUIRE(gpu->append(l, kb, kb).is_ok());
    REQUIRE(gpu->decode(l, qb, ob).is_ok());
    for (float x : ob) CHECK(std::isfinite(x));  // the clean sequence decodes as before
  }
  REQUIRE(gpu->end_step(2, true).has_value());
  // a is refused from now on (every operation that would read or share its pages), until released
  const status refused = gpu->begin_step(batch, counts);
  CHECK(refused.code() == errc::non_finite_input);
  CHECK(std::string(refused.message()).find("position 1, layer 1") != std::string::npos);
  CHECK(gpu->fork(a).error_status().code() == errc::non_finite_input);
  CHECK(*gpu->storage().length(a) == 4);
  REQUIRE(gpu->release(a).is_ok());
  const seq_id c = gpu->create_sequence().value();
  REQUIRE(gpu->begin_step(std::vector<seq_id>{b, c}, counts).is_ok());
  for (int l = 0; l < layers; ++l) REQUIRE(gpu->append(l, q, q).is_ok());
  REQUIRE(gpu->end_step(3, true).has_value());
  REQUIRE(gpu->check_invariants().is_ok());
}

TEST_CASE("cuda::tiered_cache: a NaN key gives NaN outputs for the heads that read it",
          "[cuda][cache][nan]") {
  auto gpu = nan_test_cache();
  const seq_id a = gpu->create_sequence().value();
  const seq_id b = gpu->create_sequence().value();
  std::vector<seq_id> batch{a, b};
  REQUIRE(gpu->begin_step(batch, std::vector<std::int32_t>{1, 1}).is_ok());
  std::vector<float> kv(2 * std::size_t(KVH) * D, 0.1f), q(2 * std::size_t(QH) * D, 0.3f), out;
  std::vector<float> lse;
  kv[3] = std::numeric_limits<float>::infinity();  // a's token, KV head 0, key dim 3
  for (int l = 0; l < layers; ++l) {
    REQUIRE(gpu->append(l, kv, kv).is_ok());
    REQUIRE(gpu->decode(l, q, out, 0.f, 0, &lse).is_ok());
    for (int h = 0; h < QH; ++h) {
      const bool reads_it = h / G::group_size == 0;  // a's query heads of KV head 0
      for (int i = 0; i < D; ++i) {
        const float x = out[std::size_t(h) * D + std::size_t(i)];
        CHECK((reads_it ? std::isnan(x) : std::isfinite(x)));
      }
      CHECK((reads_it ? std::isnan(lse[std::size_t(h)]) : std::isfinite(lse[std::size_t(h)])));
      for (int i = 0; i < D; ++i)  // b is clean
        CHECK(std::isfinite(out[std::size_t(QH + h) * D + std::size_t(i)]));
    }
  }
  CHECK(gpu->device_error().code() == errc::non_finite_input);
  REQUIRE(gpu->end_step(1, true).error_status().code() == errc::non_finite_input);
}

TEST_CASE("cuda::tiered_cache: a NaN key gives NaN prefill outputs for the rows that read it",
          "[cuda][cache][nan]") {
  // A prefill of 4 tokens each into a and b; a's token 1 has a NaN key (KV head 0, dim 3). Causal:
  // a's token 0 does not read it, a's tokens 1-3 do (query heads of KV head 0 only); b is clean.
  auto gpu = nan_test_cache();
  const seq_id a = gpu->create_sequence().value();
  const seq_id b = gpu->create_sequence().value();
  REQUIRE(gpu->begin_step(std::vector<seq_id>{a, b}, std::vector<std::int32_t>{4, 4}).is_ok());
  std::vector<float> q(8 * std::size_t(QH) * D, 0.3f), out, lse;
  for (int l = 0; l < layers; ++l) {
    auto [k, v] = distinct_kv(8);
    k[(1 * std::size_t(KVH) + 0) * D + 3] = std::numeric_limits<float>::quiet_NaN();
    REQUIRE(gpu->append(l, k, v).is_ok());
    REQUIRE(gpu->prefill(l, q, out, &lse).is_ok());
    for (int t = 0; t < 8; ++t)
      for (int h = 0; h < QH; ++h) {
        const bool reads_it = t >= 1 && t < 4 && h / G::group_size == 0;
        INFO("layer " << l << ", step row " << t << ", query head " << h);
        const std::size_t r = std::size_t(t) * QH + std::size_t(h);
        for (int i = 0; i < D; ++i) {
          const float x = out[r * D + std::size_t(i)];
          CHECK((reads_it ? std::isnan(x) : std::isfinite(x)));
        }
        CHECK((reads_it ? std::isnan(lse[r]) : std::isfinite(lse[r])));
      }
  }
  REQUIRE(gpu->end_step(1, true).error_status().code() == errc::non_finite_input);
}

TEST_CASE("cuda::tiered_cache: a prefill step feeds the page mass of each chunk's last row",
          "[cuda][cache][mass]") {
  // As the host cache's prefill: a sampled layer's prefill decodes each sequence's last chunk row
  // again, so prefill-only steps (a long prompt in chunks, a perplexity pass) give the policy
  // attention mass before pages are demoted. What is fed equals the mass of a decode step (no
  // new token) whose query is that row; a sequence with no new token in the step is not fed.
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = policy::recency_anchor(tierkv_test::recency_knobs(64, 1, 1.0f, 3.0f, 1.5f, 2));
  auto gpu = std::move(cuda_test::e2e_cache::create(o).value());    // every page stays in tier 0
  std::map<std::pair<std::uint32_t, int>, std::vector<float>> fed;  // (sequence, layer) -> mass
  gpu->set_mass_observer([&](seq_id s, int l, std::span<const float> m) {
    REQUIRE(fed.emplace(std::pair{s.value, l}, std::vector<float>(m.begin(), m.end())).second);
  });
  normal_source randn(20261206);
  const std::size_t vec = std::size_t(KVH) * D, qvec = std::size_t(QH) * D;
  std::vector<seq_id> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(gpu->create_sequence().value());
  {  // the third sequence's prompt first, so that it has pages but no token in the next step
    REQUIRE(gpu->begin_step(std::vector<seq_id>{seqs[2]}, std::vector<std::int32_t>{20}).is_ok());
    for (int l = 0; l < layers; ++l)
      REQUIRE(gpu->append(l, randn(20 * vec), randn(20 * vec)).is_ok());
    REQUIRE(gpu->end_step(0, true).has_value());
    fed.clear();
  }
  const std::vector<std::int32_t> counts{70, 37, 0};
  REQUIRE(gpu->begin_step(seqs, counts).is_ok());
  std::vector<std::vector<float>> last(layers);  // per layer: [batch][q_heads][head_dim]
  for (int l = 0; l < layers; ++l) {
    REQUIRE(gpu->append(l, randn(107 * vec), randn(107 * vec)).is_ok());
    const auto q = randn(107 * qvec);
    std::vector<float> out;
    REQUIRE(gpu->prefill(l, q, out).is_ok());
    last[std::size_t(l)].assign(3 * qvec, 0.f);
    for (std::size_t b = 0, end = 0; b < 2; ++b) {
      end += std::size_t(counts[b]);
      std::copy_n(q.begin() + std::ptrdiff_t((end - 1) * qvec), qvec,
                  last[std::size_t(l)].begin() + std::ptrdiff_t(b * qvec));
    }
  }
  REQUIRE(gpu->end_step(1, true).has_value());
  REQUIRE(fed.size() == std::size_t(2 * layers));  // not the sequence without new tokens
  const auto from_prefill = std::exchange(fed, {});

  REQUIRE(gpu->begin_step(seqs, std::vector<std::int32_t>{0, 0, 0}).is_ok());
  for (int l = 0; l < layers; ++l) {
    std::vector<float> out;
    REQUIRE(gpu->decode(l, last[std::size_t(l)], out).is_ok());
  }
  REQUIRE(gpu->end_step(2, true).has_value());
  for (const auto& [key, mass] : from_prefill) {
    INFO("sequence " << key.first << " layer " << key.second);
    const auto& want = fed.at(key);
    REQUIRE(mass.size() == want.size());
    REQUIRE(mass.size() == std::size_t(key.first == seqs[0].value ? 5 : 3));  // 70 and 37 tokens
    double sum = 0;
    for (std::size_t p = 0; p < mass.size(); ++p) {
      REQUIRE(std::abs(mass[p] - want[p]) <= 1e-5f);
      sum += mass[p];
    }
    REQUIRE(std::abs(sum - 1.0) < 1e-3);
  }
}

TEST_CASE("cuda::tiered_cache: a step captured in a CUDA graph replays as eager steps run",
          "[cuda][cache][graph]") {
  // Twins on the GPU: `eager` calls append/decode every step; `graphed` captures one step's
  // forward pass (every layer's append, then decode) and replays it at every later step. Both
  // get the same tokens and queries; the graph keeps the decode plan of its capture, so outputs
  // agree to rounding, and the page masses it computes reach the policy without the host
  // calling decode (the device marks what ran), so every page's tier stays the same.
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = knobs();
  o.mass_layers_per_step = 1;  // one layer's mass fed a step, in turn
  auto eager = std::move(cuda_test::e2e_cache::create(o).value());
  auto graphed = std::move(cuda_test::e2e_cache::create(o).value());
  std::uint64_t fed[2] = {0, 0};
  eager->set_mass_observer([&](seq_id, int, std::span<const float>) { ++fed[0]; });
  graphed->set_mass_observer([&](seq_id, int, std::span<const float>) { ++fed[1]; });

  normal_source randn(20261203);
  const std::size_t vec = std::size_t(KVH) * D, qvec = std::size_t(QH) * D;
  std::vector<seq_id> se, sg;
  for (int i = 0; i < 3; ++i) {
    se.push_back(eager->create_sequence().value());
    sg.push_back(graphed->create_sequence().value());
  }
  {  // a prefill of 40, 70 and 23 tokens, eagerly on both
    const std::vector<std::int32_t> counts{40, 70, 23};
    REQUIRE(eager->begin_step(se, counts).is_ok());
    REQUIRE(graphed->begin_step(sg, counts).is_ok());
    for (int l = 0; l < layers; ++l) {
      const auto k = randn(133 * vec), v = randn(133 * vec);
      REQUIRE(eager->append(l, k, v).is_ok());
      REQUIRE(graphed->append(l, k, v).is_ok());
    }
    REQUIRE(eager->end_step(1, true).has_value());
    REQUIRE(graphed->end_step(1, true).has_value());
  }
  const std::vector<std::int32_t> ones(3, 1);
  double worst = 0;
  int bf16_checked = 0;
  for (int step = 2; step <= 80; ++step) {
    INFO("step " << step);
    std::vector<std::vector<float>> k(layers), v(layers), q(layers), outs;
    for (int l = 0; l < layers; ++l) {
      k[l] = randn(3 * vec);
      v[l] = randn(3 * vec);
      q[l] = randn(3 * qvec);
    }
    REQUIRE(eager->begin_step(se, ones).is_ok());
    std::vector<std::vector<float>> ref(layers);
    for (int l = 0; l < layers; ++l) {
      REQUIRE(eager->append(l, k[l], v[l]).is_ok());
      REQUIRE(eager->decode(l, q[l], ref[l]).is_ok());
    }
    if (step % 7 == 0) {  // bf16 outputs are the f32 outputs rounded once, bit for bit
      std::vector<std::uint16_t> out16;
      REQUIRE(eager->decode_bf16(0, q[0], out16).is_ok());
      for (std::size_t i = 0; i < out16.size(); ++i) REQUIRE(out16[i] == float_to_bf16(ref[0][i]));
      ++bf16_checked;
    }
    if (step == 30) {  // set_stream between steps; a later replay runs on the new stream
      REQUIRE(graphed->move_to_new_stream().is_ok());
    }
    REQUIRE(graphed->begin_step(sg, ones).is_ok());
    if (step == 2) {
      CHECK(graphed->decode_on_other_stream(0).code() == errc::invalid_argument);
      CHECK(graphed->move_to_new_stream().code() == errc::invalid_argument);  // inside a step
      REQUIRE(graphed->capture_step().is_ok());  // records, runs nothing: replay runs the step
    }
    REQUIRE(graphed->replay_step(k, v, q, outs).is_ok());
    for (int l = 0; l < layers; ++l) {
      std::size_t nan_graph = 0, nan_eager = 0;
      for (std::size_t i = 0; i < outs[l].size(); ++i) {
        nan_graph += std::isnan(outs[l][i]) ? 1 : 0;
        nan_eager += std::isnan(ref[l][i]) ? 1 : 0;
      }
      INFO("NaNs: graph " << nan_graph << " eager " << nan_eager << " of " << outs[l].size());
      const double err = rel_l2(outs[l], ref[l]);
      worst = std::max(worst, err);
      INFO("layer " << l << " graph vs eager rel_l2 " << err);
      REQUIRE(err < 1e-5);
    }
    REQUIRE(eager->device_error().is_ok());
    REQUIRE(graphed->device_error().is_ok());
    REQUIRE(eager->end_step(std::uint64_t(step), true).has_value());
    REQUIRE(graphed->end_step(std::uint64_t(step), true).has_value());
    REQUIRE(fed[1] == fed[0]);
    for (std::size_t i = 0; i < se.size(); ++i)
      for (int l = 0; l < layers; ++l) {
        const std::int64_t pages = *eager->storage().logical_pages(se[i]);
        for (std::int64_t p = 0; p < pages; ++p)
          REQUIRE(eager->storage().page(se[i], l, p)->format ==
                  graphed->storage().page(sg[i], l, p)->format);
      }
  }
  CHECK(fed[0] == 79u * 3u);  // one layer a step, every sequence decoded
  CHECK(bf16_checked > 0);
  CHECK(graphed->counters().converted > 0);
  std::printf("graph: 79 steps replayed, worst rel_l2 vs eager %.2e, masses fed %llu\n", worst,
              (unsigned long long)fed[1]);
}

// ---- fault injection (issue 24): every conversion step of every façade operation that converts
namespace {

// What a fault may not change: every logical page's tier and token bytes, the pools' free
// counts, the sequences' lengths and the retier totals.
struct cache_state {
  std::vector<std::int64_t> lengths;
  std::vector<int> formats;  // [seq][page][layer]
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<std::uint32_t> free_pages;
  std::uint64_t converted = 0, failed = 0, pressure_demoted = 0;
};

template <int F>
std::vector<std::uint8_t> token_bytes(const std::vector<std::uint8_t>& pool, std::uint32_t slot,
                                      int tokens) {
  using tier = tier_at_t<TL, F>;
  using K = typename tier::template key_codec<D>;
  using V = typename tier::template value_codec<D>;
  using L = page_layout<G, K, V>;
  const std::uint8_t* p = pool.data() + std::size_t(slot) * L::page_bytes;
  std::vector<std::uint8_t> out;
  auto put = [&](std::size_t at, std::size_t n) { out.insert(out.end(), p + at, p + at + n); };
  for (int h = 0; h < KVH; ++h)
    for (int t = 0; t < tokens; ++t) {
      put(L::key_payload(h, t), K::payload_bytes);
      put(L::key_meta(h, t), K::meta_bytes);
      put(L::value_payload(h, t), V::payload_bytes);
      put(L::value_meta(h, t), V::meta_bytes);
    }
  return out;
}

cache_state state_of(cuda_test::e2e_cache& c, const std::vector<seq_id>& seqs, int num_layers) {
  cache_state s;
  const std::vector<std::uint8_t> pools[2] = {c.pool_bytes(0), c.pool_bytes(1)};
  auto& st = c.storage();
  for (const seq_id q : seqs) {
    const std::int64_t len = *st.length(q);
    s.lengths.push_back(len);
    const std::int64_t pages = *st.logical_pages(q);
    for (std::int64_t p = 0; p < pages; ++p)
      for (int l = 0; l < num_layers; ++l) {
        const page_id pg = *st.page(q, l, p);
        const int tokens = int(std::min<std::int64_t>(T, len - p * T));
        s.formats.push_back(int(pg.format));
        s.bytes.push_back(pg.format == 0 ? token_bytes<0>(pools[0], pg.slot, tokens)
                                         : token_bytes<1>(pools[1], pg.slot, tokens));
      }
  }
  for (int f = 0; f < 2; ++f) s.free_pages.push_back(st.free_pages(f));
  const auto k = c.counters();
  s.converted = k.converted;
  s.failed = k.failed;
  s.pressure_demoted = k.pressure_demoted;
  return s;
}

// A cache whose tier 0 (12 pages, 2 layers) is full after a prefill of a (64 tokens: 4 sealed
// pages) and b (20 tokens: one sealed, one open). recent: the policy's recent pages (1: the
// prefill's end_step demotes what aged out; 16: nothing ages out). No anchors.
struct fault_world {
  std::unique_ptr<cuda_test::e2e_cache> c;
  std::vector<seq_id> seqs;
};

constexpr int fault_layers = 2;

fault_world make_fault_world(int recent, bool end_prefill) {
  cuda_test::e2e_options o;
  o.storage.num_layers = fault_layers;
  o.storage.max_sequences = 4;
  o.storage.pages_per_tier = {12, 64};
  o.storage.codec_seed = 7;
  o.storage.head_base = 0;
  o.policy = policy::recency_anchor(tierkv_test::recency_knobs(recent, 0, 1.0f, 1e30f, 1e29f, 0));
  o.max_batch = 4;
  o.max_pages = 16;
  o.max_step_tokens = 128;
  fault_world w;
  w.c = std::move(cuda_test::e2e_cache::create(o).value());
  w.seqs = {w.c->create_sequence().value(), w.c->create_sequence().value()};
  const std::vector<std::int32_t> counts{64, 20};
  REQUIRE(w.c->begin_step(w.seqs, counts).is_ok());
  std::mt19937_64 rng(424242);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int l = 0; l < fault_layers; ++l) {
    std::vector<float> k(84 * std::size_t(KVH) * D), v(k.size());
    for (auto& e : k) e = normal(rng);
    for (auto& e : v) e = normal(rng);
    REQUIRE(w.c->append(l, k, v).is_ok());
  }
  if (end_prefill) REQUIRE(w.c->end_step(0, true).has_value());
  REQUIRE(w.c->storage().free_pages(0) == 0);
  return w;
}

// One operation swept: the world it starts from, the call, whether it may absorb a fault.
struct fault_op {
  const char* name;
  int recent;
  bool end_prefill;
  std::function<status(fault_world&)> run;
  bool refuses;  // a fault refuses the call (else: conversions fail one by one, the call succeeds)
};

}  // namespace

TEST_CASE(
    "cuda::tiered_cache: a fault at every conversion step refuses with nothing changed, "
    "or fails only the conversions it hits",
    "[cuda][cache][faults]") {
  const std::vector<fault_op> ops = {
      // begin_step needing 4 tier-0 pages: make_room demotes 4 sealed pages, all or none
      {"pressured begin_step", 16, true,
       [](fault_world& w) {
         const std::vector<seq_id> b{w.seqs[1]};
         return w.c->begin_step(b, std::vector<std::int32_t>{32});
       },
       true},
      // fork of b copies its open tail page into tier 0 (one page per layer): make_room first
      {"pressured fork", 16, true,
       [](fault_world& w) { return w.c->fork(w.seqs[1]).error_status(); }, true},
      // the prefill's end_step: the policy demotes the pages that aged out, one batch
      {"end_step retier", 1, false,
       [](fault_world& w) { return w.c->end_step(0, true).error_status(); }, false},
  };
  int points = 0;
  for (const fault_op& op : ops) {
    INFO(op.name);
    cache_state clean, before;
    std::int64_t calls = 0;
    {
      fault_world w = make_fault_world(op.recent, op.end_prefill);
      before = state_of(*w.c, w.seqs, fault_layers);
      REQUIRE(op.run(w).is_ok());
      REQUIRE(w.c->check_invariants().is_ok());
      clean = state_of(*w.c, w.seqs, fault_layers);
      calls = w.c->faults().calls;
    }
    REQUIRE(calls >= 6);  // every op converts at least two pages (3 steps each)
    for (std::int64_t k = 0; k < calls; ++k) {
      INFO("fault at call " << k << " of " << calls);
      fault_world w = make_fault_world(op.recent, op.end_prefill);
      REQUIRE(state_of(*w.c, w.seqs, fault_layers).bytes == before.bytes);
      w.c->faults().fail_at = k;
      const status st = op.run(w);
      REQUIRE(w.c->faults().calls > k);  // the fault fired
      REQUIRE(w.c->check_invariants().is_ok());
      REQUIRE(w.c->device_error().is_ok());
      const cache_state after = state_of(*w.c, w.seqs, fault_layers);
      if (op.refuses) {
        REQUIRE(st.code() == errc::injected_fault);
        CHECK(after.lengths == before.lengths);
        CHECK(after.formats == before.formats);
        CHECK(after.bytes == before.bytes);
        CHECK(after.free_pages == before.free_pages);
        CHECK(after.converted == before.converted);
        CHECK(after.failed == before.failed);
        CHECK(after.pressure_demoted == before.pressure_demoted);
        // nothing is left half done: the same call without the fault then succeeds as in the
        // clean run
        w.c->faults().fail_at = -1;
        REQUIRE(op.run(w).is_ok());
        const cache_state retried = state_of(*w.c, w.seqs, fault_layers);
        CHECK(retried.formats == clean.formats);
        CHECK(retried.bytes == clean.bytes);
      } else {
        REQUIRE(st.is_ok());
        REQUIRE(after.lengths == clean.lengths);
        CHECK(after.failed > 0);
        // every logical page is its page before the call or its page after the clean call
        for (std::size_t i = 0; i < after.formats.size(); ++i) {
          const bool as_before =
              after.formats[i] == before.formats[i] && after.bytes[i] == before.bytes[i];
          const bool as_clean =
              after.formats[i] == clean.formats[i] && after.bytes[i] == clean.bytes[i];
          INFO("page " << i);
          CHECK((as_before || as_clean));
        }
        CHECK(after.converted < clean.converted);
        CHECK(after.converted + after.failed >= clean.converted);
      }
      ++points;
    }
  }
  std::printf(
      "gpu faults: %d injected (pressured begin_step, pressured fork, end_step retier), "
      "0 lost or changed pages\n",
      points);
}

namespace {

// Float64 attention of one query head over the first n tokens of a sequence's layer
// ([token][kv_head][dim] floats): out (D floats) and the natural-log lse.
void exact_attention(const float* q, int kvh, const std::vector<float>& k,
                     const std::vector<float>& v, int n, double scale, double* out, double& lse) {
  const std::size_t vec = std::size_t(KVH) * D;
  std::vector<double> s(static_cast<std::size_t>(n));
  double mx = -INFINITY;
  for (int t = 0; t < n; ++t) {
    double dot = 0;
    for (int d = 0; d < D; ++d)
      dot += double(q[d]) * k[std::size_t(t) * vec + std::size_t(kvh) * D + std::size_t(d)];
    s[std::size_t(t)] = scale * dot;
    mx = std::max(mx, s[std::size_t(t)]);
  }
  double sum = 0;
  for (int d = 0; d < D; ++d) out[d] = 0;
  for (int t = 0; t < n; ++t) {
    const double w = std::exp(s[std::size_t(t)] - mx);
    sum += w;
    for (int d = 0; d < D; ++d)
      out[d] += w * v[std::size_t(t) * vec + std::size_t(kvh) * D + std::size_t(d)];
  }
  for (int d = 0; d < D; ++d) out[d] /= sum;
  lse = mx + std::log(sum);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}

}  // namespace

TEST_CASE(
    "cuda::tiered_cache with centring: pages, outputs and lse as the host façade's, and keys "
    "with per-channel offsets much closer to exact than without",
    "[cuda][cache][centering]") {
  // Two sequences prefill n0 tokens (one chunk), the policy demotes their old pages to TQ3,
  // then one decode step. Keys carry a per-channel offset 5x their spread, values 2x (what QK
  // biases and massive activations give real models; docs/codecs.md "Centring"). Three caches
  // get the same input: the GPU façade with centring (`gc`), without (`gu`), and the host
  // façade with centring (`hc`, the reference implementation). Means estimated from the first
  // tokens, then given by set_centering.
  using host_cache = tiered_cache<G, TL>;
  // by age alone, from the first step on: all but the sink page and the 2 newest go to TQ3
  const policy::recency_anchor age_only(tierkv_test::recency_knobs(2, 1, 1.0f, 1e30f, 1e29f, 0));
  constexpr int n0 = 160, n = n0 + 1;
  const double scale = 1.0 / std::sqrt(double(D));
  const std::size_t vec = std::size_t(KVH) * D, qvec = std::size_t(QH) * D;
  std::mt19937_64 rng(20261204);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<std::vector<float>> off_k(layers, std::vector<float>(vec)), off_v = off_k;
  for (int l = 0; l < layers; ++l)
    for (std::size_t i = 0; i < vec; ++i) {
      off_k[std::size_t(l)][i] = 5.f * normal(rng);
      off_v[std::size_t(l)][i] = 2.f * normal(rng);
    }
  // [seq][layer] -> [token][kv_head][dim]; queries [layer] -> [rows][q_heads][dim]
  std::vector<std::vector<float>> K[2], V[2];
  for (int s = 0; s < 2; ++s)
    for (int l = 0; l < layers; ++l) {
      std::vector<float> k(std::size_t(n) * vec), v(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = normal(rng) + off_k[std::size_t(l)][i % vec];
        v[i] = normal(rng) + off_v[std::size_t(l)][i % vec];
      }
      K[s].push_back(std::move(k));
      V[s].push_back(std::move(v));
    }
  std::vector<std::vector<float>> q_pre(layers), q_dec(layers);
  for (int l = 0; l < layers; ++l) {
    q_pre[std::size_t(l)].resize(2 * std::size_t(n0) * qvec);
    q_dec[std::size_t(l)].resize(2 * qvec);
    for (auto& e : q_pre[std::size_t(l)]) e = normal(rng);
    for (auto& e : q_dec[std::size_t(l)]) e = normal(rng);
  }
  // tokens [first, first + count) of both sequences, in batch order, for one layer
  auto step_rows = [&](const std::vector<std::vector<float>>(&X)[2], int l, int first, int count) {
    std::vector<float> out;
    for (int s = 0; s < 2; ++s)
      out.insert(out.end(), X[s][std::size_t(l)].begin() + std::ptrdiff_t(first * vec),
                 X[s][std::size_t(l)].begin() + std::ptrdiff_t((first + count) * vec));
    return out;
  };
  // the host façade's append layout: [layer][token][kv_head][dim]
  auto host_rows = [&](const std::vector<std::vector<float>>(&X)[2], int s, int first, int count) {
    std::vector<float> out;
    for (int l = 0; l < layers; ++l)
      out.insert(out.end(), X[s][std::size_t(l)].begin() + std::ptrdiff_t(first * vec),
                 X[s][std::size_t(l)].begin() + std::ptrdiff_t((first + count) * vec));
    return out;
  };

  for (const bool given : {false, true}) {
    INFO((given ? "means given by set_centering" : "means estimated from the first tokens"));
    struct run {
      std::unique_ptr<cuda_test::e2e_cache> c;
      seq_id s[2];
      std::vector<std::vector<float>> pout, plse, dout, dlse;
    };
    run gc, gu;
    for (run* r : {&gc, &gu}) {
      cuda_test::e2e_options o;
      o.storage = storage_opts();
      o.policy = age_only;
      o.center = r == &gc;
      r->c = std::move(cuda_test::e2e_cache::create(o).value());
      if (given && o.center)
        for (int l = 0; l < layers; ++l)
          REQUIRE(r->c->set_centering(l, off_k[std::size_t(l)], off_v[std::size_t(l)]).is_ok());
      for (seq_id& s : r->s) s = r->c->create_sequence().value();
    }
    host_cache::options ho;
    ho.storage = storage_opts();
    ho.policy = age_only;
    ho.max_batch = 8;
    ho.max_pages = 64;
    ho.center = true;
    auto hc = std::move(host_cache::create(ho).value());
    // The GPU estimates from its first append, the prefill chunk of both sequences; the host
    // appends a sequence at a time, so it is given the float64 means of those same tokens (the
    // estimate's documented formula: pages equal only if the device computed exactly that).
    for (int l = 0; l < layers; ++l) {
      std::vector<float> mk = off_k[std::size_t(l)], mv = off_v[std::size_t(l)];
      if (!given) {
        const std::vector<float> k = step_rows(K, l, 0, n0), v = step_rows(V, l, 0, n0);
        for (std::size_t i = 0; i < vec; ++i) {
          double sk = 0, sv = 0;
          for (std::size_t t = 0; t < 2 * std::size_t(n0); ++t) {
            sk += double(k[t * vec + i]);
            sv += double(v[t * vec + i]);
          }
          mk[i] = float(sk / double(2 * n0));
          mv[i] = float(sv / double(2 * n0));
        }
      }
      REQUIRE(hc->set_centering(l, mk, mv).is_ok());
    }
    seq_id hs[2] = {hc->create_sequence().value(), hc->create_sequence().value()};

    // ---- the prefill step: one chunk of n0 tokens per sequence ----
    for (run* r : {&gc, &gu}) {
      const std::vector<seq_id> b{r->s[0], r->s[1]};
      REQUIRE(r->c->begin_step(b, std::vector<std::int32_t>{n0, n0}).is_ok());
      for (int l = 0; l < layers; ++l) {
        REQUIRE(r->c->append(l, step_rows(K, l, 0, n0), step_rows(V, l, 0, n0)).is_ok());
        std::vector<float> out, lse;
        REQUIRE(r->c->prefill(l, q_pre[std::size_t(l)], out, &lse).is_ok());
        r->pout.push_back(std::move(out));
        r->plse.push_back(std::move(lse));
      }
      REQUIRE(r->c->end_step(1, true).has_value());
      REQUIRE(r->c->device_error().is_ok());
    }
    CHECK(gc.c->centering_known(0));
    for (int s = 0; s < 2; ++s)
      REQUIRE(hc->append(hs[s], n0, host_rows(K, s, 0, n0), host_rows(V, s, 0, n0)).is_ok());
    twin_retier(hc->storage(), hc->controller(), 1);

    // ---- the decode step ----
    for (run* r : {&gc, &gu}) {
      const std::vector<seq_id> b{r->s[0], r->s[1]};
      REQUIRE(r->c->begin_step(b, std::vector<std::int32_t>{1, 1}).is_ok());
      for (int l = 0; l < layers; ++l) {
        REQUIRE(r->c->append(l, step_rows(K, l, n0, 1), step_rows(V, l, n0, 1)).is_ok());
        std::vector<float> out, lse;
        REQUIRE(r->c->decode(l, q_dec[std::size_t(l)], out, 0.f, 0, &lse).is_ok());
        r->dout.push_back(std::move(out));
        r->dlse.push_back(std::move(lse));
      }
      REQUIRE(r->c->device_error().is_ok());
    }
    for (int s = 0; s < 2; ++s)
      REQUIRE(hc->append(hs[s], 1, host_rows(K, s, n0, 1), host_rows(V, s, n0, 1)).is_ok());

    // ---- every page of every layer: the same tier and bytes on the GPU as on the host ----
    const auto pool0 = gc.c->pool_bytes(0), pool1 = gc.c->pool_bytes(1);
    int stale = 0;
    for (int s = 0; s < 2; ++s)
      for (int l = 0; l < layers; ++l)
        for (std::int64_t i = 0; i * T < n; ++i) {
          const page_id gp = *gc.c->storage().page(gc.s[s], l, i);
          const page_id tp = *hc->storage().page(hs[s], l, i);
          const int tokens = int(std::min<std::int64_t>(T, n - i * T));
          INFO("sequence " << s << " layer " << l << " page " << i);
          REQUIRE(gp.format == tp.format);
          stale += gp.format == 1;
          REQUIRE((gp.format == 0 ? same_page<0>(pool0, gp, hc->storage(), tp, tokens)
                                  : same_page<1>(pool1, gp, hc->storage(), tp, tokens)));
        }
    CHECK(stale > 0);  // TQ3 pages are in the comparison

    for (int l = 0; l < layers; ++l) {
      INFO("layer " << l);
      const std::vector<seq_id> hb{hs[0], hs[1]};
      std::vector<float> hout(2 * qvec), hlse(2 * QH);
      REQUIRE(hc->attend(l, hb, q_dec[std::size_t(l)], hout, {}, hlse).is_ok());
      // the GPU's centring is the host's: outputs and lse agree as the uncentred paths do
      CHECK(rel_l2(gc.dout[std::size_t(l)], hout) < 2e-3);
      CHECK(max_abs_diff(gc.dlse[std::size_t(l)], hlse) < 2e-3);
      // against float64 attention over the original tokens
      std::vector<float> dref(2 * qvec), dlse_ref(2 * QH), pref(2 * std::size_t(n0) * qvec),
          plse_ref(2 * std::size_t(n0) * QH);
      for (int s = 0; s < 2; ++s)
        for (int h = 0; h < QH; ++h) {
          double o[D], lse;
          exact_attention(q_dec[std::size_t(l)].data() + (std::size_t(s) * QH + h) * D,
                          h / G::group_size, K[s][std::size_t(l)], V[s][std::size_t(l)], n, scale,
                          o, lse);
          for (int d = 0; d < D; ++d) dref[(std::size_t(s) * QH + h) * D + d] = float(o[d]);
          dlse_ref[std::size_t(s) * QH + h] = float(lse);
          for (int t = 0; t < n0; ++t) {
            const std::size_t row = (std::size_t(s) * n0 + t) * QH + h;
            exact_attention(q_pre[std::size_t(l)].data() + row * D, h / G::group_size,
                            K[s][std::size_t(l)], V[s][std::size_t(l)], t + 1, scale, o, lse);
            for (int d = 0; d < D; ++d) pref[row * D + d] = float(o[d]);
            plse_ref[row] = float(lse);
          }
        }
      const double dc = rel_l2(gc.dout[std::size_t(l)], dref),
                   du = rel_l2(gu.dout[std::size_t(l)], dref);
      const double pc = rel_l2(gc.pout[std::size_t(l)], pref),
                   pu = rel_l2(gu.pout[std::size_t(l)], pref);
      const double dl = max_abs_diff(gc.dlse[std::size_t(l)], dlse_ref),
                   pl = max_abs_diff(gc.plse[std::size_t(l)], plse_ref);
      std::printf(
          "centring %s, layer %d: decode rel_l2 to exact %.4f (without centring %.4f), "
          "prefill %.4f (%.4f), max |lse - exact| decode %.4f prefill %.4f\n",
          given ? "given" : "estimated", l, dc, du, pc, pu, dl, pl);
      CHECK(dc < 0.5 * du);
      CHECK(pc < 0.5 * pu);
      CHECK(dl < 0.25);  // without the lse term it would be off by scale * q.mu_k (~5 here)
      CHECK(pl < 0.25);
    }

    // ---- refusals ----
    std::vector<float> out;
    CHECK(gc.c->decode(0, q_dec[0], out, 5.f).code() == errc::invalid_argument);  // soft-cap
    REQUIRE(gc.c->end_step(2, true).has_value());
    REQUIRE(gu.c->end_step(2, true).has_value());
    const std::vector<float> zeros(vec, 0.f);
    CHECK(gc.c->set_centering(0, zeros, zeros).code() == errc::invalid_argument);  // pages held
    CHECK(gu.c->set_centering(0, zeros, zeros).code() == errc::invalid_argument);  // no centring
  }

  // A graph capture must not estimate means (it would at every replay): refused, nothing run.
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = knobs();
  o.center = true;
  auto fresh = std::move(cuda_test::e2e_cache::create(o).value());
  const seq_id s = fresh->create_sequence().value();
  const std::vector<seq_id> b{s};
  REQUIRE(fresh->begin_step(b, std::vector<std::int32_t>{1}).is_ok());
  CHECK(fresh->capture_step().code() == errc::invalid_argument);
  CHECK_FALSE(fresh->centering_known(0));
  REQUIRE(fresh->end_step(1, true).has_value());
  const std::vector<float> bad(vec, NAN), ok(vec, 0.f), short_(vec - 1, 0.f);
  CHECK(fresh->set_centering(0, bad, ok).code() == errc::non_finite_input);
  CHECK(fresh->set_centering(0, short_, ok).code() == errc::invalid_argument);
  CHECK(fresh->set_centering(layers, ok, ok).code() == errc::out_of_range);
}

TEST_CASE("document_index over cuda::tiered_cache: a request forks the compacted document's pages",
          "[cuda][cache][document_index]") {
  cuda_test::e2e_options o;
  o.storage = storage_opts();
  o.policy = knobs();
  auto gpu = std::move(cuda_test::e2e_cache::create(o).value());
  compaction::document_index<cuda_test::e2e_cache> index(*gpu);
  // the compacted document: 40 tokens standing for a 256-token document
  const seq_id d = gpu->create_sequence().value();
  std::mt19937_64 rng(20261204);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::size_t vec = std::size_t(KVH) * D;
  REQUIRE(gpu->begin_step(std::vector<seq_id>{d}, std::vector<std::int32_t>{40}).is_ok());
  for (int l = 0; l < layers; ++l) {
    std::vector<float> k(40 * vec), v(k.size());
    for (auto& e : k) e = normal(rng);
    for (auto& e : v) e = normal(rng);
    REQUIRE(gpu->append(l, k, v).is_ok());
  }
  REQUIRE(gpu->end_step(1, true).has_value());
  std::vector<std::int32_t> request(300);
  for (auto& t : request) t = std::int32_t(rng() % 50000);
  REQUIRE(index.insert(d, 5, std::span<const std::int32_t>(request).first(256)).is_ok());
  const std::uint32_t free0 = gpu->storage().free_pages(0);

  auto s = index.start_sequence(5, request);
  REQUIRE(s.has_value());
  REQUIRE(s->has_value());
  const seq_id f = (*s)->seq;
  CHECK((*s)->document_tokens == 256);
  CHECK(*gpu->storage().length(f) == 40);
  CHECK(*gpu->storage().block_of(f, 0) == *gpu->storage().block_of(d, 0));  // sealed: shared
  CHECK(gpu->storage().free_pages(0) == free0 - layers);  // the open tail page copied per layer
  // decode over the fork equals decode over the document (both rows get the same query)
  REQUIRE(gpu->begin_step(std::vector<seq_id>{d, f}, std::vector<std::int32_t>{0, 0}).is_ok());
  std::vector<float> q(2 * std::size_t(QH) * D), out;
  for (std::size_t i = 0; i < q.size() / 2; ++i) q[i] = q[i + q.size() / 2] = normal(rng);
  for (int l = 0; l < layers; ++l) {
    REQUIRE(gpu->decode(l, q, out).is_ok());
    CHECK(std::equal(out.begin(), out.begin() + std::ptrdiff_t(out.size() / 2),
                     out.begin() + std::ptrdiff_t(out.size() / 2)));
  }
  // mid-step the cache refuses the release: eviction stops with the entry kept
  CHECK(index.evict(1).error_status().code() == errc::invalid_argument);
  CHECK(index.size() == 1);
  REQUIRE(gpu->end_step(2, true).has_value());
  REQUIRE(index.clear().is_ok());
  REQUIRE(gpu->release(f).is_ok());
  CHECK(gpu->storage().free_pages(0) == tier0_pages);
  REQUIRE(gpu->check_invariants().is_ok());
}
