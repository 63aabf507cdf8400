// SPDX-License-Identifier: Apache-2.0
// FP8 E4M3 on the device: everything the kernels know of the format. Warp encode / decode
// (bit-exact with fp8_codec), the CUDA-core slice reader and the tensor-core fragments.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/codec/byte_fragments.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/warp/lane_group.cuh"
#include "tierkv/cuda/warp/payload.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
#include "tierkv/cuda/warp/scaling.cuh"
namespace tierkv::cuda::detail {

// ---- FP8 E4M3 ------------------------------------------------------------------------------

// Two FP8 codes in one conversion (lo in the low byte): the rounding of float_to_fp8.
__device__ __forceinline__ std::uint32_t float2_to_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
#else
  return std::uint32_t(float_to_fp8<fp8_kind::e4m3>(lo)) |
         (std::uint32_t(float_to_fp8<fp8_kind::e4m3>(hi)) << 8);
#endif
}

// Bits 0..3 of `nib` to bits 7, 15, 23, 31 (the signs of four E4M3 codes in a word): one
// multiply by 2^7 + 2^14 + 2^21 + 2^28 moves bit b to b + 7 + 7c for c = 0..3, a target 8b' + 7
// only for c = b, and all these positions differ (no carries).
__device__ __forceinline__ std::uint32_t e4m3_sign_mask(std::uint32_t nib) {
  return ((nib & 0xFu) * 0x10204080u) & 0x80808080u;
}
// The rotation's D as xor masks on a lane's N E4M3 codes (word i holds coordinates gl*N + 4i ..
// gl*N + 4i + 3): the sign bits 7, 15, 23, 31. Flipping a code's sign bit is flipping the sign of
// its value, before decoding or after encoding (E4M3 rounding, clipping and the encoder's
// divisions are odd functions). A function of the seed and the lane alone: a caller converting
// many vectors of one seed (the retier kernel: a row of tokens) makes it once, in shared memory
// (a register copy is remade per vector under that kernel's register limit), lane-interleaved
// (word 4k + c of lane L in component c of uint4 32k + L: a warp's 16-byte accesses hit
// distinct bank quads). A lane reads only its own words: no synchronization. Runs: for a vector
// in lane_exchange's runs (word i: run i / (S/4), coordinates g N + gl S + 4 (i % (S/4)) ..).
template <int N, int G, bool Runs = false>
struct e4m3_sign_masks {
  static_assert(
      N % 16 == 0 && (!Runs || (N <= 64 && (N / G) % 4 == 0)),
      "e4m3_sign_masks: whole 16-byte groups of masks (runs: within one 64-bit sign word)");
  static constexpr int uint4s = 32 * N / 16;  // per warp
  uint4* area;                                // the warp's uint4s
  __device__ __forceinline__ void make(std::uint64_t seed, int lane) const {
    std::uint32_t m[N / 4];
    if constexpr (Runs) {
      constexpr int S = N / G;
#pragma unroll
      for (int g = 0; g < G; ++g) {  // a run's S <= 64 bits lie in one sign word
        const int first = g * N + (lane & (G - 1)) * S;
        const std::uint64_t bits = rotation_sign_word(seed, first >> 6) >> (first & 63);
#pragma unroll
        for (int i = 0; i < S / 4; ++i)
          m[g * (S / 4) + i] = e4m3_sign_mask(std::uint32_t(bits >> (4 * i)));
      }
    } else {
      std::uint32_t bits[(N + 31) / 32];
      lane_sign_bits<N, G>(seed, lane, bits);
#pragma unroll
      for (int i = 0; i < N / 4; ++i) m[i] = e4m3_sign_mask(bits[i / 8] >> (4 * (i % 8)));
    }
#pragma unroll
    for (int k = 0; k < N / 16; ++k)
      area[32 * k + lane] = make_uint4(m[4 * k], m[4 * k + 1], m[4 * k + 2], m[4 * k + 3]);
  }
  __device__ __forceinline__ void load(std::uint32_t (&w)[N / 4], int lane) const {
#pragma unroll
    for (int k = 0; k < N / 16; ++k) {
      const uint4 v = area[32 * k + lane];
      w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
    }
  }
};

