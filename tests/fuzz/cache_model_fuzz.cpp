// SPDX-License-Identifier: Apache-2.0
// Model-based libFuzzer harness over the host tiered_cache and a prefix index on its storage
// (issue 24). A byte stream picks small options, then a sequence of operations: create,
// append, reserve (+ write_layer), commit, cancel, fork, release, pin, retier, attend, prefix
// insert / start_sequence / evict, bad calls, and armed faults (the k-th bookkeeping
// allocation, the k-th conversion step). After every operation the cache is compared with a
// plain model: sequences as token lists, each logical page an "origin" shared by its holders
// (sequences and prefix entries, exact LRU), so lengths, sharing, block refcounts, live
// blocks and pool conservation are predicted exactly; every token decodes within its codec's
// bound; attend matches a float64 reference over the decoded tokens and stays finite; the
// report reconciles; and a refused operation leaves everything observable (page bytes
// included) unchanged, with a code the operation documents. A divergence aborts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "../unit/tiering/tiering_test_support.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq4.hpp"

using namespace tiering_test;

namespace {

[[noreturn]] void diverge(const std::string& what) {
  std::fprintf(stderr, "model divergence: %s\n", what.c_str());
  std::abort();
}
#define EXPECT(cond, msg)         \
  do {                            \
    if (!(cond)) {                \
      std::ostringstream o_;      \
      o_ << #cond << ": " << msg; \
      diverge(o_.str());          \
    }                             \
  } while (0)

using k4_tiers = tiers<tier<int8_rotated, int8_rotated>, tier<tq4_key, tq3_value>>;
constexpr int D = tiny::head_dim, QH = tiny::q_heads, T = tiny::page_tokens;
// Per-vector relative MSE bounds: the 8-bit tiers (FP8 2^-8; int8_rotated far below), the
// Stale tiers (TQ3 / TQ4, as the tiering tests bound them), and a page that has been Stale
// once and came back to 8 bits (the two errors add at most as sqrt(a) + sqrt(b)).
constexpr double bound8 = fp8_vector_bound, bound_stale = tq3_vector_bound, bound_back = 0.4;

struct mseq {
  seq_id id;
  std::vector<std::uint64_t> seeds;     // committed tokens
  std::vector<std::uint64_t> origins;   // per logical page (committed + reserved)
  std::vector<std::uint64_t> reserved;  // seeds written into the reservation
};

struct mentry {
  std::uint64_t origin = 0, last_used = 0;
};

template <class Tiers>
struct harness {
  using cache_t = tiered_cache<tiny, Tiers, policy::recency_anchor, host_allocator,
                               failing_allocator, tier_roles<Tiers>, fault_injector>;
  using storage_t = typename cache_t::storage_type;

  FuzzedDataProvider& in;
  std::unique_ptr<cache_t> c;
  std::unique_ptr<prefix_index<storage_t>> px;
  std::vector<mseq> seqs;
  std::vector<seq_id> dead;                             // released ids: refused from now on
  std::map<std::uint64_t, int> holders;                 // origin -> holders
  std::map<std::uint64_t, block_ref> block_of_origin;   // as first observed
  std::map<std::uint64_t, std::uint8_t> visited_stale;  // origin*layers+layer -> 1
  std::map<std::pair<std::uint64_t, std::vector<std::int32_t>>, mentry> entries;
  std::uint64_t next_seed = 1, next_origin = 1, tick = 0, step = 0;
  int layers = 1, max_pages = 1;

  explicit harness(FuzzedDataProvider& p) : in(p) {}

  static std::int32_t id_of(std::uint64_t seed) { return std::int32_t(seed & 0x7fffffff); }
  std::vector<std::int32_t> ids(const std::vector<std::uint64_t>& s, std::size_t n) const {
    std::vector<std::int32_t> out;
    for (std::size_t i = 0; i < n; ++i) out.push_back(id_of(s[i]));
    return out;
  }
  void hold(std::uint64_t o) { ++holders[o]; }
  void drop(std::uint64_t o) {
    if (--holders[o] == 0) {
      holders.erase(o);
      block_of_origin.erase(o);
    }
  }

