// SPDX-License-Identifier: Apache-2.0
// The format registry: the one list of tierkv's storage formats. A format is its host codec
// header (codec/: the codec families and a descriptor naming them), its device codec header
// (cuda/codec/, when the GPU reads it) and one line here; everything that enumerates formats
// derives from this list: run-time names (Python's recent / cache_type_k / cache_type_v, the
// prebuilt sets), names of storage_format tags in messages, the device codecs the kernels see.
// A format's properties that code asks of it (rotation context, per-token scale, decode work)
// are traits of its codecs, not lists kept elsewhere (codec/codec.hpp,
// cuda/codec/device_codec.cuh).
#pragma once

#include "tierkv/core/config.hpp"

#include <string_view>
#include <type_traits>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

#if defined(__CUDACC__)  // the device codecs of the formats the GPU reads
#include "tierkv/cuda/codec/dense_bf16.cuh"
#include "tierkv/cuda/codec/fp8_e4m3.cuh"
#include "tierkv/cuda/codec/int8_rotated.cuh"
#include "tierkv/cuda/codec/tq2.cuh"
#include "tierkv/cuda/codec/tq3.cuh"
#include "tierkv/cuda/codec/tq4.cuh"
#endif

// Formats added without editing tierkv (an engine's own codec; tests/unit/user_format/): compile
// every translation unit with TIERKV_USER_FORMATS_HEADER, a header (found on the include path)
// that declares their codecs (codec_family, storage_format tags 128 and up: codec/codec.hpp), their
// descriptors and, under nvcc, their device codecs (cuda/codec/device_codec.cuh), and with
// TIERKV_USER_FORMATS, the descriptors' comma-separated types. They are then registered formats
// like tierkv's own: named from Python (python/setup.py passes both through), in tier lists, in
// transfers. One program, one definition: every unit must see the same two macros.
#if defined(TIERKV_USER_FORMATS_HEADER) != defined(TIERKV_USER_FORMATS)
#error \
    "tierkv/formats.hpp: define both TIERKV_USER_FORMATS_HEADER and TIERKV_USER_FORMATS, or neither"
#endif
#ifdef TIERKV_USER_FORMATS_HEADER
#include TIERKV_USER_FORMATS_HEADER
#define TIERKV_DETAIL_USER_FORMATS , TIERKV_USER_FORMATS
#else
#define TIERKV_DETAIL_USER_FORMATS
#endif

namespace tierkv {

/// A list of format descriptors (tierkv::formats::X beside each codec: name, key_family,
/// value_family).
template <class... Formats>
struct format_list {
  static constexpr int size = int(sizeof...(Formats));  ///< number of formats
};

/// tierkv's own formats (tags below 128).
using builtin_formats = format_list<formats::fp8, formats::int8_rotated, formats::tq3, formats::tq4,
                                    formats::bf16, formats::f32, formats::fp8_e5m2, formats::tq2>;

namespace detail {
template <class List, class... More>
struct append_formats;
template <class... F, class... More>
struct append_formats<format_list<F...>, More...> {
  using type = format_list<F..., More...>;
};
}  // namespace detail

/// Every registered format, tierkv's own then the user formats (above); a descriptor's index
/// here is its run-time index.
using registered_formats =
    typename detail::append_formats<builtin_formats TIERKV_DETAIL_USER_FORMATS>::type;

namespace detail {
template <class F>
constexpr storage_format format_tag = codec_for<typename F::key_family, 64>::format;

template <class... F>
constexpr bool registry_consistent(format_list<F...>) {
  const std::string_view names[] = {std::string_view(F::name)...};
  const storage_format tags[] = {format_tag<F>...};
  const bool same_tag[] = {(codec_for<typename F::key_family, 64>::format ==
                            codec_for<typename F::value_family, 64>::format)...};
  for (int i = 0; i < int(sizeof...(F)); ++i) {
    if (!same_tag[i] || names[i].empty()) return false;
    if ((i < builtin_formats::size) != (int(tags[i]) < user_format_tags)) return false;
    for (int j = 0; j < i; ++j)
      if (names[i] == names[j] || tags[i] == tags[j]) return false;
  }
  return true;
}
static_assert(
    registry_consistent(registered_formats{}),
    "tierkv/formats.hpp: every registered format needs a non-empty name and a storage_format "
    "tag of its own, shared by its key and value codecs (tierkv's below 128, user formats' "
    "128 and up)");

template <int I, class List>
struct format_at_impl;
template <int I, class F, class... Rest>
struct format_at_impl<I, format_list<F, Rest...>> : format_at_impl<I - 1, format_list<Rest...>> {};
template <class F, class... Rest>
struct format_at_impl<0, format_list<F, Rest...>> {
  using type = F;
};
template <class... F>
constexpr std::string_view name_at(format_list<F...>, int i) {
  const std::string_view names[] = {std::string_view(F::name)...};
  return i >= 0 && i < int(sizeof...(F)) ? names[i] : std::string_view{};
}
template <class... F>
constexpr int index_of_tag(format_list<F...>, storage_format tag) {
  const storage_format tags[] = {format_tag<F>...};
  for (int i = 0; i < int(sizeof...(F)); ++i)
    if (tags[i] == tag) return i;
  return -1;
}
}  // namespace detail

/// Number of registered formats.
inline constexpr int format_count = registered_formats::size;

/// The descriptor at run-time index I.
template <int I>
using format_at = typename detail::format_at_impl<I, registered_formats>::type;

/// The run-time name of format index i ("" outside the registry).
constexpr std::string_view format_name(int i) { return detail::name_at(registered_formats{}, i); }

/// The index of the format named `name`, or -1.
constexpr int find_format(std::string_view name) {
  for (int i = 0; i < format_count; ++i)
    if (format_name(i) == name) return i;
  return -1;
}

/// The registered name of a storage_format tag ("" for a tag no registered format has).
constexpr std::string_view format_name(storage_format tag) {
  return format_name(detail::index_of_tag(registered_formats{}, tag));
}

}  // namespace tierkv
