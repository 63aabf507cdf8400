// SPDX-License-Identifier: Apache-2.0
// TQ3: 3-bit TurboQuant-style token-vector codec (tq3_key, tq3_value), the grid of the
// rotated scalar codec in codec/turboquant.hpp: each sqrt(d)·y_i is quantized to the nearest
// of 8 levels for N(0, 1), and the 3-bit codes are packed as 3 words per 32 coordinates
// (docs/formats.md). The levels are the Lloyd–Max centroids moved onto an int8 grid
// (±14, ±44, ±79, ±127, times a common scale that alpha absorbs): the GPU scores TQ3 keys as
// int8 x int8 tensor-core products, a code becoming its int8 level by one byte-permute per
// four codes. Gaussian MSE 0.034564 against Lloyd–Max's 0.034548 (+0.05%, docs/codecs.md).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/turboquant.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

namespace detail {

/// The level of a code, code 0 = most negative: the int8 level L (codes 0..3: -127, -79,
/// -44, -14; 4..7 their mirror) over 64, exact in f32, f16 and bf16 (tq3_level_int / 64).
/// Selects rather than an indexed array, which device code would place in local memory.
TIERKV_HD_INLINE constexpr int tq3_level_int(int code) {
  const bool pos = (code & 4) != 0;
  const int m = pos ? (code & 3) : 3 - (code & 3);  // magnitude rank 0..3
  const int mag = m == 0 ? 14 : m == 1 ? 44 : m == 2 ? 79 : 127;
  return pos ? mag : -mag;
}
inline constexpr float tq3_level_scale = 1.0f / 64.0f;  ///< level = L / 64 (exact)
TIERKV_HD_INLINE float tq3_centroid(int code) {
  return float(tq3_level_int(code)) * tq3_level_scale;
}
/// All 8 levels, for the host loops that index them by code.
struct tq3_level_table {
  float v[8];
};
TIERKV_HD_INLINE tq3_level_table tq3_levels() {
  tq3_level_table t{};
  for (int c = 0; c < 8; ++c) t.v[c] = tq3_centroid(c);
  return t;
}

/// Byte tables of the GPU lookups (one byte-permute maps the 4 code nibbles of a selector to 4
/// table bytes): word 0 holds codes 0-3, word 1 codes 4-7. f16 and bf16 levels: bits of L/64,
/// split into low and high bytes; s8: the int8 levels themselves.
///
/// The bits of level L/64 in a binary float format of `mant_bits` fraction bits and exponent bias
/// `bias` (1 <= |L| <= 127: normal and exact in f16 and in bf16, whose 8 significant bits hold
/// |L| < 2^7).
constexpr std::uint32_t tq3_level_bits(int code, int mant_bits, int bias) {
  const int l = tq3_level_int(code), m = l < 0 ? -l : l;
  int e = 0;
  while ((2 << e) <= m) ++e;  // 2^e <= m < 2^(e+1)
  const std::uint32_t mant = std::uint32_t(m - (1 << e)) << (mant_bits - e);
  return (l < 0 ? 0x8000u : 0u) | (std::uint32_t(e - 6 + bias) << mant_bits) | mant;
}
/// f16 levels: the CUDA-core and tensor-core decodes' lookups.
constexpr std::uint32_t tq3_f16_bits(int code) { return tq3_level_bits(code, 10, 15); }
/// bf16 levels: the value tiles' lookup on the tensor-core prefill (cuda/codec/tq3.cuh).
constexpr std::uint32_t tq3_bf16_bits(int code) { return tq3_level_bits(code, 7, 127); }
template <class F>
constexpr std::uint32_t tq3_table_word(int first_code, F byte_of) {
  std::uint32_t w = 0;
  for (int i = 0; i < 4; ++i) w |= (byte_of(first_code + i) & 0xffu) << (8 * i);
  return w;
}
inline constexpr std::uint32_t tq3_f16_lo0 =
    tq3_table_word(0, [](int c) { return tq3_f16_bits(c); });
inline constexpr std::uint32_t tq3_f16_lo1 =
    tq3_table_word(4, [](int c) { return tq3_f16_bits(c); });
inline constexpr std::uint32_t tq3_f16_hi0 =
    tq3_table_word(0, [](int c) { return tq3_f16_bits(c) >> 8; });
inline constexpr std::uint32_t tq3_f16_hi1 =
    tq3_table_word(4, [](int c) { return tq3_f16_bits(c) >> 8; });
inline constexpr std::uint32_t tq3_bf16_lo0 =
    tq3_table_word(0, [](int c) { return tq3_bf16_bits(c); });
inline constexpr std::uint32_t tq3_bf16_lo1 =
    tq3_table_word(4, [](int c) { return tq3_bf16_bits(c); });
inline constexpr std::uint32_t tq3_bf16_hi0 =
    tq3_table_word(0, [](int c) { return tq3_bf16_bits(c) >> 8; });
inline constexpr std::uint32_t tq3_bf16_hi1 =
    tq3_table_word(4, [](int c) { return tq3_bf16_bits(c) >> 8; });
inline constexpr std::uint32_t tq3_s8_0 =
    tq3_table_word(0, [](int c) { return std::uint32_t(tq3_level_int(c)); });
inline constexpr std::uint32_t tq3_s8_1 =
    tq3_table_word(4, [](int c) { return std::uint32_t(tq3_level_int(c)); });
/// u8: the biased levels L + 128 (1..255), which the GPU value path widens to f16
/// (cuda/codec/tq3.cuh).
inline constexpr std::uint32_t tq3_u8_0 = tq3_s8_0 ^ 0x80808080u;
inline constexpr std::uint32_t tq3_u8_1 = tq3_s8_1 ^ 0x80808080u;
static_assert(tq3_f16_bits(0) == 0xBFF0u && tq3_f16_bits(4) == 0x3300u &&
                  tq3_f16_bits(6) == 0x3CF0u,
              "tq3: f16 level bits");
static_assert(tq3_bf16_bits(0) == 0xBFFEu && tq3_bf16_bits(4) == 0x3E60u &&
                  tq3_bf16_bits(6) == 0x3F9Eu,
              "tq3: bf16 level bits");
static_assert(tq3_s8_0 == 0xF2D4B181u && tq3_s8_1 == 0x7F4F2C0Eu, "tq3: int8 level table");
/// Nearest-level thresholds for N(0, 1): the midpoints of adjacent int8 levels (29, 61.5, 103)
/// times a = 0.0169736, the unit scale of the levels that minimizes the Gaussian MSE.
inline constexpr float tq3_threshold1 = 0.49223481f;
inline constexpr float tq3_threshold2 = 1.04387727f;
inline constexpr float tq3_threshold3 = 1.74828226f;

/// Decision bounds for z = sqrt(d)·y·|x'| (the unnormalized WHT output), i.e. the unit
/// thresholds times n = |x'|: comparing z to t·n avoids dividing every coordinate.
struct tq3_bounds {
  float b1, b2, b3;
};
TIERKV_HD_INLINE tq3_bounds tq3_make_bounds(float n) {
  return {tq3_threshold1 * n, tq3_threshold2 * n, tq3_threshold3 * n};
}
/// Nearest centroid by sign and magnitude (z = -0 counts as negative: code 3).
TIERKV_HD_INLINE int tq3_quantize(float z, const tq3_bounds& b) {
  const float a = abs_bits(z);
  const int m = int(a > b.b1) + int(a > b.b2) + int(a > b.b3);
  return (float_bits(z) >> 31) != 0u ? 3 - m : 4 + m;
}

/// Packing of one group of 32 codes into 3 words (docs/formats.md):
/// j < 24: nibble j%8 of word j/8 (bits 4n..4n+2); j >= 24: bit 4(j-24)+3 of words 0,1,2
/// hold bits 0,1,2 of the code.
TIERKV_HD_INLINE void tq3_pack_group(const std::uint8_t* codes, std::uint32_t* w) {
  w[0] = w[1] = w[2] = 0u;
  for (int j = 0; j < 24; ++j) w[j >> 3] |= std::uint32_t(codes[j] & 7u) << (4 * (j & 7));
  for (int n = 0; n < 8; ++n) {
    const std::uint32_t c = codes[24 + n];
    w[0] |= (c & 1u) << (4 * n + 3);
    w[1] |= ((c >> 1) & 1u) << (4 * n + 3);
    w[2] |= ((c >> 2) & 1u) << (4 * n + 3);
  }
}
TIERKV_HD_INLINE int tq3_unpack(const std::uint32_t* w, int j) {
  if (j < 24) return int((w[j >> 3] >> (4 * (j & 7))) & 7u);
  const int s = 4 * (j - 24) + 3;
  return int(((w[0] >> s) & 1u) | (((w[1] >> s) & 1u) << 1) | (((w[2] >> s) & 1u) << 2));
}

}  // namespace detail

