// SPDX-License-Identifier: Apache-2.0
#include <sstream>
#include <unordered_set>

#include "catch.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"

using namespace tierkv;

using qwen_full = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<64>>;
using smollm = geometry<head_dim<64>, kv_heads<3>, group_size<3>, page_tokens<16>>;

static_assert(qwen_full::q_heads == 24);
static_assert(smollm::q_heads == 9);
static_assert(is_geometry_v<smollm>);
static_assert(!is_geometry_v<int>);

TEST_CASE("geometry_desc mirrors the compile-time geometry", "[core][geometry]") {
  constexpr auto d = geometry_desc::of<qwen_full>();
  CHECK(d.head_dim == 256);
  CHECK(d.kv_heads == 4);
  CHECK(d.group_size == 6);
  CHECK(d.page_tokens == 64);
  CHECK(d == geometry_desc::of<qwen_full>());
  CHECK_FALSE(d == geometry_desc::of<smollm>());
}

TEST_CASE("strong ids are distinct types with an invalid default", "[core][ids]") {
  seq_id s;
  CHECK_FALSE(s.valid());
  seq_id a{3}, b{4};
  CHECK(a < b);
  CHECK(a == seq_id{3});
  std::ostringstream out;
  out << a << ' ' << s;
  CHECK(out.str() == "seq#3 seq#<invalid>");
  static_assert(!std::is_convertible_v<seq_id, layer_id>);
  static_assert(!std::is_convertible_v<unsigned, seq_id>);
}

TEST_CASE("page ids compare format, slot and generation", "[core][ids]") {
  const page_id p{5, 1, 2};
  CHECK(p.valid());
  CHECK_FALSE(page_id{}.valid());
  CHECK_FALSE(p == page_id{5, 2, 2});  // same slot, later generation: a different page
  CHECK_FALSE(p == page_id{5, 1, 3});
  std::unordered_set<page_id> ids{p, page_id{5, 2, 2}, page_id{6, 1, 2}};
  CHECK(ids.size() == 3);
  std::ostringstream out;
  out << p;
  CHECK(out.str() == "page#2:5@1");
}
