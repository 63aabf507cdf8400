// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "paging_test_support.hpp"

using namespace tierkv;
using namespace paging_test;

namespace {
std::unique_ptr<storage_t> make_storage(int layers, std::uint32_t pages0, std::uint32_t pages1,
                                        std::uint32_t max_seqs = 8) {
  storage_t::options o;
  o.num_layers = layers;
  o.pages_per_tier = {pages0, pages1};
  o.max_sequences = max_seqs;
  o.codec_seed = 42;
  auto s = storage_t::create(o);
  REQUIRE(s);
  return std::move(*s);
}

std::vector<std::uint64_t> seeds(std::uint64_t first, std::size_t n) {
  std::vector<std::uint64_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

void append_seeds(storage_t& s, seq_id id, const std::vector<std::uint64_t>& sd) {
  std::vector<float> k, v;
  make_kv<storage_t>(s.num_layers(), sd, k, v);
  REQUIRE(s.append(id, std::int64_t(sd.size()), k, v));
}
}  // namespace

TEST_CASE("storage creation validates options and reports every failure", "[paging][storage]") {
  storage_t::options o;
  o.num_layers = 0;
  o.pages_per_tier = {8, 8};
  CHECK(storage_t::create(o).code() == errc::invalid_argument);
  o.num_layers = 4;
  o.pages_per_tier = {3, 8};
  auto few = storage_t::create(o);
  CHECK(few.code() == errc::invalid_argument);
  CHECK(few.error_status().message().find("num_layers = 4") != std::string::npos);
  o.pages_per_tier = {8, 0};
  CHECK(storage_t::create(o).code() == errc::invalid_argument);
  o.pages_per_tier = {8, 8};
  // Fault injection at every bookkeeping allocation of construction: an error, no leak.
  for (int k = 1; k <= 12; ++k) {
    failing_allocator meta;
    meta.fail_on(std::uint64_t(k));
    auto s = storage_t::create(o, host_allocator{}, std::move(meta));
    if (s) {
      CHECK(s.value()->meta_alloc().faults_injected() == 0);
      break;
    }
    CHECK(s.code() == errc::injected_fault);
  }
}

TEST_CASE("append encodes every layer and head, seals full pages, reads back exactly",
          "[paging][storage]") {
  auto s = make_storage(3, 30, 6);
  auto id = s->create_sequence();
  REQUIRE(id);
  const auto sd = seeds(100, 37);
  append_seeds(*s, *id, sd);
  CHECK(*s->length(*id) == 37);
  CHECK(*s->logical_pages(*id) == 3);
  CHECK(s->free_pages(0) == 30 - 9);
  for (int l = 0; l < 3; ++l)
    for (std::int64_t t = 0; t < 37; ++t) REQUIRE(token_matches(*s, *id, t, sd[std::size_t(t)], l));
  // Full pages are sealed, the tail is open; tokens past the fill keep the poison.
  CHECK(s->page_state_of(*s->page(*id, 0, 0)) == page_state::sealed);
  CHECK(s->page_state_of(*s->page(*id, 2, 1)) == page_state::sealed);
  CHECK(s->page_state_of(*s->page(*id, 1, 2)) == page_state::open);
#if TIERKV_POISON_PAGES
  using L = storage_t::layout<0>;
  auto bytes = s->page_bytes(*s->page(*id, 1, 2));
  REQUIRE(bytes);
  const std::uint8_t* past = bytes->data() + L::key_payload(1, 5);
  CHECK(std::all_of(past, past + L::key_codec::payload_bytes,
                    [](std::uint8_t b) { return b == page_poison_byte; }));
#endif
  // Appending in pieces gives the same content as at once.
  auto id2 = s->create_sequence();
  for (std::size_t i = 0; i < sd.size(); i += 5) {
    const std::vector<std::uint64_t> part(sd.begin() + std::ptrdiff_t(i),
                                          sd.begin() + std::ptrdiff_t(std::min(sd.size(), i + 5)));
    append_seeds(*s, *id2, part);
  }
  for (int l = 0; l < 3; ++l)
    for (std::int64_t t = 0; t < 37; ++t)
      REQUIRE(token_matches(*s, *id2, t, sd[std::size_t(t)], l));
  REQUIRE(s->check_invariants());
  CHECK(s->read_token(*id, 3, 0, 0, nullptr, nullptr).code() == errc::out_of_range);
  CHECK(s->read_token(*id, 0, 37, 0, nullptr, nullptr).code() == errc::out_of_range);
}

TEST_CASE("append failures change nothing (strong guarantee)", "[paging][storage][fault]") {
  auto s = make_storage(2, 8, 2);
  auto id = s->create_sequence();
  append_seeds(*s, *id, seeds(1, 20));
  const snapshot before = take_snapshot(*s);
  std::vector<float> k, v;

  SECTION("full pool") {
    // 20 tokens use 2 logical pages x 2 layers = 4 of 8 pages; 60 more need 4 new pages... 80
    // tokens = 5 pages.
    make_kv<storage_t>(2, seeds(50, 60), k, v);
    auto st = s->append(*id, 60, k, v);
    CHECK(st.code() == errc::capacity_exhausted);
    CHECK(st.message().find("4 free pages") != std::string::npos);
  }
  SECTION("non-finite input") {
    make_kv<storage_t>(2, seeds(50, 3), k, v);
    v[v.size() - 1] = std::numeric_limits<float>::quiet_NaN();
    auto st = s->append(*id, 3, k, v);
    CHECK(st.code() == errc::non_finite_input);
    CHECK(st.message().find("layer 1, token 2, kv head 1") != std::string::npos);
    k[0] = std::numeric_limits<float>::infinity();
    CHECK(s->append(*id, 3, k, v).code() == errc::non_finite_input);
  }
  SECTION("wrong sizes and bad ids") {
    make_kv<storage_t>(2, seeds(50, 3), k, v);
    CHECK(s->append(*id, 4, k, v).code() == errc::invalid_argument);
    CHECK(s->append(*id, -1, k, v).code() == errc::invalid_argument);
    CHECK(s->append(seq_id{}, 3, k, v).code() == errc::out_of_range);
    CHECK(s->append(seq_id(12345), 3, k, v).code() == errc::stale_id);  // a slot, wrong generation
    auto other = s->create_sequence();
    REQUIRE(s->release(*other));
    CHECK(s->append(*other, 3, k, v).code() == errc::stale_id);
    CHECK(s->release(*other).code() == errc::stale_id);
  }
  SECTION("bookkeeping allocation fails") {
    make_kv<storage_t>(2, seeds(50, 30), k, v);
    s->meta_alloc().fail_on(1);
    auto st = s->append(*id, 30, k, v);
    CHECK(st.code() == errc::capacity_exhausted);
    CHECK(st.message().find("injected_fault") != std::string::npos);
    CHECK(s->meta_alloc().faults_injected() == 1);
    s->meta_alloc().reset();
  }
  CHECK(take_snapshot(*s) == before);
  REQUIRE(s->check_invariants());
  CHECK(make_report(*s).reconciles());
  for (int l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < 20; ++t)
      REQUIRE(token_matches(*s, *id, t, std::uint64_t(t + 1), l));
}

TEST_CASE("fork shares sealed pages and copies the open tail", "[paging][storage]") {
  auto s = make_storage(2, 16, 4);
  auto a = s->create_sequence();
  append_seeds(*s, *a, seeds(1, 21));
  const std::uint32_t free_before = s->free_pages(0);
  auto b = s->fork(*a);
  REQUIRE(b);
  CHECK(s->free_pages(0) == free_before - 2);  // one tail page per layer
  for (int l = 0; l < 2; ++l) {
    CHECK(*s->page(*a, l, 0) == *s->page(*b, l, 0));
    CHECK_FALSE(*s->page(*a, l, 1) == *s->page(*b, l, 1));
  }
  CHECK(s->block_refcount(*s->block_of(*a, 0)) == 2);
  append_seeds(*s, *a, seeds(1000, 4));
  append_seeds(*s, *b, seeds(2000, 4));
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 0; t < 21; ++t) {
      REQUIRE(token_matches(*s, *a, t, std::uint64_t(t + 1), l));
      REQUIRE(token_matches(*s, *b, t, std::uint64_t(t + 1), l));
    }
    for (std::int64_t t = 21; t < 25; ++t) {
      REQUIRE(token_matches(*s, *a, t, std::uint64_t(1000 + t - 21), l));
      REQUIRE(token_matches(*s, *b, t, std::uint64_t(2000 + t - 21), l));
    }
  }
  // A page-aligned fork copies nothing.
  auto c = s->create_sequence();
  append_seeds(*s, *c, seeds(5, 16));
  const std::uint32_t f2 = s->free_pages(0);
  auto d = s->fork(*c);
  REQUIRE(d);
  CHECK(s->free_pages(0) == f2);
  REQUIRE(s->check_invariants());
  // Releasing the parent keeps shared pages alive for the child.
  REQUIRE(s->release(*a));
  for (std::int64_t t = 0; t < 21; ++t) REQUIRE(token_matches(*s, *b, t, std::uint64_t(t + 1), 1));
  REQUIRE(s->release(*b));
  REQUIRE(s->release(*c));
  REQUIRE(s->release(*d));
  CHECK(s->free_pages(0) == 16);
  CHECK(s->live_blocks() == 0);
  REQUIRE(s->check_invariants());
}

