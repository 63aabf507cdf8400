// SPDX-License-Identifier: Apache-2.0
// The seam between the kernels and the storage formats: device_codec<C> is everything the
// kernels know of host codec C's format, one specialization per format, each in its own file
// of this folder. A new format is that file, its host codec (codec/) and its line in the
// format registry (tierkv/formats.hpp, which includes the device file under nvcc). A
// specialization provides:
//   rotated        the format stores vectors in the seeded rotation's domain: decode prepares
//                  queries and finalizes outputs there, retier flips or skips the signs
//   slice_reader   the CUDA-core inner loop: raw, load<Shared = false>(payload, slice) (global
//                  memory through the read-only path, or shared), unpack(raw, slice, x[16]) (16
//                  scalars of the codec's own domain: coordinates 16 slice ..), code_scale;
//                  optionally unpack_h2(raw, slice, h[8]) / unpack_bf16x2(..): the same as
//                  exact f16 / bf16 pairs (the prefill's keys / values)
//   fragments      the tensor-core operand builders (decode/tensor_core.cuh's interface:
//                  key_words, load_key, key_frag / key_frag_s8, value_words, load_value,
//                  value_pairs, value_codes_finite, ...; derived from fragment_defaults)
//   warp_decode<N, Signed>(payload, meta, seed, signs, exchange, lane) -> lane_vector
//   warp_encode<N>(vector, payload, meta*, seed, lane, norm, exchange, signs) -> false on
//                  non-finite input (the codec's poison written)
// The host codec's per-token metadata is a bf16 scale (every quantized format) or nothing
// (dense_bf16: the kernels take 1).
// The warp codecs hold a vector N coordinates per lane (warp/lane_group.cuh) and are
// bit-exact with the host codec for every lane grouping.
#pragma once

#include "tierkv/core/config.hpp"

#include <concepts>

#include "tierkv/codec/codec.hpp"
#include "tierkv/cuda/arch/convert.cuh"

namespace tierkv::cuda::detail {

template <class C, storage_format F = C::format>
struct device_codec {
  static_assert(
      tierkv::detail::dependent_false<C>,
      "tierkv::cuda: no device codec for this codec's storage_format (the supported ones are "
      "registered in tierkv/formats.hpp). A new format needs a device_codec specialization in a "
      "file of cuda/codec/, registered in tierkv/formats.hpp");
};

// The policy traits' defaults: a specialization derives from device_codec_defaults and its
// fragments from fragment_defaults, redeclaring what differs for its format (each codec's file
// says why; the pairs of formats the kernels treat specially):
//   sign_coded       the rotation's D applies as sign-bit flips of its codes, so a retier with
//                    a rotated format flips signs instead
//   stores_runs      its warp encoder stores a vector given in lane_exchange's runs (a rotated
//                    retier source decodes into them)
//   exchange_encode  its warp encoder takes an unrotated source through a layout exchange, in
//                    a retier whose roles share one path
//   appends          an append tier's format (append_encode: cuda/append/append.cuh)
//   key_operand / value_operand   the 16-bit type of the f16 path's operands
//   long_steps_with_s8_keys (values) / long_steps_max_head_dim (keys): the tensor-core decode's
//                    tier takes 32-token steps
struct device_codec_defaults {
  static constexpr bool sign_coded = false;
  static constexpr bool stores_runs = false;
  static constexpr bool exchange_encode = false;
  static constexpr bool appends = false;
};
struct fragment_defaults {
  static constexpr operand_type key_operand = operand_type::f16;
  static constexpr operand_type value_operand = operand_type::f16;
  static constexpr bool long_steps_with_s8_keys = false;
  static constexpr int long_steps_max_head_dim = 0;
};

// Whether a slice reader unpacks straight to exact f16 / bf16 pairs (unpack_h2 / unpack_bf16x2).
// Asked of the type: a requires-expression over a kernel's locals tested false under nvcc 13.0
// although the call compiles, and the float round trip ran instead (record
// bench/results/prefill/prefill-producer-2026-12-05.json).
template <class R>
inline constexpr bool has_unpack_h2 = requires(const typename R::raw& r, int s,
                                               std::uint32_t (&h)[8]) {
  R::unpack_h2(r, s, h);
};
template <class R>
inline constexpr bool has_unpack_bf16x2 = requires(const typename R::raw& r, int s,
                                                   std::uint32_t (&h)[8]) {
  R::unpack_bf16x2(r, s, h);
};

// What a specialization must provide, checked where a kernel first uses one.
template <class C>
consteval bool check_device_codec() {
  using DC = device_codec<C>;
  static_assert(
      requires {
        { DC::rotated } -> std::convertible_to<bool>;
      },
      "device_codec<C>: missing `static constexpr bool rotated`");
  static_assert(
      requires { typename DC::slice_reader; },
      "device_codec<C>: missing `slice_reader` (the CUDA-core decode's inner loop)");
  static_assert(
      requires { typename DC::fragments; },
      "device_codec<C>: missing `fragments` (the tensor-core decode's operand builders)");
  static_assert(C::meta_bytes == 0 || C::meta_bytes == 2,
                "device_codec<C>: the per-token meta must be a bf16 scale or nothing");
  static_assert(
      requires { C::decode_work_percent; },
      "device_codec<C>: the host codec must declare `static constexpr int "
      "decode_work_percent` (its decode time per scalar against an 8-bit format's: the "
      "decode planner balances chunks by it; codec/codec.hpp)");
  return true;
}

template <class C>
inline constexpr bool rotated_format = check_device_codec<C>() && device_codec<C>::rotated;
template <class C>
using slice_reader = typename device_codec<C>::slice_reader;
template <class C>
using mma_codec = typename device_codec<C>::fragments;
// A per-token scale to read (a bf16 meta), or 1.
template <class C>
inline constexpr bool token_scaled = check_device_codec<C>() && C::meta_bytes != 0;
}  // namespace tierkv::cuda::detail
