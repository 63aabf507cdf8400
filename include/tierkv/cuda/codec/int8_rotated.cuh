// SPDX-License-Identifier: Apache-2.0
// int8_rotated on the device: the warp encoder and decoder (bit-exact with
// int8_rotated_codec), the CUDA-core slice reader and the tensor-core fragments.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/codec/byte_fragments.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/warp/lane_group.cuh"
#include "tierkv/cuda/warp/payload.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
#include "tierkv/cuda/warp/scaling.cuh"
namespace tierkv::cuda::detail {

// ---- int8_rotated --------------------------------------------------------------------------

// int8_rotated encode (exactly int8_rotated_codec::encode): the same power-of-two scaling
// and rotation as TQ3, a group maximum, then the codec's alpha_for and per-element rounding.
template <class Codec, int N, bool F, bool S>
__device__ __forceinline__ bool warp_encode_int8r(const lane_vector<N, F, S>& v,
                                                  std::uint8_t* payload,
                                                  typename Codec::meta_type* meta,
                                                  std::uint64_t seed, int lane) {
  using lg = lane_group<Codec::head_dim, N>;
  using meta_t = typename Codec::meta_type;
  float z[N];
  const auto [finite, coded, k] = rotated_input<lg::G>(v, Codec::input_limit, z);
  if constexpr (!lane_vector<N, F, S>::rotation_signed) warp_signs<N, lg::G>(z, seed, lane);
  warp_wht<N, lg::G>(z, lane);
  const float zmax = __uint_as_float(group_max_bits<lg::G>(lane_max_abs_bits(z)));
  const meta_t alpha = coded ? Codec::alpha_for(zmax, k) : meta_t(0);
  const narrow_divisor div =
      narrow_divisor::of(tierkv::detail::scale_pow2(bf16_to_float(alpha), k));
  std::uint32_t w[(N + 3) / 4];  // codes four to a word as they are produced
  const auto encode = [&](auto fast) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      const float q = div.template divide<decltype(fast)::value>(z[r]);
      int c = int(q + (q >= 0.0f ? 0.5f : -0.5f));
      c = c > Codec::max_code ? Codec::max_code : (c < -Codec::max_code ? -Codec::max_code : c);
      const std::uint32_t b = std::uint32_t(c) & 0xffu;
      w[r / 4] = r % 4 == 0 ? b : w[r / 4] | (b << (8 * (r % 4)));
    }
  };
  if (!warp_any<lg::G>(coded && !div.fast))
    encode(std::true_type{});
  else
    encode(std::false_type{});
  store_code_words<lane_alignment(Codec::payload_bytes, N), N>(payload + lg::index(lane) * N, w,
                                                               coded);
  if (lg::index(lane) == 0) *meta = finite ? alpha : Codec::poison_meta;
  return finite;
}
template <class Codec, int N>
__device__ __forceinline__ bool warp_encode_int8r(const float (&x)[N], std::uint8_t* payload,
                                                  typename Codec::meta_type* meta,
                                                  std::uint64_t seed, int lane) {
  return warp_encode_int8r<Codec, N>(make_lane_vector(x), payload, meta, seed, lane);
}

// int8_rotated decode (exactly int8_rotated_codec::decode: 0 + alpha*c, D H_un / d; Signed: D x;
// with a lane_exchange in runs).
template <class Codec, int N, bool Signed = false, class Exchange = no_exchange>
__device__ __forceinline__ void warp_decode_int8r(const std::uint8_t* payload,
                                                  typename Codec::meta_type meta,
                                                  std::uint64_t seed, float (&x)[N], int lane,
                                                  const Exchange& ex = {}) {
  constexpr int D = Codec::head_dim;
  const std::uint8_t* p = payload + lane_group<D, N>::index(lane) * N;
  if constexpr (N % 4 == 0) {  // a word of four codes at a time, biased by one xor
    std::uint32_t w[N / 4];
    load_words<lane_alignment(Codec::payload_bytes, N)>(p, w);
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = biased_byte_value(w[r / 4] ^ 0x80808080u, r % 4);
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = biased_byte_value(p[r] ^ 0x80u, 0);
  }
  warp_inverse_rotation_of_levels<D, N, !Signed>(x, bf16_to_float(meta), 1.0f, seed, lane, ex);
}