/// The 8-level grid (tq_codec's Grid): Lloyd–Max centroids on an int8 grid.
struct tq3_grid {
  static constexpr storage_format format = storage_format::tq3;  ///< the storage format tag
  static constexpr int bits = 3;                                 ///< bits per code
  static constexpr int zero_code = 4;  ///< codes stored for an all-zero vector (alpha 0)
  static constexpr float plain_scale = 1.08631131f;   ///< 64 x 0.0169736: L / 64 -> unit variance
  static constexpr const char* key_name = "tq3_key";  ///< name of tq3_key
  static constexpr const char* value_name = "tq3_value";  ///< name of tq3_value
  static constexpr const char* plain_name = "tq3_plain";  ///< name of tq3_plain
  /// GPU decode work per scalar against an 8-bit page: a TQ3 page (2.6x fewer bytes) is
  /// instruction-bound and takes about 3/4 of an FP8 page's time (H200 sweep of tiered and
  /// tiered_k4 batches, 75 against 108: B = 1 -4.7%, B = 8 -1.3%, B = 32 -1.2%; docs/gpu.md).
  static constexpr int decode_work_percent = 75;
  using bounds = detail::tq3_bounds;  ///< decision thresholds for one vector

  /// The thresholds for coordinates ~ N(0, n^2).
  TIERKV_HD_INLINE static bounds make_bounds(float n) { return detail::tq3_make_bounds(n); }
  /// The code of one rotated coordinate.
  TIERKV_HD_INLINE static int quantize(float z, const bounds& b) {
    return detail::tq3_quantize(z, b);
  }
  /// The grid level of a code.
  TIERKV_HD_INLINE static float level(int code) { return detail::tq3_centroid(code); }