// FP8 E4M3 encode of a vector held N per lane (exactly fp8_codec::encode); of D x for a Signed
// vector (the rotation's D as `signs`, flipped on the codes); a vector in runs stored run by run.
// Returns false (and writes the codec's poison) on non-finite input.
template <class Codec, int N, bool F, bool S, bool Runs>
__device__ __forceinline__ bool warp_encode_fp8(
    const lane_vector<N, F, S, Runs>& v, std::uint8_t* payload, typename Codec::meta_type* meta,
    int lane, const e4m3_sign_masks<N, lane_group<Codec::head_dim, N>::G, Runs>* signs = nullptr) {
  static_assert(!S || N % 16 == 0, "warp_encode_fp8: signs on whole groups of code words");
  using lg = lane_group<Codec::head_dim, N>;
  using meta_t = typename Codec::meta_type;
  float amax = __uint_as_float(group_max_bits<lg::G>(v.max_bits));
  if constexpr (F) amax *= fabsf(v.scale);
  const bool finite = (__float_as_uint(amax) & 0x7fffffffu) < inf_bits;
  const meta_t scale = finite ? Codec::scale_for(fminf(amax, Codec::input_limit)) : meta_t(0);
  const bool coded = scale != 0;  // else zero codes (a zero vector, or the poison)
  const narrow_divisor div = narrow_divisor::of(bf16_to_float(scale));
  // codes two by two into 32-bit words (a zero word where not coded)
  constexpr int W = (N + 3) / 4;
  std::uint32_t w[W];
  const auto encode = [&](auto plain) {
    constexpr bool fast = decltype(plain)::value;  // no clip, fast division
#pragma unroll
    for (int r = 0; r < N; r += 2) {
      float q[2] = {0.0f, 0.0f};
#pragma unroll
      for (int u = 0; u < 2 && r + u < N; ++u) {
        const float x = F ? v.x[r + u] * v.scale : v.x[r + u];
        q[u] = div.template divide<fast>(
            fast ? x : fmaxf(fminf(x, Codec::input_limit), -Codec::input_limit));
      }
      const std::uint32_t two = float2_to_e4m3x2(q[0], q[1]);
      w[r / 4] = r % 4 == 0 ? two : w[r / 4] | (two << 16);
    }
  };
  if (!warp_any<lg::G>(coded && (!div.fast || amax > Codec::input_limit)))
    encode(std::true_type{});
  else
    encode(std::false_type{});
  if constexpr (S) {  // D on the codes
    std::uint32_t m[N / 4];
    signs->load(m, lane);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] ^= m[i];
  }
  if constexpr (Runs) {
    constexpr int R = N / lg::G;  // run length
#pragma unroll
    for (int g = 0; g < lg::G; ++g) {
      std::uint32_t run[R / 4];
#pragma unroll
      for (int i = 0; i < R / 4; ++i) run[i] = w[g * (R / 4) + i];
      store_code_words<lane_alignment(Codec::payload_bytes, R), R>(
          payload + g * N + lg::index(lane) * R, run, coded);
    }
  } else {
    store_code_words<lane_alignment(Codec::payload_bytes, N), N>(payload + lg::index(lane) * N, w,
                                                                 coded);
  }
  if (lg::index(lane) == 0) *meta = finite ? scale : Codec::poison_meta;
  return finite;
}
template <class Codec, int N>
__device__ __forceinline__ bool warp_encode_fp8(const float (&x)[N], std::uint8_t* payload,
                                                typename Codec::meta_type* meta, int lane) {
  return warp_encode_fp8<Codec, N>(make_lane_vector(x), payload, meta, lane);
}

