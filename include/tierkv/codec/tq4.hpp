// SPDX-License-Identifier: Apache-2.0
// TQ4: 4-bit TurboQuant-style token-vector codec (tq4_key, tq4_value), a grid of the rotated
// scalar codec in codec/turboquant.hpp. Made for Stale keys: key error moves attention
// routing, and TQ3 keys lose multi-needle retrievals SmolLM2 gets right (docs/model.md).
//
// Grid: 16 uniform levels (c - 7.5)·Δ in units of the coordinate's standard deviation, with
// Δ = 0.3352 the minimum-MSE uniform step for N(0, 1) at 16 levels (Max 1960). Codes
// c = clamp(floor(z / (Δ n)) + 8, 0, 15) with n = |x'| (z ~ N(0, n^2)): the nearest level,
// clipped beyond ±2.68 standard deviations. Uniform rather than the 16-level Lloyd–Max
// codebook: the decode kernel turns two codes into a half2 with one lop3 (1024 + c, the
// constant folded into a per-query term) instead of a table lookup and a sign fix, for
// ~10% more inner-product error (float64 simulation, docs/codecs.md).
//
// Packing (docs/formats.md): nibbles, little-endian: byte b holds coordinate 2b in bits 0-3
// and 2b+1 in bits 4-7, so 32-bit word w holds coordinates 8w..8w+7 in nibbles 0..7.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/turboquant.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// The 16-level grid (tq_codec's Grid): uniform levels in units of the vector's norm.
struct tq4_grid {
  static constexpr storage_format format = storage_format::tq4;  ///< the storage format tag
  static constexpr int bits = 4;                                 ///< bits per code
  static constexpr int zero_code = 8;         ///< codes stored for an all-zero vector (alpha 0)
  static constexpr float plain_scale = 1.0f;  ///< tq4_plain keeps |x| as it was measured
  static constexpr const char* key_name = "tq4_key";      ///< name of tq4_key
  static constexpr const char* value_name = "tq4_value";  ///< name of tq4_value
  static constexpr const char* plain_name = "tq4_plain";  ///< name of the uncorrected variant
  static constexpr float step = 0.3352f;                  ///< Δ in standard deviations
  static constexpr float offset = 7.5f;  ///< level of code c is c - offset (times alpha)
  static constexpr int max_code = 15;    ///< codes lie in [0, 15]
  /// GPU decode work per scalar against an 8-bit page: as one (never measured apart).
  static constexpr int decode_work_percent = 100;
  /// Decision data for one vector.
  struct bounds {
    float step;  ///< Δ·n in z's units
  };

  /// The step for coordinates ~ N(0, n^2).
  TIERKV_HD_INLINE static bounds make_bounds(float n) { return {step * n}; }
  /// The code of one rotated coordinate (clamped to [0, 15]).
  TIERKV_HD_INLINE static int quantize(float z, const bounds& b) {
    const int c = int(floorf(z / b.step)) + 8;  // |z / step| < 2d / 0.3352: no int overflow
    return c < 0 ? 0 : (c > max_code ? max_code : c);
  }
  /// The grid level of a code: code - offset.
  TIERKV_HD_INLINE static float level(int code) { return float(code) - offset; }  // exact

  /// Codes -> payload: two codes per byte, low nibble first.
  template <int D>
  TIERKV_HD static void pack(const std::uint8_t* codes, std::uint8_t* payload) {
    for (int b = 0; b < D / 2; ++b)
      payload[b] = std::uint8_t((codes[2 * b] & 15u) | ((codes[2 * b + 1] & 15u) << 4));
  }
  /// Payload -> codes.
  template <int D>
  TIERKV_HD static void unpack(const std::uint8_t* payload, std::uint8_t* codes) {
    for (int b = 0; b < D / 2; ++b) {
      codes[2 * b] = std::uint8_t(payload[b] & 15u);
      codes[2 * b + 1] = std::uint8_t(payload[b] >> 4);
    }
  }
  /// sum q_i level(code_i).
  template <int D>
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int b = 0; b < D / 2; b += 2)
      for (int u = 0; u < 2; ++u) {
        const std::uint8_t v = payload[b + u];
        s[2 * u] += q[2 * (b + u)] * level(v & 15);
        s[2 * u + 1] += q[2 * (b + u) + 1] * level(v >> 4);
      }
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
  /// acc_i += w level(code_i).
  template <int D>
  TIERKV_HD static void accumulate(float w, const std::uint8_t* payload, float* acc) {
    for (int b = 0; b < D / 2; ++b) {
      acc[2 * b] += w * level(payload[b] & 15);
      acc[2 * b + 1] += w * level(payload[b] >> 4);
    }
  }
};

/// TQ4 at HeadDim with norm correction Norm.
template <int HeadDim, tq_norm Norm>
using tq4_codec = tq_codec<HeadDim, Norm, tq4_grid>;

/// Codec family: TQ4 keys (alpha unbiases inner products; Stale keys where routing matters).
struct tq4_key {
  template <int HeadDim>
  using bind = tq4_codec<HeadDim, tq_norm::unbiased_inner_product>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): 1.75x lower key inner-product rms than TQ3 (3.1x
  /// lower variance), MSE 0.011 (d = 128, 20000 vectors; docs/codecs.md).
  static constexpr error_figures expected_error{0.01124, 0.0760, 0.0};
};
/// Codec family: TQ4 values (alpha minimizes the squared error).
struct tq4_value {
  template <int HeadDim>
  using bind = tq4_codec<HeadDim, tq_norm::least_squares>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): Least-squares alpha, the lowest MSE; inner products
  /// shrink slightly.
  static constexpr error_figures expected_error{0.01111, 0.1196, -0.0079};
};

namespace formats {
/// TQ4 by name: keys unbiased (tq4_key), values least-squares (tq4_value) (tierkv/formats.hpp
/// registers it).
struct tq4 {
  static constexpr const char* name =
      "tq4";                           ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::tq4_key;  ///< the codec family of its keys
  using value_family = tierkv::tq4_value;  ///< the codec family of its values
};
}  // namespace formats

static_assert(vector_codec<tq4_codec<128, tq_norm::unbiased_inner_product>>);
static_assert(codec_family<tq4_key>);
static_assert(codec_family<tq4_value>);

}  // namespace tierkv