  /// Codes -> payload: 3 words per group of 32 (docs/formats.md).
  template <int D>
  TIERKV_HD static void pack(const std::uint8_t* codes, std::uint8_t* payload) {
    for (int g = 0; g < D / 32; ++g) {
      std::uint32_t w[3];
      detail::tq3_pack_group(codes + 32 * g, w);
      for (int t = 0; t < 3; ++t) detail::store_le32(payload + 12 * g + 4 * t, w[t]);
    }
  }
  /// Payload -> codes.
  template <int D>
  TIERKV_HD static void unpack(const std::uint8_t* payload, std::uint8_t* codes) {
    for (int g = 0; g < D / 32; ++g) {
      std::uint32_t w[3];
      for (int t = 0; t < 3; ++t) w[t] = detail::load_le32(payload + 12 * g + 4 * t);
      for (int j = 0; j < 32; ++j) codes[32 * g + j] = std::uint8_t(detail::tq3_unpack(w, j));
    }
  }

  /// Visits (coordinate i, code) of a payload group by group, 4 independent streams.
  template <int D, class F>
  TIERKV_HD_INLINE static void for_each_code(const std::uint8_t* payload, F&& f) {
    for (int g = 0; g < D / 32; ++g) {
      const std::uint8_t* p = payload + 12 * g;
      const std::uint32_t w0 = detail::load_le32(p), w1 = detail::load_le32(p + 4),
                          w2 = detail::load_le32(p + 8);
      for (int n = 0; n < 8; ++n) {
        const int sh = 4 * n;
        const std::uint32_t hi =
            ((w0 >> (sh + 3)) & 1u) | ((w1 >> (sh + 2)) & 2u) | ((w2 >> (sh + 1)) & 4u);
        f(0, 32 * g + n, (w0 >> sh) & 7u);
        f(1, 32 * g + 8 + n, (w1 >> sh) & 7u);
        f(2, 32 * g + 16 + n, (w2 >> sh) & 7u);
        f(3, 32 * g + 24 + n, hi);
      }
    }
  }
  /// sum q_i level(code_i).
  template <int D>
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const detail::tq3_level_table t = detail::tq3_levels();
    for_each_code<D>(payload,
                     [&](int stream, int i, std::uint32_t code) { s[stream] += q[i] * t.v[code]; });
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
  /// acc_i += w level(code_i).
  template <int D>
  TIERKV_HD static void accumulate(float w, const std::uint8_t* payload, float* acc) {
    const detail::tq3_level_table t = detail::tq3_levels();
    for_each_code<D>(payload, [&](int, int i, std::uint32_t code) { acc[i] += w * t.v[code]; });
  }
};

/// TQ3 at HeadDim with norm correction Norm.
template <int HeadDim, tq_norm Norm>
using tq3_codec = tq_codec<HeadDim, Norm, tq3_grid>;

/// Codec family: TQ3 keys (alpha unbiases inner products).
struct tq3_key {
  template <int HeadDim>
  using bind = tq3_codec<HeadDim, tq_norm::unbiased_inner_product>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): alpha = |x|/<u,u_hat> makes q·k_hat unbiased (gain
  /// 1.000) and halves the rms against the plain norm, at a slightly higher MSE (0.0348 vs 0.0340
  /// at d = 128).
  static constexpr error_figures expected_error{0.0348, 0.1336, 0.0};
};
/// Codec family: TQ3 values (alpha minimizes the squared error).
struct tq3_value {
  template <int HeadDim>
  using bind = tq3_codec<HeadDim, tq_norm::least_squares>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): Least-squares alpha gives the lowest MSE; inner
  /// products shrink by 0.966.
  static constexpr error_figures expected_error{0.0336, 0.302, -0.0237};
};
/// Not a tier codec: |x| uncorrected, kept to measure the corrections against.
struct tq3_plain {
  template <int HeadDim>
  using bind = tq3_codec<HeadDim, tq_norm::plain>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): The plain norm as scale (neither key nor value
  /// correction), for reference.
  static constexpr error_figures expected_error{0.0340, 0.353, -0.0234};
};

namespace formats {
/// TQ3 by name: keys unbiased (tq3_key), values least-squares (tq3_value) (tierkv/formats.hpp
/// registers it).
struct tq3 {
  static constexpr const char* name =
      "tq3";                           ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::tq3_key;  ///< the codec family of its keys
  using value_family = tierkv::tq3_value;  ///< the codec family of its values
};
}  // namespace formats

static_assert(vector_codec<tq3_codec<128, tq_norm::unbiased_inner_product>>);
static_assert(codec_family<tq3_key>);
static_assert(codec_family<tq3_value>);

}  // namespace tierkv
