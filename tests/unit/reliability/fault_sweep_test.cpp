// SPDX-License-Identifier: Apache-2.0
// Fault injection at every allocation and conversion step of every mutating operation of the
// host cache (issue 24): for each operation and each point k, a fresh cache in the same state
// has its k-th bookkeeping allocation (failing_allocator) or its k-th conversion step
// (fault_injector, the façade's fault hook) fail. A refused operation must leave everything
// observable as it was (report, page tables, refcounts, pool counts, totals, page bytes, the
// prefix index); one that absorbs the fault must still pass every invariant and hold every
// token within its codec's bound. The sweep of an operation ends at the first k its run never
// reaches, so a new allocation or conversion in an operation is swept without editing this file.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "reliability_support.hpp"
#include "tierkv/cache.hpp"

using namespace reliability_test;

namespace {

using cache_t = tiered_cache<tiny, two_tiers, policy::recency_anchor, host_allocator,
                             failing_allocator, tier_roles<two_tiers>, fault_injector>;
using storage_t = cache_t::storage_type;
constexpr int D = tiny::head_dim, QH = tiny::q_heads;

// A cache under pressure: tier 0 full, three sequences (sealed pages, an open tail, both), a
// prefix index over the storage. Deterministic, so every k starts from the same state.
struct world {
  std::unique_ptr<cache_t> c;
  std::unique_ptr<prefix_index<storage_t>> px;  // destroyed before the cache it points into
  seq_id a, b, t;
  std::map<std::uint32_t, std::vector<std::uint64_t>> tokens;  // seq_id::value -> token seeds

