// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "catch.hpp"
#include "paging_test_support.hpp"
#include "tierkv/paging/index_builder.hpp"

using namespace tierkv;
using namespace paging_test;

namespace {
struct aligned_buffer {
  explicit aligned_buffer(std::size_t n) : store((n + 7) / 8 + 2) {}
  std::span<std::uint8_t> span(std::size_t n) {
    return {reinterpret_cast<std::uint8_t*>(store.data()), n};
  }
  std::vector<std::uint64_t> store;
};

// A storage with sequences of 0, 5, 16, 40 and 70 tokens, and some sealed pages of
// some layers moved to tier 1 (mixed formats inside one sequence).
struct fixture {
  std::unique_ptr<storage_t> s;
  std::vector<seq_id> seqs;
  fixture() {
    storage_t::options o;
    o.num_layers = 3;
    o.pages_per_tier = {64, 32};
    o.max_sequences = 8;
    auto created = storage_t::create(o);
    REQUIRE(created);
    s = std::move(*created);
    std::mt19937 rng(3);
    std::uint64_t seed = 1;
    for (int n : {0, 5, 16, 40, 70}) {
      auto id = *s->create_sequence();
      std::vector<std::uint64_t> sd(static_cast<std::size_t>(n));
      for (auto& x : sd) x = seed++;
      std::vector<float> k, v;
      make_kv<storage_t>(3, sd, k, v);
      REQUIRE(s->append(id, n, k, v));
      seqs.push_back(id);
      for (std::int64_t i = 0; i < n / 16; ++i)
        for (int l = 0; l < 3; ++l)
          if (rng() % 2) {
            const page_id old = *s->page(id, l, i);
            auto p = s->allocate_page(1);
            REQUIRE(p);
            REQUIRE(s->replace_page(id, l, i, old, *p));
          }
    }
    REQUIRE(s->check_invariants());
  }
};

// Reference: walks logical pages one by one through the storage's checked accessors.
void check_view(const storage_t& s, int layer, const std::vector<seq_id>& batch,
                const batch_index_view<2>& v) {
  REQUIRE(v.batch == int(batch.size()));
  for (int b = 0; b < v.batch; ++b) {
    const seq_id id = batch[std::size_t(b)];
    CHECK(v.seq_len[b] == *s.length(id));
    const std::int64_t pages = *s.logical_pages(id);
    std::vector<int> seen(std::size_t(pages), 0);
    for (int f = 0; f < 2; ++f) {
      const auto& fp = v.formats[f];
      int prev = -1;
      for (int e = fp.indptr[b]; e < fp.indptr[b + 1]; ++e) {
        const int lp = fp.logical[e];
        REQUIRE(lp >= 0);
        REQUIRE(lp < pages);
        CHECK(lp > prev);  // logical order inside a format
        prev = lp;
        ++seen[std::size_t(lp)];
        const page_id p = *s.page(id, layer, lp);
        CHECK(int(p.format) == f);
        CHECK(fp.slot[e] == int(p.slot));
      }
    }
    for (int c : seen) CHECK(c == 1);  // disjoint union over formats = all logical pages
    for (std::int64_t i = 0; i < pages; ++i) {
      const int expect = int(std::min<std::int64_t>(16, *s.length(id) - i * 16));
      CHECK(v.tokens_in_page(b, int(i), 16) == expect);
    }
  }
}
}  // namespace

TEST_CASE("index layout: capacity computed ahead, aligned regions", "[paging][index]") {
  constexpr std::size_t cap = index_layout<2>::capacity_for(4, 10);
  STATIC_REQUIRE(cap == 16 + 2 * (32 + 2 * 160));
  const index_layout<2> l{4, 10};
  CHECK(l.bytes() == cap);
  for (int f = 0; f < 2; ++f) {
    CHECK(l.indptr_offset(f) % 16 == 0);
    CHECK(l.slot_offset(f) % 16 == 0);
    CHECK(l.logical_offset(f) % 16 == 0);
  }
  CHECK(index_layout<2>{0, 4}.validate().code() == errc::invalid_argument);
  CHECK(index_layout<2>{1 << 20, 1 << 20}.validate().code() == errc::out_of_range);
}

