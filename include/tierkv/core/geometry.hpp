// SPDX-License-Identifier: Apache-2.0
// Compile-time attention geometry: head_dim, kv_heads, group size, page_tokens.
#pragma once

#include <cstddef>
#include <type_traits>

#include "tierkv/core/config.hpp"

namespace tierkv {

/// Named parameters, so an instantiation reads as its meaning:
///   geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>
template <int N>
struct head_dim {
  static constexpr int value = N;  ///< scalars per head vector
};
/// Number of KV heads (of this cache or tensor-parallel shard).
template <int N>
struct kv_heads {
  static constexpr int value = N;  ///< KV heads
};
/// Query heads per KV head (grouped-query attention; 1 = multi-head attention).
template <int N>
struct group_size {
  static constexpr int value = N;  ///< query heads per KV head
};
/// Tokens per page (the unit of allocation, sharing and retiering).
template <int N>
struct page_tokens {
  static constexpr int value = N;  ///< tokens per page
};

namespace detail {
template <template <int> class Tag, class T>
struct is_tag : std::false_type {};
template <template <int> class Tag, int N>
struct is_tag<Tag, Tag<N>> : std::true_type {};
}  // namespace detail

/// Limits below are the ones the kernels are written for; each assertion names
/// the rule so a user knows what to change.
inline constexpr int max_head_dim = 512;      ///< largest head_dim
inline constexpr int max_group_size = 16;     ///< query rows of one m16 tensor-core tile
inline constexpr int max_page_tokens = 4096;  ///< largest page_tokens

/// The compile-time shape of a cache: head_dim, kv_heads, group_size, page_tokens; each
/// parameter checked by a static_assert that names its rule.
template <class HeadDim, class KvHeads, class GroupSize, class PageTokens>
struct geometry {
  static_assert(detail::is_tag<tierkv::head_dim, HeadDim>::value,
                "geometry: first parameter must be tierkv::head_dim<N>");
  static_assert(detail::is_tag<tierkv::kv_heads, KvHeads>::value,
                "geometry: second parameter must be tierkv::kv_heads<N>");
  static_assert(detail::is_tag<tierkv::group_size, GroupSize>::value,
                "geometry: third parameter must be tierkv::group_size<N>");
  static_assert(detail::is_tag<tierkv::page_tokens, PageTokens>::value,
                "geometry: fourth parameter must be tierkv::page_tokens<N>");

  static constexpr int head_dim = HeadDim::value;        ///< scalars per head vector
  static constexpr int kv_heads = KvHeads::value;        ///< KV heads
  static constexpr int group_size = GroupSize::value;    ///< query heads per KV head (GQA)
  static constexpr int page_tokens = PageTokens::value;  ///< tokens per page
  static constexpr int q_heads = kv_heads * group_size;  ///< query heads

  static_assert(head_dim >= 16 && head_dim <= max_head_dim,
                "geometry: head_dim must lie in [16, 512]");
  static_assert(head_dim % 16 == 0,
                "geometry: head_dim must be a multiple of 16 (one 16-byte load of FP8 codes)");
  static_assert(kv_heads >= 1, "geometry: kv_heads must be at least 1");
  static_assert(group_size >= 1 && group_size <= max_group_size,
                "geometry: group_size (query heads per KV head) must lie in [1, 16]");
  static_assert(page_tokens >= 16 && page_tokens <= max_page_tokens,
                "geometry: page_tokens must lie in [16, 4096]");
  static_assert(page_tokens % 16 == 0,
                "geometry: page_tokens must be a multiple of 16 (tensor-core tile of tokens)");
};

/// True for tierkv::geometry<...> instantiations.
template <class T>
struct is_geometry : std::false_type {};
template <class A, class B, class C, class D>
struct is_geometry<geometry<A, B, C, D>> : std::true_type {};
/// is_geometry<T>::value
template <class T>
inline constexpr bool is_geometry_v = is_geometry<T>::value;

/// Runtime mirror of a geometry, for plain-data views handed to kernels and for
/// self-describing buffers.
struct geometry_desc {
  int head_dim = 0;     ///< geometry::head_dim
  int kv_heads = 0;     ///< geometry::kv_heads
  int group_size = 0;   ///< geometry::group_size
  int page_tokens = 0;  ///< geometry::page_tokens

  /// The descriptor of geometry G.
  template <class G>
  static constexpr geometry_desc of() noexcept {
    static_assert(is_geometry_v<G>, "geometry_desc::of<G>: G must be a tierkv::geometry<...>");
    return {G::head_dim, G::kv_heads, G::group_size, G::page_tokens};
  }
  /// Same shape.
  friend constexpr bool operator==(const geometry_desc&, const geometry_desc&) = default;
};

}  // namespace tierkv
