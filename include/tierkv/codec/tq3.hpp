// SPDX-License-Identifier: Apache-2.0
// TQ3: 3-bit TurboQuant-style token-vector codec (tq3_key, tq3_value).
//
// Encode (docs/formats.md, docs/codecs.md): y = H·D·x / |x| with the seeded randomized
// Walsh–Hadamard rotation (codec/rotation.hpp); each sqrt(d)·y_i is quantized to the
// nearest of the 8 unit-variance Lloyd–Max centroids of N(0, 1); the 3-bit codes are
// packed as 3 words per 32 coordinates; meta = a corrected norm alpha as bf16 bits.
// The decoded vector is D·H·(alpha · c / sqrt(d)) with c the centroids of the codes.
//
// The two families differ only in alpha (same bytes, same kernels):
//   tq3_key:   alpha = |x| / <u, u_hat>    inner products q·k_hat unbiased (keys);
//   tq3_value: alpha = <x, u_hat> / |u_hat|^2   least-squares, minimum MSE (values).
// (u = x/|x|, u_hat = decoded unit-norm estimate.) Measured in docs/codecs.md.
//
// Host/device bit-exactness: encode uses only exact operations (sign flips, powers of
// two, WHT additions), correctly rounded * / sqrt, explicit fmaf, and sums in the
// "canonical warp order" (lane l of 32 owns coordinates [l*d/32, (l+1)*d/32), adds its
// terms in ascending order with fmaf, then a xor-butterfly over offsets 16, 8, 4, 2, 1),
// which the CUDA warp kernel (cuda/codec_kernels.cuh) reproduces exactly. No a*b+c is
// left for a compiler to contract.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/rotation.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

// How the stored norm alpha is corrected (see the header comment).
enum class tq3_norm : std::uint8_t {
  unbiased_inner_product,  // tq3_key
  least_squares,           // tq3_value
  plain,                   // |x| itself: only for measuring the other two against
};

namespace detail {

inline constexpr int tq3_lanes = 32;  // the canonical warp

// Unit-variance Lloyd–Max centroids of N(0,1), code 0 = most negative.
// Centroid of a code: codes 0..3 are -2.1519, -1.3439, -0.7560, -0.2451 and 4..7 their
// mirror. Selects rather than an indexed array, which device code would place in local memory.
TIERKV_HD_INLINE float tq3_centroid(int code) {
  const bool pos = (code & 4) != 0;
  const int m = pos ? (code & 3) : 3 - (code & 3);  // magnitude rank 0..3
  const float mag = m == 0 ? 0.2451f : m == 1 ? 0.7560f : m == 2 ? 1.3439f : 2.1519f;
  return pos ? mag : -mag;
}
inline constexpr float tq3_threshold1 = 0.5005f;
inline constexpr float tq3_threshold2 = 1.0500f;
inline constexpr float tq3_threshold3 = 1.7479f;

// Decision bounds for z = sqrt(d)·y·|x'| (the unnormalized WHT output), i.e. the unit
// thresholds times n = |x'|: comparing z to t·n avoids dividing every coordinate.
struct tq3_bounds {
  float b1, b2, b3;
};
TIERKV_HD_INLINE tq3_bounds tq3_make_bounds(float n) {
  return {tq3_threshold1 * n, tq3_threshold2 * n, tq3_threshold3 * n};
}
// Nearest centroid by sign and magnitude (z = -0 counts as negative: code 3).
TIERKV_HD_INLINE int tq3_quantize(float z, const tq3_bounds& b) {
  const float a = abs_bits(z);
  const int m = int(a > b.b1) + int(a > b.b2) + int(a > b.b3);
  return (float_bits(z) >> 31) != 0u ? 3 - m : 4 + m;
}

// Largest stored alpha (2^112, exact in bf16): decoding multiplies alpha by centroids up
// to 2.15 and the WHT sums up to 512 terms, so every intermediate stays below FLT_MAX.
// Vectors with a larger norm (> 5.2e33) are clipped there and counted as saturated.
inline constexpr float tq3_alpha_limit = 5.19229686e33f;  // 2^112

// The stored alpha from the canonical sums over the scaled vector x' = x·2^k:
// sumsq = |x'|^2, s_zc = sum z_i c_i, s_cc = sum c_i^2 (z = H_un D x', c = centroids).
// With u_hat = D H c / d:  <u, u_hat> = s_zc / (|x'| d),  |u_hat|^2 = s_cc / d.
TIERKV_HD_INLINE bf16_bits tq3_alpha(tq3_norm mode, int d, float sumsq, float s_zc, float s_cc,
                                     int k, bool* saturated) {
  float a;
  if (mode == tq3_norm::unbiased_inner_product) {
    const float t = sumsq * float(d);  // exact: d is a power of two
    a = t / s_zc;
  } else if (mode == tq3_norm::least_squares) {
    a = s_zc / s_cc;
  } else {
    a = sqrtf(sumsq);
  }
  a = scale_pow2(a, -k);
  if (!(a <= tq3_alpha_limit)) {  // also catches an overflow to +Inf
    a = tq3_alpha_limit;
    if (saturated) *saturated = true;
  }
  return float_to_bf16(a);
}

// Packing of one group of 32 codes into 3 words (docs/formats.md):
// j < 24: nibble j%8 of word j/8 (bits 4n..4n+2); j >= 24: bit 4(j-24)+3 of words 0,1,2
// hold bits 0,1,2 of the code.
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
TIERKV_HD_INLINE std::uint32_t load_le32(const std::uint8_t* p) {
  return std::uint32_t(p[0]) | (std::uint32_t(p[1]) << 8) | (std::uint32_t(p[2]) << 16) |
         (std::uint32_t(p[3]) << 24);
}
TIERKV_HD_INLINE void store_le32(std::uint8_t* p, std::uint32_t w) {
  p[0] = std::uint8_t(w);
  p[1] = std::uint8_t(w >> 8);
  p[2] = std::uint8_t(w >> 16);
  p[3] = std::uint8_t(w >> 24);
}

// sum_i a_i b_i in the canonical warp order (see the header comment).
template <int N>
TIERKV_HD float canonical_dot(const float* a, const float* b) {
  constexpr int per = N / tq3_lanes;
  float part[tq3_lanes];
  for (int l = 0; l < tq3_lanes; ++l) {
    float s = 0.0f;
    for (int r = 0; r < per; ++r) s = fmaf(a[l * per + r], b[l * per + r], s);
    part[l] = s;
  }
  for (int o = tq3_lanes / 2; o >= 1; o >>= 1) {
    float next[tq3_lanes];
    for (int l = 0; l < tq3_lanes; ++l) next[l] = part[l] + part[l ^ o];
    for (int l = 0; l < tq3_lanes; ++l) part[l] = next[l];
  }
  return part[0];
}

}  // namespace detail

