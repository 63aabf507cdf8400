// SPDX-License-Identifier: Apache-2.0
// One warp per token vector: FP8 E4M3, TQ3, TQ4 and int8_rotated encode / decode with the element
// ownership and summation order the host codecs define as canonical (codec/turboquant.hpp: lane l owns
// coordinates [l*d/32, (l+1)*d/32), fmaf in ascending order, then a xor butterfly over
// 16, 8, 4, 2, 1), so the codes equal the host encoder's bit for bit.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/rotation.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

namespace tierkv::cuda::detail {

inline constexpr unsigned full_warp = 0xffffffffu;

__device__ __forceinline__ float warp_sum_canonical(float s) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) s = s + __shfl_xor_sync(full_warp, s, o);
  return s;
}
__device__ __forceinline__ float warp_max(float s) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) s = fmaxf(s, __shfl_xor_sync(full_warp, s, o));
  return s;
}

// This lane's P consecutive bytes at p + lane*P as one load / store when P is a multiple
// of 4 (payload regions are 16-byte aligned and d-byte FP8 payloads keep that alignment).
template <int P>
__device__ __forceinline__ void load_bytes(const std::uint8_t* p, std::uint8_t (&b)[P]) {
  if constexpr (P % 4 == 0) {
#pragma unroll
    for (int w = 0; w < P / 4; ++w) {
      const std::uint32_t v = reinterpret_cast<const std::uint32_t*>(p)[w];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[4 * w + j] = std::uint8_t(v >> (8 * j));
    }
  } else {
#pragma unroll
    for (int j = 0; j < P; ++j) b[j] = p[j];
  }
}
template <int P>
__device__ __forceinline__ void store_bytes(std::uint8_t* p, const std::uint8_t (&b)[P]) {
  if constexpr (P % 4 == 0) {
#pragma unroll
    for (int w = 0; w < P / 4; ++w)
      reinterpret_cast<std::uint32_t*>(p)[w] = std::uint32_t(b[4 * w]) | (std::uint32_t(b[4 * w + 1]) << 8) |
                                               (std::uint32_t(b[4 * w + 2]) << 16) | (std::uint32_t(b[4 * w + 3]) << 24);
  } else {
#pragma unroll
    for (int j = 0; j < P; ++j) p[j] = b[j];
  }
}

// x <- D x on this lane's coordinates [lane*P, lane*P + P): a sign-bit flip, exact. When P
// divides 64 the lane's coordinates share one 64-bit sign word: one splitmix64 per lane.
template <int P>
__device__ __forceinline__ void warp_signs(float (&x)[P], std::uint64_t seed, int lane) {
  if constexpr (64 % P == 0) {
    const int first = lane * P;
    const std::uint64_t w = rotation_sign_word(seed, first >> 6) >> (first & 63);
#pragma unroll
    for (int r = 0; r < P; ++r)
      x[r] = __uint_as_float(__float_as_uint(x[r]) ^ (std::uint32_t((w >> r) & 1u) << 31));
  } else {
#pragma unroll
    for (int r = 0; r < P; ++r) {
      const int i = lane * P + r;
      if (rotation_sign_negative(seed, i)) x[r] = -x[r];
    }
  }
}

// Unnormalized Walsh-Hadamard over the warp, stage order of walsh_hadamard_unnormalized:
// strides below P inside the lane, the rest across lanes (lower index a + b, upper a - b).
template <int P>
__device__ __forceinline__ void warp_wht(float (&x)[P], int lane) {
#pragma unroll
  for (int h = 1; h < P; h <<= 1)
#pragma unroll
    for (int i = 0; i < P; i += 2 * h)
#pragma unroll
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
#pragma unroll
  for (int lm = 1; lm < 32; lm <<= 1) {
    const bool upper = (lane & lm) != 0;
#pragma unroll
    for (int r = 0; r < P; ++r) {
      const float other = __shfl_xor_sync(full_warp, x[r], lm);
      x[r] = upper ? other - x[r] : x[r] + other;
    }
  }
}

// x <- D H_un x / d on a warp-held vector (the rotated codecs' decode and finalize; the
// stage order of rotated_domain::finalize, so bit-identical to it).
template <int D, int P>
__device__ __forceinline__ void warp_inverse_rotation(float (&x)[P], std::uint64_t seed, int lane) {
  warp_wht<P>(x, lane);
  const float s = tierkv::detail::exp2i(-tierkv::detail::log2_of<D>);
#pragma unroll
  for (int r = 0; r < P; ++r) x[r] *= s;
  warp_signs<P>(x, seed, lane);
}

