// SPDX-License-Identifier: Apache-2.0
// TQ2: 2-bit TurboQuant-style token-vector codec (tq2_key, tq2_value), a grid of the rotated
// scalar codec in codec/turboquant.hpp. Made for the Cold tier (issue 52): pages that receive
// little attention mass, where a value's error is scaled down by the little probability it gets
// (values), or where routing precision matters least (keys, measured before use: docs/tiering.md).
//
// Grid: 4 uniform levels (c - 1.5)·Δ in units of the coordinate's standard deviation, with
// Δ = 0.9957 the minimum-MSE uniform step for N(0, 1) at 4 levels (Max 1960; recomputed in
// float64 from the Gaussian partial moments, a golden-section search giving Δ = 0.995687 and MSE
// 0.118846). Codes c = clamp(floor(z / (Δ n)) + 2, 0, 3) with n = |x'| (z ~ N(0, n^2)): the
// nearest level, clipped beyond ±Δ standard deviations. Uniform rather than the 4-level
// Lloyd–Max codebook (±0.4528, ±1.5104; MSE 0.117482): 1.2% more MSE, and the decode turns a code
// into a number by bit tricks (a half 1024 + c from one lop3, the offset 1.5 folded into a
// per-query term) or feeds integer tensor-core products directly (docs/codecs.md).
//
// Packing (docs/formats.md): little-endian 32-bit word w holds coordinates 16w..16w+15, coordinate
// 16w + i in bits 8 (i % 4) + 2 (i / 4): byte j of the word holds coordinates 16w + j + 4f in its
// bit pairs f = 0..3. One shift and one mask then give four codes of consecutive coordinates, one
// per byte (`(w >> 2f) & 0x03030303`: coordinates 16w + 4f .. 16w + 4f + 3), the A register of a
// uint8 x int8 tensor-core product, or eight byte-permute selectors (cuda/codec/tq2.cuh).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/turboquant.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// The 4-level grid (tq_codec's Grid): uniform levels in units of the vector's norm.
struct tq2_grid {
  static constexpr storage_format format = storage_format::tq2;  ///< the storage format tag
  static constexpr int bits = 2;                                 ///< bits per code
  static constexpr int zero_code = 2;     ///< codes stored for an all-zero vector (alpha 0)
  static constexpr float step = 0.9957f;  ///< Δ in standard deviations
  /// Level x plain_scale is in standard deviations (tq2_plain's alpha = |x| x Δ).
  static constexpr float plain_scale = step;
  static constexpr const char* key_name = "tq2_key";      ///< name of tq2_key
  static constexpr const char* value_name = "tq2_value";  ///< name of tq2_value
  static constexpr const char* plain_name = "tq2_plain";  ///< name of the uncorrected variant
  static constexpr float offset = 1.5f;  ///< level of code c is c - offset (times alpha)
  static constexpr int max_code = 3;     ///< codes lie in [0, 3]
  /// GPU decode work per scalar against an 8-bit page: as one (not measured apart yet).
  static constexpr int decode_work_percent = 100;
  /// Decision data for one vector.
  struct bounds {
    float step;  ///< Δ·n in z's units
  };

  /// The step for coordinates ~ N(0, n^2).
  TIERKV_HD_INLINE static bounds make_bounds(float n) { return {step * n}; }
  /// The code of one rotated coordinate (clamped to [0, 3]).
  TIERKV_HD_INLINE static int quantize(float z, const bounds& b) {
    // |z| <= sqrt(d)·n and b.step = 0.9957·n with n >= 1: |z / step| < 24, no int overflow
    const int c = int(floorf(z / b.step)) + 2;
    return c < 0 ? 0 : (c > max_code ? max_code : c);
  }
  /// The grid level of a code: code - offset.
  TIERKV_HD_INLINE static float level(int code) { return float(code) - offset; }  // exact