  std::vector<std::int32_t> ids(seq_id s) const {
    std::vector<std::int32_t> out;
    for (std::uint64_t x : tokens.at(s.value)) out.push_back(std::int32_t(x));
    return out;
  }
  status append(seq_id s, std::uint64_t first, int n) {
    status st = append_tokens(*c, s, first, n);
    if (st)
      for (std::uint64_t x : seeds_from(first, n)) tokens[s.value].push_back(x);
    return st;
  }
};

world make_world(bool shadows) {
  cache_t::options opt;
  opt.storage.num_layers = 2;
  opt.storage.max_sequences = 5;
  opt.storage.pages_per_tier = {14, 40};
  opt.policy = policy::recency_anchor({.recent_pages = 1,
                                       .sink_pages = 0,
                                       .min_dwell_steps = 0,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  opt.tiering.keep_shadows = shadows;
  opt.tiering.shadow_slack_percent = 0;
  opt.max_batch = 4;
  opt.max_pages = 16;
  world w;
  w.c = cache_t::create(opt).value();
  w.px = std::make_unique<prefix_index<storage_t>>(w.c->storage());
  w.a = w.c->create_sequence().value();
  w.b = w.c->create_sequence().value();
  w.t = w.c->create_sequence().value();
  REQUIRE(w.append(w.a, 1, 64));     // four sealed pages x 2 layers
  REQUIRE(w.append(w.b, 1000, 10));  // one open page
  REQUIRE(w.append(w.t, 2000, 20));  // one sealed, one open: 14 of 14 tier-0 pages
  REQUIRE(w.c->storage().free_pages(0) == 0);
  return w;
}

// Every invariant, and every token of the tracked sequences within its page's codec bound.
bool healthy(world& w, std::uint64_t& lost) {
  bool ok = w.c->check_invariants().is_ok() && w.px->check_invariants().is_ok() &&
            w.c->report().reconciles();
  for (const auto& [id, seeds] : w.tokens) {
    const seq_id s{id};
    if (!w.c->storage().contains(s)) continue;  // released by the operation
    if (w.c->length(s).value() != std::int64_t(seeds.size())) ok = false;
    for (int l = 0; l < 2; ++l)
      for (std::int64_t p = 0; p * 16 < std::int64_t(seeds.size()); ++p) {
        const page_error e = page_error_of(w.c->storage(), s, l, p, seeds);
        const bool lossy = w.c->storage().page(s, l, p).value().format != 0;
        if (!e.finite || e.max > (lossy ? tq3_vector_bound : fp8_vector_bound)) {
          ++lost;
          ok = false;
        }
      }
  }
  return ok;
}

struct operation {
  std::string name;
  std::function<void(world&)> pre;  // state the operation needs, not faulted
  std::function<status(world&)> run;
};

template <class T>
status status_of(const result<T>& r) {
  return r ? status{} : r.error_status();
}

std::vector<operation> operations() {
  const auto nothing = [](world&) {};
  const auto reserve_written = [](world& w) {
    REQUIRE(w.c->reserve(w.b, 20));
    std::vector<float> k, v;
    make_kv<storage_t>(2, seeds_from(5000, 20), k, v);  // [layer][token][head][dim]
    const std::size_t n = k.size() / 2;
    for (int l = 0; l < 2; ++l)
      REQUIRE(w.c->write_layer(w.b, l, std::span(k).subspan(std::size_t(l) * n, n),
                               std::span(v).subspan(std::size_t(l) * n, n)));
  };
  const auto cached_a = [](world& w) { REQUIRE(w.px->insert(w.a, 7, w.ids(w.a))); };
  return {
      {"create_sequence", nothing, [](world& w) { return status_of(w.c->create_sequence()); }},
      {"append (page list growth, make_room)", nothing,
       [](world& w) { return w.append(w.b, 3000, 40); }},
      {"append (into the open page)", nothing, [](world& w) { return w.append(w.b, 3000, 3); }},
      {"reserve (make_room)", nothing, [](world& w) { return w.c->reserve(w.b, 40); }},
      {"commit", reserve_written,
       [](world& w) {
         status st = w.c->commit(w.b, 20);
         if (st)
           for (std::uint64_t x : seeds_from(5000, 20)) w.tokens[w.b.value].push_back(x);
         return st;
       }},
      {"cancel", reserve_written, [](world& w) { return w.c->cancel(w.b); }},
      {"fork (tail copy, make_room)", nothing, [](world& w) { return status_of(w.c->fork(w.t)); }},
      {"fork (sealed pages only)", nothing, [](world& w) { return status_of(w.c->fork(w.a)); }},
      {"release", nothing, [](world& w) { return w.c->release(w.a); }},
      {"pin", nothing, [](world& w) { return w.c->pin(w.a, 0, 2); }},
      {"attend", nothing,
       [](world& w) {
         std::vector<seq_id> batch{w.a, w.b, w.t};
         std::vector<float> q(batch.size() * QH * D, 0.3f), out(q.size());
         return w.c->attend(1, batch, q, out);
       }},
      {"prefix insert", nothing,
       [](world& w) { return status_of(w.px->insert(w.a, 7, w.ids(w.a))); }},
      {"prefix start_sequence", cached_a,
       [](world& w) { return status_of(w.px->start_sequence(7, w.ids(w.a))); }},
      {"prefix evict",
       [=](world& w) {
         cached_a(w);
         REQUIRE(w.c->release(w.a));
       },
       [](world& w) {
         (void)w.px->evict(3);
         return status{};
       }},
  };
}

enum class fault_kind { allocation, conversion };

struct tally {
  std::uint64_t injected = 0, refused = 0, absorbed = 0, side_effects = 0, lost = 0;
};

// Sweeps one operation: returns the number of fault points it has.
std::uint64_t sweep(const operation& op, fault_kind kind, bool shadows, tally& t) {
  for (std::uint64_t k = 1;; ++k) {
    world w = make_world(shadows);
    op.pre(w);
    const std::string before = full_snapshot(*w.c) + std::to_string(w.px->size()) + ' ' +
                               std::to_string(w.px->evictable());
    auto& meta = w.c->storage().meta_alloc();
    const std::uint64_t meta_faults = meta.faults_injected();
    if (kind == fault_kind::allocation)
      meta.fail_on(k);
    else
      w.c->faults() = fault_injector{0, k, 0};
    const status st = op.run(w);
    const bool injected = kind == fault_kind::allocation ? meta.faults_injected() != meta_faults
                                                         : w.c->faults().injected != 0;
    meta.reset();
    w.c->faults() = fault_injector{};
    INFO(op.name << (kind == fault_kind::allocation ? ": allocation " : ": conversion step ") << k
                 << (shadows ? " (shadows)" : "") << ": " << st);
    if (!injected) {
      CHECK(st);  // every operation above succeeds without a fault
      CHECK(healthy(w, t.lost));
      return k - 1;
    }
    ++t.injected;
    if (st) {
      ++t.absorbed;
      CHECK(healthy(w, t.lost));
      continue;
    }
    ++t.refused;
    CHECK((st.code() == errc::injected_fault || st.code() == errc::capacity_exhausted));
    const std::string after = full_snapshot(*w.c) + std::to_string(w.px->size()) + ' ' +
                              std::to_string(w.px->evictable());
    if (after != before) ++t.side_effects;
    CHECK(after == before);
    CHECK(healthy(w, t.lost));
  }
}

}  // namespace

TEST_CASE("fault sweep: every allocation and conversion step of every mutating operation",
          "[reliability][faults]") {
  tally t;
  std::uint64_t points = 0;
  for (const bool shadows : {false, true})
    for (const operation& op : operations())
      for (const fault_kind kind : {fault_kind::allocation, fault_kind::conversion}) {
        const std::uint64_t n = sweep(op, kind, shadows, t);
        points += n;
        if (!shadows)
          std::printf("fault-sweep %-40s %-10s %3llu points\n", op.name.c_str(),
                      kind == fault_kind::allocation ? "allocation" : "conversion",
                      static_cast<unsigned long long>(n));
      }
  // The sweep reaches the points it is meant to: page-list growth and make_room's demotions.
  CHECK(points > 20);
  CHECK(t.refused > 0);
  CHECK(t.side_effects == 0);
  CHECK(t.lost == 0);
  print_metric("faults_injected_ops", double(t.injected));
  print_metric("fault_refusals", double(t.refused));
  print_metric("fault_absorbed", double(t.absorbed));
  print_metric("refusals_with_side_effects", double(t.side_effects));
  print_metric("fault_live_pages_lost", double(t.lost));
}

// retier is not all or nothing: a faulted conversion keeps its page, the others go on. Each
// fault point is checked against a twin that ran the same retier without a fault: exactly the
// faulted page differs, and it is byte for byte the page it was before.
TEST_CASE("fault sweep: every conversion step of a retier keeps the faulted page, moves the rest",
          "[reliability][faults]") {
  std::uint64_t injected = 0, lost = 0;
  for (const bool shadows : {false, true})
    for (std::uint64_t k = 1;; ++k) {
      world w1 = make_world(shadows), w2 = make_world(shadows);
      struct page_copy {
        page_id id;
        std::vector<std::uint8_t> bytes;
      };
      const auto pages_of = [](world& w) {
        std::vector<page_copy> out;
        for (seq_id s : {w.a, w.b, w.t})
          for (int l = 0; l < 2; ++l)
            w.c->storage().for_each_page(s, l, [&](std::int64_t, page_id p) {
              out.push_back({p, bytes_of(w.c->storage(), p)});
            });
        return out;
      };
      const auto pre = pages_of(w1);
      const std::uint64_t requests = w1.c->storage().meta_alloc().requests();
      w1.c->faults() = fault_injector{0, k, 0};
      const retier_stats s1 = w1.c->retier(1);
      const retier_stats s2 = w2.c->retier(1);
      CHECK(w1.c->storage().meta_alloc().requests() == requests);  // retier allocates nothing
      INFO("retier conversion step " << k << (shadows ? " (shadows)" : ""));
      REQUIRE(s2.failed == 0);
      REQUIRE(s2.converted > 0);
      if (w1.c->faults().injected == 0) {
        CHECK(k == 3 * s2.planned + 1);
        break;
      }
      ++injected;
      CHECK(s1.failed == 1);
      CHECK(s1.injected_faults == 1);
      CHECK(s1.converted + 1 == s2.converted);
      const auto got = pages_of(w1), twin = pages_of(w2);
      REQUIRE(got.size() == twin.size());
      int differ = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        if (got[i].id.format == twin[i].id.format && got[i].bytes == twin[i].bytes) continue;
        ++differ;
        CHECK(got[i].id == pre[i].id);  // the faulted page stayed published, untouched
        CHECK(got[i].bytes == pre[i].bytes);
      }
      CHECK(differ == 1);
      if (!healthy(w1, lost)) CHECK(false);
    }
  CHECK(injected > 0);
  CHECK(lost == 0);
  print_metric("faults_injected_retier", double(injected));
  print_metric("retier_live_pages_lost", double(lost));
}