// FP8 E4M3 encode of a vector held as x[P] per lane (exactly fp8_codec::encode).
// Returns false (and writes the codec's poison) on non-finite input.
template <class Codec, int P>
__device__ __forceinline__ bool warp_encode_fp8(const float (&x)[P], std::uint8_t* payload,
                                                typename Codec::meta_type* meta, int lane) {
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int r = 0; r < P; ++r) {
    finite = finite && tierkv::detail::is_finite_bits(x[r]);
    float a = tierkv::detail::abs_bits(x[r]);
    if (a > Codec::input_limit) a = Codec::input_limit;
    amax = fmaxf(amax, a);
  }
  finite = __all_sync(full_warp, finite);
  amax = warp_max(amax);
  std::uint8_t codes[P];
  if (!finite) {
#pragma unroll
    for (int r = 0; r < P; ++r) codes[r] = 0;
    store_bytes<P>(payload + lane * P, codes);
    if (lane == 0) *meta = Codec::poison_meta;
    return false;
  }
  const typename Codec::meta_type scale = Codec::scale_for(amax);
  const float s = bf16_to_float(scale);
#pragma unroll
  for (int r = 0; r < P; ++r) {
    float v = x[r];
    if (v > Codec::input_limit) v = Codec::input_limit;
    if (v < -Codec::input_limit) v = -Codec::input_limit;
    codes[r] = scale == 0 ? std::uint8_t(0) : float_to_fp8<fp8_kind::e4m3>(v / s);
  }
  store_bytes<P>(payload + lane * P, codes);
  if (lane == 0) *meta = scale;
  return true;
}

// FP8 E4M3 decode (exactly fp8_codec::decode).
template <class Codec, int P>
__device__ __forceinline__ void warp_decode_fp8(const std::uint8_t* payload,
                                                typename Codec::meta_type meta, float (&x)[P],
                                                int lane) {
  const float s = bf16_to_float(meta);
  std::uint8_t codes[P];
  load_bytes<P>(payload + lane * P, codes);
  if constexpr (P % 2 == 0) {
    // cvt.f16x2.e4m3x2 (or e5m2x2): two codes per instruction, exact like code_value
    constexpr __nv_fp8_interpretation_t kind =
        Codec::format == storage_format::fp8_e4m3 ? __NV_E4M3 : __NV_E5M2;
#pragma unroll
    for (int r = 0; r < P; r += 2) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(codes[r] | (codes[r + 1] << 8)), kind);
      __half_raw lo, hi;
      lo.x = h.x;
      hi.x = h.y;
      x[r] = __half2float(__half(lo)) * s;
      x[r + 1] = __half2float(__half(hi)) * s;
    }
  } else {
#pragma unroll
    for (int r = 0; r < P; ++r) x[r] = Codec::code_value(codes[r]) * s;
  }
}