TEST_CASE("fork failures change nothing", "[paging][storage][fault]") {
  auto s = make_storage(2, 8, 2, 3);
  auto a = s->create_sequence();
  append_seeds(*s, *a, seeds(1, 40));  // 3 logical pages x 2 layers of 8
  const snapshot before = take_snapshot(*s);
  s->meta_alloc().fail_on(1);  // the child's page list cannot grow
  auto f = s->fork(*a);
  CHECK(f.code() == errc::capacity_exhausted);
  CHECK(s->meta_alloc().faults_injected() == 1);
  s->meta_alloc().reset();
  CHECK(take_snapshot(*s) == before);
  auto b = s->fork(*a);  // takes the last 2 pages for its tail
  REQUIRE(b);
  const snapshot full = take_snapshot(*s);
  auto c = s->fork(*a);
  CHECK(c.code() == errc::capacity_exhausted);
  CHECK(take_snapshot(*s) == full);
  auto d = s->create_sequence();
  REQUIRE(d);
  CHECK(s->create_sequence().code() == errc::capacity_exhausted);
  CHECK(s->fork(*d).code() == errc::capacity_exhausted);  // no sequence slot left
  REQUIRE(s->check_invariants());
  CHECK(make_report(*s).reconciles());
}

TEST_CASE("replace_page publishes for every holder, then releases the old page",
          "[paging][storage][tiering]") {
  auto s = make_storage(2, 12, 4);
  auto a = s->create_sequence();
  append_seeds(*s, *a, seeds(1, 20));
  auto b = s->fork(*a);
  const page_id old = *s->page(*a, 1, 0);
  auto fresh = s->allocate_page(1);
  REQUIRE(fresh);
  CHECK(fresh->format == 1);
  // A lossless conversion between the two dense tiers: copy the bytes.
  auto src = s->page_bytes(old);
  auto dst = s->page_bytes(*fresh);
  REQUIRE(src);
  REQUIRE(dst);
  std::memcpy(dst->data(), src->data(), src->size());
  REQUIRE(s->check_invariants(1));

  SECTION("errors change nothing") {
    const snapshot before = take_snapshot(*s);
    CHECK(s->replace_page(*a, 1, 1, *s->page(*a, 1, 1), *fresh).code() ==
          errc::not_writable);  // open tail
    CHECK(s->replace_page(*a, 1, 0, *s->page(*a, 0, 0), *fresh).code() == errc::stale_id);
    CHECK(s->replace_page(*a, 2, 0, old, *fresh).code() == errc::out_of_range);
    CHECK(s->replace_page(*a, 0, 0, *s->page(*a, 0, 0), *s->page(*a, 1, 1)).code() ==
          errc::invalid_argument);
    CHECK(s->release_page(*s->page(*a, 0, 0)).code() == errc::not_writable);
    CHECK(take_snapshot(*s) == before);
    REQUIRE(s->release_page(*fresh));
    CHECK(s->release_page(*fresh).code() == errc::double_release);
    REQUIRE(s->check_invariants());
  }
  SECTION("success") {
    REQUIRE(s->replace_page(*b, 1, 0, old, *fresh));
    CHECK(*s->page(*a, 1, 0) == *fresh);
    CHECK(*s->page(*b, 1, 0) == *fresh);
    CHECK(s->check_page(old).code() == errc::double_release);  // freed: no holder left
    CHECK(s->free_pages(1) == 3);
    for (std::int64_t t = 0; t < 20; ++t) {
      REQUIRE(token_matches(*s, *a, t, std::uint64_t(t + 1), 1));
      REQUIRE(token_matches(*s, *b, t, std::uint64_t(t + 1), 1));
    }
    // Publishing the same page twice is refused.
    CHECK(s->replace_page(*a, 0, 0, *s->page(*a, 0, 0), *fresh).code() == errc::invalid_argument);
    REQUIRE(s->check_invariants());
    REQUIRE(s->release(*a));
    REQUIRE(s->release(*b));
    CHECK(s->free_pages(1) == 4);
    CHECK(s->free_pages(0) == 12);
  }
}

