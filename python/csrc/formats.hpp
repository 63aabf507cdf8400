// SPDX-License-Identifier: Apache-2.0
// The one place where run-time format names meet compile-time types: the prebuilt tier
// sets (llama.cpp-style names for the Recent/Anchor tier and the Stale tier's keys and
// values) and the geometry values the prebuilt set covers. registry.cpp resolves names
// through tier_sets; the instantiation units (inst/*.cpp) instantiate the same types.
#pragma once

#include <array>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

namespace tierkv_py {

using fp8_tier = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using int8r_tier = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
using tq3_tier = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using tq4k_tq3v_tier = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;

// A tier set by name: recent = tier 0 (Recent and Anchor pages, both codecs), cache_type_k /
// cache_type_v = the Stale tier's key / value codecs. An 8-bit-only set names its tier-0
// format three times (no Stale tier: every page stays 8-bit).
struct fp8_tq3 {
  static constexpr std::string_view recent = "fp8", k = "tq3", v = "tq3";
  using type = tierkv::tiers<fp8_tier, tq3_tier>;
};
struct int8r_tq4 {
  static constexpr std::string_view recent = "int8_rotated", k = "tq4", v = "tq3";
  using type = tierkv::tiers<int8r_tier, tq4k_tq3v_tier>;
};
struct int8r_only {
  static constexpr std::string_view recent = "int8_rotated", k = "int8_rotated", v = "int8_rotated";
  using type = tierkv::tiers<int8r_tier>;
};

// Index i of tier_set_names is the tier_set value of a combo (runtime.hpp).
template <class... S>
struct set_list {
  static constexpr int size = sizeof...(S);
};
using tier_sets = set_list<fp8_tq3, int8r_tq4, int8r_only>;

template <class S, class... L>
constexpr int index_in(set_list<L...>) {
  int i = 0, found = -1;
  ((std::is_same_v<S, L> ? (found = i, ++i) : ++i), ...);
  return found;
}
template <class S>
inline constexpr int tier_set_index = index_in<S>(tier_sets{});

struct tier_set_name {
  std::string_view recent, k, v;
};
inline constexpr std::array<tier_set_name, tier_sets::size> tier_set_names = {
    tier_set_name{fp8_tq3::recent, fp8_tq3::k, fp8_tq3::v},
    tier_set_name{int8r_tq4::recent, int8r_tq4::k, int8r_tq4::v},
    tier_set_name{int8r_only::recent, int8r_only::k, int8r_only::v},
};

// Every format name any set uses, for the "unknown format" message.
inline constexpr std::array<std::string_view, 4> format_names = {"fp8", "int8_rotated", "tq3",
                                                                 "tq4"};

// Geometry values of the prebuilt set. Each instantiation unit (inst/<set>_d<head_dim>_p<page
// size>.cpp; those files are the set's tier-set x head_dim x page-size list) builds every
// group size x KV-head count below: kv_heads_default, or kv_heads_full when built with
// TIERKV_PYTHON_SET=full (setup.py defines TIERKV_PY_FULL).
using group_list = std::integer_sequence<int, 1, 2, 4, 6, 8>;
using kv_heads_full = std::integer_sequence<int, 1, 2, 4, 8>;
using kv_heads_default = std::integer_sequence<int, 1, 4, 8>;

}  // namespace tierkv_py