  bool setup() {
    typename cache_t::options opt;
    layers = in.ConsumeIntegralInRange<int>(1, 2);
    opt.storage.num_layers = layers;
    opt.storage.max_sequences = in.ConsumeIntegralInRange<std::uint32_t>(1, 4);
    opt.storage.pages_per_tier = {in.ConsumeIntegralInRange<std::uint32_t>(1, 14),
                                  in.ConsumeIntegralInRange<std::uint32_t>(1, 20)};
    opt.storage.codec_seed = in.ConsumeIntegral<std::uint8_t>();
    opt.policy =
        policy::recency_anchor({.recent_pages = in.ConsumeIntegralInRange<int>(0, 2),
                                .sink_pages = in.ConsumeIntegralInRange<int>(0, 1),
                                .min_dwell_steps = in.ConsumeIntegralInRange<std::uint64_t>(0, 2),
                                .keep_first_layers = 0,
                                .keep_last_layers = 0});
    opt.tiering.keep_shadows = in.ConsumeBool();
    opt.tiering.incremental_plan = in.ConsumeBool();
    opt.max_batch = in.ConsumeIntegralInRange<int>(1, 4);
    max_pages = opt.max_pages = in.ConsumeIntegralInRange<int>(1, 8);
    auto r = cache_t::create(opt);
    if (!r) {  // only what validation refuses: pools too small for the layers
      EXPECT(r.code() == errc::invalid_argument, r.error_status());
      return false;
    }
    c = std::move(*r);
    px = std::make_unique<prefix_index<storage_t>>(c->storage());
    return true;
  }

  std::string snapshot() {
    std::ostringstream o;
    o << cache_snapshot(*c) << " px " << px->size() << ' ' << px->evictable() << " bytes ";
    std::uint64_t h = 1469598103934665603ull;
    c->storage().for_each_block([&](block_ref b, int, std::uint32_t) {
      for (int l = 0; l < layers; ++l)
        for (std::uint8_t x : bytes_of(c->storage(), c->storage().block_page(b, l)))
          h = (h ^ x) * 1099511628211ull;
    });
    o << h;
    return o.str();
  }

  mseq* pick_seq() {
    if (seqs.empty()) return nullptr;
    return &seqs[in.ConsumeIntegralInRange<std::size_t>(0, seqs.size() - 1)];
  }
  std::vector<std::uint64_t> fresh(int n) {
    std::vector<std::uint64_t> s(static_cast<std::size_t>(n));
    for (auto& x : s) x = next_seed++;
    return s;
  }
  void open_pages(mseq& m, std::size_t tokens) {  // origins for pages covering `tokens`
    while (m.origins.size() * T < tokens) {
      m.origins.push_back(next_origin);
      hold(next_origin++);
    }
  }
  void release_model(std::size_t i) {
    for (std::uint64_t o : seqs[i].origins) drop(o);
    dead.push_back(seqs[i].id);
    seqs.erase(seqs.begin() + std::ptrdiff_t(i));
  }
  // The codes a refusal may carry for a well-formed call.
  void expect_refusal_code(const status& st, bool armed, bool may_exceed_pages) {
    const errc e = st.code();
    EXPECT(e == errc::capacity_exhausted || (armed && e == errc::injected_fault) ||
               (may_exceed_pages && e == errc::out_of_range),
           "unexpected refusal " << st);
  }

