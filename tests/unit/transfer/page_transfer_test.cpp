// SPDX-License-Identifier: Apache-2.0
#include "tierkv/paging/page_transfer.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "catch.hpp"
#include "transfer_support.hpp"

using namespace tierkv;
using namespace tierkv::test_transfer;

namespace {
using geo = geometry<head_dim<64>, kv_heads<4>, group_size<2>, page_tokens<16>>;
using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using tq3_tier = tier<tq3_key, tq3_value>;
using two = tiers<fp8_tier, tq3_tier>;
using storage_t = paged_storage<geo, two, host_allocator, failing_allocator>;
constexpr int layers = 3;
constexpr std::uint64_t seed = 0x5eed1234ull;

std::unique_ptr<storage_t> make(std::uint32_t fp8_pages = 64, std::uint32_t tq3_pages = 64,
                                std::uint64_t codec_seed = seed) {
  storage_t::options o;
  o.num_layers = layers;
  o.max_sequences = 4;
  o.pages_per_tier = {fp8_pages, tq3_pages};
  o.codec_seed = codec_seed;
  return storage_t::create(o).value();
}

// A sequence of `tokens` random tokens (some adversarial), with a mix of tiers: pages
// whose (logical + layer) is odd move to TQ3 (sealed pages only).
seq_id fill(storage_t& s, std::mt19937_64& rng, std::int64_t tokens) {
  const seq_id q = s.create_sequence().value();
  auto k = random_kv(rng, layers, tokens, geo::kv_heads, geo::head_dim);
  auto v = random_kv(rng, layers, tokens, geo::kv_heads, geo::head_dim);
  // Adversarial vectors: all zeros, huge, subnormal (finite: append refuses NaN/Inf).
  if (tokens >= 3) {
    std::fill_n(k.begin(), geo::head_dim, 0.f);
    std::fill_n(v.begin() + geo::head_dim * geo::kv_heads, geo::head_dim, 3e38f);
    std::fill_n(k.begin() + 2 * geo::head_dim * geo::kv_heads, geo::head_dim, std::numeric_limits<float>::denorm_min());
  }
  REQUIRE(s.append(q, tokens, k, v));
  const std::int64_t full = tokens / geo::page_tokens;
  for (std::int64_t j = 0; j < full; ++j)
    for (int l = 0; l < layers; ++l)
      if ((j + l) % 2 == 1) REQUIRE(retier(s, q, j, l, 1));
  return q;
}

struct snapshot {
  std::uint32_t seqs, blocks, free0, free1;
  std::size_t meta_bytes;
  bool operator==(const snapshot&) const = default;
};
snapshot snap(const storage_t& s) {
  return {s.live_sequences(), s.live_blocks(), s.free_pages(0), s.free_pages(1), s.meta_alloc().bytes_allocated()};
}

// Re-seals a buffer after a deliberate edit, so a check after the checksum is reached.
void reseal(std::vector<std::uint8_t>& b) {
  const std::uint64_t c = detail::transfer_checksum(std::span<const std::uint8_t>(b.data(), b.size() - 8));
  std::memcpy(b.data() + b.size() - 8, &c, 8);
}

void check_same_outputs(storage_t& a, seq_id sa, storage_t& b, seq_id sb, std::mt19937_64& rng) {
  auto qs = random_kv(rng, 1, 1, geo::q_heads, geo::head_dim);
  for (int l = 0; l < layers; ++l) {
    std::vector<float> oa, la, ob, lb;
    REQUIRE(decode_layer(a, sa, l, qs, oa, la));
    REQUIRE(decode_layer(b, sb, l, qs, ob, lb));
    CHECK(std::all_of(oa.begin(), oa.end(), [](float x) { return std::isfinite(x); }));
    CHECK(std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0);
  }
}
}  // namespace

