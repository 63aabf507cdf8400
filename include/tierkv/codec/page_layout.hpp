// SPDX-License-Identifier: Apache-2.0
// Byte layout of one physical page: page_tokens tokens of ONE layer, all KV heads,
// keys with the tier's key codec and values with its value codec.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/core/config.hpp"
#include "tierkv/core/geometry.hpp"

namespace tierkv {

/// Pages are per layer (so a policy can keep chosen layers in FP8) and hold every KV
/// head (one allocation per logical page and layer). Inside, structure of arrays,
/// each region 16-byte aligned, so a warp reading one head's keys issues coalesced
/// 16-byte loads over contiguous payloads:
///
///   [key payloads   : kv_heads x page_tokens x KeyCodec::payload_bytes  ]
///   [value payloads : kv_heads x page_tokens x ValueCodec::payload_bytes]
///   [key meta       : kv_heads x page_tokens x KeyCodec::meta_bytes     ]
///   [value meta     : kv_heads x page_tokens x ValueCodec::meta_bytes   ]
///
/// Example, head_dim 128, 8 KV heads, 64 tokens, FP8 keys and values with a 4-byte
/// scale: 8*64*128 = 65536 B of key codes at offset 0, values at 65536, key scales
/// at 131072 (2048 B), value scales at 133120; page_bytes = 135168.
template <class Geometry, vector_codec KeyCodec, vector_codec ValueCodec>
struct page_layout {
  static_assert(is_geometry_v<Geometry>, "page_layout: Geometry must be a tierkv::geometry<...>");
  static_assert(KeyCodec::head_dim == Geometry::head_dim,
                "page_layout: the key codec is bound to another head_dim than the geometry");
  static_assert(ValueCodec::head_dim == Geometry::head_dim,
                "page_layout: the value codec is bound to another head_dim than the geometry");
  static_assert(KeyCodec::payload_bytes % 8 == 0 && ValueCodec::payload_bytes % 8 == 0,
                "page_layout: codec payloads must be multiples of 8 bytes");

  using geometry = Geometry;       ///< the cache's shape
  using key_codec = KeyCodec;      ///< the tier's key codec
  using value_codec = ValueCodec;  ///< the tier's value codec

  /// n rounded up to 16.
  static constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

  static constexpr int tokens = Geometry::page_tokens;  ///< token slots per page
  static constexpr int heads = Geometry::kv_heads;      ///< KV heads per page
  static constexpr std::size_t key_head_stride =
      std::size_t(tokens) * KeyCodec::payload_bytes;  ///< bytes of one head's key payloads
  static constexpr std::size_t value_head_stride =
      std::size_t(tokens) * ValueCodec::payload_bytes;  ///< bytes of one head's value payloads

  static constexpr std::size_t key_payload_offset = 0;  ///< start of the key payloads
  /// start of the value payloads
  static constexpr std::size_t value_payload_offset =
      align16(key_payload_offset + heads * key_head_stride);
  /// start of the key metas
  static constexpr std::size_t key_meta_offset =
      align16(value_payload_offset + heads * value_head_stride);
  /// start of the value metas
  static constexpr std::size_t value_meta_offset =
      align16(key_meta_offset + std::size_t(heads) * tokens * KeyCodec::meta_bytes);
  /// bytes of one page (16-aligned)
  static constexpr std::size_t page_bytes =
      align16(value_meta_offset + std::size_t(heads) * tokens * ValueCodec::meta_bytes);

  /// Byte offsets inside a page of (kv head h, token slot t).
  TIERKV_HD static constexpr std::size_t key_payload(int h, int t) {
    return key_payload_offset + std::size_t(h) * key_head_stride +
           std::size_t(t) * KeyCodec::payload_bytes;
  }
  /// Offset of the value payload of (h, t).
  TIERKV_HD static constexpr std::size_t value_payload(int h, int t) {
    return value_payload_offset + std::size_t(h) * value_head_stride +
           std::size_t(t) * ValueCodec::payload_bytes;
  }
  /// Offset of the key meta of (h, t).
  TIERKV_HD static constexpr std::size_t key_meta(int h, int t) {
    return key_meta_offset + (std::size_t(h) * tokens + std::size_t(t)) * KeyCodec::meta_bytes;
  }
  /// Offset of the value meta of (h, t).
  TIERKV_HD static constexpr std::size_t value_meta(int h, int t) {
    return value_meta_offset + (std::size_t(h) * tokens + std::size_t(t)) * ValueCodec::meta_bytes;
  }
};

/// What device code needs to address one pool's pages: no host call, no virtual.
struct pool_view {
  std::uint8_t* base = nullptr;  ///< page p starts at base + p * page_bytes
  std::size_t page_bytes = 0;    ///< bytes per page
  std::uint32_t capacity = 0;    ///< number of pages

  /// The bytes of page p.
  TIERKV_HD std::uint8_t* page(std::uint32_t p) const { return base + std::size_t(p) * page_bytes; }
};

}  // namespace tierkv