TEST_CASE("host index builder partitions by format and preserves logical order",
          "[paging][index]") {
  fixture fx;
  const index_layout<2> layout{8, 8};
  aligned_buffer buf(layout.bytes());
  for (int layer = 0; layer < 3; ++layer) {
    auto v = build_batch_index(*fx.s, layer, std::span<const seq_id>(fx.seqs), layout,
                               buf.span(layout.bytes()));
    REQUIRE(v);
    check_view(*fx.s, layer, fx.seqs, *v);
  }
  // A sub-batch in another order, reusing the same buffer.
  std::vector<seq_id> sub{fx.seqs[4], fx.seqs[0], fx.seqs[2]};
  auto v =
      build_batch_index(*fx.s, 1, std::span<const seq_id>(sub), layout, buf.span(layout.bytes()));
  REQUIRE(v);
  check_view(*fx.s, 1, sub, *v);
  // Both formats appear (the fixture moved about half of the sealed pages).
  auto all = build_batch_index(*fx.s, 0, std::span<const seq_id>(fx.seqs), layout,
                               buf.span(layout.bytes()));
  CHECK(all->formats[0].indptr[5] > 0);
  CHECK(all->formats[1].indptr[5] > 0);
}

TEST_CASE("host index builder rejects bad input and leaves the buffer untouched",
          "[paging][index]") {
  fixture fx;
  const index_layout<2> layout{4, 4};
  aligned_buffer buf(layout.bytes() + 16);
  auto span = buf.span(layout.bytes());
  std::memset(span.data(), 0xCD, span.size());
  const std::vector<std::uint8_t> before(span.begin(), span.end());
  std::vector<seq_id> five = fx.seqs;
  std::vector<seq_id> big{fx.seqs[4]};  // 5 logical pages > 4
  std::vector<seq_id> ok{fx.seqs[1]};
  CHECK(build_batch_index(*fx.s, 0, std::span<const seq_id>(five), layout, span).code() ==
        errc::capacity_exhausted);
  auto too_many_pages = build_batch_index(*fx.s, 0, std::span<const seq_id>(big), layout, span);
  CHECK(too_many_pages.code() == errc::capacity_exhausted);
  CHECK(too_many_pages.error_status().message().find("5 logical pages") != std::string::npos);
  CHECK(build_batch_index(*fx.s, 3, std::span<const seq_id>(ok), layout, span).code() ==
        errc::out_of_range);
  CHECK(
      build_batch_index(*fx.s, 0, std::span<const seq_id>(ok), layout, span.first(span.size() - 4))
          .code() == errc::capacity_exhausted);
  CHECK(build_batch_index(*fx.s, 0, std::span<const seq_id>(ok), layout,
                          buf.span(layout.bytes() + 8).subspan(8))
            .code() == errc::invalid_argument);
  std::vector<seq_id> gone{*fx.s->create_sequence()};
  REQUIRE(fx.s->release(gone[0]));
  CHECK(build_batch_index(*fx.s, 0, std::span<const seq_id>(gone), layout, span).code() ==
        errc::stale_id);
  CHECK(std::equal(before.begin(), before.end(), span.begin()));
}

TEST_CASE("page table export matches the storage", "[paging][index]") {
  fixture fx;
  const page_table_layout layout{8, 8};
  aligned_buffer buf(layout.bytes());
  auto t = export_page_tables(*fx.s, 2, std::span<const seq_id>(fx.seqs), layout,
                              buf.span(layout.bytes()));
  REQUIRE(t);
  CHECK(t->batch == 5);
  for (int b = 0; b < 5; ++b) {
    CHECK(t->seq_len[b] == *fx.s->length(fx.seqs[std::size_t(b)]));
    CHECK(t->indptr[b + 1] - t->indptr[b] == *fx.s->logical_pages(fx.seqs[std::size_t(b)]));
    for (int e = t->indptr[b]; e < t->indptr[b + 1]; ++e) {
      const page_id p = *fx.s->page(fx.seqs[std::size_t(b)], 2, e - t->indptr[b]);
      CHECK(t->slot[e] == int(p.slot));
      CHECK(t->format[e] == int(p.format));
    }
  }
}

