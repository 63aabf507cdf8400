// SPDX-License-Identifier: Apache-2.0
// paged_storage::append_pages: a logical page appended whole from the caller's fresh pages (how
// an import and the GPU host tier's restore build a sequence). The pages become the sequence's
// as given (tiers, bytes), full pages sealed, a partial one open and growable by append; every
// refusal changes nothing and leaves the pages the caller's.
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "catch.hpp"
#include "paging_test_support.hpp"

using namespace tierkv;
using namespace paging_test;

namespace {
constexpr int H = storage_t::kv_heads, D = storage_t::head_dim, T = storage_t::page_tokens;
constexpr int L = 3;

std::unique_ptr<storage_t> make_storage(std::uint32_t pages0 = 40, std::uint32_t pages1 = 40) {
  storage_t::options o;
  o.num_layers = L;
  o.pages_per_tier = {pages0, pages1};
  o.max_sequences = 4;
  o.codec_seed = 42;
  return std::move(storage_t::create(o).value());
}

// L fresh pages of the given tiers, each filled with the keys and values of tokens with seeds
// first.. (lossless dense tiers: decode reads them back exactly).
std::vector<page_id> fresh_pages(storage_t& s, const std::vector<int>& tier_of_layer,
                                 std::uint64_t first, int fill) {
  std::vector<page_id> pages;
  for (int l = 0; l < L; ++l) {
    const page_id p = s.allocate_page(tier_of_layer[std::size_t(l)]).value();
    auto bytes = s.page_bytes(p).value();
    std::memset(bytes.data(), 0, bytes.size());
    // a scratch sequence's page of the same tier gives the encoded bytes
    auto scratch = s.create_sequence().value();
    std::vector<std::uint64_t> seeds(static_cast<std::size_t>(fill));
    std::iota(seeds.begin(), seeds.end(), first);
    std::vector<float> k, v;
    make_kv<storage_t>(L, seeds, k, v);
    REQUIRE(s.append(scratch, fill, k, v).is_ok());
    const page_id src = *s.page(scratch, l, 0);
    REQUIRE(src.format == 0);  // dense tiers share one layout: tier 0's bytes serve tier 1
    std::memcpy(bytes.data(), s.page_bytes(src).value().data(), bytes.size());
    REQUIRE(s.release(scratch).is_ok());
    pages.push_back(p);
  }
  return pages;
}

}  // namespace

TEST_CASE("append_pages builds a sequence from whole pages of any tier", "[paging][append_pages]") {
  auto s = make_storage();
  const seq_id q = s->create_sequence().value();
  const auto full = fresh_pages(*s, {1, 0, 1}, 100, T);
  REQUIRE(s->append_pages(q, T, full).is_ok());
  CHECK(s->length(q).value() == T);
  for (int l = 0; l < L; ++l) {
    CHECK(*s->page(q, l, 0) == full[std::size_t(l)]);
    CHECK(s->page_state_of(full[std::size_t(l)]) == page_state::sealed);
    CHECK(s->page_published(full[std::size_t(l)]));
    for (int t = 0; t < T; ++t) CHECK(token_matches(*s, q, t, 100 + std::uint64_t(t), l));
  }
  // a partial page (tier 0) after it: open, and append fills it in place
  const auto part = fresh_pages(*s, {0, 0, 0}, 200, 5);
  REQUIRE(s->append_pages(q, 5, part).is_ok());
  CHECK(s->length(q).value() == T + 5);
  CHECK(s->page_state_of(part[0]) == page_state::open);
  std::vector<std::uint64_t> more(3);
  std::iota(more.begin(), more.end(), 300);
  std::vector<float> k, v;
  make_kv<storage_t>(L, more, k, v);
  REQUIRE(s->append(q, 3, k, v).is_ok());
  CHECK(s->length(q).value() == T + 8);
  for (int l = 0; l < L; ++l) {
    CHECK(*s->page(q, l, 1) == part[std::size_t(l)]);
    for (int t = 0; t < 5; ++t) CHECK(token_matches(*s, q, T + t, 200 + std::uint64_t(t), l));
    for (int t = 0; t < 3; ++t) CHECK(token_matches(*s, q, T + 5 + t, 300 + std::uint64_t(t), l));
  }
  // releasing the sequence gives every page back
  REQUIRE(s->release(q).is_ok());
  CHECK(s->free_pages(0) == 40);
  CHECK(s->free_pages(1) == 40);
  CHECK(s->live_blocks() == 0);
}

TEST_CASE("append_pages refusals change nothing and leave the pages the caller's",
          "[paging][append_pages]") {
  auto s = make_storage();
  const seq_id q = s->create_sequence().value();
  const auto full = fresh_pages(*s, {1, 1, 0}, 1, T);
  const snapshot before = take_snapshot(*s);
  const auto refused = [&](seq_id seq, std::int64_t fill, const std::vector<page_id>& pages,
                           errc code, const char* says) {
    const status st = s->append_pages(seq, fill, pages);
    INFO(st.message());
    CHECK(st.code() == code);
    CHECK(st.message().find(says) != std::string::npos);
    CHECK(take_snapshot(*s) == before);
  };
  refused(seq_id{}, T, full, errc::out_of_range, "");
  refused(q, 0, full, errc::invalid_argument, "fill = 0 must lie in [1, 16]");
  refused(q, T + 1, full, errc::invalid_argument, "fill = 17");
  refused(q, T, {full[0], full[1]}, errc::invalid_argument, "2 pages for 3 layers");
  refused(q, T, {full[0], full[1], full[0]}, errc::invalid_argument, "given for layers 0 and 2");
  refused(q, 5, full, errc::invalid_argument, "is not in tier 0");

  // a page a sequence holds already is not fresh
  const seq_id other = s->create_sequence().value();
  const auto theirs = fresh_pages(*s, {0, 0, 0}, 50, T);
  REQUIRE(s->append_pages(other, T, theirs).is_ok());
  const snapshot with_other = take_snapshot(*s);
  {
    const std::vector<page_id> mixed{full[0], theirs[1], full[2]};
    const status st = s->append_pages(q, T, mixed);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("not a fresh caller-owned page") != std::string::npos);
    CHECK(take_snapshot(*s) == with_other);
  }
  // not on a page boundary, or with a reservation outstanding
  std::vector<float> k, v;
  make_kv<storage_t>(L, {7, 8, 9}, k, v);
  REQUIRE(s->append(other, 3, k, v).is_ok());
  {
    const snapshot mid = take_snapshot(*s);
    const status st = s->append_pages(other, T, full);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("not a whole number of pages") != std::string::npos);
    CHECK(take_snapshot(*s) == mid);
  }
  REQUIRE(s->reserve(q, 4).is_ok());
  CHECK(s->append_pages(q, T, full).code() == errc::invalid_argument);
  REQUIRE(s->cancel(q).is_ok());
  // the caller still owns its pages: it appends them now, or gives them back
  REQUIRE(s->append_pages(q, T, full).is_ok());
  CHECK(s->length(q).value() == T);
  REQUIRE(s->release(q).is_ok());
  REQUIRE(s->release(other).is_ok());
  CHECK(s->free_pages(0) == 40);
  CHECK(s->free_pages(1) == 40);
}