// Four E4M3 codes (a little-endian word) as two f16x2 (exact, like code_value): one
// cvt.f16x2.e4m3x2 per 16-bit half of the word.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(std::uint32_t w, std::uint32_t& lo,
                                                  std::uint32_t& hi) {
#if __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 "
      "%1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  const __half2_raw l =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = std::uint32_t(l.x) | (std::uint32_t(l.y) << 16);
  hi = std::uint32_t(h.x) | (std::uint32_t(h.y) << 16);
#endif
}
__device__ __forceinline__ float f16_bits_to_float(std::uint32_t bits16) {
  __half_raw r;
  r.x = static_cast<unsigned short>(bits16);
  return __half2float(__half(r));
}

// FP8 E4M3 decode (exactly fp8_codec::decode), factored: the code values (each exactly
// code_value(c), by one cvt.f16x2.e4m3x2 per two codes), the scale apart (x_r * scale is the
// host's product), and the largest |code value| from f16 maxima (NaN codes propagate). Signed:
// D x for a rotated encoder, by flipping the codes' sign bits with `signs` (that seed's masks).
template <class Codec, int N, bool Signed = false>
__device__ __forceinline__ lane_vector<N, true, Signed> warp_decode_fp8(
    const std::uint8_t* payload, typename Codec::meta_type meta, int lane,
    const e4m3_sign_masks<N, lane_group<Codec::head_dim, N>::G>* signs = nullptr) {
  static_assert(Codec::format == storage_format::fp8_e4m3, "warp_decode_fp8: an E4M3 codec");
  static_assert(!Signed || N % 16 == 0, "warp_decode_fp8: signs on whole groups of code words");
  using lg = lane_group<Codec::head_dim, N>;
  lane_vector<N, true, Signed> v;
  v.scale = bf16_to_float(meta);
  const std::uint8_t* p = payload + lg::index(lane) * N;
  if constexpr (N % 4 == 0) {
    std::uint32_t w[N / 4];
    load_words<lane_alignment(Codec::payload_bytes, N)>(p, w);
    if constexpr (Signed) {  // D on the codes
      std::uint32_t m[N / 4];
      signs->load(m, lane);
#pragma unroll
      for (int i = 0; i < N / 4; ++i) w[i] ^= m[i];
    }
    __half2 m = __float2half2_rn(0.0f);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      std::uint32_t h[2];
      e4m3x4_to_f16x2x2(w[i], h[0], h[1]);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        __half2 pair;
        std::memcpy(&pair, &h[t], sizeof pair);
        m = __hmax2_nan(m, __habs2(pair));
        v.x[4 * i + 2 * t] = f16_bits_to_float(h[t]);
        v.x[4 * i + 2 * t + 1] = f16_bits_to_float(h[t] >> 16);
      }
    }
    const std::uint32_t lo = __float_as_uint(__low2float(m)), hi = __float_as_uint(__high2float(m));
    v.max_bits = (lo > hi ? lo : hi) & 0x7fffffffu;
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) v.x[r] = Codec::code_value(p[r]);
    v.max_bits = lane_max_abs_bits(v.x);
  }
  return v;
}

// FP8 E4M3: 16 codes are one 16-byte load; two codes convert per instruction to half2
// (exact: every E4M3 value is a half), then to float.
template <class C>
struct fp8_slice_reader {
  static_assert(C::payload_bytes == std::size_t(C::head_dim),
                "fp8 reader: payload must be head_dim bytes (docs/formats.md)");
  using raw = uint4;
  static constexpr float code_scale = 1.f;

