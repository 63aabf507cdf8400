// SPDX-License-Identifier: Apache-2.0
// The TurboQuant-style rotated scalar codec shared by TQ3 and TQ4: rotate, quantize every
// coordinate on a fixed grid in units of the vector's own norm, store the codes and one
// corrected norm alpha. A grid (tq3_grid, tq4_grid) supplies the levels, the decision rule
// and the bit packing; everything else is here once.
//
// Encode (docs/formats.md, docs/codecs.md): y = H·D·x / |x| with the seeded randomized
// Walsh–Hadamard rotation (codec/rotation.hpp); each sqrt(d)·y_i is quantized on the grid;
// meta = a corrected norm alpha as bf16 bits. The decoded vector is D·H·(alpha·c)/d with c
// the grid levels of the codes.
//
// The two families of a grid differ only in alpha (same bytes, same kernels):
//   *_key:   alpha = |x| / <u, u_hat>          inner products q·k_hat unbiased (keys);
//   *_value: alpha = <x, u_hat> / |u_hat|^2    least-squares, minimum MSE (values).
// (u = x/|x|, u_hat = decoded unit-norm estimate.) Measured in docs/codecs.md.
//
// Host/device bit-exactness: encode uses only exact operations (sign flips, powers of
// two, WHT additions), correctly rounded * / sqrt, explicit fmaf, and sums in the
// "canonical warp order" (lane l of 32 owns coordinates [l*d/32, (l+1)*d/32), adds its
// terms in ascending order with fmaf, then a xor-butterfly over offsets 16, 8, 4, 2, 1),
// which the CUDA warp kernels (cuda/warp/, cuda/codec/, cuda/codec_kernels.cuh) reproduce
// exactly. No a*b+c is left for a compiler to contract.
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

/// How the stored norm alpha is corrected (see the header comment).
enum class tq_norm : std::uint8_t {
  unbiased_inner_product,  ///< *_key
  least_squares,           ///< *_value
  plain,                   ///< |x| itself: only for measuring the other two against
};

namespace detail {

inline constexpr int tq_lanes = 32;  ///< the canonical warp

/// Largest stored alpha (2^112, exact in bf16): decoding multiplies alpha by levels up to
/// 7.5 (TQ4; 2.15 for TQ3) and the WHT sums up to 512 terms, so every intermediate stays
/// below FLT_MAX. Vectors with a larger norm are clipped there and counted as saturated.
inline constexpr float tq_alpha_limit = 5.19229686e33f;  ///< 2^112

/// The stored alpha from the canonical sums over the scaled vector x' = x·2^k:
/// sumsq = |x'|^2, s_zc = sum z_i c_i, s_cc = sum c_i^2 (z = H_un D x', c = grid levels).
/// With u_hat = D H c / d:  <u, u_hat> = s_zc / (|x'| d),  |u_hat|^2 = s_cc / d.
/// Invariant to a common scale of the levels: alpha absorbs it, except plain's |x|, which
/// assumes unit-variance levels and is multiplied by the grid's plain_scale (the factor from
/// its levels to unit-variance ones).
TIERKV_HD_INLINE bf16_bits tq_alpha(tq_norm mode, int d, float sumsq, float s_zc, float s_cc, int k,
                                    float plain_scale, bool* saturated) {
  float a;
  if (mode == tq_norm::unbiased_inner_product) {
    const float t = sumsq * float(d);  // exact: d is a power of two
    a = t / s_zc;
  } else if (mode == tq_norm::least_squares) {
    a = s_zc / s_cc;
  } else {
    a = sqrtf(sumsq) * plain_scale;
  }
  a = scale_pow2(a, -k);
  if (!(a <= tq_alpha_limit)) {  // also catches an overflow to +Inf
    a = tq_alpha_limit;
    if (saturated) *saturated = true;
  }
  return float_to_bf16(a);
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

/// sum_i a_i b_i in the canonical warp order (see the header comment).
template <int N>
TIERKV_HD float canonical_dot(const float* a, const float* b) {
  constexpr int per = N / tq_lanes;
  float part[tq_lanes];
  for (int l = 0; l < tq_lanes; ++l) {
    float s = 0.0f;
    for (int r = 0; r < per; ++r) s = fmaf(a[l * per + r], b[l * per + r], s);
    part[l] = s;
  }
  for (int o = tq_lanes / 2; o >= 1; o >>= 1) {
    float next[tq_lanes];
    for (int l = 0; l < tq_lanes; ++l) next[l] = part[l] + part[l ^ o];
    for (int l = 0; l < tq_lanes; ++l) part[l] = next[l];
  }
  return part[0];
}

}  // namespace detail

/// A grid G provides (all TIERKV_HD, static):
///   format, bits, zero_code (codes of an all-zero vector), names of its three families;
///   bounds make_bounds(float n)        per-vector decision data for z ~ N(0, n^2);
///   int quantize(float z, bounds)       the code of one rotated coordinate;
///   float level(int code)               its grid level c (any common scale: alpha absorbs it);
///   plain_scale                         level x plain_scale is unit-variance (plain's |x| alpha);
///   pack<D> / unpack<D>                 codes <-> payload bytes (docs/formats.md);
///   dot<D>(q, payload)                  sum q_i c_i;  accumulate<D>(w, payload, acc): acc += w c.
template <int HeadDim, tq_norm Norm, class Grid>
struct tq_codec {
  static_assert(is_power_of_two<HeadDim> && HeadDim >= 32 && HeadDim <= 512,
                "tq3 / tq4: head_dim must be a power of two in [32, 512] (the Walsh–Hadamard "
                "rotation and the canonical 32-lane sums need it); head_dim 80, 96, 112 and 192 "
                "are not supported - keep such layers in FP8");
  using meta_type = bf16_bits;  ///< alpha, the corrected norm
  using grid = Grid;            ///< the level grid (tq3_grid or tq4_grid)

