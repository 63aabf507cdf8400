// SPDX-License-Identifier: Apache-2.0
// The conversion protocol: exact re-encodes, error bounds, shared pages converting once,
// lossless byte moves, and the old page surviving every failure.
#include <cstring>
#include <numeric>

#include "catch.hpp"
#include "tiering_test_support.hpp"

using namespace tiering_test;

namespace {

template <class Storage>
std::unique_ptr<Storage> make_storage(std::array<std::uint32_t, Storage::num_tiers> pages,
                                      int layers = 2) {
  typename Storage::options o;
  o.num_layers = layers;
  o.max_sequences = 8;
  o.pages_per_tier = pages;
  o.codec_seed = 0x5eed;
  return std::move(Storage::create(o).value());
}

// What the converted page must hold: every vector of `src` (bytes of a page in tier
// From) decoded with From's codecs and encoded with To's, assembled independently.
template <class Storage, int From, int To>
std::vector<std::uint8_t> reference_reencode(const Storage& s, const std::vector<std::uint8_t>& src,
                                             int layer) {
  using SL = typename Storage::template layout<From>;
  using TL = typename Storage::template layout<To>;
  std::vector<std::uint8_t> out(TL::page_bytes, 0);
  const auto one = [&](auto scodec, auto tcodec, std::size_t sp, std::size_t sm, std::size_t tp,
                       std::size_t tm, codec_context ctx) {
    using SC = decltype(scodec);
    using TC = decltype(tcodec);
    float x[Storage::head_dim];
    typename SC::meta_type m{};
    std::memcpy(&m, src.data() + sm, SC::meta_bytes);
    SC::decode(src.data() + sp, m, x, ctx);
    typename TC::meta_type tmeta{};
    REQUIRE(TC::encode(x, out.data() + tp, tmeta, ctx, nullptr) == errc::ok);
    std::memcpy(out.data() + tm, &tmeta, TC::meta_bytes);
  };
  for (int h = 0; h < Storage::kv_heads; ++h)
    for (int t = 0; t < Storage::page_tokens; ++t) {
      const auto seed = s.config().codec_seed;
      one(typename SL::key_codec{}, typename TL::key_codec{}, SL::key_payload(h, t),
          SL::key_meta(h, t), TL::key_payload(h, t), TL::key_meta(h, t),
          make_codec_context(seed, layer, h, kv_role::key));
      one(typename SL::value_codec{}, typename TL::value_codec{}, SL::value_payload(h, t),
          SL::value_meta(h, t), TL::value_payload(h, t), TL::value_meta(h, t),
          make_codec_context(seed, layer, h, kv_role::value));
    }
  // Alignment padding of the target layout is never written by either side: compare it as the page
  // has it.
  return out;
}

// Compares only the regions the layout defines (payloads and meta), not padding.
template <class Layout>
bool same_regions(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  using K = typename Layout::key_codec;
  using V = typename Layout::value_codec;
  const std::size_t kp = std::size_t(Layout::heads) * Layout::key_head_stride;
  const std::size_t vp = std::size_t(Layout::heads) * Layout::value_head_stride;
  const std::size_t km = std::size_t(Layout::heads) * Layout::tokens * K::meta_bytes;
  const std::size_t vm = std::size_t(Layout::heads) * Layout::tokens * V::meta_bytes;
  return std::memcmp(a.data() + Layout::key_payload_offset, b.data() + Layout::key_payload_offset,
                     kp) == 0 &&
         std::memcmp(a.data() + Layout::value_payload_offset,
                     b.data() + Layout::value_payload_offset, vp) == 0 &&
         std::memcmp(a.data() + Layout::key_meta_offset, b.data() + Layout::key_meta_offset, km) ==
             0 &&
         std::memcmp(a.data() + Layout::value_meta_offset, b.data() + Layout::value_meta_offset,
                     vm) == 0;
}

}  // namespace

