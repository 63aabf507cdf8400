// SPDX-License-Identifier: Apache-2.0
// Model-based randomized test: random operations on a paged storage and its prefix
// index, mirrored on a plain reference model (each sequence is a std::vector of token
// ids; a token's KV content is a seeded pattern of (id, position)). After every
// operation: pool conservation and free lists, refcounts, block/sequence bookkeeping,
// prefix-index chains, exact accounting, lengths, and content of the pages the
// operation touched plus one random live logical page; every 1024 operations, the
// content of every live token. Failed operations must leave the storage unchanged.
// Appends also go layer by layer (reserve with fault injection, write_layer in a random layer
// order, commit of all, some or none of the reserved tokens), and reservations stay
// outstanding across other operations (fork, release, prefix insert, retier, other appends).
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>

#include "catch.hpp"
#include "paging_test_support.hpp"
#include "tierkv/paging/prefix_index.hpp"

using namespace tierkv;
using namespace paging_test;

namespace {

constexpr int P = storage_t::page_tokens;
constexpr int layers = 2;

// A weak hash: collisions are constant, so token comparison is exercised all the time.
struct weak_hash {
  std::uint64_t root(std::uint64_t salt) const noexcept { return salt & 3; }
  std::uint64_t operator()(std::uint64_t parent, std::span<const std::int32_t> t) const noexcept {
    return (parent * 31 + std::uint64_t(std::uint32_t(t[0]))) & 63;
  }
};

std::uint64_t seed_of(std::int32_t token, std::size_t pos) {
  return mix64(std::uint64_t(token) << 32 | pos);
}

struct ref_seq {
  std::vector<std::int32_t> tokens;
  std::uint64_t salt = 0;
  std::vector<std::int32_t> pending;  // tokens written into the outstanding reservation
  std::vector<std::int32_t> slot;     // its slot mapping, [layer][pending.size()]
};

struct harness {
  std::unique_ptr<storage_t> s;
  std::unique_ptr<prefix_index<storage_t, weak_hash>> px;
  std::map<std::uint32_t, ref_seq> model;  // seq id value -> reference contents
  std::mt19937_64 rng;
  std::uint64_t ops = 0, failures_expected = 0, divergences = 0, content_checks = 0,
                faults_injected = 0, reserved_ops = 0, committed_ops = 0;
  std::vector<std::vector<std::int32_t>> docs;

  explicit harness(std::uint64_t seed) : rng(seed) {
    storage_t::options o;
    o.num_layers = layers;
    o.pages_per_tier = {24, 10};
    o.max_sequences = 6;
    o.codec_seed = seed;
    auto r = storage_t::create(o);
    REQUIRE(r);
    s = std::move(*r);
    px = std::make_unique<prefix_index<storage_t, weak_hash>>(*s);
    for (int d = 0; d < 3; ++d) {  // shared "documents" so prefixes repeat
      std::vector<std::int32_t> t(8 * P);
      for (auto& x : t) x = std::int32_t(rng() % 5);
      docs.push_back(t);
    }
  }

  std::size_t pick(std::size_t n) { return std::size_t(rng() % n); }
  seq_id random_seq() {
    auto it = model.begin();
    std::advance(it, std::ptrdiff_t(pick(model.size())));
    return seq_id(it->first);
  }
  void diverge(const char* what, const status& st) {
    ++divergences;
    if (divergences <= 5)
      std::fprintf(stderr, "divergence at op %llu: %s (%s)\n", (unsigned long long)ops, what,
                   st.message().c_str());
  }

  bool append_ok(seq_id id, const std::vector<std::int32_t>& add) {
    ref_seq& m = model[id.value];
    const std::size_t len = m.tokens.size();
    if (!m.pending.empty()) {  // append is refused while a reservation is outstanding
      const snapshot before = take_snapshot(*s);
      std::vector<float> k, v;
      make_kv<storage_t>(layers, std::vector<std::uint64_t>(add.size(), 1), k, v);
      const status st = s->append(id, std::int64_t(add.size()), k, v);
      if (st.code() != errc::invalid_argument)
        diverge("append with a reservation outstanding not refused", st);
      if (!(take_snapshot(*s) == before)) diverge("refused append changed the storage", st);
      ++failures_expected;
      return false;
    }
    std::vector<std::uint64_t> sd;
    for (std::size_t i = 0; i < add.size(); ++i) sd.push_back(seed_of(add[i], len + i));
    std::vector<float> k, v;
    make_kv<storage_t>(layers, sd, k, v);
    const std::size_t need = (len + add.size() + P - 1) / P - (len + P - 1) / P;
    const bool fits = need * layers <= s->free_pages(0);
    // Now and then the next bookkeeping allocation fails (fault injection).
    const bool arm = rng() % 32 == 0;
    const snapshot before = (fits && !arm) ? snapshot{} : take_snapshot(*s);
    const std::uint64_t faults = s->meta_alloc().faults_injected();
    if (arm) s->meta_alloc().fail_on(1);
    status st = s->append(id, std::int64_t(add.size()), k, v);
    s->meta_alloc().reset();
    const bool injected = s->meta_alloc().faults_injected() != faults;
    faults_injected += injected;
    if (injected ? bool(st) : fits != bool(st))
      diverge("append success differs from prediction", st);
    if (!st) {
      ++failures_expected;
      if (st.code() != errc::capacity_exhausted) diverge("append failed with another code", st);
      if (!(take_snapshot(*s) == before)) diverge("failed append changed the storage", st);
      return false;
    }
    m.tokens.insert(m.tokens.end(), add.begin(), add.end());
    check_tokens(id, len, m.tokens.size());
    return true;
  }

