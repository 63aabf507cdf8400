// SPDX-License-Identifier: Apache-2.0
// Strong id types: a page id cannot be passed where a sequence id is expected.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>

#include "tierkv/core/config.hpp"

namespace tierkv {

// A distinct integer type per Tag. Invalid is the all-ones value.
template <class Tag, class Rep = std::uint32_t>
struct strong_id {
  using rep = Rep;
  static constexpr Rep invalid_value = std::numeric_limits<Rep>::max();

  Rep value = invalid_value;

  constexpr strong_id() = default;
  TIERKV_HD constexpr explicit strong_id(Rep v) : value(v) {}

  TIERKV_HD constexpr bool valid() const { return value != invalid_value; }
  friend constexpr auto operator<=>(const strong_id&, const strong_id&) = default;
  friend std::ostream& operator<<(std::ostream& out, const strong_id& id) {
    return id.valid() ? (out << Tag::prefix << id.value) : (out << Tag::prefix << "<invalid>");
  }
};

struct seq_tag {
  static constexpr const char* prefix = "seq#";
};
struct layer_tag {
  static constexpr const char* prefix = "layer#";
};
struct head_tag {
  static constexpr const char* prefix = "head#";
};

using seq_id = strong_id<seq_tag>;
using layer_id = strong_id<layer_tag>;
using head_id = strong_id<head_tag>;

// Index of a storage format in a cache's compile-time format list.
using format_index = std::uint8_t;

// A physical page: format, slot in that format's pool, and the slot's
// generation when the id was issued. A freed and reused slot gets a new
// generation, so a stale id is detected instead of reading someone else's page.
struct page_id {
  static constexpr std::uint32_t invalid_slot = std::numeric_limits<std::uint32_t>::max();

  std::uint32_t slot = invalid_slot;
  std::uint32_t generation = 0;
  format_index format = 0;

  TIERKV_HD constexpr bool valid() const { return slot != invalid_slot; }
  friend constexpr bool operator==(const page_id&, const page_id&) = default;
  friend std::ostream& operator<<(std::ostream& out, const page_id& id) {
    if (!id.valid()) return out << "page#<invalid>";
    return out << "page#" << unsigned(id.format) << ':' << id.slot << '@' << id.generation;
  }
};

}  // namespace tierkv

template <class Tag, class Rep>
struct std::hash<tierkv::strong_id<Tag, Rep>> {
  std::size_t operator()(const tierkv::strong_id<Tag, Rep>& id) const noexcept {
    return std::hash<Rep>{}(id.value);
  }
};

template <>
struct std::hash<tierkv::page_id> {
  std::size_t operator()(const tierkv::page_id& id) const noexcept {
    const std::uint64_t packed =
        (std::uint64_t(id.format) << 56) ^ (std::uint64_t(id.generation) << 32) ^ id.slot;
    return std::hash<std::uint64_t>{}(packed);
  }
};
