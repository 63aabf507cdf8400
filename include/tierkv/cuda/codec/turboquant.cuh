// SPDX-License-Identifier: Apache-2.0
// The TurboQuant family on the device (TQ3, TQ4, TQ2): code packing, quantization against the
// grid bounds, the warp encoder and decoder (bit-exact with tq_codec). The format-specific
// readers and fragments are in codec/tq3.cuh, codec/tq4.cuh and codec/tq2.cuh.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/codec/turboquant.hpp"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/warp/lane_group.cuh"
#include "tierkv/cuda/warp/payload.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
#include "tierkv/cuda/warp/scaling.cuh"
namespace tierkv::cuda::detail {

// Values on the tensor cores (TQ3, TQ2): bytes 0, 2 (Sel = 0x4240) or 1, 3 (0x4341) of biased
// int8 levels u = L + 128 -> a half2: each byte becomes an f16 subnormal u 2^-24 (high byte 0),
// exact. Biased: the tensor cores take it as is, and the tier's loop subtracts the bias
// 128 2^-24 x (the sum of its probabilities) once, at its end (the fragments' value_bias_pair).
// Otherwise one fma makes it L / 1024 exactly (u 2^-24 x 2^14 - 2^-3): an hfma2 per pair of codes,
// 128 of a d = 256 32-token step's 1245 instructions.
template <unsigned Sel, bool Biased>
__device__ __forceinline__ std::uint32_t widen_biased_levels(std::uint32_t u) {
  const std::uint32_t h = __byte_perm(u, 0u, Sel);
  if constexpr (Biased) return h;
  const __half2 r =
      __hfma2(*reinterpret_cast<const __half2*>(&h), __half2(__half(16384.f), __half(16384.f)),
              __half2(__half(-0.125f), __half(-0.125f)));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
// ---- TQ3 / TQ4 -----------------------------------------------------------------------------

// A lane's N TQ3 / TQ4 codes (coordinates [gl*N, gl*N + N)) packed into payload words as they
// are produced (docs/formats.md), by integer multiply-adds where a lane packs whole words (the
// FMA pipe; codes are added, never overlapping, into place). TQ3: 3 words per 32-coordinate
// group, codes j < 24 in nibble j % 8 of word j / 8, the three bits of codes 24..31 in bit
// 4(j - 24) + 3 of words 0, 1, 2. Codes arrive as the bits of the float 2^23 + code (bias
// 0x4B000000, see quantize_level): code j < 24 adds at nibble j % 8 of its word, code j >= 24
// at nibble j - 24 of a spare word whose bits store() spreads; each word starts at minus the
// biases its eight codes bring. With N >= 32 the lane's coordinates are whole groups, stored
// by the lane alone; with N < 32 each lane ORs its codes into the three words of its group, the
// 32 / N lanes of the group OR-reduce by shuffles and lanes store whole words. TQ4: nibbles,
// coordinate 2b in the low nibble of byte b, plain codes in [0, 15]. TQ2: word w holds
// coordinates 16w..16w+15 at tq2_grid::code_shift; with N < 16 the 16 / N lanes of a word
// OR-reduce it by shuffles and its first lane stores it.
inline constexpr std::uint32_t tq_packer_bias = 0x4B000000u;
template <class Codec, int N>
struct tq_packer {
  static constexpr int D = Codec::head_dim;
  static constexpr bool tq3 = Codec::format == storage_format::tq3;
  static constexpr bool tq2 = Codec::format == storage_format::tq2;
  static_assert(tq3 || tq2 || Codec::format == storage_format::tq4,
                "tq_packer: a TQ3, TQ4 or TQ2 codec");
  static_assert(!tq2 || N % 16 == 0 || 16 % N == 0,
                "tq_packer: a lane's TQ2 coordinates are whole words or lie in one");
  static_assert(!tq3 || N % 32 == 0 || 32 % N == 0,
                "tq_packer: a lane's coordinates are whole TQ3 groups or lie in one");
  static_assert(tq3 || tq2 || N % 2 == 0,
                "tq_packer: TQ4 needs whole bytes per lane (head_dim >= 64)");
  static constexpr std::uint32_t bias = tq3 ? tq_packer_bias : 0u;  // the bits of 2^23
  // minus the biases of eight codes added at nibbles 0..7 (bias << 4k vanishes from k = 2 on)
  static constexpr std::uint32_t word_start = 0u - (bias + (bias << 4));
  static constexpr bool whole = tq3 ? N >= 32 : tq2 ? N >= 16 : true;  // words of this lane only
  static constexpr int groups = N >= 32 ? N / 32 : 1;
  static constexpr int words = tq3 ? 3 * groups : tq2 ? (N >= 16 ? N / 16 : 1) : (N + 7) / 8;
  std::uint32_t w[words];
  std::uint32_t high[tq3 && whole ? groups : 1];  // TQ3: codes 24..31 of each group, as nibbles

  __device__ tq_packer() {
#pragma unroll
    for (int t = 0; t < words; ++t) w[t] = tq3 && whole ? word_start : 0u;
#pragma unroll
    for (int g = 0; g < (tq3 && whole ? groups : 1); ++g) high[g] = word_start;
  }
  // The code of the lane's coordinate r (TQ3: biased; gl: the lane's index in its group).
  __device__ __forceinline__ void add(int r, std::uint32_t code, int gl) {
    if constexpr (tq2) {
      w[whole ? r / 16 : 0] |= code << tq2_grid::code_shift((gl * N + r) % 16);
    } else if constexpr (!tq3) {
      w[r / 8] += code << (4 * (r % 8));
    } else if constexpr (whole) {
      const int j = r % 32;
      std::uint32_t& t = j < 24 ? w[3 * (r / 32) + j / 8] : high[r / 32];
      t += code << (4 * (j % 8));
    } else {
      const int j = (gl * N + r) % 32;
      const std::uint32_t c = code & 7u;
      if (j < 24) {
        const std::uint32_t v = c << (4 * (j & 7));
#pragma unroll
        for (int t = 0; t < 3; ++t) w[t] |= (j >> 3) == t ? v : 0u;
      } else {
        const int sh = 4 * (j - 24) + 3;
#pragma unroll
        for (int t = 0; t < 3; ++t) w[t] |= ((c >> t) & 1u) << sh;
      }
    }
  }
  // TQ3 with whole words: the lane's codes from nibble words in coordinate order (eight codes
  // each; per group codes 0-23 in words 0-2 and 24-31 in the fourth).
  __device__ __forceinline__ void set_words(const std::uint32_t (&q)[4 * groups]) {
    static_assert(tq3 && whole, "set_words: TQ3 codes in whole words");
#pragma unroll
    for (int g = 0; g < groups; ++g) {
#pragma unroll
      for (int t = 0; t < 3; ++t) w[3 * g + t] = q[4 * g + t];
      high[g] = q[4 * g + 3];
    }
  }
  // Where `take` holds, the codes of `other` instead.
  __device__ __forceinline__ void replace_if(bool take, const tq_packer& other) {
#pragma unroll
    for (int t = 0; t < words; ++t) w[t] = take ? other.w[t] : w[t];
#pragma unroll
    for (int g = 0; g < (tq3 && whole ? groups : 1); ++g) high[g] = take ? other.high[g] : high[g];
  }
  __device__ __forceinline__ void store(std::uint8_t* payload, int lane) {
    const int gl = lane_group<D, N>::index(lane);
    if constexpr (tq2 && whole) {
      store_words<lane_alignment(Codec::payload_bytes, N / 4)>(payload + gl * (N / 4), w);
    } else if constexpr (tq2) {
      constexpr int lanes_per_word = 16 / N;
#pragma unroll
      for (int o = 1; o < lanes_per_word; o <<= 1) w[0] |= __shfl_xor_sync(full_warp, w[0], o);
      if (gl % lanes_per_word == 0) reinterpret_cast<std::uint32_t*>(payload)[(gl * N) / 16] = w[0];
    } else if constexpr (!tq3) {
      constexpr int A = lane_alignment(Codec::payload_bytes, N / 2);
      if constexpr (N % 8 == 0) {
        store_words<A>(payload + gl * (N / 2), w);
      } else {
        std::uint8_t b[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) b[i] = std::uint8_t(w[i / 4] >> (8 * (i % 4)));
        store_bytes<A>(payload + gl * (N / 2), b);
      }
    } else if constexpr (whole) {
#pragma unroll
      for (int g = 0; g < groups; ++g)  // bit t of code 24 + n to bit 4n + 3 of word t
#pragma unroll
        for (int t = 0; t < 3; ++t) w[3 * g + t] |= (high[g] & (0x11111111u << t)) << (3 - t);
      store_words<lane_alignment(Codec::payload_bytes, 12 * groups)>(payload + 12 * groups * gl, w);
    } else {
      constexpr int lanes_per_group = 32 / N;
#pragma unroll
      for (int o = 1; o < lanes_per_group; o <<= 1)
#pragma unroll
        for (int t = 0; t < 3; ++t) w[t] |= __shfl_xor_sync(full_warp, w[t], o);
      std::uint32_t* out = reinterpret_cast<std::uint32_t*>(payload) + 3 * ((gl * N) >> 5);
      const int li = gl % lanes_per_group;
      if constexpr (lanes_per_group >= 3) {
        if (li < 3) out[li] = li == 0 ? w[0] : li == 1 ? w[1] : w[2];
      } else if (li == 0) {
#pragma unroll
        for (int t = 0; t < 3; ++t) out[t] = w[t];
      }
    }
  }
};

// 1.0f where a > b, else 0.0f, in the FMA pipe: fma.sat(a, K, -b K) with K = 2^32 saturates the
// once-rounded K(a - b) into [0, 1]; a > b >= 2^-9 means a - b >= ulp(b) >= 2^-32, so K(a - b)
// >= 1, and a <= b gives <= 0. b2_32 = b K (exact). TQ3's bounds are at least 0.49.
__device__ __forceinline__ float greater_step(float a, float b2_32) {
  float r;
  asm("fma.rn.sat.f32 %0, %1, 0f4F800000, %2;" : "=f"(r) : "f"(a), "f"(-b2_32));
  return r;
}
// TQ3 level magnitudes by rank m (codes 4 + m): mag(0) plus the steps to mag(1..3).
constexpr float tq3_magnitude(int m) {
  return float(tierkv::detail::tq3_level_int(4 + m)) * tierkv::detail::tq3_level_scale;
}
// The code from the level L: floor(4 + L * 64/36) is 4 + m for L = +mag(m) and 3 - m for L =
// -mag(m), since 64 mag(m) / 36 (14, 44, 79, 127 over 36: 0.39, 1.22, 2.19, 3.53) lies in
// (m, m + 1) with a margin of 0.19 or more.
inline constexpr float tq3_code_slope = 64.0f / 36.0f;
static_assert(tq3_magnitude(0) * 64 / 36 > 0.1f && tq3_magnitude(0) * 64 / 36 < 0.9f &&
                  tq3_magnitude(1) * 64 / 36 > 1.1f && tq3_magnitude(1) * 64 / 36 < 1.9f &&
                  tq3_magnitude(2) * 64 / 36 > 2.1f && tq3_magnitude(2) * 64 / 36 < 2.9f &&
                  tq3_magnitude(3) * 64 / 36 > 3.1f && tq3_magnitude(3) * 64 / 36 < 3.9f,
              "tq3: the code slope separates the magnitudes");

// The code of one rotated coordinate and its level c: grid::quantize and grid::level. For TQ3
// in floating point (the FMA pipe; comparisons would become predicates and integer selects):
// the bounds increase (thresholds t1 < t2 < t3 times n >= 1), so with f_i = [|z| > b_i] in
// {0, 1} the magnitude rank is m = f1 + f2 + f3 and the magnitude is mag(0) + f1 (mag(1) -
// mag(0)) + ... (multiples of 1/64: exact); level = +-magnitude with z's sign bit (-0 counts as
// negative), and the code 4 + m or 3 - m comes back as the bits of the float 2^23 + code,
// rounded down from 2^23 + 4 + level * 64/36 (tq3_code_slope). TQ4: the grid's own functions.
template <class Grid>
__device__ __forceinline__ std::uint32_t quantize_level(float z, const typename Grid::bounds& b2_32,
                                                        float& level) {
  if constexpr (Grid::format == storage_format::tq3) {
    const float a = fabsf(z);
    const float f1 = greater_step(a, b2_32.b1), f2 = greater_step(a, b2_32.b2),
                f3 = greater_step(a, b2_32.b3);
    const float magnitude =
        fmaf(f3, tq3_magnitude(3) - tq3_magnitude(2),
             fmaf(f2, tq3_magnitude(2) - tq3_magnitude(1),
                  fmaf(f1, tq3_magnitude(1) - tq3_magnitude(0), tq3_magnitude(0))));
    level = __uint_as_float(__float_as_uint(magnitude) | (__float_as_uint(z) & 0x80000000u));
    return __float_as_uint(__fmaf_rd(level, tq3_code_slope, 8388612.0f));
  } else {
    const int code = Grid::quantize(z, b2_32);
    level = Grid::level(code);
    return std::uint32_t(code);
  }
}
// The bounds quantize_level takes: TQ3's thresholds times 2^32 (exact), TQ4's as they are.
template <class Grid>
__device__ __forceinline__ typename Grid::bounds quantize_bounds(float n) {
  typename Grid::bounds b = Grid::make_bounds(n);
  if constexpr (Grid::format == storage_format::tq3) {
    b.b1 *= 0x1p32f;
    b.b2 *= 0x1p32f;
    b.b3 *= 0x1p32f;
  }
  return b;
}
// A code as quantize_level returns it (TQ3: biased), for the packer.
template <class Grid>
constexpr std::uint32_t packer_code(int code) {
  return Grid::format == storage_format::tq3 ? tq_packer_bias + std::uint32_t(code)
                                             : std::uint32_t(code);
}

// The canonical butterfly (group_sum_canonical) over partial sums held in runs: part[g][i] is
// canonical lane g 32/G + gl 32/G^2 + i. Stages 16 .. 32/G over g in registers, then across the
// group, then over i in registers.
template <int G>
__device__ __forceinline__ float runs_sum_canonical(float (&part)[G][32 / (G * G)]) {
  constexpr int I = 32 / (G * G);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    if (o >= 32 / G) {
#pragma unroll
      for (int g = 0; g < G / 2; ++g)  // only g < o G/32 feeds the result
#pragma unroll
        for (int i = 0; i < I; ++i)
          if (g < o * G / 32) part[g][i] = part[g][i] + part[g + o * G / 32][i];
    } else if (o >= I) {
#pragma unroll
      for (int i = 0; i < I; ++i)
        part[0][i] = part[0][i] + __shfl_xor_sync(full_warp, part[0][i], o / I);
    } else {
#pragma unroll
      for (int i = 0; i < I / 2; ++i)
        if (i < o) part[0][i] = part[0][i] + part[0][i + o];
    }
  }
  return part[0][0];
}

// sum L^2 over TQ3 codes held eight to a word in 3-bit nibbles (level = L / 64): one byte
// permute per four codes to their int8 levels (the nibbles' top bits are clear) and a 4-way
// byte dot product.
template <int W>
__device__ __forceinline__ int tq3_level_square_sum(const std::uint32_t (&q)[W]) {
  int s = 0;
#pragma unroll
  for (int i = 0; i < W; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int l =
          int(__byte_perm(tierkv::detail::tq3_s8_0, tierkv::detail::tq3_s8_1, q[i] >> (16 * h)));
      s = __dp4a(l, l, s);
    }
  return s;
}

// TQ3 encode's rotation and quantization in runs (lane_exchange): the in-lane Walsh-Hadamard
// stages, the exchange, the remaining stages in registers, then per coordinate the code (into
// nibble words) and the canonical partial sums of z.c. c.c comes from the codes: every c_i^2 =
// L_i^2 / 4096 and every partial sum of them is a multiple of 2^-12 below 2^11 (d 127^2 <
// 2^23), exact in any order, so the host's canonical sum is the integer sum L_i^2 / 4096.
// The codes go back to layout A into `pk`.
template <class Codec, int N, int G>
__device__ __forceinline__ void tq3_quantize_runs(float (&z)[N], float sumsq,
                                                  const lane_exchange<N, G>& ex, int lane,
                                                  tq_packer<Codec, N>& pk, float& s_zc,
                                                  float& s_cc) {
  using grid = typename Codec::grid;
  using X = lane_exchange<N, G>;
  constexpr int P = Codec::head_dim / 32;
  static_assert(grid::format == storage_format::tq3 && X::S % P == 0,
                "tq3_quantize_runs: TQ3, whole canonical lanes per run");
  lane_wht<N>(z);
  float y[N];
  ex.to_runs(z, y, lane);
  runs_wht<N, G>(y);
  const typename grid::bounds bounds = quantize_bounds<grid>(sqrtf(sumsq));
  float p_zc[G][32 / (G * G)];
  std::uint32_t q[X::words];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 32 / (G * G); ++i) p_zc[g][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < X::words; ++i) q[i] = tq_packer<Codec, N>::word_start;
#pragma unroll
  for (int r = 0; r < N; ++r) {  // y[r]: run r / S, coordinate r % S of it
    float c;
    const std::uint32_t code = quantize_level<grid>(y[r], bounds, c);
    float& part = p_zc[r / X::S][r % X::S / P];
    part = fmaf(y[r], c, part);
    q[r / 8] += code << (4 * (r % 8));
  }
  s_zc = runs_sum_canonical<G>(p_zc);
  s_cc = float(group_sum_int<G>(tq3_level_square_sum(q))) *
         (tierkv::detail::tq3_level_scale * tierkv::detail::tq3_level_scale);
  std::uint32_t w[X::words];
  ex.words_from_runs(q, w, lane);
  pk.set_words(w);
}