  // The layer-by-layer path: reserve (predicted like append, faults injected), write every
  // layer in a random order; then commit now (all or some tokens), cancel, or leave the
  // reservation outstanding for a later commit_pending.
  void reserve_ok(seq_id id, const std::vector<std::int32_t>& add) {
    ref_seq& m = model[id.value];
    if (!m.pending.empty()) {
      const snapshot before = take_snapshot(*s);
      if (s->reserve(id, 1).code() != errc::invalid_argument)
        diverge("second reserve not refused", {});
      if (!(take_snapshot(*s) == before)) diverge("refused reserve changed the storage", {});
      ++failures_expected;
      return;
    }
    const std::size_t len = m.tokens.size(), n = add.size();
    const std::size_t need = (len + n + P - 1) / P - (len + P - 1) / P;
    const bool fits = need * layers <= s->free_pages(0);
    const bool arm = rng() % 32 == 0;
    const snapshot before = (fits && !arm) ? snapshot{} : take_snapshot(*s);
    const std::uint64_t faults = s->meta_alloc().faults_injected();
    std::vector<std::int32_t> slot(layers * n), offset(n);
    if (arm) s->meta_alloc().fail_on(1);
    const status st = s->reserve(id, std::int64_t(n), slot_mapping{slot, 0, offset});
    s->meta_alloc().reset();
    const bool injected = s->meta_alloc().faults_injected() != faults;
    faults_injected += injected;
    if (injected ? bool(st) : fits != bool(st))
      diverge("reserve success differs from prediction", st);
    if (!st) {
      ++failures_expected;
      if (st.code() != errc::capacity_exhausted) diverge("reserve failed with another code", st);
      if (!(take_snapshot(*s) == before)) diverge("failed reserve changed the storage", st);
      return;
    }
    ++reserved_ops;
    for (std::size_t i = 0; i < n; ++i)
      if (offset[i] != std::int32_t((len + i) % P)) diverge("reserve offset differs", {});
    std::vector<std::uint64_t> sd;
    for (std::size_t i = 0; i < n; ++i) sd.push_back(seed_of(add[i], len + i));
    std::vector<float> k, v;
    make_kv<storage_t>(layers, sd, k, v);
    const std::size_t per_layer = n * storage_t::kv_heads * storage_t::head_dim;
    const int first = int(pick(layers));
    for (int j = 0; j < layers; ++j) {
      const int l = (first + j) % layers;
      const auto kl = std::span<const float>(k).subspan(std::size_t(l) * per_layer, per_layer);
      const auto vl = std::span<const float>(v).subspan(std::size_t(l) * per_layer, per_layer);
      if (auto w = s->write_layer(id, l, kl, vl); !w) diverge("write_layer failed", w);
    }
    m.pending = add;
    m.slot = slot;
    if (*s->length(id) != std::int64_t(len)) diverge("reserve changed the length", {});
    const unsigned what = unsigned(rng() % 4);
    if (what == 0) return;  // outstanding
    commit_pending(id, what == 1 ? n : pick(n + 1));
  }

  // Commits the first `count` pending tokens of id (0: cancel); checks content and mapping.
  void commit_pending(seq_id id, std::size_t count) {
    ref_seq& m = model[id.value];
    const std::size_t len = m.tokens.size(), n = m.pending.size();
    const std::uint32_t free_before = s->free_pages(0);
    const std::size_t opened = (len + n + P - 1) / P - (len + P - 1) / P;
    const std::size_t kept = (len + count + P - 1) / P - (len + P - 1) / P;
    if (auto st = s->commit(id, std::int64_t(count)); !st) diverge("commit failed", st);
    ++committed_ops;
    if (s->free_pages(0) != free_before + (opened - kept) * layers)
      diverge("commit gave back another number of pages", {});
    m.tokens.insert(m.tokens.end(), m.pending.begin(), m.pending.begin() + std::ptrdiff_t(count));
    for (std::size_t i = 0; i < count; ++i)
      for (int l = 0; l < layers; ++l)
        if (std::uint32_t(m.slot[std::size_t(l) * n + i]) !=
            s->page(id, l, std::int64_t((len + i) / P))->slot)
          diverge("reserve slot differs from the committed page", {});
    m.pending.clear();
    m.slot.clear();
    check_tokens(id, len, m.tokens.size());
  }

