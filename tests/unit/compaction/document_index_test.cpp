// SPDX-License-Identifier: Apache-2.0
// document_index: requests that begin with a registered compacted document start from a fork
// of its sequence (pages shared, the same attention), the longest document wins, anything short
// of an exact match (an id, the salt, the variant, a shorter request) starts nothing, hash
// collisions are decided by the ids, refusals change nothing, and eviction gives every page back.
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "catch.hpp"
#include "colliding_hash.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/compaction/document_index.hpp"

using namespace tierkv;
using namespace tierkv::compaction;

namespace {

using geo = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
using cache_t = tiered_cache<geo, tiers<tier<fp8_e4m3, fp8_e4m3>>>;
constexpr int layers = 2;
constexpr std::uint32_t pool_pages = 96;
constexpr std::size_t vec = std::size_t(geo::kv_heads) * geo::head_dim;

std::unique_ptr<cache_t> make_cache(std::uint32_t max_sequences = 16) {
  cache_t::options opt;
  opt.storage.num_layers = layers;
  opt.storage.max_sequences = max_sequences;
  opt.storage.pages_per_tier = {pool_pages};
  opt.max_batch = 4;
  opt.max_pages = 32;
  return std::move(cache_t::create(opt).value());
}

// A sequence holding t random tokens (what write_prefix would leave: the index does not care how
// the compacted tokens were made).
seq_id compacted(cache_t& c, std::int64_t t, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> k(std::size_t(layers) * std::size_t(t) * vec), v(k.size());
  for (auto& e : k) e = normal(rng);
  for (auto& e : v) e = normal(rng);
  const seq_id s = c.create_sequence().value();
  REQUIRE(c.append(s, t, k, v).is_ok());
  return s;
}

std::vector<std::int32_t> ids(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> x(n);
  for (auto& e : x) e = std::int32_t(rng() % 50000);
  return x;
}

}  // namespace