TEST_CASE("demotion FP8 -> TQ3 and promotion back are exact re-encodes within the codec bounds",
          "[tiering][conversion]") {
  auto s = make_storage<storage2>({16, 16});
  const auto tokens = seeds_from(1000, 40);  // two sealed pages and an open one
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, tokens));
  const int layer = 1;
  const block_ref b = s->block_of(q, 0).value();
  const page_id old = s->block_page(b, layer);
  REQUIRE(old.format == 0);
  const auto src = bytes_of(*s, old);
  const page_error fp8_err = page_error_of(*s, q, layer, 0, tokens);
  CHECK(fp8_err.max <= fp8_vector_bound);

  conversion_counters counters;
  const page_id now = convert_page(*s, b, layer, 1, counters).value();
  CHECK(now.format == 1);
  CHECK(s->block_page(b, layer) == now);
  CHECK(s->page(q, layer, 0).value() == now);
  CHECK(s->check_page(old).code() ==
        errc::double_release);  // the old page was freed, its id is stale
  CHECK(same_regions<storage2::layout<1>>(bytes_of(*s, now),
                                          reference_reencode<storage2, 0, 1>(*s, src, layer)));
  const page_error tq3_err = page_error_of(*s, q, layer, 0, tokens);
  CHECK(tq3_err.finite);
  CHECK(tq3_err.mean <= tq3_page_bound);
  CHECK(tq3_err.max <= tq3_vector_bound);
  CHECK(tq3_err.mean > fp8_err.mean);  // it did get compressed
  // The other layer and the other pages did not move.
  CHECK(s->block_page(b, 0).format == 0);
  CHECK(s->page(q, layer, 1).value().format == 0);
  REQUIRE(s->check_invariants());

  // Promotion reconstructs into FP8 before publication.
  const auto tq3_bytes = bytes_of(*s, now);
  const page_id back = convert_page(*s, b, layer, 0, counters).value();
  CHECK(back.format == 0);
  CHECK(same_regions<storage2::layout<0>>(
      bytes_of(*s, back), reference_reencode<storage2, 1, 0>(*s, tq3_bytes, layer)));
  const page_error round = page_error_of(*s, q, layer, 0, tokens);
  CHECK(round.mean <= tq3_page_bound + fp8_vector_bound);

  // Repeated round trips do not drift: TQ3 re-quantizes its own reconstruction to (nearly) the same
  // codes.
  for (int i = 0; i < 10; ++i) {
    REQUIRE(convert_page(*s, b, layer, 1, counters));
    REQUIRE(convert_page(*s, b, layer, 0, counters));
  }
  const page_error drift = page_error_of(*s, q, layer, 0, tokens);
  CHECK(drift.mean <= 1.25 * round.mean);
  CHECK(counters.saturated == 0);
  REQUIRE(s->check_invariants());
}

TEST_CASE("conversion refuses open pages, same-tier moves and bad arguments without a change",
          "[tiering][conversion]") {
  auto s = make_storage<storage2>({16, 16});
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(7, 20)));
  conversion_counters c;
  const block_ref open = s->block_of(q, 1).value();
  const block_ref sealed = s->block_of(q, 0).value();
  const page_id p0 = s->block_page(sealed, 0);
  CHECK(convert_page(*s, open, 0, 1, c).code() == errc::not_writable);
  CHECK(convert_page(*s, sealed, 0, 0, c).code() == errc::invalid_argument);
  CHECK(convert_page(*s, sealed, 2, 1, c).code() == errc::out_of_range);
  CHECK(convert_page(*s, sealed, 0, 2, c).code() == errc::out_of_range);
  CHECK(convert_page(*s, block_ref{sealed.index, sealed.generation + 1}, 0, 1, c).code() ==
        errc::stale_id);
  CHECK(s->block_page(sealed, 0) == p0);
  CHECK(s->template pool<1>().live_count() == 0);
  REQUIRE(s->check_invariants());
}

TEST_CASE("a page shared by forks and the prefix index converts once and every holder sees it",
          "[tiering][conversion]") {
  auto s = make_storage<storage2>({32, 16});
  const auto tokens = seeds_from(50, 36);
  const seq_id a = s->create_sequence().value();
  REQUIRE(append_seeds(*s, a, tokens));
  const seq_id f = s->fork(a).value();
  prefix_index<storage2> idx(*s);
  std::vector<std::int32_t> ids(tokens.size());
  std::iota(ids.begin(), ids.end(), 3);
  REQUIRE(idx.insert(a, 9, ids).value() == 2);
  const block_ref b = s->block_of(a, 1).value();
  REQUIRE(s->block_of(f, 1).value() == b);
  REQUIRE(s->block_refcount(b) == 3);  // two sequences and the index
  const std::uint32_t live0 = s->template pool<0>().live_count();

  conversion_counters c;
  const page_id now = convert_page(*s, b, 0, 1, c).value();
  CHECK(s->page(a, 0, 1).value() == now);
  CHECK(s->page(f, 0, 1).value() == now);
  const prefix_match m = idx.lookup(9, ids);
  REQUIRE(m.blocks.size() == 2);
  CHECK(m.pages[1 * 2 + 0] == now);
  CHECK(s->page_refcount(now) == 1);  // one block reference, however many holders
  CHECK(s->template pool<0>().live_count() == live0 - 1);
  CHECK(s->template pool<1>().live_count() == 1);
  CHECK(page_error_of(*s, f, 0, 1, tokens).mean <= tq3_page_bound);
  REQUIRE(s->check_invariants());
  REQUIRE(idx.check_invariants());
  // Releasing every holder frees the converted page.
  REQUIRE(s->release(a));
  REQUIRE(s->release(f));
  idx.clear();
  CHECK(s->template pool<1>().live_count() == 0);
  CHECK(s->template pool<0>().live_count() == 0);
}

