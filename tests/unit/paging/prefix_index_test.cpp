// SPDX-License-Identifier: Apache-2.0
#include <numeric>
#include <vector>

#include "catch.hpp"
#include "paging_test_support.hpp"
#include "tierkv/paging/prefix_index.hpp"

using namespace tierkv;
using namespace paging_test;

namespace {
std::unique_ptr<storage_t> make_storage(std::uint32_t pages0 = 40) {
  storage_t::options o;
  o.num_layers = 2;
  o.pages_per_tier = {pages0, 8};
  o.max_sequences = 8;
  auto s = storage_t::create(o);
  REQUIRE(s);
  return std::move(*s);
}
// Token content depends on the token id and its position (a prefix determines its KV).
std::uint64_t seed_of(std::int32_t token, std::size_t pos) {
  return std::uint64_t(token) * 100003u + pos;
}

void append_tokens(storage_t& s, seq_id id, const std::vector<std::int32_t>& tokens,
                   std::size_t from) {
  std::vector<std::uint64_t> sd;
  for (std::size_t i = from; i < tokens.size(); ++i) sd.push_back(seed_of(tokens[i], i));
  std::vector<float> k, v;
  make_kv<storage_t>(s.num_layers(), sd, k, v);
  REQUIRE(s.append(id, std::int64_t(sd.size()), k, v));
}
bool content_ok(const storage_t& s, seq_id id, const std::vector<std::int32_t>& tokens) {
  for (int l = 0; l < s.num_layers(); ++l)
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (!token_matches(s, id, std::int64_t(i), seed_of(tokens[i], i), l)) return false;
  return true;
}
std::vector<std::int32_t> doc(std::int32_t first, std::size_t n) {
  std::vector<std::int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}
struct colliding_hash {  // every page hashes alike: only the token comparison tells them apart
  std::uint64_t root(std::uint64_t) const noexcept { return 7; }
  std::uint64_t operator()(std::uint64_t, std::span<const std::int32_t>) const noexcept {
    return 7;
  }
};
}  // namespace

TEST_CASE("prefix index serves the longest cached prefix, sharing pages", "[paging][prefix]") {
  auto s = make_storage();
  prefix_index<storage_t> px(*s);
  const auto tokens = doc(10, 40);
  auto a = *s->create_sequence();
  append_tokens(*s, a, tokens, 0);
  auto n = px.insert(a, 5, tokens);
  REQUIRE(n);
  CHECK(*n == 2);  // two full pages; the partial third is never cached
  CHECK(*px.insert(a, 5, tokens) == 0);
  CHECK(px.size() == 2);

  auto m = px.lookup(5, tokens);
  CHECK(m.tokens == 32);
  REQUIRE(m.blocks.size() == 2);
  CHECK(m.blocks[0] == *s->block_of(a, 0));
  REQUIRE(m.pages.size() == 4);
  CHECK(m.pages[3] == *s->page(a, 1, 1));
  CHECK(px.lookup(6, tokens).tokens == 0);  // another salt (tenant, adapter)
  auto other = tokens;
  other[20] = 999;
  CHECK(px.lookup(5, other).tokens == 16);

  auto st = px.start_sequence(5, other);
  REQUIRE(st);
  CHECK(st->cached_tokens == 16);
  CHECK(*s->page(st->seq, 0, 0) == *s->page(a, 0, 0));
  append_tokens(*s, st->seq, other, 16);
  CHECK(content_ok(*s, st->seq, other));
  CHECK(content_ok(*s, a, tokens));
  REQUIRE(px.check_invariants());
  REQUIRE(s->check_invariants());
  auto r = make_report(*s);
  CHECK(r.prefix_index > 0);
  CHECK(r.reconciles());
}

TEST_CASE("forced hash collisions are rejected by comparing token ids", "[paging][prefix]") {
  auto s = make_storage();
  prefix_index<storage_t, colliding_hash> px(*s);
  const auto t1 = doc(100, 32);
  const auto t2 = doc(500, 32);
  auto a = *s->create_sequence();
  auto b = *s->create_sequence();
  append_tokens(*s, a, t1, 0);
  append_tokens(*s, b, t2, 0);
  CHECK(*px.insert(a, 1, t1) == 2);
  CHECK(*px.insert(b, 1, t2) == 2);
  CHECK(*px.insert(b, 2, t2) == 2);
  auto m1 = px.lookup(1, t1);
  auto m2 = px.lookup(1, t2);
  auto m3 = px.lookup(2, t2);
  CHECK(m1.tokens == 32);
  CHECK(m2.tokens == 32);
  CHECK(m1.blocks[1] == *s->block_of(a, 1));
  CHECK(m2.blocks[1] == *s->block_of(b, 1));
  CHECK(m3.blocks[0] == *s->block_of(b, 0));
  auto mixed = t1;
  for (int i = 16; i < 32; ++i) mixed[std::size_t(i)] = t2[std::size_t(i)];
  CHECK(px.lookup(1, mixed).tokens == 16);  // second page of t2 hangs off another parent
  auto st = px.start_sequence(1, t2);
  REQUIRE(st);
  CHECK(content_ok(*s, st->seq, t2));
  REQUIRE(px.check_invariants());
}