TEST_CASE("document_index: a request that begins with a document forks its compacted sequence",
          "[compaction][document_index]") {
  auto c = make_cache();
  document_index<cache_t> index(*c);
  const auto stream = ids(600, 1);
  const std::span<const std::int32_t> all(stream);
  // two documents of one stream (the second extends the first) and one of another salt
  const seq_id a = compacted(*c, 40, 11), b = compacted(*c, 70, 12), other = compacted(*c, 20, 13);
  REQUIRE(index.insert(a, 7, all.first(256)).is_ok());
  REQUIRE(index.insert(b, 7, all.first(512)).is_ok());
  REQUIRE(index.insert(other, 8, all.first(256)).is_ok());
  CHECK(index.size() == 3);

  SECTION("the longest document the request holds wins; the fork shares its pages") {
    auto s = index.start_sequence(7, all.first(540));
    REQUIRE(s.has_value());
    REQUIRE(s->has_value());
    const auto& st = **s;
    CHECK(st.document_tokens == 512);
    CHECK(st.compacted_tokens == 70);
    CHECK(*c->length(st.seq) == 70);
    const auto parent = *c->storage().block_of(b, 0);
    CHECK(*c->storage().block_of(st.seq, 0) == parent);  // shared, not copied
    CHECK(c->storage().block_refcount(parent) == 2);
    // attention over the fork is attention over the registered sequence
    std::vector<float> q(std::size_t(geo::q_heads) * geo::head_dim, 0.25f), o1(q.size()),
        o2(q.size());
    for (int l = 0; l < layers; ++l) {
      const seq_id one[] = {b}, two[] = {st.seq};
      REQUIRE(c->attend(l, one, q, o1).is_ok());
      REQUIRE(c->attend(l, two, q, o2).is_ok());
      CHECK(o1 == o2);
    }
    // a request of 300 tokens holds only the first document
    auto s2 = index.start_sequence(7, all.first(300));
    REQUIRE(s2.has_value());
    REQUIRE(s2->has_value());
    CHECK((*s2)->document_tokens == 256);
    CHECK((*s2)->compacted_tokens == 40);
    // the salt picks the document
    auto s3 = index.start_sequence(8, all.first(300));
    REQUIRE(s3->has_value());
    CHECK((*s3)->compacted_tokens == 20);
    REQUIRE(index.find(7, all.first(512)).has_value());
    CHECK(index.find(7, all.first(512))->seq == b);
  }

  SECTION("anything short of an exact match starts nothing and changes nothing") {
    const std::uint32_t free_before = c->storage().free_pages(0);
    auto changed = stream;
    changed[100] ^= 1;  // one id inside both documents
    for (auto req :
         {std::span<const std::int32_t>(changed).first(540), all.first(255), all.first(0)}) {
      auto s = index.start_sequence(7, req);
      REQUIRE(s.has_value());
      CHECK_FALSE(s->has_value());
    }
    CHECK_FALSE(index.start_sequence(9, all.first(540))->has_value());     // another salt
    CHECK_FALSE(index.start_sequence(7, all.first(540), 1)->has_value());  // another variant
    CHECK(c->storage().free_pages(0) == free_before);
    CHECK(c->check_invariants().is_ok());
  }

  SECTION("refusals: nothing changes, the sequence stays the caller's") {
    const seq_id d = compacted(*c, 30, 14);
    CHECK(index.insert(d, 7, all.first(0)).code() == errc::invalid_argument);    // empty
    CHECK(index.insert(d, 7, all.first(20)).code() == errc::invalid_argument);   // t > n
    CHECK(index.insert(d, 7, all.first(256)).code() == errc::invalid_argument);  // registered
    const seq_id empty = c->create_sequence().value();
    CHECK(index.insert(empty, 7, all.first(64)).code() == errc::invalid_argument);  // no token
    REQUIRE(c->release(empty).is_ok());
    CHECK(index.insert(empty, 7, all.first(64)).code() == errc::stale_id);
    CHECK(index.size() == 3);
    REQUIRE(index.insert(d, 7, all.first(256), 5).is_ok());  // another variant: a new entry
    CHECK(index.size() == 4);
    // a registered sequence the engine appended to is refused at start
    std::vector<float> kv(std::size_t(layers) * vec, 0.5f);
    REQUIRE(c->append(d, 1, kv, kv).is_ok());
    CHECK(index.start_sequence(7, all.first(300), 5).error_status().code() ==
          errc::invalid_argument);
  }

  SECTION("eviction releases the least recently used; every page comes back") {
    auto s = index.start_sequence(7, all.first(600));  // uses b (its fork holds b's pages)
    REQUIRE(s->has_value());
    auto n = index.evict(2);  // a and other: the least recently used
    REQUIRE(n.has_value());
    CHECK(*n == 2);
    CHECK(index.size() == 1);
    CHECK(index.find(7, all.first(512))->seq == b);
    CHECK_FALSE(c->storage().length(a).has_value());  // released
    REQUIRE(index.clear().is_ok());
    CHECK(index.size() == 0);
    CHECK(*c->length((*s)->seq) == 70);  // the fork keeps its pages
    REQUIRE(c->release((*s)->seq).is_ok());
    CHECK(c->storage().free_pages(0) == pool_pages);
    CHECK(c->check_invariants().is_ok());
  }
}

TEST_CASE("document_index: a fork the cache refuses changes nothing",
          "[compaction][document_index]") {
  auto c = make_cache(/*max_sequences=*/1);
  document_index<cache_t> index(*c);
  const auto doc = ids(128, 2);
  REQUIRE(index.insert(compacted(*c, 20, 21), 3, doc).is_ok());
  const std::uint32_t free_before = c->storage().free_pages(0);
  auto s = index.start_sequence(3, doc);
  CHECK(s.error_status().code() == errc::capacity_exhausted);
  CHECK(c->storage().free_pages(0) == free_before);
  CHECK(index.size() == 1);
  CHECK(c->check_invariants().is_ok());
}

TEST_CASE("document_index: documents whose hashes collide are told apart by their ids",
          "[compaction][document_index]") {
  auto c = make_cache();
  document_index<cache_t, tierkv_test::colliding_hash> index(*c);
  const auto x = ids(200, 3), y = ids(200, 4);
  REQUIRE(index.insert(compacted(*c, 10, 31), 0, x).is_ok());
  REQUIRE(index.insert(compacted(*c, 12, 32), 0, y).is_ok());  // same hash, other ids: new
  CHECK(index.start_sequence(0, x).value()->compacted_tokens == 10);
  CHECK(index.start_sequence(0, y).value()->compacted_tokens == 12);
  auto z = x;
  z[199] += 1;
  CHECK_FALSE(index.start_sequence(0, z).value().has_value());
}