// TQ3 / TQ4 encode (exactly tq_codec::encode), codes packed in registers; `norm` the alpha
// correction (the codec's, or its sibling family's: key and value codecs differ only there). A
// zero or non-finite vector runs the common path on substitute numbers, then takes zero_code
// codes and alpha 0, or zero codes and the poison (returning false). With a lane_exchange (TQ3)
// the rotation's cross-lane half and the quantization run in runs (tq3_quantize_runs).
template <class Codec, int N, bool F, bool S, class Exchange = no_exchange>
__device__ __forceinline__ bool warp_encode_tq(const lane_vector<N, F, S>& v, std::uint8_t* payload,
                                               typename Codec::meta_type* meta, std::uint64_t seed,
                                               int lane, tq_norm norm = Codec::norm,
                                               const Exchange& ex = {}) {
  constexpr int D = Codec::head_dim;
  using grid = typename Codec::grid;
  using lg = lane_group<D, N>;
  const int gl = lg::index(lane);
  float z[N];
  const auto [finite, coded, k] = rotated_input<lg::G>(v, __FLT_MAX__, z);
  const float sumsq = group_dot_canonical<D, N>(z, z);
  if constexpr (!lane_vector<N, F, S>::rotation_signed) warp_signs<N, lg::G>(z, seed, lane);
  tq_packer<Codec, N> pk;
  float s_zc, s_cc;
  if constexpr (Exchange::runs) {
    tq3_quantize_runs<Codec, N>(z, sumsq, ex, lane, pk, s_zc, s_cc);
  } else {
    warp_wht<N, lg::G>(z, lane);
    const typename grid::bounds bounds = quantize_bounds<grid>(sqrtf(sumsq));
    // Quantize, pack and form the canonical partial sums of z.c and c.c in one pass (the
    // fmaf order of group_dot_canonical), so codes and levels need no registers of their own.
    float p_zc[lg::R], p_cc[lg::R];
#pragma unroll
    for (int q = 0; q < lg::R; ++q) p_zc[q] = p_cc[q] = 0.0f;
#pragma unroll
    for (int r = 0; r < N; ++r) {
      float c;
      const std::uint32_t code = quantize_level<grid>(z[r], bounds, c);
      p_zc[r / lg::P] = fmaf(z[r], c, p_zc[r / lg::P]);
      p_cc[r / lg::P] = fmaf(c, c, p_cc[r / lg::P]);
      pk.add(r, code, gl);
    }
    s_zc = group_sum_canonical<lg::G>(p_zc);
    s_cc = group_sum_canonical<lg::G>(p_cc);
  }
  tq_packer<Codec, N> special;  // zero_code codes (zero vector) or zeros (poison)
#pragma unroll
  for (int r = 0; r < N; ++r)
    special.add(r, finite ? packer_code<grid>(Codec::zero_code) : packer_code<grid>(0), gl);
  pk.replace_if(!coded, special);
  pk.store(payload, lane);
  if (gl == 0) {
    bool saturated = false;
    *meta = coded    ? tierkv::detail::tq_alpha(norm, D, sumsq, s_zc, s_cc, k, grid::plain_scale,
                                                &saturated)
            : finite ? typename Codec::meta_type(0)
                     : Codec::poison_meta;
  }
  return finite;
}
template <class Codec, int N>
__device__ __forceinline__ bool warp_encode_tq(const float (&x)[N], std::uint8_t* payload,
                                               typename Codec::meta_type* meta, std::uint64_t seed,
                                               int lane) {
  return warp_encode_tq<Codec, N>(make_lane_vector(x), payload, meta, seed, lane);
}