  static constexpr storage_format format = Grid::format;  ///< the storage format tag
  static constexpr tq_norm norm = Norm;                   ///< which norm correction alpha carries
  static constexpr int head_dim = HeadDim;                ///< scalars per vector
  static constexpr std::size_t payload_bytes =
      std::size_t(HeadDim) * Grid::bits / 8;                    ///< packed codes
  static constexpr std::size_t meta_bytes = sizeof(meta_type);  ///< alpha
  /// the family's name (e.g. "tq3_key")
  static constexpr const char* name = Norm == tq_norm::unbiased_inner_product ? Grid::key_name
                                      : Norm == tq_norm::least_squares        ? Grid::value_name
                                                                              : Grid::plain_name;
  /// Written on non-finite input: codes 0 and a NaN alpha, so a slot read by mistake
  /// yields NaN (loud) rather than a plausible vector.
  static constexpr meta_type poison_meta = bf16_quiet_nan;
  /// Codes live in the seeded rotation's domain (codec.hpp).
  static constexpr bool uses_context = true;
  /// GPU decode work per scalar against an 8-bit format (codec.hpp): the grid's.
  static constexpr int decode_work_percent = Grid::decode_work_percent;
  /// The per-token scale in meta (codec.hpp: a tile unpacks under unit_meta() once a token).
  TIERKV_HD static float token_scale(const meta_type& m) { return bf16_to_float(m); }
  /// The meta of scale 1.
  TIERKV_HD static meta_type unit_meta() { return bf16_one; }
  static constexpr int zero_code = Grid::zero_code;  ///< codes stored for an all-zero vector

  /// Rotates x (seeded by ctx), quantizes every coordinate on the grid and stores alpha;
  /// non_finite_input (poisoned slot) on NaN / Inf.
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
      Grid::template pack<HeadDim>(codes, payload);
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
    const typename Grid::bounds bounds = Grid::make_bounds(sqrtf(sumsq));
    float c[HeadDim];
    for (int i = 0; i < HeadDim; ++i) {
      const int code = Grid::quantize(z[i], bounds);
      codes[i] = std::uint8_t(code);
      c[i] = Grid::level(code);
    }
    const float s_zc = detail::canonical_dot<HeadDim>(z, c);
    const float s_cc = detail::canonical_dot<HeadDim>(c, c);
    bool saturated = false;
    meta = detail::tq_alpha(Norm, HeadDim, sumsq, s_zc, s_cc, k, Grid::plain_scale, &saturated);
    if (saturated && stats) ++stats->saturated;
    Grid::template pack<HeadDim>(codes, payload);
    return errc::ok;
  }

  /// One code per coordinate -> payload bytes.
  TIERKV_HD static void pack(const std::uint8_t* codes, std::uint8_t* payload) {
    Grid::template pack<HeadDim>(codes, payload);
  }
  /// Payload bytes -> one code per coordinate.
  TIERKV_HD static void unpack(const std::uint8_t* payload, std::uint8_t* codes) {
    Grid::template unpack<HeadDim>(payload, codes);
  }

  /// The vector in the input domain (alpha x levels, inverse rotation).
  TIERKV_HD static void decode(const std::uint8_t* payload, const meta_type& meta, float* out,
                               const codec_context& ctx) {
    for (int i = 0; i < HeadDim; ++i) out[i] = 0.0f;
    accumulate(1.0f, payload, meta, out);
    finalize(out, ctx);
  }

  /// q'' = H_un D q / d, so that dot(q'', k) = alpha · sum q''_i c_i = q · k_hat.
  TIERKV_HD static void prepare_query(const float* q, float* out, const codec_context& ctx) {
    rotated_domain<HeadDim>::prepare_query(q, out, ctx.seed);
  }

  /// alpha x sum q_i c_i over the prepared query.
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload, const meta_type& meta) {
    return Grid::template dot<HeadDim>(q, payload) * bf16_to_float(meta);
  }

  /// acc (rotated domain, unscaled) += p · alpha · c; finalize maps it back.
  TIERKV_HD static void accumulate(float p, const std::uint8_t* payload, const meta_type& meta,
                                   float* acc) {
    Grid::template accumulate<HeadDim>(p * bf16_to_float(meta), payload, acc);
  }

  /// acc <- D H_un acc / d: the inverse rotation (linear, so it commutes with merges of
  /// partial states of this codec and seed).
  TIERKV_HD static void finalize(float* acc, const codec_context& ctx) {
    rotated_domain<HeadDim>::finalize(acc, ctx.seed);
  }
};

}  // namespace tierkv