// Packs this lane's P TQ3 codes (coordinates [lane*P, lane*P + P)) into the payload's
// 3-word groups (docs/formats.md): each lane ORs its codes into the three words of its
// group, the 32 / P lanes of a group OR-reduce by shuffles, and lanes store whole words.
template <int P>
__device__ __forceinline__ void warp_pack_tq3(const std::uint32_t (&code)[P], std::uint8_t* payload, int lane) {
  static_assert(P <= 32 && 32 % P == 0, "warp_pack_tq3: a lane's coordinates lie in one group");
  constexpr int lanes_per_group = 32 / P;
  std::uint32_t w[3] = {0u, 0u, 0u};
#pragma unroll
  for (int r = 0; r < P; ++r) {
    const int j = (lane * P + r) & 31;
    const std::uint32_t c = code[r] & 7u;
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
#pragma unroll
  for (int o = 1; o < lanes_per_group; o <<= 1)
#pragma unroll
    for (int t = 0; t < 3; ++t) w[t] |= __shfl_xor_sync(full_warp, w[t], o);
  std::uint32_t* out = reinterpret_cast<std::uint32_t*>(payload) + 3 * ((lane * P) >> 5);
  const int li = lane % lanes_per_group;
  if constexpr (lanes_per_group >= 3) {
    if (li < 3) out[li] = li == 0 ? w[0] : li == 1 ? w[1] : w[2];
  } else if (li == 0) {
#pragma unroll
    for (int t = 0; t < 3; ++t) out[t] = w[t];
  }
}

// Packs this lane's P TQ4 codes (coordinates [lane*P, lane*P + P)) as P/2 nibble bytes at
// payload + lane*P/2 (docs/formats.md: coordinate 2b in the low nibble of byte b).
template <int P>
__device__ __forceinline__ void warp_pack_tq4(const std::uint32_t (&code)[P], std::uint8_t* payload, int lane) {
  static_assert(P % 2 == 0, "warp_pack_tq4: whole bytes per lane (head_dim >= 64)");
  std::uint8_t b[P / 2];
#pragma unroll
  for (int i = 0; i < P / 2; ++i) b[i] = std::uint8_t((code[2 * i] & 15u) | ((code[2 * i + 1] & 15u) << 4));
  store_bytes<P / 2>(payload + lane * (P / 2), b);
}

template <class Codec, int P>
__device__ __forceinline__ void warp_pack_tq(const std::uint32_t (&code)[P], std::uint8_t* payload, int lane) {
  if constexpr (Codec::format == storage_format::tq3) {
    warp_pack_tq3<P>(code, payload, lane);
  } else {
    static_assert(Codec::format == storage_format::tq4, "warp_pack_tq: a TQ3 or TQ4 codec");
    warp_pack_tq4<P>(code, payload, lane);
  }
}

// TQ3 / TQ4 encode (exactly tq_codec::encode), codes packed in registers.
// The payload must be 4-byte aligned.
template <class Codec, int P>
__device__ __forceinline__ bool warp_encode_tq(const float (&x)[P], std::uint8_t* payload,
                                               typename Codec::meta_type* meta, std::uint64_t seed, int lane) {
  constexpr int D = Codec::head_dim;
  using grid = typename Codec::grid;
  static_assert(P * 32 == D, "warp_encode_tq: one warp owns d/32 coordinates per lane");
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int r = 0; r < P; ++r) {
    finite = finite && tierkv::detail::is_finite_bits(x[r]);
    amax = fmaxf(amax, tierkv::detail::abs_bits(x[r]));
  }
  finite = __all_sync(full_warp, finite);
  amax = warp_max(amax);
  std::uint32_t codes[P];
  if (!finite || amax == 0.f) {
    // all-zero vector: zero_code everywhere, alpha 0; non-finite: zero payload, poison meta
#pragma unroll
    for (int r = 0; r < P; ++r) codes[r] = finite ? std::uint32_t(Codec::zero_code) : 0u;
    warp_pack_tq<Codec, P>(codes, payload, lane);
    if (lane == 0) *meta = finite ? typename Codec::meta_type(0) : Codec::poison_meta;
    return finite;
  }
  const int k = tierkv::detail::unit_exponent(amax);
  float z[P];
  float sumsq = 0.f;
#pragma unroll
  for (int r = 0; r < P; ++r) {
    z[r] = tierkv::detail::scale_pow2(x[r], k);
    sumsq = fmaf(z[r], z[r], sumsq);
  }
  sumsq = warp_sum_canonical(sumsq);
  warp_signs<P>(z, seed, lane);
  warp_wht<P>(z, lane);
  const typename grid::bounds bounds = grid::make_bounds(sqrtf(sumsq));
  float s_zc = 0.f, s_cc = 0.f;
#pragma unroll
  for (int r = 0; r < P; ++r) {
    const int code = grid::quantize(z[r], bounds);
    codes[r] = std::uint32_t(code);
    const float c = grid::level(code);
    s_zc = fmaf(z[r], c, s_zc);
    s_cc = fmaf(c, c, s_cc);
  }
  s_zc = warp_sum_canonical(s_zc);
  s_cc = warp_sum_canonical(s_cc);
  warp_pack_tq<Codec, P>(codes, payload, lane);
  if (lane == 0) {
    bool saturated = false;
    *meta = tierkv::detail::tq_alpha(Codec::norm, D, sumsq, s_zc, s_cc, k, grid::plain_scale, &saturated);
  }
  return true;
}

