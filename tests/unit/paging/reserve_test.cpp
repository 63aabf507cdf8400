// SPDX-License-Identifier: Apache-2.0
// Layer-by-layer writes (issue 22): reserve (metadata and the slot mapping cuda::append
// takes), write_layer (host encode of one layer), commit / cancel; the same bytes as append.
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "catch.hpp"
#include "paging_test_support.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"

using namespace tierkv;
using namespace paging_test;

namespace {
constexpr int H = storage_t::kv_heads, D = storage_t::head_dim, T = storage_t::page_tokens;
constexpr std::size_t per_token = std::size_t(H) * D;

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

// Layer l of make_kv's [layer][token][head][dim] arrays.
std::span<const float> layer_of(const std::vector<float>& x, int l, std::size_t tokens) {
  return std::span<const float>(x).subspan(std::size_t(l) * tokens * per_token, tokens * per_token);
}

// Writes every layer of the reservation (in the given order) with the tokens of `sd`.
template <class S>
void write_all(S& s, seq_id id, const std::vector<std::uint64_t>& sd, bool reverse = false) {
  std::vector<float> k, v;
  make_kv<S>(s.num_layers(), sd, k, v);
  const std::size_t pt = std::size_t(S::kv_heads) * S::head_dim;
  for (int i = 0; i < s.num_layers(); ++i) {
    const int l = reverse ? s.num_layers() - 1 - i : i;
    const auto kl =
        std::span<const float>(k).subspan(std::size_t(l) * sd.size() * pt, sd.size() * pt);
    const auto vl =
        std::span<const float>(v).subspan(std::size_t(l) * sd.size() * pt, sd.size() * pt);
    REQUIRE(s.write_layer(id, l, kl, vl));
  }
}

// Reserves sd.size() tokens, checks the mapping against the pages after commit, writes and
// commits them all.
void reserve_write_commit(storage_t& s, seq_id id, const std::vector<std::uint64_t>& sd) {
  const std::int64_t n = std::int64_t(sd.size());
  const std::int64_t len = *s.length(id);
  std::vector<std::int32_t> slot(std::size_t(s.num_layers()) * sd.size()), offset(sd.size());
  REQUIRE(s.reserve(id, n, slot_mapping{slot, 0, offset}));
  write_all(s, id, sd);
  REQUIRE(s.commit(id, n));
  for (std::int64_t i = 0; i < n; ++i) {
    CHECK(offset[std::size_t(i)] == (len + i) % T);
    for (int l = 0; l < s.num_layers(); ++l)
      CHECK(std::uint32_t(slot[std::size_t(l) * sd.size() + std::size_t(i)]) ==
            s.page(id, l, (len + i) / T)->slot);
  }
}
}  // namespace