TEST_CASE("eviction is LRU and never touches pages a sequence uses", "[paging][prefix]") {
  auto s = make_storage();
  prefix_index<storage_t> px(*s);
  std::vector<seq_id> seqs;
  for (int d = 0; d < 3; ++d) {
    const auto t = doc(1000 * (d + 1), 32);
    auto id = *s->create_sequence();
    append_tokens(*s, id, t, 0);
    REQUIRE(*px.insert(id, 0, t) == 2);
    seqs.push_back(id);
  }
  CHECK(px.evictable() == 0);
  CHECK(px.evict(10) == 0);  // every page is still used by a sequence
  REQUIRE(s->release(seqs[0]));
  REQUIRE(s->release(seqs[1]));
  CHECK(px.evictable() == 2);         // leaves only; their parents are not leaves
  (void)px.lookup(0, doc(1000, 32));  // doc 0 becomes most recently used
  const std::uint32_t free_before = s->free_pages(0);
  CHECK(px.evict(1) == 1);
  CHECK(s->free_pages(0) == free_before + 2);  // doc 1's second page, both layers
  CHECK(px.lookup(0, doc(2000, 32)).tokens == 16);
  CHECK(px.lookup(0, doc(1000, 32)).tokens == 32);
  CHECK(px.evict(10) == 3);  // doc 1's first page, then doc 0 leaf, then its parent
  CHECK(px.size() == 2);     // doc 2 is used by a live sequence
  CHECK(content_ok(*s, seqs[2], doc(3000, 32)));
  REQUIRE(s->release(seqs[2]));
  CHECK(px.evict_until_free(0, 40) == 2);
  CHECK(s->free_pages(0) == 40);
  REQUIRE(px.check_invariants());
  REQUIRE(s->check_invariants());
}

TEST_CASE("prefix insert failures change nothing", "[paging][prefix][fault]") {
  auto s = make_storage();
  prefix_index<storage_t> px(*s);
  const auto t = doc(1, 48);
  auto a = *s->create_sequence();
  append_tokens(*s, a, t, 0);
  REQUIRE(*px.insert(a, 0, std::span<const std::int32_t>(t).first(16)) == 1);
  const snapshot before = take_snapshot(*s);
  // Every allocation of the growth: a later one failing used to keep the arrays grown by the
  // earlier ones (the prefix_index report line changed under a refused insert).
  const std::size_t line = s->lines().prefix_index, held = s->meta_alloc().bytes_allocated();
  for (std::uint64_t k = 1; k <= 3; ++k) {  // entries, token ids, free list
    INFO("allocation " << k);
    s->meta_alloc().fail_on(k);
    auto r = px.insert(a, 0, t);
    CHECK(r.code() == errc::capacity_exhausted);
    s->meta_alloc().reset();
    CHECK(take_snapshot(*s) == before);
    CHECK(s->lines().prefix_index == line);
    CHECK(s->meta_alloc().bytes_allocated() == held);
    CHECK(px.size() == 1);
  }
  CHECK(px.insert(a, 0, doc(1, 64)).code() == errc::invalid_argument);  // more ids than tokens
  REQUIRE(px.check_invariants());
  CHECK(*px.insert(a, 0, t) == 2);
  auto rep = make_report(*s);
  CHECK(rep.reconciles());
  px.clear();
  CHECK(s->lines().prefix_index == 0);
  REQUIRE(s->check_invariants());
}

TEST_CASE("inserting an already cached prefix marks it recently used", "[paging][prefix]") {
  // insert documented "pages already cached are kept (and touched)" but did not touch them:
  // a prefix re-inserted by every request that used it was evicted as if nobody had.
  auto s = make_storage();
  prefix_index<storage_t> px(*s);
  const auto d0 = doc(0, 16), d1 = doc(100, 16);
  for (const auto* d : {&d0, &d1}) {  // d0 first: the least recently used entry
    auto q = *s->create_sequence();
    append_tokens(*s, q, *d, 0);
    REQUIRE(px.insert(q, 1, *d).value() == 1);
    REQUIRE(s->release(q));
  }
  auto again = *s->create_sequence();
  append_tokens(*s, again, d0, 0);
  REQUIRE(px.insert(again, 1, d0).value() == 0);  // cached already: touched, nothing new
  REQUIRE(s->release(again));
  REQUIRE(px.evict(1) == 1);
  CHECK(px.lookup(1, d0).tokens == 16);  // d1 is now the least recently used: evicted
  CHECK(px.lookup(1, d1).tokens == 0);
  REQUIRE(px.check_invariants());
}