// TQ3 / TQ4 decode (exactly tq_codec::decode: alpha*c, inverse rotation D H_un / d).
template <class Codec, int P>
__device__ __forceinline__ void warp_decode_tq(const std::uint8_t* payload, typename Codec::meta_type meta,
                                               std::uint64_t seed, float (&x)[P], int lane) {
  constexpr int D = Codec::head_dim;
  using grid = typename Codec::grid;
  const float w = 1.0f * bf16_to_float(meta);
  if constexpr (Codec::format == storage_format::tq3) {
    // This lane's P <= 16 coordinates lie in one 32-coordinate group: three aligned words.
    const std::uint32_t* grp = reinterpret_cast<const std::uint32_t*>(payload) + 3 * ((lane * P) / 32);
    const std::uint32_t words[3] = {grp[0], grp[1], grp[2]};
#pragma unroll
    for (int r = 0; r < P; ++r) x[r] = 0.0f + w * grid::level(tierkv::detail::tq3_unpack(words, (lane * P + r) % 32));
  } else {
    static_assert(P % 2 == 0, "warp_decode_tq: TQ4 needs whole bytes per lane (head_dim >= 64)");
    std::uint8_t b[P / 2];
    load_bytes<P / 2>(payload + lane * (P / 2), b);
#pragma unroll
    for (int r = 0; r < P; ++r) x[r] = 0.0f + w * grid::level((b[r / 2] >> (4 * (r % 2))) & 15);
  }
  warp_inverse_rotation<D, P>(x, seed, lane);
}

// int8_rotated encode (exactly int8_rotated_codec::encode): the same power-of-two scaling
// and rotation as TQ3, a warp maximum, then the codec's alpha_for and per-element rounding.
template <class Codec, int P>
__device__ __forceinline__ bool warp_encode_int8r(const float (&x)[P], std::uint8_t* payload,
                                                  typename Codec::meta_type* meta, std::uint64_t seed,
                                                  int lane) {
  static_assert(P * 32 == Codec::head_dim, "warp_encode_int8r: one warp owns d/32 coordinates per lane");
  float amax = 0.f;
  bool finite = true;
#pragma unroll
  for (int r = 0; r < P; ++r) {
    finite = finite && tierkv::detail::is_finite_bits(x[r]);
    amax = fmaxf(amax, fminf(tierkv::detail::abs_bits(x[r]), Codec::input_limit));
  }
  finite = __all_sync(full_warp, finite);
  amax = warp_max(amax);
  std::uint8_t codes[P];
  if (!finite || amax == 0.f) {
#pragma unroll
    for (int r = 0; r < P; ++r) codes[r] = 0;
    store_bytes<P>(payload + lane * P, codes);
    if (lane == 0) *meta = finite ? typename Codec::meta_type(0) : Codec::poison_meta;
    return finite;
  }
  const int k = tierkv::detail::unit_exponent(amax);
  float z[P];
#pragma unroll
  for (int r = 0; r < P; ++r)
    z[r] = tierkv::detail::scale_pow2(fmaxf(fminf(x[r], Codec::input_limit), -Codec::input_limit), k);
  warp_signs<P>(z, seed, lane);
  warp_wht<P>(z, lane);
  float zmax = 0.f;
#pragma unroll
  for (int r = 0; r < P; ++r) zmax = fmaxf(zmax, tierkv::detail::abs_bits(z[r]));
  zmax = warp_max(zmax);
  const typename Codec::meta_type alpha = Codec::alpha_for(zmax, k);
  const float step = tierkv::detail::scale_pow2(bf16_to_float(alpha), k);
#pragma unroll
  for (int r = 0; r < P; ++r) {
    const float q = __fdiv_rn(z[r], step);
    int c = int(q + (q >= 0.0f ? 0.5f : -0.5f));
    c = c > Codec::max_code ? Codec::max_code : (c < -Codec::max_code ? -Codec::max_code : c);
    codes[r] = std::uint8_t(std::int8_t(c));
  }
  store_bytes<P>(payload + lane * P, codes);
  if (lane == 0) *meta = alpha;
  return true;
}

// int8_rotated decode (exactly int8_rotated_codec::decode: alpha*c, D H_un / d).
template <class Codec, int P>
__device__ __forceinline__ void warp_decode_int8r(const std::uint8_t* payload,
                                                  typename Codec::meta_type meta, std::uint64_t seed,
                                                  float (&x)[P], int lane) {
  constexpr int D = Codec::head_dim;
  const float w = 1.0f * bf16_to_float(meta);
  std::uint8_t codes[P];
  load_bytes<P>(payload + lane * P, codes);
#pragma unroll
  for (int r = 0; r < P; ++r) x[r] = 0.0f + w * float(std::int8_t(codes[r]));
  warp_inverse_rotation<D, P>(x, seed, lane);
}

}  // namespace tierkv::cuda::detail