TEST_CASE("reserve and commit across page boundaries; the mapping names each page and row",
          "[paging][reserve]") {
  auto s = make_storage(3, 30, 6);
  const seq_id id = *s->create_sequence();
  const auto sd = seeds(100, 60);

  // 5 tokens into a fresh sequence: one new logical page (3 tier-0 pages).
  std::vector<std::int32_t> slot(3 * 5), offset(5);
  REQUIRE(s->reserve(id, 5, slot_mapping{slot, 0, offset}));
  CHECK(*s->reserved(id) == 5);
  CHECK(*s->length(id) == 0);
  CHECK(*s->logical_pages(id) == 0);  // not live yet
  CHECK(s->free_pages(0) == 27);
  REQUIRE(s->check_invariants());
  for (int i = 0; i < 5; ++i) CHECK(offset[std::size_t(i)] == i);
  for (int l = 0; l < 3; ++l)
    for (int i = 1; i < 5; ++i) CHECK(slot[std::size_t(l * 5 + i)] == slot[std::size_t(l * 5)]);
  CHECK(slot[0] != slot[5]);  // one page per layer
  write_all(*s, id, std::vector<std::uint64_t>(sd.begin(), sd.begin() + 5));
  REQUIRE(s->commit(id, 5));
  CHECK(*s->reserved(id) == 0);
  CHECK(*s->length(id) == 5);
  for (int l = 0; l < 3; ++l)
    CHECK(std::uint32_t(slot[std::size_t(l * 5)]) == s->page(id, l, 0)->slot);

  // 30 more (positions 5..34): the open tail page, one full page, one partial page.
  std::vector<std::int32_t> slot2(3 * 30), offset2(30);
  REQUIRE(s->reserve(id, 30, slot_mapping{slot2, 0, offset2}));
  CHECK(s->free_pages(0) == 30 - 9);
  CHECK(*s->logical_pages(id) == 1);
  CHECK(s->page(id, 0, 1).code() == errc::out_of_range);
  float k[D], v[D];
  CHECK(s->read_token(id, 0, 5, 0, k, v).code() == errc::out_of_range);
  REQUIRE(s->check_invariants());
  const std::vector<std::uint64_t> next(sd.begin() + 5, sd.begin() + 35);
  write_all(*s, id, next, /*reverse=*/true);  // layer order does not matter
  REQUIRE(s->commit(id, 30));
  CHECK(*s->length(id) == 35);
  CHECK(*s->logical_pages(id) == 3);
  for (int i = 0; i < 30; ++i) {
    CHECK(offset2[std::size_t(i)] == (5 + i) % T);
    for (int l = 0; l < 3; ++l)
      CHECK(std::uint32_t(slot2[std::size_t(l * 30 + i)]) == s->page(id, l, (5 + i) / T)->slot);
  }
  for (int l = 0; l < 3; ++l) {
    CHECK(s->page_state_of(*s->page(id, l, 0)) == page_state::sealed);
    CHECK(s->page_state_of(*s->page(id, l, 1)) == page_state::sealed);
    CHECK(s->page_state_of(*s->page(id, l, 2)) == page_state::open);
    for (std::int64_t t = 0; t < 35; ++t) REQUIRE(token_matches(*s, id, t, sd[std::size_t(t)], l));
  }
  // Exactly to the page boundary seals the tail without opening a page.
  reserve_write_commit(*s, id, std::vector<std::uint64_t>(sd.begin() + 35, sd.begin() + 48));
  CHECK(*s->logical_pages(id) == 3);
  CHECK(s->page_state_of(*s->page(id, 1, 2)) == page_state::sealed);
  CHECK(s->free_pages(0) == 30 - 9);
  // slots() repeats the mapping; a strided mapping leaves the other columns alone.
  REQUIRE(s->reserve(id, 2));
  std::vector<std::int32_t> wide(3 * 4, -7), off(2);
  REQUIRE(s->slots(id, slot_mapping{wide, 4, off}));
  for (int l = 0; l < 3; ++l) {
    CHECK(wide[std::size_t(l * 4 + 2)] == -7);
    CHECK(wide[std::size_t(l * 4 + 3)] == -7);
    CHECK(wide[std::size_t(l * 4)] == wide[std::size_t(l * 4 + 1)]);
  }
  CHECK(off[0] == 0);
  CHECK(off[1] == 1);
  REQUIRE(s->cancel(id));
  CHECK(s->free_pages(0) == 30 - 9);
  CHECK(s->slots(id, slot_mapping{wide, 4, off}).code() == errc::invalid_argument);
  REQUIRE(s->check_invariants());
  CHECK(make_report(*s).reconciles());
}