TEST_CASE("accounting reconciles and splits pages by role", "[paging][report]") {
  auto s = make_storage(2, 10, 4);
  auto empty = make_report(*s);
  CHECK(empty.reconciles());
  CHECK(empty.live_tokens == 0);
  auto a = s->create_sequence();
  append_seeds(*s, *a, seeds(1, 24));  // 1 full + 1 half page per layer
  auto b = s->fork(*a);
  (void)b;
  auto r = make_report(*s);
  CHECK(r.reconciles());
  CHECK(r.allocator_total == s->page_alloc().bytes_allocated() + s->meta_alloc().bytes_allocated());
  REQUIRE(r.tiers.size() == 2);
  using L = storage_t::layout<0>;
  CHECK(r.tiers[0].live_pages == 6);
  CHECK(r.tiers[0].key_payload == 6 * 2 * 16 * 64);
  CHECK(r.tiers[0].value_payload == 6 * 2 * 16 * 64);
  CHECK(r.tiers[0].key_meta == 0);
  CHECK(r.tiers[0].padding == 0);
  CHECK(r.tiers[0].free_page_bytes == 4 * L::page_bytes);
  CHECK(r.live_tokens == 16 + 8 + 8);  // shared full page once, two tails
  CHECK(r.sequence_tokens == 48);
  CHECK(r.bits_per_scalar == Approx(32.0 * (6 * 16.0) / (32 * 2)));
  CHECK(r.tiers[0].token_layers == 64);
  std::ostringstream out;
  out << r;
  CHECK(out.str().find("(reconciled)") != std::string::npos);
}
