// SPDX-License-Identifier: Apache-2.0
// Strong id types: a page id cannot be passed where a sequence id is expected.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>

#include "tierkv/core/config.hpp"
#include "tierkv/core/text.hpp"

namespace tierkv {

/// A distinct integer type per Tag. Invalid is the all-ones value.
template <class Tag, class Rep = std::uint32_t>
struct strong_id {
  using rep = Rep;  ///< the integer type
  static constexpr Rep invalid_value =
      std::numeric_limits<Rep>::max();  ///< the value of a default-constructed (invalid) id

  Rep value = invalid_value;  ///< the raw id

  constexpr strong_id() = default;
  /// An id with raw value v.
  TIERKV_HD constexpr explicit strong_id(Rep v) : value(v) {}

  /// False for a default-constructed id.
  TIERKV_HD constexpr bool valid() const { return value != invalid_value; }
  /// Ordered by raw value.
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 flags the defaulted <=>'s own literal 0
  friend constexpr auto operator<=>(const strong_id&, const strong_id&) = default;
  /// E.g. "seq#3", or "seq#<invalid>".
  friend std::string to_string(const strong_id& id) {
    return id.valid() ? concat(Tag::prefix, id.value) : concat(Tag::prefix, "<invalid>");
  }
  /// Writes to_string(id).
  friend std::ostream& operator<<(std::ostream& out, const strong_id& id) {
    return out << to_string(id);
  }
};

/// Tag of seq_id.
struct seq_tag {
  static constexpr const char* prefix = "seq#";  ///< printed before the value
};
/// Tag of layer_id.
struct layer_tag {
  static constexpr const char* prefix = "layer#";  ///< printed before the value
};
/// Tag of head_id.
struct head_tag {
  static constexpr const char* prefix = "head#";  ///< printed before the value
};

/// A sequence of a cache (create_sequence, fork, prefix_index::start_sequence).
using seq_id = strong_id<seq_tag>;
/// A model layer.
using layer_id = strong_id<layer_tag>;
/// A KV head.
using head_id = strong_id<head_tag>;

/// Index of a storage format in a cache's compile-time format list.
using format_index = std::uint8_t;

/// A physical page: format, slot in that format's pool, and the slot's
/// generation when the id was issued. A freed and reused slot gets a new
/// generation, so a stale id is detected instead of reading someone else's page.
struct page_id {
  static constexpr std::uint32_t invalid_slot =
      std::numeric_limits<std::uint32_t>::max();  ///< slot of an invalid id

  std::uint32_t slot = invalid_slot;  ///< slot in its tier's pool
  std::uint32_t generation = 0;       ///< the slot's generation when the id was issued
  format_index format = 0;            ///< the tier (index in the tier list) whose pool holds it

  /// False for a default-constructed id.
  TIERKV_HD constexpr bool valid() const { return slot != invalid_slot; }
  /// Same slot, generation and tier.
  friend constexpr bool operator==(const page_id&, const page_id&) = default;
  /// "page#tier:slot@generation", or "page#<invalid>".
  friend std::string to_string(const page_id& id) {
    if (!id.valid()) return "page#<invalid>";
    return concat("page#", unsigned(id.format), ':', id.slot, '@', id.generation);
  }
  /// Writes to_string(id).
  friend std::ostream& operator<<(std::ostream& out, const page_id& id) {
    return out << to_string(id);
  }
};

}  // namespace tierkv

// The std::hash specializations are standard customization points, left out of the API reference.
/// @cond
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
/// @endcond