TEST_CASE("commit of fewer tokens than reserved gives the rest back; cancel gives all back",
          "[paging][reserve]") {
  auto s = make_storage(2, 20, 4);
  const seq_id id = *s->create_sequence();
  const auto sd = seeds(7, 40);
  reserve_write_commit(*s, id, std::vector<std::uint64_t>(sd.begin(), sd.begin() + 30));
  const std::uint32_t free_at_30 = s->free_pages(0);
  // Speculative: 20 drafted (positions 30..49, pages 1..3), 5 accepted.
  REQUIRE(s->reserve(id, 20));
  CHECK(s->free_pages(0) == free_at_30 - 4);
  CHECK(s->write_layer(id, 0, std::span<const float>(), std::span<const float>()).code() ==
        errc::invalid_argument);  // sizes are the reservation's: 20 tokens
  std::vector<float> k, v;
  make_kv<storage_t>(2, seeds(30 + 7, 20), k, v);
  for (int l = 0; l < 2; ++l)
    REQUIRE(s->write_layer(id, l, layer_of(k, l, 20), layer_of(v, l, 20)));
  CHECK(s->commit(id, 21).code() == errc::invalid_argument);  // beyond the reservation
  CHECK(*s->reserved(id) == 20);
  REQUIRE(s->commit(id, 5));
  CHECK(*s->length(id) == 35);
  CHECK(*s->reserved(id) == 0);
  CHECK(s->free_pages(0) == free_at_30 - 2);  // page 2 kept, page 3 given back
  for (int l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < 35; ++t) REQUIRE(token_matches(*s, id, t, sd[std::size_t(t)], l));
  REQUIRE(s->check_invariants());

  // Cancel: every page the reservation opened goes back; the committed tokens are as they were.
  const snapshot before = take_snapshot(*s);
  REQUIRE(s->reserve(id, 40));
  write_all(*s, id, seeds(900, 40));
  REQUIRE(s->cancel(id));
  const snapshot after = take_snapshot(*s);
  CHECK(after.seqs == before.seqs);
  CHECK(after.free_pages == before.free_pages);
  CHECK(after.blocks == before.blocks);
  CHECK(after.page_tables >= before.page_tables);  // the page list keeps its capacity
  for (int l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < 35; ++t) REQUIRE(token_matches(*s, id, t, sd[std::size_t(t)], l));
  // Overwritten rows past the fill are rewritten by the next reservation.
  reserve_write_commit(*s, id, std::vector<std::uint64_t>(sd.begin() + 35, sd.begin() + 40));
  for (int l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < 40; ++t) REQUIRE(token_matches(*s, id, t, sd[std::size_t(t)], l));
  CHECK(s->cancel(id));  // no reservation: a no-op
  CHECK(s->commit(id, 0));
  REQUIRE(s->check_invariants());
  CHECK(make_report(*s).reconciles());
}