template <int HeadDim, tq3_norm Norm>
struct tq3_codec {
  static_assert(is_power_of_two<HeadDim> && HeadDim >= 32 && HeadDim <= 512,
                "tq3: head_dim must be a power of two in [32, 512] (the Walsh–Hadamard rotation "
                "and the 32-coordinate packing need it); head_dim 80, 96, 112 and 192 are not "
                "supported by TQ3 - keep such layers in FP8");
  using meta_type = bf16_bits;  // alpha, the corrected norm

  static constexpr storage_format format = storage_format::tq3;
  static constexpr tq3_norm norm = Norm;
  static constexpr int head_dim = HeadDim;
  static constexpr int groups = HeadDim / 32;
  static constexpr std::size_t payload_bytes = std::size_t(groups) * 12;  // 3*d/8
  static constexpr std::size_t meta_bytes = sizeof(meta_type);
  static constexpr const char* name = Norm == tq3_norm::unbiased_inner_product ? "tq3_key"
                                      : Norm == tq3_norm::least_squares       ? "tq3_value"
                                                                              : "tq3_plain";
  // Written on non-finite input: codes 0 and a NaN alpha, so a slot read by mistake
  // yields NaN (loud) rather than a plausible vector.
  static constexpr meta_type poison_meta = bf16_quiet_nan;
  static constexpr int zero_code = 4;  // codes stored for an all-zero vector (alpha 0)

  TIERKV_HD static errc encode(const float* x, std::uint8_t* payload, meta_type& meta,
                               const codec_context& ctx, encode_stats* stats) {
    float amax = 0.0f;
    for (int i = 0; i < HeadDim; ++i) {
      if (!detail::is_finite_bits(x[i])) {
        for (std::size_t j = 0; j < payload_bytes; ++j) payload[j] = 0;
        meta = poison_meta;
        return errc::non_finite_input;
      }
      const float a = detail::abs_bits(x[i]);
      amax = a > amax ? a : amax;
    }
    std::uint8_t codes[HeadDim];
    if (amax == 0.0f) {
      for (int i = 0; i < HeadDim; ++i) codes[i] = zero_code;
      pack(codes, payload);
      meta = 0;
      return errc::ok;
    }
    // x' = x·2^k with max|x'| in [1, 2): |x'|^2 neither overflows nor underflows.
    const int k = detail::unit_exponent(amax);
    float z[HeadDim];
    for (int i = 0; i < HeadDim; ++i) z[i] = detail::scale_pow2(x[i], k);
    const float sumsq = detail::canonical_dot<HeadDim>(z, z);
    apply_rotation_signs<HeadDim>(z, ctx.seed);
    walsh_hadamard_unnormalized<HeadDim>(z);
    const detail::tq3_bounds bounds = detail::tq3_make_bounds(sqrtf(sumsq));
    float c[HeadDim];
    for (int i = 0; i < HeadDim; ++i) {
      const int code = detail::tq3_quantize(z[i], bounds);
      codes[i] = std::uint8_t(code);
      c[i] = detail::tq3_centroid(code);
    }
    const float s_zc = detail::canonical_dot<HeadDim>(z, c);
    const float s_cc = detail::canonical_dot<HeadDim>(c, c);
    bool saturated = false;
    meta = detail::tq3_alpha(Norm, HeadDim, sumsq, s_zc, s_cc, k, &saturated);
    if (saturated && stats) ++stats->saturated;
    pack(codes, payload);
    return errc::ok;
  }