TEST_CASE("transfer checksum: every single-byte change is detected", "[transfer]") {
  std::vector<std::uint8_t> b(77);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = std::uint8_t(i * 37u);
  const std::uint64_t c0 = detail::transfer_checksum(b);
  for (std::size_t i = 0; i < b.size(); ++i) {
    b[i] ^= 0x10;
    CHECK(detail::transfer_checksum(b) != c0);
    b[i] ^= 0x10;
  }
  CHECK(detail::transfer_checksum(std::span<const std::uint8_t>(b.data(), 76)) != c0);  // length counts
}

TEST_CASE("export/import round trip: byte-identical pages, identical decode", "[transfer]") {
  std::mt19937_64 rng(11);
  for (std::int64_t tokens : {std::int64_t(1), std::int64_t(16), std::int64_t(16 * 5 + 7), std::int64_t(16 * 6)}) {
    CAPTURE(tokens);
    auto src = make();
    const seq_id q = fill(*src, rng, tokens);
    auto buf = export_pages(*src, q);
    REQUIRE(buf);
    REQUIRE(buf->size() == export_size(*src, q).value());
    auto info = inspect_transfer(*buf);
    REQUIRE(info);
    CHECK(info->tokens == std::uint64_t(tokens));
    CHECK(info->logical_pages == std::uint32_t((tokens + 15) / 16));
    CHECK(info->codec_seed == seed);

    auto dst = make();
    auto d = import_pages(*dst, *buf);
    REQUIRE(d);
    REQUIRE(dst->check_invariants());
    CHECK(dst->length(*d).value() == tokens);
    const std::int64_t n = src->logical_pages(q).value();
    for (std::int64_t j = 0; j < n; ++j)
      for (int l = 0; l < layers; ++l) {
        const page_id ps = src->page(q, l, j).value(), pd = dst->page(*d, l, j).value();
        CHECK(ps.format == pd.format);
        CHECK(pages_equal(*src, ps, *dst, pd));
      }
    check_same_outputs(*src, q, *dst, *d, rng);
    // The imported sequence is a normal one: it appends, and re-exports to the same bytes.
    auto again = export_pages(*dst, *d);
    REQUIRE(again);
    CHECK(*again == *buf);
  }
}

TEST_CASE("export of a run of pages imports as its own sequence", "[transfer]") {
  std::mt19937_64 rng(12);
  auto src = make();
  const seq_id q = fill(*src, rng, 16 * 5 + 3);
  auto buf = export_pages(*src, q, 2, 2);
  REQUIRE(buf);
  CHECK(inspect_transfer(*buf)->first_logical == 2u);
  auto dst = make();
  auto d = import_pages(*dst, *buf);
  REQUIRE(d);
  CHECK(dst->length(*d).value() == 32);
  for (std::int64_t j = 0; j < 2; ++j)
    for (int l = 0; l < layers; ++l)
      CHECK(pages_equal(*src, src->page(q, l, j + 2).value(), *dst, dst->page(*d, l, j).value()));
  CHECK(export_pages(*src, q, 4, 3).code() == errc::out_of_range);
  CHECK(export_pages(*src, q, 7).code() == errc::out_of_range);
}

