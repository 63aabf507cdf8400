// SPDX-License-Identifier: Apache-2.0
// FP8 token-vector codecs (E4M3 and E5M2) with one bf16 scale per vector.
//
// Format (docs/formats.md): payload = head_dim FP8 codes of x[i] / scale; meta = the
// scale as bf16 bits. The scale is amax / fmt_max rounded UP to bf16 (and bumped until
// amax / scale <= fmt_max), so the vector's maximum never saturates and decode uses
// exactly the divisor the encoder used. A zero vector stores scale 0 and zero codes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/fp8_convert.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// FP8 (E4M3 or E5M2) codes of x / scale with one bf16 scale per vector (vector_codec).
template <int HeadDim, fp8_kind Kind>
struct fp8_codec {
  static_assert(HeadDim >= 1 && HeadDim <= 4096, "fp8_codec: head_dim must lie in [1, 4096]");
  using format_t = fp8_format<Kind>;  ///< the FP8 format's constants
  using meta_type = bf16_bits;        ///< the scale

  /// the storage format tag
  static constexpr storage_format format =
      Kind == fp8_kind::e4m3 ? storage_format::fp8_e4m3 : storage_format::fp8_e5m2;
  static constexpr int head_dim = HeadDim;                            ///< scalars per vector
  static constexpr std::size_t payload_bytes = std::size_t(HeadDim);  ///< one code per scalar
  static constexpr std::size_t meta_bytes = sizeof(meta_type);        ///< the bf16 scale
  /// the format's name
  static constexpr const char* name = Kind == fp8_kind::e4m3 ? "fp8_e4m3" : "fp8_e5m2";

  /// Inputs beyond +-2^127 are clipped there (and counted as saturated): it keeps
  /// fmt_max * scale, and so every decoded value, finite.
  static constexpr float input_limit = 1.70141183e38f;  ///< 2^127
  /// Written on non-finite input: codes 0 and a NaN scale, so a slot that is read by
  /// mistake yields NaN (loud) rather than a plausible vector.
  static constexpr meta_type poison_meta = bf16_quiet_nan;
  /// GPU decode work per scalar against an 8-bit format (codec.hpp): one byte a scalar, the
  /// reference.
  static constexpr int decode_work_percent = 100;
  /// The per-token scale in meta (codec.hpp: a tile unpacks under unit_meta() once a token).
  TIERKV_HD static float token_scale(const meta_type& m) { return bf16_to_float(m); }
  /// The meta of scale 1.
  TIERKV_HD static meta_type unit_meta() { return bf16_one; }

  /// The scale encode() stores for a vector whose largest clipped magnitude is amax.
  TIERKV_HD static meta_type scale_for(float amax) {
    if (!(amax > 0.0f)) return 0;
    bf16_bits s = float_to_bf16_up(amax / format_t::max_value);
    if (s == 0) s = 1;  // amax / fmt_max underflowed: the least positive bf16
    while (amax / bf16_to_float(s) > format_t::max_value) ++s;
    return s;
  }

  /// Codes of x with the scale scale_for(max |x|); non_finite_input (poisoned slot) on NaN / Inf.
  TIERKV_HD static errc encode(const float* x, std::uint8_t* payload, meta_type& meta,
                               const codec_context&, encode_stats* stats) {
    float amax = 0.0f;
    std::uint64_t clipped = 0;
    if (!detail::clipped_amax(x, HeadDim, input_limit, amax, clipped)) {
      for (int j = 0; j < HeadDim; ++j) payload[j] = 0;
      meta = poison_meta;
      return errc::non_finite_input;
    }
    meta = scale_for(amax);
    if (meta == 0) {
      for (int j = 0; j < HeadDim; ++j) payload[j] = 0;
    } else {
      encode_with_scale(x, meta, payload, nullptr);
    }
    if (stats) stats->saturated += clipped;
    return errc::ok;
  }