// The TQ3 levels L (level = L / 64) of codes 0..7 as biased bytes, for one byte permute per four
// codes: word 0 holds codes 0-3, word 1 codes 4-7.
inline constexpr std::uint32_t tq3_biased_levels_0 = tierkv::detail::tq3_s8_0 ^ 0x80808080u;
inline constexpr std::uint32_t tq3_biased_levels_1 = tierkv::detail::tq3_s8_1 ^ 0x80808080u;

// The lane's N TQ3 codes in coordinate order, 8 per word in 3-bit nibbles (the top bit of each
// nibble clear, as a byte-permute selector needs): per 32-coordinate group the nibbles of its
// three words (codes 0-23) and the fourth word gathered from their top bits (codes 24-31).
template <class Codec, int N>
__device__ __forceinline__ void tq3_lane_nibbles(const std::uint8_t* payload, int lane,
                                                 std::uint32_t (&nib)[(N + 7) / 8]) {
  static_assert(N % 32 == 0 || 32 % N == 0,
                "TQ3: a lane's coordinates are whole groups or lie in one");
  constexpr int groups = N >= 32 ? N / 32 : 1;
  const int first = lane_group<Codec::head_dim, N>::index(lane) * N;
  std::uint32_t words[3 * groups];
  load_words<lane_alignment(Codec::payload_bytes, 12 * groups)>(payload + 12 * (first / 32), words);
#pragma unroll
  for (int g = 0; g < groups; ++g) {
    const std::uint32_t w0 = words[3 * g], w1 = words[3 * g + 1], w2 = words[3 * g + 2];
    const std::uint32_t q[4] = {
        w0 & 0x77777777u, w1 & 0x77777777u, w2 & 0x77777777u,
        ((w0 >> 3) & 0x11111111u) | ((w1 >> 2) & 0x22222222u) | ((w2 >> 1) & 0x44444444u)};
    if constexpr (N >= 32) {
#pragma unroll
      for (int t = 0; t < 4; ++t) nib[4 * g + t] = q[t];
    } else {  // the lane's N consecutive codes from (first % 32)
      const int j = first % 32;
#pragma unroll
      for (int t = 0; t < (N + 7) / 8; ++t) {
        const int s = j / 8 + t;
        const std::uint32_t v = s == 0 ? q[0] : s == 1 ? q[1] : s == 2 ? q[2] : q[3];
        nib[t] = N >= 8 ? v : v >> (4 * (j % 8));
      }
    }
  }
}