  TIERKV_HD static void pack(const std::uint8_t* codes, std::uint8_t* payload) {
    for (int g = 0; g < groups; ++g) {
      std::uint32_t w[3];
      detail::tq3_pack_group(codes + 32 * g, w);
      for (int t = 0; t < 3; ++t) detail::store_le32(payload + 12 * g + 4 * t, w[t]);
    }
  }
  TIERKV_HD static void unpack(const std::uint8_t* payload, std::uint8_t* codes) {
    for (int g = 0; g < groups; ++g) {
      std::uint32_t w[3];
      for (int t = 0; t < 3; ++t) w[t] = detail::load_le32(payload + 12 * g + 4 * t);
      for (int j = 0; j < 32; ++j) codes[32 * g + j] = std::uint8_t(detail::tq3_unpack(w, j));
    }
  }

  TIERKV_HD static void decode(const std::uint8_t* payload, const meta_type& meta, float* out,
                               const codec_context& ctx) {
    for (int i = 0; i < HeadDim; ++i) out[i] = 0.0f;
    accumulate(1.0f, payload, meta, out);
    finalize(out, ctx);
  }

  // q'' = H_un D q / d, so that dot(q'', k) = alpha · sum q''_i c_i = q · k_hat.
  TIERKV_HD static void prepare_query(const float* q, float* out, const codec_context& ctx) {
    rotated_domain<HeadDim>::prepare_query(q, out, ctx.seed);
  }

  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload, const meta_type& meta) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    const float t[8] = {-2.1519f, -1.3439f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3439f, 2.1519f};
    for (int g = 0; g < groups; ++g) {
      const std::uint8_t* p = payload + 12 * g;
      const std::uint32_t w0 = detail::load_le32(p), w1 = detail::load_le32(p + 4),
                          w2 = detail::load_le32(p + 8);
      const float* qg = q + 32 * g;
      for (int n = 0; n < 8; ++n) {
        const int sh = 4 * n;
        s0 += qg[n] * t[(w0 >> sh) & 7u];
        s1 += qg[8 + n] * t[(w1 >> sh) & 7u];
        s2 += qg[16 + n] * t[(w2 >> sh) & 7u];
        const std::uint32_t hi =
            ((w0 >> (sh + 3)) & 1u) | ((w1 >> (sh + 2)) & 2u) | ((w2 >> (sh + 1)) & 4u);
        s3 += qg[24 + n] * t[hi];
      }
    }
    return ((s0 + s1) + (s2 + s3)) * bf16_to_float(meta);
  }

  // acc (rotated domain, unscaled) += p · alpha · c; finalize maps it back.
  TIERKV_HD static void accumulate(float p, const std::uint8_t* payload, const meta_type& meta,
                                   float* acc) {
    const float w = p * bf16_to_float(meta);
    const float t[8] = {-2.1519f, -1.3439f, -0.7560f, -0.2451f, 0.2451f, 0.7560f, 1.3439f, 2.1519f};
    for (int g = 0; g < groups; ++g) {
      const std::uint8_t* p8 = payload + 12 * g;
      const std::uint32_t w0 = detail::load_le32(p8), w1 = detail::load_le32(p8 + 4),
                          w2 = detail::load_le32(p8 + 8);
      float* ag = acc + 32 * g;
      for (int n = 0; n < 8; ++n) {
        const int sh = 4 * n;
        ag[n] += w * t[(w0 >> sh) & 7u];
        ag[8 + n] += w * t[(w1 >> sh) & 7u];
        ag[16 + n] += w * t[(w2 >> sh) & 7u];
        const std::uint32_t hi =
            ((w0 >> (sh + 3)) & 1u) | ((w1 >> (sh + 2)) & 2u) | ((w2 >> (sh + 1)) & 4u);
        ag[24 + n] += w * t[hi];
      }
    }
  }

  // acc <- D H_un acc / d: the inverse rotation (linear, so it commutes with merges of
  // partial states of this codec and seed).
  TIERKV_HD static void finalize(float* acc, const codec_context& ctx) {
    rotated_domain<HeadDim>::finalize(acc, ctx.seed);
  }
};

struct tq3_key {
  template <int HeadDim> using bind = tq3_codec<HeadDim, tq3_norm::unbiased_inner_product>;
};
struct tq3_value {
  template <int HeadDim> using bind = tq3_codec<HeadDim, tq3_norm::least_squares>;
};
// Not a tier codec: |x| uncorrected, kept to measure the corrections against.
struct tq3_plain {
  template <int HeadDim> using bind = tq3_codec<HeadDim, tq3_norm::plain>;
};

static_assert(vector_codec<tq3_codec<128, tq3_norm::unbiased_inner_product>>);
static_assert(codec_family<tq3_key>);
static_assert(codec_family<tq3_value>);

}  // namespace tierkv
