// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/memory/page_pool.hpp"

using namespace tierkv;

namespace {
using G = geometry<head_dim<16>, kv_heads<2>, group_size<1>, page_tokens<16>>;
using L = page_layout<G, dense_f32_codec<16>, dense_f32_codec<16>>;
using pool_t = page_pool<L, host_allocator, failing_allocator>;
}  // namespace

TEST_CASE("page layout of the test geometry", "[memory][layout]") {
  STATIC_REQUIRE(L::page_bytes == 2 * 2 * 16 * 64);
  STATIC_REQUIRE(L::value_payload_offset == 2 * 16 * 64);
  STATIC_REQUIRE(L::key_payload(1, 3) == 16 * 64 + 3 * 64);
}

TEST_CASE("page pool allocates, releases, detects stale and double release", "[memory][pool]") {
  host_allocator pages;
  failing_allocator meta;
  std::size_t line = 0;
  pool_t pool;
  REQUIRE(pool.init(pages, meta, line, 4, 3));
  CHECK(pages.bytes_allocated() == 4 * L::page_bytes);
  CHECK(line == meta.bytes_allocated());
  CHECK(pool.free_count() == 4);

  std::vector<page_id> ids;
  for (int i = 0; i < 4; ++i) {
    auto p = pool.allocate();
    REQUIRE(p);
    CHECK(p->format == 3);
    CHECK(pool.state(*p) == page_state::open);
    CHECK(pool.refcount(*p) == 1);
#if TIERKV_POISON_PAGES
    const std::uint8_t* b = pool.host_page(*p);
    CHECK(std::all_of(b, b + L::page_bytes, [](std::uint8_t x) { return x == page_poison_byte; }));
#endif
    ids.push_back(*p);
  }
  auto full = pool.allocate();
  REQUIRE_FALSE(full);
  CHECK(full.code() == errc::capacity_exhausted);
  CHECK(full.error_status().message().find("all 4 pages") != std::string::npos);
  REQUIRE(pool.check_integrity());

  REQUIRE(pool.retain(ids[1]));
  CHECK(pool.refcount(ids[1]) == 2);
  REQUIRE(pool.release(ids[1]));
  CHECK(pool.free_count() == 0);
  REQUIRE(pool.release(ids[1]));
  CHECK(pool.free_count() == 1);

  // Double release: refused, nothing changes.
  const auto before = pool.free_count();
  auto dr = pool.release(ids[1]);
  CHECK(dr.code() == errc::double_release);
  CHECK(pool.free_count() == before);
  REQUIRE(pool.check_integrity());

  // The slot is reused with a new generation; the old id is now stale.
  auto again = pool.allocate();
  REQUIRE(again);
  CHECK(again->slot == ids[1].slot);
  CHECK(again->generation == ids[1].generation + 1);
  CHECK(pool.release(ids[1]).code() == errc::stale_id);
  CHECK(pool.retain(ids[1]).code() == errc::stale_id);
  CHECK(pool.refcount(*again) == 1);

  // Out of range, wrong format, invalid.
  CHECK(pool.release(page_id{99, 0, 3}).code() == errc::out_of_range);
  CHECK(pool.release(page_id{0, 0, 1}).code() == errc::invalid_argument);
  CHECK(pool.release(page_id{}).code() == errc::invalid_argument);

  REQUIRE(pool.seal(ids[0]));
  CHECK(pool.state(ids[0]) == page_state::sealed);
  REQUIRE(pool.copy_page(*again, ids[0]));
  CHECK(pool.check_integrity());
  const pool_view v = pool.view();
  CHECK(v.capacity == 4);
  CHECK(v.page_bytes == L::page_bytes);
  CHECK(v.page(2) == pool.host_page(ids[2]));
}

TEST_CASE("page pool init failures leave nothing allocated", "[memory][pool][fault]") {
  host_allocator pages;
  failing_allocator meta;
  std::size_t line = 0;
  {
    pool_t pool;
    meta.fail_on(1);
    auto st = pool.init(pages, meta, line, 4, 0);
    CHECK(st.code() == errc::injected_fault);
    CHECK_FALSE(pool.initialized());
  }
  {
    pool_t pool;
    CHECK(pool.init(pages, meta, line, 0, 0).code() == errc::invalid_argument);
  }
  CHECK(pages.bytes_allocated() == 0);
  CHECK(meta.bytes_allocated() == 0);
  CHECK(line == 0);
}

TEST_CASE("page pool random alloc/release keeps its free list intact", "[memory][pool]") {
  host_allocator pages;
  failing_allocator meta;
  std::size_t line = 0;
  pool_t pool;
  REQUIRE(pool.init(pages, meta, line, 37, 0));
  std::mt19937 rng(5);
  std::vector<page_id> live;
  for (int op = 0; op < 20000; ++op) {
    if (live.empty() || (rng() % 2 == 0 && pool.free_count() > 0)) {
      auto p = pool.allocate();
      REQUIRE(p);
      live.push_back(*p);
    } else {
      const std::size_t i = rng() % live.size();
      REQUIRE(pool.release(live[i]));
      live.erase(live.begin() + std::ptrdiff_t(i));
    }
    REQUIRE(pool.live_count() == live.size());
    if (op % 64 == 0) REQUIRE(pool.check_integrity());
  }
  REQUIRE(pool.check_integrity());
}