TEST_CASE("import verifies first and imports nothing on any mismatch", "[transfer]") {
  std::mt19937_64 rng(13);
  auto src = make();
  const seq_id q = fill(*src, rng, 16 * 4 + 5);
  const std::vector<std::uint8_t> good = export_pages(*src, q).value();
  auto dst = make();
  const seq_id other = fill(*dst, rng, 20);  // the destination is not empty
  const snapshot before = snap(*dst);
  auto refused = [&](std::vector<std::uint8_t> b, errc want, const char* text) {
    auto r = import_pages(*dst, b);
    REQUIRE_FALSE(r);
    CHECK(r.code() == want);
    INFO(r.error_status());
    CHECK(r.error_status().message().find(text) != std::string::npos);
    CHECK(snap(*dst) == before);
    CHECK(dst->check_invariants());
  };
  SECTION("bad magic") {
    auto b = good;
    b[0] = 'X';
    refused(b, errc::corrupt_data, "magic");
  }
  SECTION("bad version") {
    auto b = good;
    b[8] = 2;
    reseal(b);
    refused(b, errc::corrupt_data, "version 2");
  }
  SECTION("checksum failure anywhere") {
    for (std::size_t i : {std::size_t(20), std::size_t(100), good.size() / 2, good.size() - 9, good.size() - 1}) {
      auto b = good;
      b[i] ^= 0x01;
      refused(b, errc::corrupt_data, i < 24 && i >= 16 ? "bytes" : "checksum");
    }
  }
  SECTION("truncated at every record boundary and inside") {
    for (std::size_t n : {std::size_t(0), std::size_t(7), std::size_t(80), std::size_t(100), good.size() / 3,
                          good.size() - 8, good.size() - 1}) {
      auto b = std::vector<std::uint8_t>(good.begin(), good.begin() + std::ptrdiff_t(n));
      refused(b, errc::corrupt_data, "truncated");
    }
    // A consistent but shortened buffer: total_bytes edited to match, checksum redone.
    auto b = std::vector<std::uint8_t>(good.begin(), good.end() - 100);
    const std::uint64_t sz = b.size();
    std::memcpy(b.data() + 16, &sz, 8);
    reseal(b);
    refused(b, errc::corrupt_data, "truncated");
  }
  SECTION("corrupt records") {
    auto b = good;
    const std::size_t rec = 80 + 2 * 8;
    b[rec + 8] = 5;  // tier 5 of 2
    reseal(b);
    refused(b, errc::corrupt_data, "names tier 5");
    b = good;
    b[rec + 4] = 2;  // layer order
    reseal(b);
    refused(b, errc::corrupt_data, "out of order");
    b = good;
    b[rec + 12] = 0;  // fill 0
    reseal(b);
    refused(b, errc::corrupt_data, "fill = 0");
  }
  SECTION("geometry mismatch") {
    using geo2 = geometry<head_dim<64>, kv_heads<4>, group_size<2>, page_tokens<32>>;
    auto d2 = paged_storage<geo2, two>::create({layers, 4, {64, 64}, seed}).value();
    auto r = import_pages(*d2, good);
    CHECK(r.code() == errc::geometry_mismatch);
    CHECK(r.error_status().message().find("page_tokens = 16") != std::string::npos);
    CHECK(d2->live_sequences() == 0);
    using geo3 = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
    auto d3 = paged_storage<geo3, two>::create({layers, 4, {64, 64}, seed}).value();
    CHECK(import_pages(*d3, good).code() == errc::geometry_mismatch);
    auto d4 = paged_storage<geo, two>::create({layers + 1, 4, {64, 64}, seed}).value();
    auto r4 = import_pages(*d4, good);
    CHECK(r4.error_status().message().find("num_layers = 3") != std::string::npos);
  }
  SECTION("tier / format mismatch") {
    using other_tiers = tiers<fp8_tier, tier<fp8_e5m2, fp8_e5m2>>;
    auto d2 = paged_storage<geo, other_tiers>::create({layers, 4, {64, 64}, seed}).value();
    auto r = import_pages(*d2, good);
    CHECK(r.code() == errc::geometry_mismatch);
    CHECK(r.error_status().message().find("tier 1 formats") != std::string::npos);
    auto d3 = paged_storage<geo, tiers<fp8_tier>>::create({layers, 4, {64}, seed}).value();
    CHECK(import_pages(*d3, good).error_status().message().find("num_tiers") != std::string::npos);
  }
  SECTION("seed mismatch") {
    auto d2 = make(64, 64, seed + 1);
    auto r = import_pages(*d2, good);
    CHECK(r.code() == errc::geometry_mismatch);
    CHECK(r.error_status().message().find("codec seed") != std::string::npos);
    CHECK(d2->live_sequences() == 0);
  }
  (void)other;
}