  // Checks tokens [from, to) at every layer, or at one random layer when sampled.
  void check_tokens(seq_id id, std::size_t from, std::size_t to, bool sampled = false,
                    int only_layer = -1) {
    const ref_seq& m = model[id.value];
    const int l0 = only_layer >= 0 ? only_layer : sampled ? int(pick(layers)) : 0;
    const int l1 = (sampled || only_layer >= 0) ? l0 + 1 : layers;
    for (int l = l0; l < l1; ++l)
      for (std::size_t i = from; i < to; ++i) {
        ++content_checks;
        if (!token_matches(*s, id, std::int64_t(i), seed_of(m.tokens[i], i), l)) {
          diverge("token content differs",
                  status::make(errc::corrupt_data, "seq ", id, " token ", i, " layer ", l));
          return;
        }
      }
  }

  void step() {
    ++ops;
    const unsigned op = unsigned(rng() % 100);
    if (model.empty() || op < 8) {  // create, usually from a cached prefix
      const auto& d = docs[pick(docs.size())];
      const std::size_t n = 1 + pick(d.size());
      const std::vector<std::int32_t> t(d.begin(), d.begin() + std::ptrdiff_t(n));
      const bool has_slot = s->live_sequences() < s->max_sequences();
      const std::uint64_t salt = rng() % 2;
      auto st = px->start_sequence(salt, t);
      if (has_slot != st.has_value()) diverge("create success differs", st.error_status());
      if (!st) {
        ++failures_expected;
        return;
      }
      ref_seq& m = model[st->seq.value];
      m.salt = salt;
      m.tokens.assign(t.begin(), t.begin() + st->cached_tokens);
      check_tokens(st->seq, 0, m.tokens.size(), true);
      const std::vector<std::int32_t> rest(t.begin() + st->cached_tokens, t.end());
      if (!rest.empty()) (void)append_ok(st->seq, rest);
    } else if (op < 40) {  // append: a few tokens, or exactly up to the page boundary (seal)
      const seq_id id = random_seq();
      const std::size_t len = model[id.value].tokens.size();
      const std::size_t n = (op < 16) ? P - len % P : 1 + pick(P + 4);
      std::vector<std::int32_t> add(n);
      for (auto& x : add) x = std::int32_t(rng() % 5);
      if (op % 2 == 0) {  // the same through reserve + write_layer + commit
        reserve_ok(id, add);
      } else {
        (void)append_ok(id, add);
      }
      // Now and then an outstanding reservation (of any sequence) is committed.
      if (rng() % 4 == 0) {
        for (auto& [sid, m] : model)
          if (!m.pending.empty()) {
            commit_pending(seq_id(sid), pick(m.pending.size() + 1));
            break;
          }
      }
    } else if (op < 50) {  // fork
      const seq_id id = random_seq();
      const bool tail = model[id.value].tokens.size() % P != 0;
      const bool fits =
          s->live_sequences() < s->max_sequences() && (!tail || s->free_pages(0) >= layers);
      const snapshot before = fits ? snapshot{} : take_snapshot(*s);
      auto c = s->fork(id);
      if (fits != c.has_value()) diverge("fork success differs", c.error_status());
      if (!c) {
        ++failures_expected;
        if (!(take_snapshot(*s) == before))
          diverge("failed fork changed the storage", c.error_status());
        return;
      }
      model[c->value] = model[id.value];
      model[c->value].pending.clear();  // the parent's reservation stays the parent's
      model[c->value].slot.clear();
      if (*s->reserved(*c) != 0) diverge("a fork inherited a reservation", {});
      const std::size_t len = model[id.value].tokens.size();
      check_tokens(*c, len - len % P, len);  // the copied tail
    } else if (op < 62) {                    // release
      const seq_id id = random_seq();
      if (auto st = s->release(id); !st) diverge("release failed", st);
      model.erase(id.value);
      if (s->release(id).code() != errc::stale_id) diverge("double release not detected", {});
    } else if (op < 72) {  // share: cache a sequence's full pages
      const seq_id id = random_seq();
      const ref_seq& m = model[id.value];
      auto r = px->insert(id, m.salt, m.tokens);
      if (!r) diverge("prefix insert failed", r.error_status());
    } else if (op < 80) {  // lookup: every matched page holds the right tokens
      const auto& d = docs[pick(docs.size())];
      const std::uint64_t salt = rng() % 2;
      const auto m = px->lookup(salt, std::span<const std::int32_t>(d).first(1 + pick(d.size())));
      for (std::size_t i = 0; i < m.blocks.size(); ++i)
        if (!s->block_sealed(m.blocks[i]) ||
            !(s->block_page(m.blocks[i], 0) == m.pages[i * layers]))
          diverge("lookup returned an unsealed or inconsistent page", {});
    } else if (op < 86) {  // evict
      (void)px->evict(1 + pick(3));
    } else {  // retier: move one sealed page of one layer to the other tier (lossless)
      const seq_id id = random_seq();
      const std::size_t full = model[id.value].tokens.size() / P;
      if (full == 0) return;
      const std::int64_t lp = std::int64_t(pick(full));
      const int l = int(pick(layers));
      const page_id old = *s->page(id, l, lp);
      const int to = 1 - old.format;
      auto fresh = s->allocate_page(to);
      if (!fresh) {
        ++failures_expected;
        return;
      }
      const std::size_t from_len = std::size_t(lp) * P;
      copy_dense(old, *fresh);
      if (auto st = s->replace_page(id, l, lp, old, *fresh); !st)
        diverge("replace_page failed", st);
      check_tokens(id, from_len, from_len + P, false, l);
    }
  }