// int8_rotated: 16 codes are one 16-byte load; each signed byte converts exactly.
template <class C>
struct int8_rotated_slice_reader {
  static_assert(C::payload_bytes == std::size_t(C::head_dim),
                "int8_rotated reader: payload must be head_dim bytes (docs/formats.md)");
  using raw = uint4;
  static constexpr float code_scale = 1.f;  // dot = alpha * sum q''_i c_i (codec/int8_rotated.hpp)

  template <bool Shared = false>
  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const uint4* p = reinterpret_cast<const uint4*>(payload) + slice;
    return Shared ? *p : __ldg(p);
  }
  __device__ __forceinline__ static void unpack4(std::uint32_t w, float* x) {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = float(std::int8_t(std::uint8_t(w >> (8 * j))));
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
    unpack4(r.x, x + 0);
    unpack4(r.y, x + 4);
    unpack4(r.z, x + 8);
    unpack4(r.w, x + 12);
  }
  // The same 16 codes as f16 (unpack_h2: the prefill's keys) or bf16 (unpack_bf16x2: its values)
  // pairs (x[2c], x[2c + 1]) in h[c], exact.
  template <bool Bf16>
  __device__ __forceinline__ static void unpack_pairs(const raw& r, std::uint32_t (&h)[8]) {
    const std::uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      h[2 * j] = Bf16 ? s8x2_to_bf16x2<0x4140>(w[j]) : s8x2_to_h2<0x4140>(w[j]);
      h[2 * j + 1] = Bf16 ? s8x2_to_bf16x2<0x4342>(w[j]) : s8x2_to_h2<0x4342>(w[j]);
    }
  }
  __device__ __forceinline__ static void unpack_h2(const raw& r, int, std::uint32_t (&h)[8]) {
    unpack_pairs<false>(r, h);
  }
  __device__ __forceinline__ static void unpack_bf16x2(const raw& r, int, std::uint32_t (&h)[8]) {
    unpack_pairs<true>(r, h);
  }
};

template <class C>
struct device_codec<C, storage_format::int8_rotated> : device_codec_defaults {
  static constexpr bool rotated = true;
  static constexpr bool appends = true;  // an append tier's format (append_encode below)
  using slice_reader = int8_rotated_slice_reader<C>;
  using fragments = mma_byte_codec<C, s8_to_h2>;

  template <int N, bool Signed, class Signs, class Exchange>
  __device__ __forceinline__ static auto warp_decode(const std::uint8_t* payload,
                                                     typename C::meta_type meta, std::uint64_t seed,
                                                     const Signs* signs, const Exchange& ex,
                                                     int lane) {
    (void)signs;
    float x[N];
    warp_decode_int8r<C, N, Signed>(payload, meta, seed, x, lane, ex);
    return make_lane_vector<Signed, Exchange::runs>(x);
  }
  template <int N, bool F, bool S, bool R, class Norm, class Exchange, class Signs>
  __device__ __forceinline__ static bool warp_encode(const lane_vector<N, F, S, R>& v,
                                                     std::uint8_t* payload,
                                                     typename C::meta_type* meta,
                                                     std::uint64_t seed, int lane, Norm norm,
                                                     const Exchange& ex, const Signs* signs) {
    (void)norm, (void)ex, (void)signs;
    return warp_encode_int8r<C, N>(v, payload, meta, seed, lane);
  }
  // A new token's vector (cuda/append/append.cuh), lane l holding coordinates N l .. N l + N - 1:
  // warp_encode_int8r (the rotation needs the whole vector in the warp); non-finite input: its
  // poison and false.
  template <int N>
  __device__ __forceinline__ static bool append_encode(const float (&x)[N], std::uint8_t* payload,
                                                       typename C::meta_type* meta,
                                                       std::uint64_t seed, int lane) {
    static_assert(
        N * 32 == C::head_dim,
        "cuda::append: int8_rotated needs head_dim a multiple of 32 (one warp per vector)");
    return warp_encode_int8r<C, N>(x, payload, meta, seed, lane);
  }
};

}  // namespace tierkv::cuda::detail
