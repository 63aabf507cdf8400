// SPDX-License-Identifier: Apache-2.0
// The codec concept: how one token vector (one layer, one KV head, one token,
// head_dim scalars) is stored, and the operations attention needs on it.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tierkv/core/config.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv {

/// Tag of a storage format; pools, index arrays and exported buffers carry it.
enum class storage_format : std::uint8_t {
  dense_f32 = 0,
  dense_bf16 = 1,
  fp8_e4m3 = 2,
  fp8_e5m2 = 3,
  tq3 = 4,
  int8_rotated = 5,
  tq4 = 6,
  tq2 = 7,  ///< 2-bit rotated codes (codec/tq2.hpp): the Cold tier
  // 128..255: formats registered outside tierkv, storage_format{N} (tierkv/formats.hpp)
};
/// The first tag of the formats registered outside tierkv (TIERKV_USER_FORMATS).
inline constexpr int user_format_tags = 128;

/// Whether a vector is a key or a value (codec contexts and error measures differ per role).
enum class kv_role : std::uint8_t { key = 0, value = 1 };

/// Per-vector parameters a codec may need that are not in the data: the seed of
/// the randomized rotation, fixed per (layer, KV head, role) so that a key and
/// the query that reads it use the same rotation.
struct codec_context {
  std::uint64_t seed = 0;  ///< rotation seed (make_codec_context)
};

/// splitmix64 finalizer: a well-mixed 64-bit hash, cheap on host and device.
TIERKV_HD constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// The context of one (layer, kv head, role) under a cache-wide seed.
TIERKV_HD constexpr codec_context make_codec_context(std::uint64_t cache_seed, int layer,
                                                     int kv_head, kv_role role) {
  const std::uint64_t key = (std::uint64_t(std::uint32_t(layer)) << 32) ^
                            (std::uint64_t(std::uint32_t(kv_head)) << 1) ^
                            std::uint64_t(role == kv_role::value);
  return {mix64(cache_seed ^ mix64(key))};
}

/// Counters an encoder fills in: values clipped to the format's range.
struct encode_stats {
  std::uint64_t saturated = 0;  ///< scalars clipped to the format's range
};

/// Placeholder meta for codecs that keep none (meta_bytes == 0).
struct no_meta {};

/// A bound codec: the format of a token vector of exactly C::head_dim scalars.
///
/// Storage is split in two parts so a page can lay them out as structure-of-arrays
/// (coalesced 16-byte loads of payloads across tokens):
///   payload: C::payload_bytes bytes (codes), alignment 8 at least;
///   meta:    one C::meta_type (scale, norm, ...), C::meta_bytes bytes (0 when none).
///
/// Attention works in the codec's own domain: a query is prepared once
/// (identity for FP8, the rotation for TQ3), scores are dot(prepared query,
/// encoded key), values accumulate p * v_hat into a float accumulator in the
/// codec's domain, and finalize() maps the accumulator back (identity, or the
/// inverse rotation) once per partial state.
template <class C>
concept vector_codec = requires(const float* x, float* y, std::uint8_t* payload,
                                const std::uint8_t* cpayload, typename C::meta_type& meta,
                                const typename C::meta_type& cmeta, const codec_context& ctx,
                                encode_stats* stats, float p) {
  requires std::is_trivially_copyable_v<typename C::meta_type>;
  { C::format } -> std::convertible_to<storage_format>;
  { C::head_dim } -> std::convertible_to<int>;
  { C::payload_bytes } -> std::convertible_to<std::size_t>;
  { C::meta_bytes } -> std::convertible_to<std::size_t>;
  { C::name } -> std::convertible_to<const char*>;
  // Returns errc::non_finite_input (and leaves outputs unspecified) when x holds NaN or Inf.
  { C::encode(x, payload, meta, ctx, stats) } -> std::same_as<errc>;
  { C::decode(cpayload, cmeta, y, ctx) } -> std::same_as<void>;
  { C::prepare_query(x, y, ctx) } -> std::same_as<void>;
  { C::dot(x, cpayload, cmeta) } -> std::same_as<float>;
  { C::accumulate(p, cpayload, cmeta, y) } -> std::same_as<void>;
  { C::finalize(y, ctx) } -> std::same_as<void>;
};

/// Optional members of a vector_codec, read through the traits below (absent = the default):
///   static constexpr bool uses_context = true     decode depends on the codec context (the
///                                                 rotation seed of its layer, KV head and role):
///                                                 a page moves only to a cache that derives the
///                                                 same context (paging/page_transfer.hpp)
///   static float token_scale(const meta_type&)    the vector is linear in a per-token scalar kept
///   static meta_type unit_meta()                  in its meta (FP8's scale, TQ's alpha): a tile
///                                                 unpacks a token once under unit_meta() and puts
///                                                 the scalar on the score and the probability
///                                                 (attention/tile.hpp); without it, every row
///                                                 decodes the token itself.
///   static constexpr int decode_work_percent      its GPU decode time per scalar in percent of
///                                                 an 8-bit format's in the present kernels (the
///                                                 decode planner balances chunks by it); a
///                                                 format the GPU reads must declare it
///                                                 (cuda/codec/device_codec.cuh checks)
template <class C>
consteval bool codec_uses_context() {
  if constexpr (requires { C::uses_context; })
    return bool(C::uses_context);
  else
    return false;
}

/// codec C's decode_work_percent (100, an 8-bit format's, when it declares none).
template <class C>
consteval int codec_decode_work_percent() {
  if constexpr (requires { C::decode_work_percent; })
    return int(C::decode_work_percent);
  else
    return 100;
}

/// Whether codec C declares a per-token scale (see above); codecs without meta have scale 1.
template <class C>
inline constexpr bool codec_token_scaled = requires(const typename C::meta_type& m) {
  { C::token_scale(m) } -> std::same_as<float>;
  { C::unit_meta() } -> std::same_as<typename C::meta_type>;
};

/// A codec family's expected error on N(0, 1) vectors (codec/error_traits.hpp measures it;
/// docs/codecs.md has the runs). A family declares them as
/// `static constexpr error_figures expected_error`.
struct error_figures {
  double rel_mse = 0;        ///< relative MSE (value role), head_dim independent
  double ip_rms_sqrt_d = 0;  ///< inner-product rms times sqrt(head_dim) (key role)
  double ip_bias = 0;        ///< mean inner-product error (key role)
};

/// A codec family (e.g. tierkv::fp8_e4m3) is a tag that binds to a head_dim:
///   typename Family::template bind<128> is a vector_codec.
template <class F>
concept codec_family = requires {
  typename F::template bind<128>;
}
&&vector_codec<typename F::template bind<128>>;

/// The vector_codec of Family bound to HeadDim.
template <class Family, int HeadDim>
using codec_for = typename Family::template bind<HeadDim>;

/// Exact storage cost of one scalar: payload plus per-vector metadata.
template <vector_codec C>
inline constexpr double bits_per_scalar = double(8 * (C::payload_bytes + C::meta_bytes)) /
                                          double(C::head_dim);

}  // namespace tierkv