TEST_CASE("import into full pools or failing bookkeeping imports nothing", "[transfer]") {
  std::mt19937_64 rng(14);
  auto src = make();
  const seq_id q = fill(*src, rng, 16 * 5 + 9);
  const std::vector<std::uint8_t> buf = export_pages(*src, q).value();
  const auto info = inspect_transfer(buf).value();
  REQUIRE(info.pages_per_tier[1] > 0);
  SECTION("a tier's pool is one page short") {
    auto dst = make(64, std::uint32_t(info.pages_per_tier[1] - 1));
    const snapshot before = snap(*dst);
    auto r = import_pages(*dst, buf);
    CHECK(r.code() == errc::capacity_exhausted);
    CHECK(r.error_status().message().find("tier 1 pool") != std::string::npos);
    CHECK(snap(*dst) == before);
    // Exactly enough succeeds.
    auto ok = make(64, std::uint32_t(info.pages_per_tier[1]));
    CHECK(import_pages(*ok, buf));
  }
  SECTION("tier 0 at its peak") {
    const std::uint64_t peak = info.pages_per_tier[0] + layers;  // upper bound of the need
    auto dst = make(std::uint32_t(layers), 64);                   // room for one logical page only
    const snapshot before = snap(*dst);
    CHECK(import_pages(*dst, buf).code() == errc::capacity_exhausted);
    CHECK(snap(*dst) == before);
    auto ok = make(std::uint32_t(peak), 64);
    CHECK(import_pages(*ok, buf));
  }
  SECTION("no free sequence slot") {
    auto dst = make();
    for (int i = 0; i < 4; ++i) REQUIRE(dst->create_sequence());
    const snapshot before = snap(*dst);
    CHECK(import_pages(*dst, buf).code() == errc::capacity_exhausted);
    CHECK(snap(*dst) == before);
  }
  SECTION("bookkeeping fails at every request in turn") {
    auto dst = make();
    const seq_id keep = fill(*dst, rng, 18);
    int faults = 0;
    for (std::uint64_t k = 1;; ++k) {
      const snapshot before = snap(*dst);
      dst->meta_alloc().fail_on(k);
      auto r = import_pages(*dst, buf);
      dst->meta_alloc().reset();
      REQUIRE(dst->check_invariants());
      if (r) {
        CHECK(pages_equal(*src, src->page(q, 2, 5).value(), *dst, dst->page(*r, 2, 5).value()));
        check_same_outputs(*src, q, *dst, *r, rng);
        break;
      }
      ++faults;
      CHECK(r.code() == errc::capacity_exhausted);
      CHECK(r.error_status().message().find("nothing imported") != std::string::npos);
      CHECK(snap(*dst) == before);
      REQUIRE(k < 1000);
    }
    CHECK(faults > 0);
    CHECK(dst->length(keep).value() == 18);
  }
}

TEST_CASE("head slices: context-free formats import anywhere, TQ3 only at head 0", "[transfer]") {
  std::mt19937_64 rng(15);
  auto src = make();
  const seq_id q = fill(*src, rng, 16 * 3);
  using half = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
  using half_storage = paged_storage<half, two>;
  auto dst = half_storage::create({layers, 4, {64, 64}, seed}).value();
  // Slice [0, 2): allowed with TQ3 pages (the destination's head i is the source's head i).
  auto lo = export_pages(*src, q, 0, -1, head_slice{0, 2});
  REQUIRE(lo);
  auto d = import_pages(*dst, *lo);
  REQUIRE(d);
  float k[64], v[64], ks[64], vs[64];
  for (int h = 0; h < 2; ++h)
    for (std::int64_t t : {0, 17, 47}) {
      REQUIRE(dst->read_token(*d, 1, t, h, k, v));
      REQUIRE(src->read_token(q, 1, t, h, ks, vs));
      CHECK(std::memcmp(k, ks, sizeof k) == 0);
      CHECK(std::memcmp(v, vs, sizeof v) == 0);
    }
  // Slice [2, 4) holds TQ3 pages whose rotation belongs to source heads 2, 3: refused.
  auto hi = export_pages(*src, q, 0, -1, head_slice{2, 2});
  REQUIRE(hi);
  auto r = import_pages(*dst, *hi);
  CHECK(r.code() == errc::geometry_mismatch);
  CHECK(r.error_status().message().find("source head 2") != std::string::npos);
  CHECK(dst->live_sequences() == 1);
  CHECK(export_pages(*src, q, 0, -1, head_slice{3, 2}).code() == errc::out_of_range);
}