// The integer levels L_r of the lane's TQ3 / TQ4 / TQ2 codes as floats (TQ3: level = L / 64;
// TQ4 / TQ2: level = L = code - 7.5 / 1.5), and the level unit u (1/64 or 1): exact.
template <class Codec, int N>
__device__ __forceinline__ float decode_levels(const std::uint8_t* payload, float (&x)[N],
                                               int lane) {
  if constexpr (Codec::format == storage_format::tq3) {
    std::uint32_t nib[(N + 7) / 8];
    tq3_lane_nibbles<Codec, N>(payload, lane, nib);
#pragma unroll
    for (int r = 0; r < N; r += 4) {
      const std::uint32_t sel = nib[r / 8] >> (16 * ((r / 4) % 2));
      const std::uint32_t bytes =
          __byte_perm(tq3_biased_levels_0, tq3_biased_levels_1, sel & 0xffffu);
#pragma unroll
      for (int u = 0; u < 4 && r + u < N; ++u) x[r + u] = biased_byte_value(bytes, u);
    }
    return tierkv::detail::tq3_level_scale;
  } else if constexpr (Codec::format == storage_format::tq2) {
    static_assert(N % 16 == 0 || 16 % N == 0,
                  "TQ2: a lane's coordinates are whole words or lie in one");
    constexpr int W = N >= 16 ? N / 16 : 1;
    const int first = lane_group<Codec::head_dim, N>::index(lane) * N;
    std::uint32_t words[W];
    load_words<lane_alignment(Codec::payload_bytes, 4 * W)>(payload + 4 * (first / 16), words);
#pragma unroll
    for (int r = 0; r < N; ++r) {
      // 2^21 + code (the float at 2^21 steps by 1/4), minus 2^21 + 1.5: code - 1.5, exact
      const std::uint32_t code =
          (words[N >= 16 ? r / 16 : 0] >> tq2_grid::code_shift((first + r) % 16)) & 3u;
      x[r] = __uint_as_float(0x4A000000u | (code << 2)) - (2097152.0f + tq2_grid::offset);
    }
    return 1.0f;
  } else {
    static_assert(Codec::format == storage_format::tq4, "decode_levels: a TQ codec");
    static_assert(N % 2 == 0, "TQ4 needs whole bytes per lane (head_dim >= 64)");
    std::uint8_t b[N / 2];
    load_bytes<lane_alignment(Codec::payload_bytes, N / 2)>(
        payload + lane_group<Codec::head_dim, N>::index(lane) * (N / 2), b);
#pragma unroll
    for (int r = 0; r < N; ++r) {
      // 2^21 + code (the float at 2^21 steps by 1/4), minus 2^21 + 7.5: code - 7.5, exact
      const std::uint32_t code = (b[r / 2] >> (4 * (r % 2))) & 15u;
      x[r] = __uint_as_float(0x4A000000u | (code << 2)) - (2097152.0f + tq4_grid::offset);
    }
    return 1.0f;
  }
}

