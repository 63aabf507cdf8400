// SPDX-License-Identifier: Apache-2.0
#include "tierkv/paging/head_shard.hpp"

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "catch.hpp"
#include "transfer_support.hpp"

using namespace tierkv;
using namespace tierkv::test_transfer;

namespace {
using geo = geometry<head_dim<64>, kv_heads<4>, group_size<3>, page_tokens<16>>;
// Context-free formats: a rank's pages are the unsharded pages' head slices, bit for bit.
using two = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<fp8_e5m2, fp8_e5m2>>;
// Rotation-dependent: the same holds because rank r's storage has head_base = r * kv_heads / T.
using fp8_tq3 = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>;
constexpr int layers = 2;

template <class G, class Tiers>
std::unique_ptr<paged_storage<G, Tiers>> make(int head_base = 0) {
  typename paged_storage<G, Tiers>::options o{layers, 4, {64, 64}, 0xabcull};
  o.head_base = head_base;
  return paged_storage<G, Tiers>::create(o).value();
}
// Rank r of T, through rank_options (the contract's way to make a rank).
template <class G, class Tiers>
std::unique_ptr<paged_storage<G, Tiers>> make_rank(int ranks, int rank) {
  const auto o =
      rank_options(typename paged_storage<G, Tiers>::options{layers, 4, {64, 64}, 0xabcull},
                   geo::kv_heads, ranks, rank);
  REQUIRE(o);
  return paged_storage<G, Tiers>::create(*o).value();
}

template <class Tiers, int T>
void tensor_parallel(std::uint64_t rng_seed) {
  using rank_geo = shard_geometry_t<geo, T>;
  static_assert(rank_geo::kv_heads == geo::kv_heads / T && rank_geo::q_heads == geo::q_heads / T);
  std::mt19937_64 rng(rng_seed);
  auto whole = make<geo, Tiers>();
  std::vector<std::unique_ptr<paged_storage<rank_geo, Tiers>>> ranks;
  for (int r = 0; r < T; ++r) ranks.push_back(make_rank<rank_geo, Tiers>(T, r));
  for (int r = 0; r < T; ++r)
    CHECK(ranks[std::size_t(r)]->config().head_base == r * geo::kv_heads / T);
  const seq_id sw = whole->create_sequence().value();
  std::vector<seq_id> sr;
  for (auto& r : ranks) sr.push_back(r->create_sequence().value());

  // Two appends (prefill, then a few decode tokens), each split by heads.
  for (std::int64_t n : {std::int64_t(16 * 4 + 5), std::int64_t(14)}) {
    const auto k = random_kv(rng, layers, n, geo::kv_heads, geo::head_dim);
    const auto v = random_kv(rng, layers, n, geo::kv_heads, geo::head_dim);
    REQUIRE(whole->append(sw, n, k, v));
    for (int r = 0; r < T; ++r) {
      const rank_heads h = heads_of_rank(geo::kv_heads, geo::group_size, T, r).value();
      std::vector<float> kr(k.size() / T), vr(v.size() / T);
      REQUIRE(slice_heads(k, geo::kv_heads, geo::head_dim, h.kv_begin, h.kv_count, kr));
      REQUIRE(slice_heads(v, geo::kv_heads, geo::head_dim, h.kv_begin, h.kv_count, vr));
      REQUIRE(ranks[std::size_t(r)]->append(sr[std::size_t(r)], n, kr, vr));
    }
  }
  // One controller decision list, applied to every rank (and to the unsharded control).
  const std::int64_t full = whole->length(sw).value() / geo::page_tokens;
  for (std::int64_t j = 0; j < full; ++j)
    for (int l = 0; l < layers; ++l)
      if (rng() % 2) {
        REQUIRE(retier(*whole, sw, j, l, 1));
        for (int r = 0; r < T; ++r)
          REQUIRE(retier(*ranks[std::size_t(r)], sr[std::size_t(r)], j, l, 1));
      }
  for (int r = 1; r < T; ++r)
    CHECK(compare_page_tables(*ranks[0], sr[0], *ranks[std::size_t(r)], sr[std::size_t(r)]));
  CHECK(compare_page_tables(*ranks[0], sr[0], *whole, sw));  // same ops, same pools: same ids
  for (auto& r : ranks) CHECK(r->check_invariants());

  // Per-rank decode outputs, joined by query heads, equal the unsharded outputs exactly.
  const auto q = random_kv(rng, 1, 1, geo::q_heads, geo::head_dim);
  for (int l = 0; l < layers; ++l) {
    std::vector<float> ow, lw;
    REQUIRE(decode_layer(*whole, sw, l, q, ow, lw));
    std::vector<float> oj(ow.size(), 0.f), lj(lw.size(), 0.f);
    for (int r = 0; r < T; ++r) {
      const rank_heads h = heads_of_rank(geo::kv_heads, geo::group_size, T, r).value();
      std::vector<float> qr(q.size() / T), orr, lr;
      REQUIRE(slice_heads(q, geo::q_heads, geo::head_dim, h.q_begin, h.q_count, qr));
      REQUIRE(decode_layer(*ranks[std::size_t(r)], sr[std::size_t(r)], l, qr, orr, lr));
      REQUIRE(join_heads(orr, geo::q_heads, geo::head_dim, h.q_begin, h.q_count, oj));
      REQUIRE(join_heads(lr, geo::q_heads, 1, h.q_begin, h.q_count, lj));
    }
    CHECK(std::memcmp(oj.data(), ow.data(), ow.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(lj.data(), lw.data(), lw.size() * sizeof(float)) == 0);
  }

  // Splitting the unsharded cache's pages per rank gives each rank's own pages, bytewise
  // (TQ3 pages included: they import into a storage with the rank's head_base).
  for (int r = 0; r < T; ++r) {
    auto buf = export_rank_pages(*whole, sw, T, r);
    REQUIRE(buf);
    auto fresh = make_rank<rank_geo, Tiers>(T, r);
    auto d = import_pages(*fresh, *buf);
    REQUIRE(d);
    auto& rk = *ranks[std::size_t(r)];
    const std::int64_t n = rk.logical_pages(sr[std::size_t(r)]).value();
    for (std::int64_t j = 0; j < n; ++j)
      for (int l = 0; l < layers; ++l)
        CHECK(pages_equal(rk, rk.page(sr[std::size_t(r)], l, j).value(), *fresh,
                          fresh->page(*d, l, j).value(), fill_of(rk, sr[std::size_t(r)], j)));
  }
}
}  // namespace

TEST_CASE("tensor parallel, 2 ranks: identical tables, joined outputs equal the unsharded cache",
          "[transfer][tp]") {
  tensor_parallel<two, 2>(21);
}
TEST_CASE("tensor parallel, 4 ranks: identical tables, joined outputs equal the unsharded cache",
          "[transfer][tp]") {
  tensor_parallel<two, 4>(22);
}
TEST_CASE(
    "tensor parallel with TQ3 tiers, 2 ranks: joined outputs equal the unsharded cache bit for bit",
    "[transfer][tp]") {
  tensor_parallel<fp8_tq3, 2>(23);
}
TEST_CASE(
    "tensor parallel with TQ3 tiers, 4 ranks: joined outputs equal the unsharded cache bit for bit",
    "[transfer][tp]") {
  tensor_parallel<fp8_tq3, 4>(24);
}

TEST_CASE("TQ3 pages of a rank made without head_base are not the unsharded cache's",
          "[transfer][tp]") {
  // The control for the cases above: rank 1's heads encoded with local contexts (head_base 0)
  // decode differently from the same heads of the unsharded cache; with head_base they agree.
  using rank_geo = shard_geometry_t<geo, 2>;
  std::mt19937_64 rng(25);
  auto whole = make<geo, fp8_tq3>();
  auto local = make<rank_geo, fp8_tq3>(0);
  auto based = make<rank_geo, fp8_tq3>(geo::kv_heads / 2);
  const seq_id sw = whole->create_sequence().value(), sl = local->create_sequence().value(),
               sb = based->create_sequence().value();
  const std::int64_t n = 16 * 3;
  const auto k = random_kv(rng, layers, n, geo::kv_heads, geo::head_dim);
  const auto v = random_kv(rng, layers, n, geo::kv_heads, geo::head_dim);
  REQUIRE(whole->append(sw, n, k, v));
  const rank_heads h = heads_of_rank(geo::kv_heads, geo::group_size, 2, 1).value();
  std::vector<float> kr(k.size() / 2), vr(v.size() / 2);
  REQUIRE(slice_heads(k, geo::kv_heads, geo::head_dim, h.kv_begin, h.kv_count, kr));
  REQUIRE(slice_heads(v, geo::kv_heads, geo::head_dim, h.kv_begin, h.kv_count, vr));
  REQUIRE(local->append(sl, n, kr, vr));
  REQUIRE(based->append(sb, n, kr, vr));
  for (std::int64_t j = 0; j < 3; ++j)
    for (int l = 0; l < layers; ++l) {
      REQUIRE(retier(*whole, sw, j, l, 1));
      REQUIRE(retier(*local, sl, j, l, 1));
      REQUIRE(retier(*based, sb, j, l, 1));
    }
  const auto q = random_kv(rng, 1, 1, geo::q_heads, geo::head_dim);
  std::vector<float> qr(q.size() / 2);
  REQUIRE(slice_heads(q, geo::q_heads, geo::head_dim, h.q_begin, h.q_count, qr));
  std::vector<float> ow, lw, ol, ll, ob, lb;
  REQUIRE(decode_layer(*whole, sw, 1, q, ow, lw));
  REQUIRE(decode_layer(*local, sl, 1, qr, ol, ll));
  REQUIRE(decode_layer(*based, sb, 1, qr, ob, lb));
  std::vector<float> want(qr.size());
  REQUIRE(slice_heads(ow, geo::q_heads, geo::head_dim, h.q_begin, h.q_count, want));
  CHECK(std::memcmp(ob.data(), want.data(), want.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(ol.data(), want.data(), want.size() * sizeof(float)) != 0);
}

TEST_CASE("rank_options: head_base of rank r is r * kv_heads / T", "[transfer][tp]") {
  storage_options<2> o{layers, 4, {64, 64}, 7};
  CHECK(rank_options(o, 8, 4, 0)->head_base == 0);
  CHECK(rank_options(o, 8, 4, 3)->head_base == 6);
  CHECK(rank_options(o, 8, 4, 3)->codec_seed == 7u);
  o.head_base = 16;  // an unsharded cache that is itself heads [16, 24) of a larger one
  CHECK(rank_options(o, 8, 2, 1)->head_base == 20);
  CHECK(rank_options(o, 8, 3, 0).code() == errc::invalid_argument);
  CHECK(rank_options(o, 8, 2, 2).code() == errc::out_of_range);
  o.head_base = -1;
  CHECK(paged_storage<geo, two>::create(o).code() == errc::invalid_argument);
}

TEST_CASE("head helpers reject bad splits", "[transfer][tp]") {
  CHECK(heads_of_rank(4, 3, 3, 0).code() == errc::invalid_argument);
  CHECK(heads_of_rank(4, 3, 2, 2).code() == errc::out_of_range);
  const auto h = heads_of_rank(8, 2, 4, 3).value();
  CHECK(h.kv_begin == 6);
  CHECK(h.q_begin == 12);
  CHECK(h.q_count == 4);
  std::vector<float> all(2 * 4 * 2), part(2 * 2 * 2);
  CHECK(slice_heads(all, 4, 2, 3, 2, part).code() == errc::out_of_range);
  CHECK(slice_heads(all, 4, 2, 1, 2, std::span<float>(part.data(), 3)).code() ==
        errc::invalid_argument);
  CHECK(join_heads(std::span<const float>(part.data(), 5), 4, 2, 0, 2, all).code() ==
        errc::invalid_argument);
}