  // Both tiers are dense_f32 with identical layouts: a lossless conversion is a copy.
  void copy_dense(page_id from, page_id to) {
    auto a = s->page_bytes(from);
    auto b = s->page_bytes(to);
    std::memcpy(b->data(), a->data(), a->size());
  }

  void verify(bool full_sweep) {
    if (auto st = s->check_invariants(); !st) diverge("storage invariants", st);
    if (auto st = px->check_invariants(); !st) diverge("prefix index invariants", st);
    if (!make_report(*s).reconciles()) diverge("accounting does not reconcile", {});
    if (s->live_sequences() != model.size()) diverge("live sequence count", {});
    for (const auto& [id, m] : model) {
      if (*s->length(seq_id(id)) != std::int64_t(m.tokens.size())) diverge("length differs", {});
      if (*s->reserved(seq_id(id)) != std::int64_t(m.pending.size()))
        diverge("reservation differs", {});
    }
    if (full_sweep) {
      for (const auto& [id, m] : model) check_tokens(seq_id(id), 0, m.tokens.size());
    } else if (!model.empty()) {
      const seq_id id = random_seq();
      const std::size_t len = model[id.value].tokens.size();
      if (len > 0) {
        const std::size_t lp = pick((len + P - 1) / P);
        check_tokens(id, lp * P, std::min(len, lp * P + P), true);
      }
    }
  }
};

}  // namespace

TEST_CASE("model-based randomized paging operations", "[paging][model]") {
  // TIERKV_MODEL_OPS overrides the total (e.g. for a longer soak run).
  std::uint64_t total = 1'000'000;
  if (const char* env = std::getenv("TIERKV_MODEL_OPS")) total = std::strtoull(env, nullptr, 10);
  const std::uint64_t runs = 8;
  std::uint64_t ops = 0, divergences = 0, expected_failures = 0, checks = 0, faults = 0,
                reserves = 0, commits = 0;
  for (std::uint64_t run = 0; run < runs; ++run) {
    harness h(0xC0FFEE + run);
    for (std::uint64_t i = 0; i < total / runs; ++i) {
      h.step();
      h.verify(h.ops % 1024 == 0);
    }
    h.verify(true);
    // Drain: release everything, evict everything; every page must come back.
    for (const auto& [id, m] : h.model) (void)h.s->release(seq_id(id));
    h.model.clear();
    (void)h.px->evict(1u << 30);
    if (h.s->free_pages(0) != 24 || h.s->free_pages(1) != 10 || h.px->size() != 0) ++h.divergences;
    ops += h.ops;
    divergences += h.divergences;
    expected_failures += h.failures_expected;
    checks += h.content_checks;
    faults += h.faults_injected;
    reserves += h.reserved_ops;
    commits += h.committed_ops;
  }
  std::printf(
      "paging model test: %llu operations, %llu token-vector content checks, %llu refused "
      "operations "
      "(capacity or injected fault), %llu faults injected, %llu reservations, %llu commits, %llu "
      "divergences\n",
      (unsigned long long)ops, (unsigned long long)checks, (unsigned long long)expected_failures,
      (unsigned long long)faults, (unsigned long long)reserves, (unsigned long long)commits,
      (unsigned long long)divergences);
  CHECK(ops >= total - runs);
  CHECK(divergences == 0);
  CHECK(expected_failures > 0);  // the pools really ran full
  CHECK(faults > 0);             // and bookkeeping allocations really failed
  CHECK(commits > 0);
}