  /// The bit of coordinate i within its 32-bit word (i < 16): byte i % 4, bit pair i / 4.
  TIERKV_HD_INLINE static constexpr int code_shift(int i) { return 8 * (i % 4) + 2 * (i / 4); }

  /// Codes -> payload (see the file comment).
  template <int D>
  TIERKV_HD static void pack(const std::uint8_t* codes, std::uint8_t* payload) {
    for (int w = 0; w < D / 16; ++w) {
      std::uint32_t word = 0;
      for (int i = 0; i < 16; ++i) word |= std::uint32_t(codes[16 * w + i] & 3u) << code_shift(i);
      detail::store_le32(payload + 4 * w, word);
    }
  }
  /// Payload -> codes.
  template <int D>
  TIERKV_HD static void unpack(const std::uint8_t* payload, std::uint8_t* codes) {
    for (int w = 0; w < D / 16; ++w) {
      const std::uint32_t word = detail::load_le32(payload + 4 * w);
      for (int i = 0; i < 16; ++i) codes[16 * w + i] = std::uint8_t((word >> code_shift(i)) & 3u);
    }
  }
  /// sum q_i level(code_i), four independent partial sums (one per byte of a word).
  template <int D>
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int w = 0; w < D / 16; ++w) {
      const std::uint32_t word = detail::load_le32(payload + 4 * w);
      for (int i = 0; i < 16; ++i)
        s[i % 4] += q[16 * w + i] * level(int((word >> code_shift(i)) & 3u));
    }
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
  /// acc_i += w level(code_i).
  template <int D>
  TIERKV_HD static void accumulate(float w, const std::uint8_t* payload, float* acc) {
    for (int k = 0; k < D / 16; ++k) {
      const std::uint32_t word = detail::load_le32(payload + 4 * k);
      for (int i = 0; i < 16; ++i) acc[16 * k + i] += w * level(int((word >> code_shift(i)) & 3u));
    }
  }
};

/// TQ2 at HeadDim with norm correction Norm.
template <int HeadDim, tq_norm Norm>
using tq2_codec = tq_codec<HeadDim, Norm, tq2_grid>;

/// Codec family: TQ2 keys (alpha unbiases inner products).
struct tq2_key {
  template <int HeadDim>
  using bind = tq2_codec<HeadDim, tq_norm::unbiased_inner_product>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): unbiased, 1.95x TQ3's key inner-product rms (3.8x
  /// the variance), MSE 0.132 (d = 128, 20000 vectors; docs/codecs.md).
  static constexpr error_figures expected_error{0.1324, 0.2589, 0.0};
};
/// Codec family: TQ2 values (alpha minimizes the squared error; the Cold tier's values).
struct tq2_value {
  template <int HeadDim>
  using bind = tq2_codec<HeadDim, tq_norm::least_squares>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): least-squares alpha, MSE 0.117 (the 4-level uniform
  /// optimum for N(0,1) is 0.1188 per coordinate); inner products shrink by 0.88.
  static constexpr error_figures expected_error{0.1166, 0.970, -0.0824};
};

namespace formats {
/// TQ2 by name (tierkv/formats.hpp registers it): keys and values both with the unbiased alpha
/// (tq2_key). As a value codec it beat the least-squares tq2_value in the model, whose alpha
/// shrinks every value read by 0.88 (docs/codecs.md, TQ2; bench/results/cold/cold-2026-12-06.json:
/// licence 4K, stale_k3v2u +2.58% against stale_k3v2 +3.32% at 2.87 bits).
struct tq2 {
  static constexpr const char* name =
      "tq2";                             ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::tq2_key;    ///< the codec family of its keys
  using value_family = tierkv::tq2_key;  ///< the codec family of its values (unbiased, above)
};
}  // namespace formats

static_assert(vector_codec<tq2_codec<128, tq_norm::unbiased_inner_product>>);
static_assert(codec_family<tq2_key>);
static_assert(codec_family<tq2_value>);

}  // namespace tierkv