  // One operation; returns false at the end of the input.
  bool op() {
    if (in.remaining_bytes() == 0) return false;
    const int kind = in.ConsumeIntegralInRange<int>(0, 15);
    const std::string before = snapshot();
    auto& meta = c->storage().meta_alloc();
    const std::uint64_t meta_faults = meta.faults_injected();
    const std::uint64_t conv_faults = c->faults().injected;
    const bool armed = in.ConsumeBool();
    if (armed) {
      if (in.ConsumeBool())
        meta.fail_on(in.ConsumeIntegralInRange<std::uint64_t>(1, 4));
      else
        c->faults().fail_at = c->faults().calls + in.ConsumeIntegralInRange<std::uint64_t>(1, 12);
    }
    status st;
    bool refusal_checked = true;  // a non-ok status must have changed nothing
    switch (kind) {
      case 0: {  // create_sequence
        auto r = c->create_sequence();
        if (r) {
          EXPECT(seqs.size() < c->storage().max_sequences(), "more sequences than slots");
          seqs.push_back({*r, {}, {}, {}});
        } else {
          st = r.error_status();
          EXPECT(seqs.size() == c->storage().max_sequences(), "create refused with a free slot");
        }
        break;
      }
      case 1:
      case 2: {  // append
        mseq* m = pick_seq();
        if (m == nullptr || !m->reserved.empty()) break;
        const int n = in.ConsumeIntegralInRange<int>(1, kind == 1 ? 3 : 40);
        const auto seeds = fresh(n);
        std::vector<float> k, v;
        make_kv<storage_t>(layers, seeds, k, v);
        st = c->append(m->id, n, k, v);
        const bool over = (std::int64_t(m->seeds.size()) + n + T - 1) / T > max_pages;
        if (st) {
          EXPECT(!over, "append past max_pages accepted");
          m->seeds.insert(m->seeds.end(), seeds.begin(), seeds.end());
          open_pages(*m, m->seeds.size());
        } else {
          expect_refusal_code(st, armed, over);
          EXPECT(!over || st.code() == errc::out_of_range, "max_pages not checked first: " << st);
        }
        break;
      }
      case 3: {  // reserve, then write every layer
        mseq* m = pick_seq();
        if (m == nullptr || !m->reserved.empty()) break;
        const int n = in.ConsumeIntegralInRange<int>(1, 20);
        st = c->reserve(m->id, n);
        const bool over = (std::int64_t(m->seeds.size()) + n + T - 1) / T > max_pages;
        if (!st) {
          expect_refusal_code(st, armed, over);
          break;
        }
        EXPECT(!over, "reserve past max_pages accepted");
        m->reserved = fresh(n);
        open_pages(*m, m->seeds.size() + std::size_t(n));
        std::vector<float> k, v;
        make_kv<storage_t>(layers, m->reserved, k, v);
        const std::size_t per = k.size() / std::size_t(layers);
        for (int l = 0; l < layers; ++l) {
          const status w = c->write_layer(m->id, l, std::span(k).subspan(std::size_t(l) * per, per),
                                          std::span(v).subspan(std::size_t(l) * per, per));
          EXPECT(w, "write_layer of a reservation refused: " << w);
        }
        break;
      }
      case 4: {  // commit or cancel
        mseq* m = pick_seq();
        if (m == nullptr) break;
        const std::size_t r = m->reserved.size();
        const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, r + 1);
        st = c->commit(m->id, std::int64_t(n));
        if (n > r) {
          EXPECT(!st && st.code() == errc::invalid_argument, "commit past the reservation");
          break;
        }
        EXPECT(st, "commit refused: " << st);
        m->seeds.insert(m->seeds.end(), m->reserved.begin(),
                        m->reserved.begin() + std::ptrdiff_t(n));
        m->reserved.clear();
        while (m->origins.size() * T >= m->seeds.size() + T) {
          drop(m->origins.back());
          m->origins.pop_back();
        }
        break;
      }
      case 5: {  // fork
        mseq* m = pick_seq();
        if (m == nullptr) break;
        auto r = c->fork(m->id);
        if (!r) {
          st = r.error_status();
          expect_refusal_code(st, armed, false);
          break;
        }
        EXPECT(seqs.size() < c->storage().max_sequences(), "fork past the slots");
        mseq child{*r, m->seeds, {}, {}};
        const std::size_t pages = (m->seeds.size() + T - 1) / T;
        for (std::size_t i = 0; i < pages; ++i) {
          const bool tail = i + 1 == pages && m->seeds.size() % T != 0;
          const std::uint64_t o = tail ? next_origin++ : m->origins[i];
          child.origins.push_back(o);
          hold(o);
        }
        seqs.push_back(std::move(child));
        break;
      }
      case 6: {  // release
        if (seqs.empty()) break;
        const std::size_t i = in.ConsumeIntegralInRange<std::size_t>(0, seqs.size() - 1);
        st = c->release(seqs[i].id);
        EXPECT(st, "release refused: " << st);
        release_model(i);
        break;
      }
      case 7: {  // pin
        mseq* m = pick_seq();
        if (m == nullptr) break;
        const std::int64_t pages = std::int64_t((m->seeds.size() + T - 1) / T);
        const std::int64_t first = in.ConsumeIntegralInRange<std::int64_t>(0, pages);
        const std::int64_t n = in.ConsumeIntegralInRange<std::int64_t>(0, pages - first + 1);
        st = c->pin(m->id, first, n, in.ConsumeBool());
        EXPECT(bool(st) == (first + n <= pages), "pin range check: " << st);
        break;
      }
      case 8:
      case 9: {  // retier
        const retier_stats r = c->retier(++step);
        refusal_checked = false;
        const bool injected = c->faults().injected != conv_faults;
        EXPECT(r.failed == (injected ? 1u : 0u),
               "retier failed " << r.failed << ": " << r.first_error);
        break;
      }
      case 10:
      case 11: {  // attend
        attend(in.ConsumeBool() && kind == 11);
        refusal_checked = false;
        break;
      }
      case 12: {  // prefix insert
        mseq* m = pick_seq();
        if (m == nullptr) break;
        const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, m->seeds.size());
        const std::uint64_t salt = in.ConsumeIntegralInRange<std::uint64_t>(0, 1);
        auto r = px->insert(m->id, salt, ids(m->seeds, n));
        if (!r) {
          st = r.error_status();
          expect_refusal_code(st, armed, false);
          break;
        }
        std::size_t added = 0;
        std::vector<std::int32_t> key;
        std::vector<std::pair<std::uint64_t, std::vector<std::int32_t>>> chain;
        for (std::size_t j = 0; j < n / T; ++j) {
          for (std::size_t t = j * T; t < (j + 1) * T; ++t) key.push_back(id_of(m->seeds[t]));
          auto it = entries.find({salt, key});
          if (it == entries.end()) {
            entries[{salt, key}] = mentry{m->origins[j], 0};
            hold(m->origins[j]);
            ++added;
          }
          chain.push_back({salt, key});
        }
        // The index touches the cached head of the chain, then stamps each new entry: both in
        // chain order, one tick each.
        for (auto& k : chain) entries[k].last_used = ++tick;
        EXPECT(*r == added, "insert added " << *r << ", model " << added);
        break;
      }
      case 13: {  // prefix start_sequence from a (prefix of a) live sequence's ids
        mseq* m = pick_seq();
        std::vector<std::uint64_t> src = m ? m->seeds : std::vector<std::uint64_t>{};
        src.resize(in.ConsumeIntegralInRange<std::size_t>(0, src.size()));
        const std::uint64_t salt = in.ConsumeIntegralInRange<std::uint64_t>(0, 1);
        auto r = px->start_sequence(salt, ids(src, src.size()));
        if (!r) {
          st = r.error_status();
          expect_refusal_code(st, armed, false);
          break;
        }
        mseq child{r->seq, {}, {}, {}};
        std::vector<std::int32_t> key;
        std::vector<mentry*> hit;
        for (std::size_t j = 0; j < src.size() / T; ++j) {
          for (std::size_t t = j * T; t < (j + 1) * T; ++t) key.push_back(id_of(src[t]));
          auto it = entries.find({salt, key});
          if (it == entries.end()) break;
          hit.push_back(&it->second);
        }
        for (mentry* e : hit) {
          e->last_used = ++tick;
          child.origins.push_back(e->origin);
          hold(e->origin);
        }
        child.seeds.assign(src.begin(), src.begin() + std::ptrdiff_t(hit.size() * T));
        EXPECT(r->cached_tokens == std::int64_t(hit.size() * T),
               "start_sequence matched " << r->cached_tokens << ", model " << hit.size() * T);
        seqs.push_back(std::move(child));
        break;
      }
      case 14: {  // prefix evict (exact LRU among leaves only the index holds)
        const std::size_t n = in.ConsumeIntegralInRange<std::size_t>(0, 3);
        const std::size_t got = px->evict(n);
        std::size_t model = 0;
        while (model < n) {
          auto victim = entries.end();
          for (auto it = entries.begin(); it != entries.end(); ++it) {
            if (holders.at(it->second.origin) != 1) continue;
            bool leaf = true;
            for (auto& [k, e] : entries)
              if (k.first == it->first.first && k.second.size() == it->first.second.size() + T &&
                  std::equal(it->first.second.begin(), it->first.second.end(), k.second.begin()))
                leaf = false;
            if (leaf &&
                (victim == entries.end() || it->second.last_used < victim->second.last_used))
              victim = it;
          }
          if (victim == entries.end()) break;
          drop(victim->second.origin);
          entries.erase(victim);
          ++model;
        }
        EXPECT(got == model, "evicted " << got << ", model " << model);
        break;
      }
      default: {  // a bad call: refused, changing nothing
        std::vector<float> k(std::size_t(layers) * D, 0.5f), v = k;
        const int bad = in.ConsumeIntegralInRange<int>(0, 2);
        if (bad == 0 && !dead.empty())
          st = c->append(dead.back(), 1, k, v);
        else if (bad == 1 && !seqs.empty()) {
          k[3] = NAN;
          st =
              seqs[0].reserved.empty() ? c->append(seqs[0].id, 1, k, v) : c->commit(seqs[0].id, -1);
        } else
          st = c->append(seq_id(12345), 2, k, v);  // wrong sizes and an unknown id
        EXPECT(!st, "a bad call accepted");
        break;
      }
    }
    meta.reset();
    c->faults().fail_at = 0;
    (void)meta_faults;
    if (!st && refusal_checked) EXPECT(snapshot() == before, "refusal with side effects: " << st);
    check();
    return true;
  }

  void attend(bool poison) {
    std::vector<seq_id> batch;
    std::vector<const mseq*> ms;
    for (const mseq& m : seqs)
      if (!m.seeds.empty() && int(batch.size()) < c->config().max_batch && in.ConsumeBool()) {
        batch.push_back(m.id);
        ms.push_back(&m);
      }
    if (batch.empty()) return;
    const int layer = in.ConsumeIntegralInRange<int>(0, layers - 1);
    std::vector<float> q(batch.size() * QH * D), out(q.size(), 7.0f);
    const std::uint64_t qs = next_seed++;
    for (std::size_t i = 0; i < q.size(); ++i)
      q[i] = 2.0f * gauss(qs, layer, int(i / D), 5, int(i % D));
    if (poison) q[q.size() / 2] = NAN;
    const status st = c->attend(layer, batch, q, out);
    if (poison) {
      EXPECT(st.code() == errc::non_finite_input, "NaN query not refused: " << st);
      for (float x : out) EXPECT(x == 7.0f, "refused attend wrote its output");
      return;
    }
    EXPECT(st, "attend refused: " << st);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      for (int i = 0; i < QH * D; ++i)
        EXPECT(std::isfinite(out[b * QH * D + std::size_t(i)]),
               "non-finite output from finite input");
      std::vector<double> ref, mass;
      reference_attend(
          q.data() + b * QH * D, std::int64_t(ms[b]->seeds.size()),
          [&](std::int64_t t, int h, float* k, float* v) {
            EXPECT(c->storage().read_token(batch[b], layer, t, h, k, v), "read_token");
          },
          ref, mass);
      const double e = rel_l2(out.data() + b * QH * D, ref);
      EXPECT(e < 1e-4, "attend vs float64 over the decoded tokens: rel. L2 " << e);
    }
  }

  void check() {
    auto& s = c->storage();
    EXPECT(c->check_invariants(), c->check_invariants());
    EXPECT(px->check_invariants(), px->check_invariants());
    const memory_report rep = c->report();
    EXPECT(rep.reconciles(), "report does not reconcile");
    std::uint64_t tokens = 0;
    for (const mseq& m : seqs) tokens += m.seeds.size();
    EXPECT(rep.sequence_tokens == tokens,
           "sequence tokens " << rep.sequence_tokens << " vs " << tokens);
    EXPECT(s.live_sequences() == seqs.size(), "live sequences");
    EXPECT(s.live_blocks() == holders.size(),
           "live blocks " << s.live_blocks() << " vs " << holders.size());
    // Conservation: every pool's live pages are the pages blocks name (plus tier 0's shadows).
    std::uint64_t live = 0, cap = 0, free = 0;
    for (int t = 0; t < cache_t::num_tiers; ++t) {
      free += s.free_pages(t);
      cap += c->config().storage.pages_per_tier[std::size_t(t)];
    }
    live = cap - free;
    EXPECT(live == std::uint64_t(layers) * holders.size() + c->controller().shadow_pages(),
           "pages in use " << live << " vs " << layers << " x " << holders.size() << " blocks + "
                           << c->controller().shadow_pages() << " shadows");
    for (const mseq& m : seqs) {
      EXPECT(s.length(m.id).value() == std::int64_t(m.seeds.size()), "length of " << m.id);
      EXPECT(s.reserved(m.id).value() == std::int64_t(m.reserved.size()), "reserved of " << m.id);
      const std::size_t pages = (m.seeds.size() + T - 1) / T;
      for (std::size_t i = 0; i < pages; ++i) {
        const block_ref b = s.block_of(m.id, std::int64_t(i)).value();
        auto [it, inserted] = block_of_origin.try_emplace(m.origins[i], b);
        EXPECT(it->second == b, m.id << " page " << i << " is not the block its sharers hold");
        EXPECT(s.block_refcount(b) == std::uint32_t(holders[m.origins[i]]),
               m.id << " page " << i << " refcount " << s.block_refcount(b) << " vs "
                    << holders[m.origins[i]]);
        for (int l = 0; l < layers; ++l) {
          const page_id p = s.block_page(b, l);
          EXPECT(s.check_page(p) && s.page_published(p), "a page in use is not live: " << p);
          std::uint8_t& stale = visited_stale[m.origins[i] * 4 + std::uint64_t(l)];
          if (p.format != 0) stale = 1;
          const double bound = p.format != 0 ? bound_stale : stale ? bound_back : bound8;
          const page_error e = page_error_of(s, m.id, l, std::int64_t(i), m.seeds);
          EXPECT(e.finite && e.max <= bound, m.id << " page " << i << " layer " << l << " tier "
                                                  << unsigned(p.format) << " error " << e.max
                                                  << " > " << bound);
        }
      }
    }
  }
};

template <class Tiers>
void run(FuzzedDataProvider& in) {
  harness<Tiers> h(in);
  if (!h.setup()) return;
  for (int i = 0; i < 64 && h.op(); ++i) {
  }
  // Idle: every request done, the index cleared: every page is back in its pool.
  while (!h.seqs.empty()) {
    EXPECT(h.c->release(h.seqs.back().id), "release at idle");
    h.release_model(h.seqs.size() - 1);
  }
  h.px->clear();
  (void)h.c->retier(++h.step);  // the controller gives back shadows of pages now gone
  auto& s = h.c->storage();
  EXPECT(h.c->controller().shadow_pages() == 0, "shadows held at idle");
  for (int t = 0; t < harness<Tiers>::cache_t::num_tiers; ++t)
    EXPECT(s.free_pages(t) == h.c->config().storage.pages_per_tier[std::size_t(t)],
           "pages leaked at idle in tier " << t);
  EXPECT(s.live_blocks() == 0, "blocks leaked at idle");
  EXPECT(h.c->check_invariants(), "invariants at idle");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool())
    run<two_tiers>(in);
  else
    run<k4_tiers>(in);
  return 0;
}
