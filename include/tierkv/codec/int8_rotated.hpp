// SPDX-License-Identifier: Apache-2.0
// INT8 of the rotated vector (int8_rotated): the seeded randomized-Hadamard rotation of the
// TQ3 codec, then symmetric 8-bit codes with one bf16 scale per vector.
//
// Why next to FP8: E4M3 keeps 3 mantissa bits, so every element carries a relative error of
// up to 2^-4 whatever the scale. After the rotation a token vector has no outlier channel
// (its coordinates are close to Gaussian), so a uniform grid over [-amax, amax] resolves it
// ~4x finer at the same 8 bits plus scale (docs/formats.md; measured on SmolLM2 in
// docs/model.md). The host attention path reads it like TQ3: the query is rotated once,
// values accumulate in the rotated domain, finalize() rotates the accumulator back.
//
// Format (docs/formats.md): z = H_un D (x 2^k), the unnormalized rotation of x scaled by the
// power of two k that puts max|x| in [1, 2); payload = head_dim int8 codes c_i =
// round(z_i / s) in [-127, 127] (two's complement bytes); meta = alpha = s 2^-k as bf16 bits,
// rounded UP so no code exceeds 127. The decoded vector is D H_un (alpha c) / d. A zero vector
// stores alpha 0 and zero codes. Inputs beyond +-2^112 are clipped there (and counted as
// saturated): decode's unnormalized inverse rotation sums head_dim terms before dividing by
// head_dim, up to 2^12 x the input limit at head_dim 512, so every decoded value stays finite.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/rotation.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// int8 codes of the rotated vector with one bf16 scale alpha (vector_codec; see the file comment).
template <int HeadDim>
struct int8_rotated_codec {
  static_assert(is_power_of_two<HeadDim> && HeadDim >= 8 && HeadDim <= 512,
                "int8_rotated: head_dim must be a power of two in [8, 512] (the Walsh-Hadamard "
                "rotation needs it); keep other head_dims in FP8");
  using meta_type = bf16_bits;  ///< alpha

  static constexpr storage_format format =
      storage_format::int8_rotated;                                   ///< the storage format tag
  static constexpr int head_dim = HeadDim;                            ///< scalars per vector
  static constexpr std::size_t payload_bytes = std::size_t(HeadDim);  ///< one int8 code per scalar
  static constexpr std::size_t meta_bytes = sizeof(meta_type);        ///< alpha
  static constexpr const char* name = "int8_rotated";                 ///< the format's name
  static constexpr int max_code = 127;                                ///< codes lie in [-127, 127]
  static constexpr float input_limit = 5.19229686e33f;                ///< 2^112
  /// Written on non-finite input: codes 0 and a NaN alpha (a slot read by mistake is loud).
  static constexpr meta_type poison_meta = bf16_quiet_nan;
  /// Codes live in the seeded rotation's domain (codec.hpp).
  static constexpr bool uses_context = true;
  /// GPU decode work per scalar against an 8-bit format (codec.hpp): one byte a scalar, as FP8.
  static constexpr int decode_work_percent = 100;
  /// The per-token scale in meta (codec.hpp: a tile unpacks under unit_meta() once a token).
  TIERKV_HD static float token_scale(const meta_type& m) { return bf16_to_float(m); }
  /// The meta of scale 1.
  TIERKV_HD static meta_type unit_meta() { return bf16_one; }