TEST_CASE("several sequences interleaved through one strided slot mapping", "[paging][reserve]") {
  constexpr int L = 2, B = 3;
  auto s = make_storage(L, 40, 4);
  seq_id ids[B];
  std::vector<std::vector<std::uint64_t>> tokens(B);
  for (int b = 0; b < B; ++b) ids[b] = *s->create_sequence();
  // Prefill of different lengths, then decode steps of one token each, 40 steps: every
  // sequence crosses page boundaries at a different step.
  for (int b = 0; b < B; ++b) {
    tokens[std::size_t(b)] = seeds(std::uint64_t(1000 * (b + 1)), std::size_t(3 + 7 * b));
    reserve_write_commit(*s, ids[b], tokens[std::size_t(b)]);
  }
  std::vector<std::int32_t> slot(std::size_t(L) * B), offset(B);
  for (int step = 0; step < 40; ++step) {
    for (int b = 0; b < B; ++b) {  // one mapping [layers][B], column b = sequence b
      const slot_mapping col{std::span<std::int32_t>(slot).subspan(std::size_t(b)), B,
                             std::span<std::int32_t>(offset).subspan(std::size_t(b), 1)};
      REQUIRE(s->reserve(ids[b], 1, col));
    }
    for (int b = 0; b < B; ++b) {
      CHECK(offset[std::size_t(b)] == *s->length(ids[b]) % T);
      const std::uint64_t seed = std::uint64_t(1000 * (b + 1) + 500 + step);
      tokens[std::size_t(b)].push_back(seed);
      std::vector<float> k, v;
      make_kv<storage_t>(L, {seed}, k, v);
      for (int l = 0; l < L; ++l)
        REQUIRE(s->write_layer(ids[b], l, layer_of(k, l, 1), layer_of(v, l, 1)));
    }
    REQUIRE(s->check_invariants());
    for (int b = 0; b < B; ++b) {
      REQUIRE(s->commit(ids[b], 1));
      const std::int64_t pos = *s->length(ids[b]) - 1;
      for (int l = 0; l < L; ++l)
        CHECK(std::uint32_t(slot[std::size_t(l * B + b)]) == s->page(ids[b], l, pos / T)->slot);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < L; ++l)
      for (std::size_t t = 0; t < tokens[std::size_t(b)].size(); ++t)
        REQUIRE(token_matches(*s, ids[b], std::int64_t(t), tokens[std::size_t(b)][t], l));
  REQUIRE(s->check_invariants());
}

TEST_CASE(
    "a fork shares sealed pages, copies the committed tail, and leaves the parent's "
    "reservation with the parent",
    "[paging][reserve]") {
  auto s = make_storage(2, 24, 4);
  const seq_id a = *s->create_sequence();
  const auto sa = seeds(1, 21);
  reserve_write_commit(*s, a, sa);
  // a reserves 15 (positions 21..35: its open tail page and a new one) and writes them.
  REQUIRE(s->reserve(a, 15));
  write_all(*s, a, seeds(500, 15));
  const std::uint32_t free_before = s->free_pages(0);
  const seq_id b = *s->fork(a);
  CHECK(s->free_pages(0) == free_before - 2);  // the committed tail, one page per layer
  CHECK(*s->length(b) == 21);
  CHECK(*s->reserved(b) == 0);
  CHECK(*s->logical_pages(b) == 2);
  for (int l = 0; l < 2; ++l) {
    CHECK(*s->page(a, l, 0) == *s->page(b, l, 0));
    CHECK_FALSE(*s->page(a, l, 1) == *s->page(b, l, 1));
  }
  REQUIRE(s->check_invariants());
  // b writes its own continuation into its private tail while a's reservation is outstanding.
  reserve_write_commit(*s, b, seeds(700, 4));
  REQUIRE(s->commit(a, 15));
  for (int l = 0; l < 2; ++l) {
    for (std::int64_t t = 0; t < 21; ++t) {
      REQUIRE(token_matches(*s, a, t, sa[std::size_t(t)], l));
      REQUIRE(token_matches(*s, b, t, sa[std::size_t(t)], l));
    }
    for (std::int64_t t = 21; t < 36; ++t)
      REQUIRE(token_matches(*s, a, t, std::uint64_t(500 + t - 21), l));
    for (std::int64_t t = 21; t < 25; ++t)
      REQUIRE(token_matches(*s, b, t, std::uint64_t(700 + t - 21), l));
  }
  // A page-aligned fork shares every page; reservations on either side open private pages.
  const seq_id c = *s->create_sequence();
  reserve_write_commit(*s, c, seeds(50, 16));
  const seq_id d = *s->fork(c);
  REQUIRE(s->reserve(c, 3));
  REQUIRE(s->reserve(d, 3));
  CHECK(s->block_refcount(*s->block_of(c, 0)) == 2);
  write_all(*s, c, seeds(80, 3));
  write_all(*s, d, seeds(90, 3));
  REQUIRE(s->commit(c, 3));
  REQUIRE(s->commit(d, 3));
  CHECK_FALSE(*s->page(c, 0, 1) == *s->page(d, 0, 1));
  for (std::int64_t t = 16; t < 19; ++t) {
    REQUIRE(token_matches(*s, c, t, std::uint64_t(80 + t - 16), 1));
    REQUIRE(token_matches(*s, d, t, std::uint64_t(90 + t - 16), 1));
  }
  // Release drops a reservation with its sequence.
  REQUIRE(s->reserve(a, 30));
  REQUIRE(s->release(a));
  REQUIRE(s->check_invariants());
  for (const seq_id x : {b, c, d}) REQUIRE(s->release(x));
  CHECK(s->free_pages(0) == 24);
  CHECK(s->live_blocks() == 0);
  REQUIRE(s->check_invariants());
}

TEST_CASE("a refused reserve, write_layer or commit changes nothing", "[paging][reserve][fault]") {
  auto s = make_storage(2, 8, 2, 3);
  const seq_id id = *s->create_sequence();
  const auto sd = seeds(1, 20);
  reserve_write_commit(*s, id, sd);  // 2 logical pages x 2 layers of 8
  const snapshot before = take_snapshot(*s);
  std::vector<std::int32_t> slot(2 * 60), offset(60);

  SECTION("full pool") {
    const status st = s->reserve(id, 60, slot_mapping{slot, 0, offset});  // 5 pages, 4 free
    CHECK(st.code() == errc::capacity_exhausted);
    CHECK(st.message().find("4 free pages") != std::string::npos);
  }
  SECTION("bad ids, counts and mappings") {
    CHECK(s->reserve(seq_id{}, 3).code() == errc::out_of_range);
    CHECK(s->reserve(seq_id(12345), 3).code() == errc::stale_id);
    CHECK(s->reserve(id, -1).code() == errc::invalid_argument);
    CHECK(s->reserve(id, std::numeric_limits<std::int32_t>::max()).code() == errc::out_of_range);
    CHECK(s->reserve(id, 3, slot_mapping{std::span<std::int32_t>(slot).first(5), 0, {}}).code() ==
          errc::invalid_argument);  // 2 layers x 3 tokens
    CHECK(s->reserve(id, 3, slot_mapping{slot, 2, {}}).code() == errc::invalid_argument);
    CHECK(s->reserve(id, 3, slot_mapping{{}, 0, std::span<std::int32_t>(offset).first(2)}).code() ==
          errc::invalid_argument);
    CHECK(s->commit(id, 1).code() == errc::invalid_argument);  // nothing reserved
    std::vector<float> k(per_token), v(per_token);
    CHECK(s->write_layer(id, 0, k, v).code() == errc::invalid_argument);
  }
  SECTION("bookkeeping allocation fails") {
    s->meta_alloc().fail_on(1);  // the page list's growth to 4 entries
    const status st = s->reserve(id, 30, slot_mapping{slot, 0, offset});
    CHECK(st.code() == errc::capacity_exhausted);
    CHECK(s->meta_alloc().faults_injected() == 1);
    s->meta_alloc().reset();
  }
  SECTION("room hook refuses") {
    int asked = 0;
    const status st = s->reserve(id, 13, slot_mapping{slot, 0, offset}, [&](std::uint32_t pages) {
      asked = int(pages);
      return status::make(errc::capacity_exhausted, "no room");
    });
    CHECK(st.code() == errc::capacity_exhausted);
    CHECK(asked == 2);  // one new logical page x 2 layers
  }
  SECTION("a reservation outstanding: a second reserve, append and bad writes are refused") {
    REQUIRE(s->reserve(id, 3));
    const snapshot reserved = take_snapshot(*s);
    CHECK(s->reserve(id, 1).code() == errc::invalid_argument);
    std::vector<float> k, v;
    make_kv<storage_t>(2, seeds(50, 3), k, v);
    const status ap = s->append(id, 3, k, v);
    CHECK(ap.code() == errc::invalid_argument);
    CHECK(ap.message().find("reservation") != std::string::npos);
    CHECK(s->write_layer(id, 2, layer_of(k, 0, 3), layer_of(v, 0, 3)).code() == errc::out_of_range);
    std::vector<float> bad(layer_of(v, 1, 3).begin(), layer_of(v, 1, 3).end());
    bad[per_token + 20] = std::numeric_limits<float>::quiet_NaN();  // token 1, head 1
    const status nf = s->write_layer(id, 1, layer_of(k, 1, 3), bad);
    CHECK(nf.code() == errc::non_finite_input);
    CHECK(nf.message().find("layer 1, token 1, kv head 1") != std::string::npos);
    CHECK(s->commit(id, 4).code() == errc::invalid_argument);
    CHECK(take_snapshot(*s) == reserved);
    CHECK(*s->reserved(id) == 3);
    REQUIRE(s->cancel(id));
  }
  CHECK(take_snapshot(*s) == before);
  CHECK(*s->reserved(id) == 0);
  REQUIRE(s->check_invariants());
  CHECK(make_report(*s).reconciles());
  for (int l = 0; l < 2; ++l)
    for (std::int64_t t = 0; t < 20; ++t) REQUIRE(token_matches(*s, id, t, sd[std::size_t(t)], l));
}

namespace {
using G = geometry<head_dim<64>, kv_heads<2>, group_size<3>, page_tokens<16>>;

// The same chunks through append and through reserve + write_layer + commit: every page's
// bytes (poisoned rows past the fill included) and every decoded token are identical.
template <class Tier0>
void check_bit_identical() {
  using S = paged_storage<G, tiers<Tier0, tier<tq3_key, tq3_value>>>;
  typename S::options o;
  o.num_layers = 3;
  o.pages_per_tier = {60, 8};
  o.max_sequences = 4;
  o.codec_seed = 1234;
  o.head_base = 2;  // rotated contexts use the global head
  auto via_append = std::move(*S::create(o));
  auto via_layers = std::move(*S::create(o));
  const seq_id a = *via_append->create_sequence();
  const seq_id b = *via_layers->create_sequence();
  REQUIRE(a == b);
  std::mt19937 rng(11);
  std::normal_distribution<float> g;
  constexpr std::size_t pt = std::size_t(S::kv_heads) * S::head_dim;
  std::int64_t len = 0;
  for (const int n : {5, 11, 16, 1, 30, 16, 2}) {
    std::vector<float> k(std::size_t(3 * n) * pt), v(k.size());
    for (auto& x : k) x = g(rng) * 2.f;
    for (auto& x : v) x = g(rng);
    k[3] = 4.0e4f;  // a large magnitude among small ones
    REQUIRE(via_append->append(a, n, k, v));
    REQUIRE(via_layers->reserve(b, n));
    for (int l = 2; l >= 0; --l) {
      const std::size_t at = std::size_t(l) * std::size_t(n) * pt, cnt = std::size_t(n) * pt;
      REQUIRE(via_layers->write_layer(b, l, std::span<const float>(k).subspan(at, cnt),
                                      std::span<const float>(v).subspan(at, cnt)));
    }
    REQUIRE(via_layers->commit(b, n));
    len += n;
  }
  REQUIRE(*via_layers->length(b) == len);
  REQUIRE(*via_layers->logical_pages(b) == *via_append->logical_pages(a));
  CHECK(via_layers->saturations() == via_append->saturations());
  for (int l = 0; l < 3; ++l)
    for (std::int64_t p = 0; p < *via_append->logical_pages(a); ++p) {
      const page_id pa = *via_append->page(a, l, p), pb = *via_layers->page(b, l, p);
      CHECK(pa == pb);
      CHECK(via_append->page_state_of(pa) == via_layers->page_state_of(pb));
      const auto ba = *via_append->page_bytes(pa), bb = *via_layers->page_bytes(pb);
      REQUIRE(ba.size() == bb.size());
      REQUIRE(std::memcmp(ba.data(), bb.data(), ba.size()) == 0);
    }
  float ka[64], va[64], kb[64], vb[64];
  for (int l = 0; l < 3; ++l)
    for (std::int64_t t = 0; t < len; ++t)
      for (int h = 0; h < 2; ++h) {
        REQUIRE(via_append->read_token(a, l, t, h, ka, va));
        REQUIRE(via_layers->read_token(b, l, t, h, kb, vb));
        REQUIRE(std::memcmp(ka, kb, sizeof ka) == 0);
        REQUIRE(std::memcmp(va, vb, sizeof va) == 0);
      }
  REQUIRE(via_layers->check_invariants());
}
}  // namespace

TEST_CASE("reserve + write_layer + commit stores the same bytes as append",
          "[paging][reserve][codec]") {
  SECTION("FP8 E4M3") { check_bit_identical<tier<fp8_e4m3, fp8_e4m3>>(); }
  SECTION("int8_rotated") { check_bit_identical<tier<int8_rotated, int8_rotated>>(); }
}