TEST_CASE("moves between tiers with the same codecs are byte-exact copies",
          "[tiering][conversion]") {
  auto s = make_storage<storage3>({16, 16, 16});
  const seq_id q = s->create_sequence().value();
  const auto tokens = seeds_from(77, 32);
  REQUIRE(append_seeds(*s, q, tokens));
  const block_ref b = s->block_of(q, 1).value();
  const auto before = bytes_of(*s, s->block_page(b, 0));
  conversion_counters c;
  const page_id moved = convert_page(*s, b, 0, 1, c).value();
  CHECK(bytes_of(*s, moved) == before);
  const page_id back = convert_page(*s, b, 0, 0, c).value();
  CHECK(bytes_of(*s, back) == before);
  REQUIRE(s->check_invariants());
}

TEST_CASE("a failure at any step leaves the old page published at its old id and tier",
          "[tiering][conversion][faults]") {
  auto s = make_storage<storage2>({16, 16});
  const seq_id q = s->create_sequence().value();
  const auto tokens = seeds_from(300, 48);
  REQUIRE(append_seeds(*s, q, tokens));
  std::uint64_t injected = 0, lost = 0, kept = 0;
  for (int target = 0; target < 2; ++target) {
    // The page is first moved to the other tier, so both directions are faulted.
    const block_ref b = s->block_of(q, 1).value();
    if (s->block_page(b, 0).format == target) {
      conversion_counters c;
      REQUIRE(convert_page(*s, b, 0, 1 - target, c));
    }
    for (std::uint64_t k = 1; k <= conversion_steps; ++k) {
      const page_id old = s->block_page(b, 0);
      const auto bytes = bytes_of(*s, old);
      const auto live =
          std::array{s->template pool<0>().live_count(), s->template pool<1>().live_count()};
      fault_injector f{0, k, 0};
      conversion_counters c;
      const auto r = convert_page(*s, b, 0, target, c, f);
      CHECK(r.code() == errc::injected_fault);
      injected += f.injected;
      const bool ok = s->block_page(b, 0) == old && s->check_page(old) && s->page_published(old) &&
                      bytes_of(*s, old) == bytes;
      kept += ok ? 1 : 0;
      lost += ok ? 0 : 1;
      CHECK(std::array{s->template pool<0>().live_count(), s->template pool<1>().live_count()} ==
            live);
      REQUIRE(s->check_invariants());
    }
  }
  CHECK(injected == 2 * conversion_steps);
  CHECK(lost == 0);
  CHECK(kept == injected);
}

TEST_CASE("full target pool, a stale publish and non-finite sources fail cleanly",
          "[tiering][conversion][faults]") {
  auto s = make_storage<storage2>({16, 2});
  const seq_id q = s->create_sequence().value();
  REQUIRE(append_seeds(*s, q, seeds_from(5, 48)));
  conversion_counters c;
  const block_ref b0 = s->block_of(q, 0).value();
  const block_ref b1 = s->block_of(q, 1).value();

  SECTION("target pool full") {
    const page_id h1 = s->allocate_page(1).value();
    const page_id h2 = s->allocate_page(1).value();
    const page_id old = s->block_page(b0, 0);
    CHECK(convert_page(*s, b0, 0, 1, c).code() == errc::capacity_exhausted);
    CHECK(s->block_page(b0, 0) == old);
    REQUIRE(s->check_invariants(2));
    REQUIRE(s->release_page(h1));
    REQUIRE(s->release_page(h2));
  }
  SECTION("the page table changed between reserve and publish") {
    staged_conversion sc = reserve_conversion(*s, b1, 1, 1).value();
    REQUIRE(fill_conversion_on_host(*s, sc, c));
    // Someone else converted the page meanwhile (another controller, a bug): publish must refuse.
    const page_id other = convert_page(*s, b1, 1, 1, c).value();
    CHECK(publish_conversion(*s, sc).code() == errc::stale_id);
    abort_conversion(*s, sc);
    CHECK(s->block_page(b1, 1) == other);
    REQUIRE(s->check_invariants());
  }
  SECTION("a corrupted (NaN) source never spreads into a new page") {
    const page_id old = s->block_page(b0, 1);
    auto bytes = s->page_bytes(old).value();
    using L = storage2::layout<0>;
    const bf16_bits nan = bf16_quiet_nan;
    std::memcpy(bytes.data() + L::value_meta(0, 3), &nan, sizeof nan);
    CHECK(convert_page(*s, b0, 1, 1, c).code() == errc::non_finite_input);
    CHECK(s->block_page(b0, 1) == old);
    CHECK(s->template pool<1>().live_count() == 0);
    REQUIRE(s->check_invariants());
  }
}