  template <bool Shared = false>
  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const uint4* p = reinterpret_cast<const uint4*>(payload) + slice;
    return Shared ? *p : __ldg(p);
  }
  __device__ __forceinline__ static void unpack4(std::uint32_t w, float* x) {
    const __half2_raw lo =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw hi =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    const float2 a = __half22float2(__half2(lo));
    const float2 b = __half22float2(__half2(hi));
    x[0] = a.x;
    x[1] = a.y;
    x[2] = b.x;
    x[3] = b.y;
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
    unpack4(r.x, x + 0);
    unpack4(r.y, x + 4);
    unpack4(r.z, x + 8);
    unpack4(r.w, x + 12);
  }
  // The same 16 values as f16 pairs (x[2c], x[2c + 1]) in h[c], exact: one cvt a pair.
  __device__ __forceinline__ static void unpack_h2(const raw& r, int, std::uint32_t (&h)[8]) {
    const std::uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      h[2 * j] = fp8x2_to_h2(w[j]);
      h[2 * j + 1] = fp8x2_hi_to_h2(w[j]);
    }
  }
};

template <class C>
struct device_codec<C, storage_format::fp8_e4m3> : device_codec_defaults {
  static constexpr bool rotated = false;
  static constexpr bool appends = true;  // an append tier's format (append_encode below)
  // D on the codes (e4m3_sign_masks): an FP8 page converts to / from a rotated format without
  // its rotation's first / last sign pass; its encoder stores run by run (lane_exchange)
  static constexpr bool sign_coded = true;
  static constexpr bool stores_runs = true;
  using slice_reader = fp8_slice_reader<C>;
  using fragments = mma_byte_codec<C, fp8_to_h2>;

  template <int N, bool Signed, class Signs, class Exchange>
  __device__ __forceinline__ static auto warp_decode(const std::uint8_t* payload,
                                                     typename C::meta_type meta, std::uint64_t seed,
                                                     const Signs* signs, const Exchange& ex,
                                                     int lane) {
    (void)seed, (void)ex;
    return warp_decode_fp8 < C, N, Signed && N % 16 == 0 > (payload, meta, lane, signs);
  }
  template <int N, bool F, bool S, bool R, class Norm, class Exchange, class Signs>
  __device__ __forceinline__ static bool warp_encode(const lane_vector<N, F, S, R>& v,
                                                     std::uint8_t* payload,
                                                     typename C::meta_type* meta,
                                                     std::uint64_t seed, int lane, Norm norm,
                                                     const Exchange& ex, const Signs* signs) {
    (void)seed, (void)norm, (void)ex;
    return warp_encode_fp8<C, N>(v, payload, meta, lane, signs);
  }
  // A new token's vector (cuda/append/append.cuh), lane l holding coordinates N l .. N l + N - 1
  // (zeros past head_dim), exactly as fp8_codec::encode: the maximum a warp reduction (order-free,
  // so exact), the scale scale_for(), each element converted on its own as encode_with_scale does.
  // Non-finite input: zero codes, the poison meta, and false.
  template <int N>
  __device__ __forceinline__ static bool append_encode(const float (&x)[N], std::uint8_t* payload,
                                                       typename C::meta_type* meta, std::uint64_t,
                                                       int lane) {
    constexpr int D = C::head_dim;
    float amax = 0.f;
    bool finite = true;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      finite = finite && tierkv::detail::is_finite_bits(x[j]);
      float a = tierkv::detail::abs_bits(x[j]);
      if (a > C::input_limit) a = C::input_limit;
      amax = fmaxf(amax, a);
    }
    finite = __all_sync(0xffffffffu, finite);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!finite) {
      for (int i = lane; i < D; i += 32) payload[i] = 0;
      if (lane == 0) *meta = C::poison_meta;
      return false;
    }
    const typename C::meta_type scale = C::scale_for(amax);
    const float s = bf16_to_float(scale);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int i = lane * N + j;  // contiguous per lane: packed byte stores
      if (i >= D) break;
      float val = x[j];
      if (val > C::input_limit) val = C::input_limit;
      if (val < -C::input_limit) val = -C::input_limit;
      payload[i] = scale == 0 ? std::uint8_t(0) : float_to_fp8<fp8_kind::e4m3>(val / s);
    }
    if (lane == 0) *meta = scale;
    return true;
  }
};

}  // namespace tierkv::cuda::detail