  /// Codes of x / scale with a caller-chosen scale (e.g. a shared or unit scale):
  /// values beyond the format's range saturate to +-max and are counted. x must be
  /// finite (encode() checks; here non-finite values saturate / become NaN codes).
  TIERKV_HD static void encode_with_scale(const float* x, meta_type scale, std::uint8_t* payload,
                                          encode_stats* stats) {
    const float s = bf16_to_float(scale);
    std::uint64_t sat = 0;
    for (int i = 0; i < HeadDim; ++i) {
      float v = x[i];
      if (v > input_limit) v = input_limit;
      if (v < -input_limit) v = -input_limit;
      const float q = v / s;
      if (detail::abs_bits(q) > format_t::max_value) ++sat;
      payload[i] = float_to_fp8<Kind>(q);
    }
    if (stats) stats->saturated += sat;
  }

  /// The value of one FP8 code (unscaled).
  TIERKV_HD static float code_value(std::uint8_t c) {
#if TIERKV_DEVICE_PASS
    return fp8_to_float<Kind>(c);
#else
    return fp8_table<Kind>.value[c];
#endif
  }

  /// out = codes x scale.
  TIERKV_HD static void decode(const std::uint8_t* payload, const meta_type& meta, float* out,
                               const codec_context&) {
    const float s = bf16_to_float(meta);
    for (int i = 0; i < HeadDim; ++i) out[i] = code_value(payload[i]) * s;
  }
  /// The identity: FP8 keys are read in the input domain.
  TIERKV_HD static void prepare_query(const float* q, float* out, const codec_context&) {
    for (int i = 0; i < HeadDim; ++i) out[i] = q[i];
  }
  /// q . decode(payload).
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload, const meta_type& meta) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0;
    for (; i + 4 <= HeadDim; i += 4)
      for (int u = 0; u < 4; ++u) s[u] += q[i + u] * code_value(payload[i + u]);
    if constexpr (HeadDim % 4 != 0)
      for (; i < HeadDim; ++i) s[0] += q[i] * code_value(payload[i]);
    return ((s[0] + s[1]) + (s[2] + s[3])) * bf16_to_float(meta);
  }
  /// acc += p x decode(payload).
  TIERKV_HD static void accumulate(float p, const std::uint8_t* payload, const meta_type& meta,
                                   float* acc) {
    const float w = p * bf16_to_float(meta);
    for (int i = 0; i < HeadDim; ++i) acc[i] += w * code_value(payload[i]);
  }
  /// Nothing to undo.
  TIERKV_HD static void finalize(float*, const codec_context&) {}
};

/// Codec family: FP8 E4M3 with a bf16 scale per vector (the default 8-bit tier).
struct fp8_e4m3 {
  template <int HeadDim>
  using bind = fp8_codec<HeadDim, fp8_kind::e4m3>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): FP8 E4M3 per scalar (docs/codecs.md).
  static constexpr error_figures expected_error{0.00066, 0.0343, -0.00026};
};
/// Codec family: FP8 E5M2 with a bf16 scale per vector.
struct fp8_e5m2 {
  template <int HeadDim>
  using bind = fp8_codec<HeadDim, fp8_kind::e5m2>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): FP8 E5M2 per scalar: fewer mantissa bits, about 4x
  /// the E4M3 MSE.
  static constexpr error_figures expected_error{0.00263, 0.0705, -0.0014};
};

namespace formats {
/// The FP8 E4M3 format by name (tierkv/formats.hpp registers it).
struct fp8 {
  static constexpr const char* name =
      "fp8";                              ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::fp8_e4m3;    ///< the codec family of its keys
  using value_family = tierkv::fp8_e4m3;  ///< the codec family of its values
};
/// The FP8 E5M2 format by name (tierkv/formats.hpp registers it).
struct fp8_e5m2 {
  static constexpr const char* name =
      "fp8_e5m2";                         ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::fp8_e5m2;    ///< the codec family of its keys
  using value_family = tierkv::fp8_e5m2;  ///< the codec family of its values
};
}  // namespace formats

static_assert(vector_codec<fp8_codec<128, fp8_kind::e4m3>>);
static_assert(codec_family<fp8_e4m3>);
static_assert(codec_family<fp8_e5m2>);

}  // namespace tierkv
