// SPDX-License-Identifier: Apache-2.0
// A tier pairs a key codec family with a value codec family; a tier list is the
// compile-time set of storage formats of a cache (one pool, one index CSR, one
// attention inner loop per tier).
#pragma once

#include <cstddef>
#include <type_traits>

#include "tierkv/codec/codec.hpp"

namespace tierkv {

/// Keys and values have separate codecs because their errors act differently:
/// key error moves attention routing (judged by inner-product error), value error
/// moves the content read (judged by MSE).
template <codec_family KeyFamily, codec_family ValueFamily>
struct tier {
  using key_family = KeyFamily;      ///< codec family of the keys
  using value_family = ValueFamily;  ///< codec family of the values
  /// The key codec bound to HeadDim.
  template <int HeadDim>
  using key_codec = codec_for<KeyFamily, HeadDim>;
  /// The value codec bound to HeadDim.
  template <int HeadDim>
  using value_codec = codec_for<ValueFamily, HeadDim>;
};

/// True for tierkv::tier<K, V>.
template <class T>
struct is_tier : std::false_type {};
template <class K, class V>
struct is_tier<tier<K, V>> : std::true_type {};

/// An ordered list of tiers; index 0 is the tier new tokens are appended in.
template <class... Tiers>
struct tiers {
  static_assert(sizeof...(Tiers) >= 1, "tiers<...>: a cache needs at least one tier");
  static_assert((is_tier<Tiers>::value && ...),
                "tiers<...>: every entry must be a tierkv::tier<K, V>");
  static constexpr int size = int(sizeof...(Tiers));  ///< number of tiers
};

namespace detail {
template <int I, class... Ts>
struct nth;
template <class T, class... Ts>
struct nth<0, T, Ts...> {
  using type = T;
};
template <int I, class T, class... Ts>
struct nth<I, T, Ts...> : nth<I - 1, Ts...> {};
}  // namespace detail

/// The I-th tier of a tier list (tier_at<L, I>::type).
template <class TierList, int I>
struct tier_at;
/// The I-th tier of tiers<...>.
template <int I, class... Tiers>
struct tier_at<tiers<Tiers...>, I> {
  static_assert(I >= 0 && I < int(sizeof...(Tiers)), "tier_at: index beyond the tier list");
  using type = typename detail::nth<I, Tiers...>::type;  ///< the tier
};
/// tier_at<TierList, I>::type
template <class TierList, int I>
using tier_at_t = typename tier_at<TierList, I>::type;

}  // namespace tierkv