TEST_CASE("FlashInfer/vLLM page table adapter", "[paging][index][interop]") {
  std::mt19937 rng(11);
  const index_layout<2> layout{6, 9};
  aligned_buffer buf(layout.bytes());
  for (int trial = 0; trial < 200; ++trial) {
    const int batch = int(rng() % 7);
    std::vector<std::int32_t> indptr{0}, indices, last;
    for (int b = 0; b < batch; ++b) {
      const int n = int(rng() % 10);
      for (int i = 0; i < n; ++i) indices.push_back(std::int32_t(rng() % 100));
      indptr.push_back(indptr.back() + n);
      last.push_back(n == 0 ? 0 : 1 + std::int32_t(rng() % 16));
    }
    const paged_kv_table t{batch, 16, indptr.data(), indices.data(), last.data()};
    const int fmt = int(rng() % 2);
    auto v = index_from_paged_kv_table<2>(t, fmt, 100, layout, buf.span(layout.bytes()));
    REQUIRE(v);
    for (int b = 0; b < batch; ++b) {
      const int n = indptr[std::size_t(b) + 1] - indptr[std::size_t(b)];
      CHECK(v->seq_len[b] == (n == 0 ? 0 : (n - 1) * 16 + last[std::size_t(b)]));
      CHECK(v->formats[1 - fmt].count(b) == 0);
      REQUIRE(v->formats[fmt].count(b) == n);
      for (int i = 0; i < n; ++i) {
        const int e = v->formats[fmt].indptr[b] + i;
        CHECK(v->formats[fmt].slot[e] == indices[std::size_t(indptr[std::size_t(b)] + i)]);
        CHECK(v->formats[fmt].logical[e] == i);
      }
      if (n > 0) CHECK(v->tokens_in_page(b, n - 1, 16) == last[std::size_t(b)]);
    }
  }
  std::vector<std::int32_t> indptr{0, 2}, indices{3, 4}, last{0};
  paged_kv_table t{1, 16, indptr.data(), indices.data(), last.data()};
  CHECK(index_from_paged_kv_table<2>(t, 0, 100, layout, buf.span(layout.bytes())).code() ==
        errc::invalid_argument);
  last[0] = 17;
  CHECK(index_from_paged_kv_table<2>(t, 0, 100, layout, buf.span(layout.bytes())).code() ==
        errc::invalid_argument);
  last[0] = 16;
  indices[1] = 100;
  CHECK(index_from_paged_kv_table<2>(t, 0, 100, layout, buf.span(layout.bytes())).code() ==
        errc::out_of_range);
  indices[1] = 5;
  CHECK(index_from_paged_kv_table<2>(t, 2, 100, layout, buf.span(layout.bytes())).code() ==
        errc::out_of_range);
  indptr[1] = -1;
  CHECK(index_from_paged_kv_table<2>(t, 0, 100, layout, buf.span(layout.bytes())).code() ==
        errc::invalid_argument);
}

TEST_CASE("index arrays owned by a storage are accounted", "[paging][index][report]") {
  fixture fx;
  const std::size_t before = fx.s->meta_alloc().bytes_allocated();
  {
    auto arrays = index_arrays<storage_t>::create(*fx.s, 8, 8);
    REQUIRE(arrays);
    CHECK(fx.s->lines().index_arrays == index_layout<2>::capacity_for(8, 8));
    CHECK(fx.s->meta_alloc().bytes_allocated() == before + index_layout<2>::capacity_for(8, 8));
    auto r = make_report(*fx.s);
    CHECK(r.index_arrays == index_layout<2>::capacity_for(8, 8));
    CHECK(r.reconciles());
    auto v = arrays->build(1, std::span<const seq_id>(fx.seqs));
    REQUIRE(v);
    check_view(*fx.s, 1, fx.seqs, *v);
    fx.s->meta_alloc().fail_on(1);
    CHECK(index_arrays<storage_t>::create(*fx.s, 8, 8).code() == errc::injected_fault);
    fx.s->meta_alloc().reset();
  }
  CHECK(fx.s->lines().index_arrays == 0);
  CHECK(fx.s->meta_alloc().bytes_allocated() == before);
  CHECK(make_report(*fx.s).reconciles());
}