// TQ3 / TQ4 decode (exactly tq_codec::decode: 0 + alpha*c, inverse rotation D H_un / d; Signed:
// D x, i.e. without the last D; with a lane_exchange in runs).
template <class Codec, int N, bool Signed = false, class Exchange = no_exchange>
__device__ __forceinline__ void warp_decode_tq(const std::uint8_t* payload,
                                               typename Codec::meta_type meta, std::uint64_t seed,
                                               float (&x)[N], int lane, const Exchange& ex = {}) {
  constexpr int D = Codec::head_dim;
  const float unit = decode_levels<Codec, N>(payload, x, lane);
  warp_inverse_rotation_of_levels<D, N, !Signed>(x, bf16_to_float(meta), unit, seed, lane, ex);
}

// The device_codec members TQ3 and TQ4 share: the rotated domain and the TurboQuant warp codec
// (retier's decode / encode); each format's file adds its slice reader and fragments.
template <class C>
struct turboquant_warp_codec : device_codec_defaults {
  static constexpr bool rotated = true;

  template <int N, bool Signed, class Signs, class Exchange>
  __device__ __forceinline__ static auto warp_decode(const std::uint8_t* payload,
                                                     typename C::meta_type meta, std::uint64_t seed,
                                                     const Signs* signs, const Exchange& ex,
                                                     int lane) {
    (void)signs;
    float x[N];
    warp_decode_tq<C, N, Signed>(payload, meta, seed, x, lane, ex);
    return make_lane_vector<Signed, Exchange::runs>(x);
  }
  template <int N, bool F, bool S, bool R, class Norm, class Exchange, class Signs>
  __device__ __forceinline__ static bool warp_encode(const lane_vector<N, F, S, R>& v,
                                                     std::uint8_t* payload,
                                                     typename C::meta_type* meta,
                                                     std::uint64_t seed, int lane, Norm norm,
                                                     const Exchange& ex, const Signs* signs) {
    (void)signs;
    return warp_encode_tq<C, N>(v, payload, meta, seed, lane, norm, ex);
  }
};

}  // namespace tierkv::cuda::detail