  /// Rotates x (seeded by ctx) and stores its int8 codes and alpha; non_finite_input on NaN / Inf.
  TIERKV_HD static errc encode(const float* x, std::uint8_t* payload, meta_type& meta,
                               const codec_context& ctx, encode_stats* stats) {
    float amax = 0.0f;
    std::uint64_t clipped = 0;
    if (!detail::clipped_amax(x, HeadDim, input_limit, amax, clipped)) {
      for (int j = 0; j < HeadDim; ++j) payload[j] = 0;
      meta = poison_meta;
      return errc::non_finite_input;
    }
    if (stats) stats->saturated += clipped;
    if (amax == 0.0f) {
      for (int j = 0; j < HeadDim; ++j) payload[j] = 0;
      meta = 0;
      return errc::ok;
    }
    const int k = detail::unit_exponent(amax);
    float z[HeadDim];
    for (int i = 0; i < HeadDim; ++i) {
      float v = x[i];
      v = v > input_limit ? input_limit : (v < -input_limit ? -input_limit : v);
      z[i] = detail::scale_pow2(v, k);  // exact: |z| < 2
    }
    apply_rotation_signs<HeadDim>(z, ctx.seed);
    walsh_hadamard_unnormalized<HeadDim>(z);  // |z| < 2 d: no overflow
    float zmax = 0.0f;
    for (int i = 0; i < HeadDim; ++i) {
      const float a = detail::abs_bits(z[i]);
      zmax = a > zmax ? a : zmax;
    }
    meta = alpha_for(zmax, k);
    // The step in z's units: alpha 2^k, exact (a power-of-two scaling back into range).
    const float step = detail::scale_pow2(bf16_to_float(meta), k);
    for (int i = 0; i < HeadDim; ++i) {
      const float q = z[i] / step;
      int c = int(q + (q >= 0.0f ? 0.5f : -0.5f));  // round half away from zero
      c = c > max_code ? max_code : (c < -max_code ? -max_code : c);
      payload[i] = std::uint8_t(std::int8_t(c));
    }
    return errc::ok;
  }

  /// alpha = zmax / 127 * 2^-k rounded up to bf16 (bumped until zmax / (alpha 2^k) <= 127),
  /// and at least the least positive bf16: no code exceeds 127.
  TIERKV_HD static meta_type alpha_for(float zmax, int k) {
    if (!(zmax > 0.0f)) return 0;
    bf16_bits s = float_to_bf16_up(detail::scale_pow2(zmax / float(max_code), -k));
    if (s == 0) s = 1;
    while (zmax / detail::scale_pow2(bf16_to_float(s), k) > float(max_code)) ++s;
    return s;
  }

  /// The value of one code (unscaled).
  TIERKV_HD static float code_value(std::uint8_t c) { return float(std::int8_t(c)); }

  /// The vector in the input domain (inverse rotation applied).
  TIERKV_HD static void decode(const std::uint8_t* payload, const meta_type& meta, float* out,
                               const codec_context& ctx) {
    for (int i = 0; i < HeadDim; ++i) out[i] = 0.0f;
    accumulate(1.0f, payload, meta, out);
    finalize(out, ctx);
  }

  /// q'' = H_un D q / d, so that dot(q'', codes) * alpha = q . x_hat.
  TIERKV_HD static void prepare_query(const float* q, float* out, const codec_context& ctx) {
    rotated_domain<HeadDim>::prepare_query(q, out, ctx.seed);
  }

  /// dot(prepared q, codes) x alpha = q . x_hat.
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload, const meta_type& meta) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < HeadDim; i += 4)
      for (int u = 0; u < 4; ++u) s[u] += q[i + u] * code_value(payload[i + u]);
    return ((s[0] + s[1]) + (s[2] + s[3])) * bf16_to_float(meta);
  }

  /// acc (rotated domain, unscaled) += p alpha c; finalize maps it back.
  TIERKV_HD static void accumulate(float p, const std::uint8_t* payload, const meta_type& meta,
                                   float* acc) {
    const float w = p * bf16_to_float(meta);
    for (int i = 0; i < HeadDim; ++i) acc[i] += w * code_value(payload[i]);
  }

  /// acc <- D H_un acc / d: the inverse rotation.
  TIERKV_HD static void finalize(float* acc, const codec_context& ctx) {
    rotated_domain<HeadDim>::finalize(acc, ctx.seed);
  }
};

/// Codec family: int8 codes of the rotated vector (the 8-bit tier where quality matters).
struct int8_rotated {
  template <int HeadDim>
  using bind = int8_rotated_codec<HeadDim>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): 16x lower MSE than E4M3, 5x lower inner-product rms,
  /// unbiased (gain 1.0000).
  static constexpr error_figures expected_error{4.24e-5, 0.00653, 0.0};
};

namespace formats {
/// The int8_rotated format by name (tierkv/formats.hpp registers it).
struct int8_rotated {
  static constexpr const char* name =
      "int8_rotated";  ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::int8_rotated;    ///< the codec family of its keys
  using value_family = tierkv::int8_rotated;  ///< the codec family of its values
};
}  // namespace formats

static_assert(vector_codec<int8_rotated_codec<128>>);
static_assert(codec_family<int8_rotated>);

}  // namespace tierkv
