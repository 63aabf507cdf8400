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
#include "tierkv/paging/head_shard.hpp"
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
    std::fill_n(k.begin() + 2 * geo::head_dim * geo::kv_heads, geo::head_dim,
                std::numeric_limits<float>::denorm_min());
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
  return {s.live_sequences(), s.live_blocks(), s.free_pages(0), s.free_pages(1),
          s.meta_alloc().bytes_allocated()};
}

// Re-seals a buffer after a deliberate edit, so a check after the checksum is reached.
void reseal(std::vector<std::uint8_t>& b) {
  const std::uint64_t c =
      detail::transfer_checksum(std::span<const std::uint8_t>(b.data(), b.size() - 8));
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
  CHECK(detail::transfer_checksum(std::span<const std::uint8_t>(b.data(), 76)) !=
        c0);  // length counts
}

TEST_CASE("export/import round trip: byte-identical pages, identical decode", "[transfer]") {
  std::mt19937_64 rng(11);
  for (std::int64_t tokens :
       {std::int64_t(1), std::int64_t(16), std::int64_t(16 * 5 + 7), std::int64_t(16 * 6)}) {
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
        CHECK(pages_equal(*src, ps, *dst, pd, fill_of(*src, q, j)));
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
    b[8] = 3;
    reseal(b);
    refused(b, errc::corrupt_data, "version 3");
  }
  SECTION("version 1 (TQ3 on the Lloyd-Max centroids) is refused") {
    auto b = good;
    b[8] = 1;
    reseal(b);
    refused(b, errc::corrupt_data, "version 1");
  }
  SECTION("checksum failure anywhere") {
    for (std::size_t i :
         {std::size_t(20), std::size_t(100), good.size() / 2, good.size() - 9, good.size() - 1}) {
      auto b = good;
      b[i] ^= 0x01;
      refused(b, errc::corrupt_data, i < 24 && i >= 16 ? "bytes" : "checksum");
    }
  }
  SECTION("truncated at every record boundary and inside") {
    for (std::size_t n : {std::size_t(0), std::size_t(7), std::size_t(80), std::size_t(100),
                          good.size() / 3, good.size() - 8, good.size() - 1}) {
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
    auto dst = make(std::uint32_t(layers), 64);                  // room for one logical page only
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
        CHECK(pages_equal(*src, src->page(q, 2, 5).value(), *dst, dst->page(*r, 2, 5).value(),
                          fill_of(*src, q, 5)));
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

TEST_CASE(
    "head slices: context-free formats import anywhere, TQ3 where head_base is the slice's first "
    "head",
    "[transfer]") {
  std::mt19937_64 rng(15);
  auto src = make();
  const seq_id q = fill(*src, rng, 16 * 3 + 6);
  using half = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
  using half_storage = paged_storage<half, two>;
  const auto make_half = [](int head_base) {
    half_storage::options o{layers, 4, {64, 64}, seed};
    o.head_base = head_base;
    return half_storage::create(o).value();
  };
  auto dst0 = make_half(0);  // holds global heads [0, 2)
  auto dst2 = make_half(2);  // holds global heads [2, 4): rank 1 of 2
  const auto same_tokens = [&](half_storage& d, seq_id sd, int base) {
    float k[64], v[64], ks[64], vs[64];
    for (int h = 0; h < 2; ++h)
      for (std::int64_t t : {0, 17, 47, 53}) {
        REQUIRE(d.read_token(sd, 1, t, h, k, v));
        REQUIRE(src->read_token(q, 1, t, base + h, ks, vs));
        CHECK(std::memcmp(k, ks, sizeof k) == 0);
        CHECK(std::memcmp(v, vs, sizeof v) == 0);
      }
  };
  // Slice [0, 2) into head_base 0: the destination's head i is the source's head i.
  auto lo = export_pages(*src, q, 0, -1, head_slice{0, 2});
  REQUIRE(lo);
  REQUIRE(inspect_transfer(*lo)->pages_per_tier[1] > 0);  // TQ3 pages are in the slice
  auto d = import_pages(*dst0, *lo);
  REQUIRE(d);
  same_tokens(*dst0, *d, 0);

  // Slice [2, 4): its TQ3 rotations belong to global heads 2, 3.
  auto hi = export_pages(*src, q, 0, -1, head_slice{2, 2});
  REQUIRE(hi);
  CHECK(inspect_transfer(*hi)->head_begin == 2u);
  {  // refused at head_base 0, nothing changes
    const auto before = std::array{dst0->live_sequences(), dst0->live_blocks(), dst0->free_pages(0),
                                   dst0->free_pages(1)};
    auto r = import_pages(*dst0, *hi);
    CHECK(r.code() == errc::geometry_mismatch);
    INFO(r.error_status());
    CHECK(r.error_status().message().find("global head 2") != std::string::npos);
    CHECK(r.error_status().message().find("head_base = 0") != std::string::npos);
    CHECK(before == std::array{dst0->live_sequences(), dst0->live_blocks(), dst0->free_pages(0),
                               dst0->free_pages(1)});
    CHECK(dst0->check_invariants());
  }
  // ... and imported at head_base 2: same tokens, same decode as the unsharded cache's heads.
  auto d2 = import_pages(*dst2, *hi);
  REQUIRE(d2);
  REQUIRE(dst2->check_invariants());
  same_tokens(*dst2, *d2, 2);
  const auto qs = random_kv(rng, 1, 1, geo::q_heads, geo::head_dim);
  std::vector<float> qh(qs.size() / 2);
  REQUIRE(slice_heads(qs, geo::q_heads, geo::head_dim, 4, 4, qh));  // query heads of KV heads 2, 3
  for (int l = 0; l < layers; ++l) {
    std::vector<float> ow, lw, oh, lh;
    REQUIRE(decode_layer(*src, q, l, qs, ow, lw));
    REQUIRE(decode_layer(*dst2, *d2, l, qh, oh, lh));
    CHECK(std::memcmp(oh.data(), ow.data() + 4 * geo::head_dim, oh.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(lh.data(), lw.data() + 4, lh.size() * sizeof(float)) == 0);
  }
  // A re-export from head_base 2 names global head 2 again, so it moves to another rank 1 only.
  auto again = export_pages(*dst2, *d2);
  REQUIRE(again);
  CHECK(inspect_transfer(*again)->head_begin == 2u);
  CHECK(import_pages(*make_half(2), *again));
  CHECK(import_pages(*make_half(0), *again).code() == errc::geometry_mismatch);
  CHECK(import_pages(*dst2, *lo).code() == errc::geometry_mismatch);  // [0, 2) into head_base 2

  // Context-free pages (one open FP8 page) import at any head_base.
  auto fp8_src = make();
  const seq_id f = fill(*fp8_src, rng, 9);
  auto fp8_hi = export_pages(*fp8_src, f, 0, -1, head_slice{2, 2});
  REQUIRE(fp8_hi);
  CHECK(inspect_transfer(*fp8_hi)->pages_per_tier[1] == 0u);
  CHECK(import_pages(*make_half(0), *fp8_hi));
  CHECK(import_pages(*make_half(2), *fp8_hi));
  CHECK(export_pages(*src, q, 0, -1, head_slice{3, 2}).code() == errc::out_of_range);
}

TEST_CASE("export of a partial page: zero bytes past the fill, whatever the page held",
          "[transfer]") {
  std::mt19937_64 rng(16);
  auto src = make();
  const int fill5 = 5;
  const seq_id q = fill(*src, rng, 16 * 2 + fill5);
  const std::int64_t last = 2;
  using L = storage_t::layout<0>;  // an open page is in tier 0
  using K = L::key_codec;
  using V = L::value_codec;
  // The source's unused slots hold the pool's poison: the test has something to see.
  {
    auto pb = src->page_bytes(src->page(q, 0, last).value()).value();
    CHECK(pb[L::key_payload(0, fill5)] == page_poison_byte);
  }
  for (const head_slice hs : {head_slice{0, 4}, head_slice{1, 2}}) {
    CAPTURE(hs.begin, hs.count);
    const auto buf = export_pages(*src, q, 0, -1, hs).value();
    const auto info = inspect_transfer(buf).value();
    const auto r = detail::slice_regions<L>::make(hs.begin, hs.count);
    const std::size_t units[4] = {K::payload_bytes, V::payload_bytes, K::meta_bytes, V::meta_bytes};
    std::size_t off = page_transfer_header_bytes + 2 * page_transfer_tier_entry_bytes;
    int checked = 0;
    for (std::uint32_t j = 0; j < info.logical_pages; ++j)
      for (int l = 0; l < layers; ++l) {
        const std::uint32_t tier = buf[off + 8];
        const std::uint32_t fill = detail::get<std::uint32_t>(buf.data(), off + 12);
        off += page_transfer_record_bytes;
        if (j == last) {
          REQUIRE(tier == 0u);
          REQUIRE(fill == std::uint32_t(fill5));
          const std::uint8_t* page = buf.data() + off;
          const std::uint8_t* sp = src->page_bytes(src->page(q, l, j).value()).value().data();
          std::size_t nonzero = 0, differ = 0;
          for (int k = 0; k < 4; ++k)
            for (int h = 0; h < hs.count; ++h) {
              const std::size_t head = r.dst[k] + std::size_t(h) * geo::page_tokens * units[k];
              const std::size_t shead = r.src[k] + std::size_t(h) * geo::page_tokens * units[k];
              for (std::size_t i = fill * units[k]; i < geo::page_tokens * units[k]; ++i)
                nonzero += page[head + i] != 0;
              differ += std::memcmp(page + head, sp + shead, fill * units[k]) !=
                        0;  // the filled part is copied
            }
          CHECK(nonzero == 0);
          CHECK(differ == 0);
          ++checked;
        }
        off += info.tiers[tier].page_bytes;
      }
    CHECK(checked == layers);

    // Scribbling over the unused slots changes nothing in the export; the import has zeros there.
    for (int l = 0; l < layers; ++l) {
      auto pb = src->page_bytes(src->page(q, l, last).value()).value();
      for (int h = 0; h < geo::kv_heads; ++h)
        for (int t = fill5; t < geo::page_tokens; ++t)
          pb[L::value_payload(h, t)] = std::uint8_t(rng());
    }
    CHECK(export_pages(*src, q, 0, -1, hs).value() == buf);
  }
  auto dst = make();
  const auto buf = export_pages(*src, q).value();
  auto d = import_pages(*dst, buf);
  REQUIRE(d);
  for (int l = 0; l < layers; ++l) {
    auto pd = dst->page_bytes(dst->page(*d, l, last).value()).value();
    CHECK(pd[L::key_payload(3, fill5)] == 0);
    CHECK(pd[L::value_meta(3, geo::page_tokens - 1)] == 0);
    CHECK(pages_equal(*src, src->page(q, l, last).value(), *dst, dst->page(*d, l, last).value(),
                      fill5));
  }
  CHECK(export_pages(*dst, *d).value() == buf);
}
