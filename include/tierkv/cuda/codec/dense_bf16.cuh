// SPDX-License-Identifier: Apache-2.0
// dense_bf16 on the device: the BF16 control arm of the mixed-format decode (the pages engines
// store today, read by the same kernels as the quantized tiers). No per-token metadata (the
// kernels take a scale of 1), no rotation; the tensor-core fragments are the bf16 values
// themselves, on bf16 mma (an f16 operand would overflow beyond 65504 and round below 2^-14).
// Decode only: prefill's keys are f16 and the retier / append kernels have no warp codec here.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/warp/payload.cuh"
namespace tierkv::cuda::detail {

// 16 values are 32 bytes: two 16-byte loads.
template <class C>
struct dense_bf16_slice_reader {
  static_assert(C::payload_bytes == 2 * std::size_t(C::head_dim),
                "dense_bf16 reader: payload must be 2 x head_dim bytes (codec/dense_bf16.hpp)");
  struct raw {
    uint4 lo, hi;
  };
  static constexpr float code_scale = 1.f;

  template <bool Shared = false>
  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const uint4* p = reinterpret_cast<const uint4*>(payload) + 2 * slice;
    return Shared ? raw{p[0], p[1]} : raw{__ldg(p), __ldg(p + 1)};
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
    const std::uint32_t w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // the high half is a float as it lies, masked (no shift)
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  }
  // No unpack_h2: a bf16 value has no exact f16 in general.
};

// Tensor-core operands: bf16 pairs as stored.
template <class C>
struct dense_bf16_fragments : fragment_defaults {
  static constexpr int D = C::head_dim;
  static_assert(D % 64 == 0, "tensor-core decode: dense_bf16 head_dim must be a multiple of 64");
  static constexpr operand_type key_operand = operand_type::bf16;
  static constexpr operand_type value_operand = operand_type::bf16;
  // keys: lane c reads 16 bytes (8 values) at 64 seg + 16 c; k16 step s takes words 2s (its k
  // slots 2c, 2c + 1) and 2s + 1 (2c + 8, 2c + 9): coordinates 32 (s / 2) + 8 c + 4 (s % 2) + j.
  static constexpr int key_words = D / 8;
  template <bool Shared>
  __device__ __forceinline__ static void load_key(const std::uint8_t* row, int c,
                                                  std::uint32_t (&w)[key_words]) {
    load_lane_segments<16, 4, Shared>(row, c, w);
  }
  __device__ __forceinline__ static void key_frag(const std::uint32_t (&w)[key_words], int, int s,
                                                  std::uint32_t& lo, std::uint32_t& hi) {
    lo = w[2 * s];
    hi = w[2 * s + 1];
  }
  __device__ __forceinline__ static int key_coord(int c, int s, int j) {
    return 32 * (s / 2) + 8 * c + 4 * (s % 2) + j;
  }
  static constexpr bool s8_keys = false;
  static constexpr bool key_unsigned = false;
  static constexpr float key_level_scale = 1.f, key_level_offset = 0.f;
  static constexpr int query_parts = 1;

  // values: lane g reads 16 bytes (8 values) at 128 seg + 16 g; word k is m-tile k: its two
  // values are rows g, g + 8 (coordinates 64 (k / 4) + 8 g + 2 (k % 4) + r).
  static constexpr int value_words = D / 16;
  static constexpr int value_eff_words = value_words;
  static constexpr int value_mtiles_per_word = 1;
  // bf16 NaN / Inf bit patterns past a page's tokens must not reach the product (0 x NaN)
  static constexpr bool value_codes_finite = false;
  template <bool Shared>
  __device__ __forceinline__ static void load_value(const std::uint8_t* row, int g,
                                                    std::uint32_t (&w)[value_words]) {
    load_lane_segments<16, 8, Shared>(row, g, w);
  }
  __device__ __forceinline__ static std::uint32_t value_word(const std::uint32_t (&w)[value_words],
                                                             int, int k) {
    return w[k];
  }
  __device__ __forceinline__ static std::uint32_t value_table(const void*) { return 0; }
  // word k of tokens t0, t1 -> m-tile k: (t0, t1) of the low values (row g), of the high (g + 8)
  template <bool Biased>
  __device__ __forceinline__ static void value_pairs(std::uint32_t w0, std::uint32_t w1,
                                                     std::uint32_t (&out)[1][2], std::uint32_t) {
    out[0][0] = __byte_perm(w0, w1, 0x5410);
    out[0][1] = __byte_perm(w0, w1, 0x7632);
  }
  static constexpr float value_log2_unit(bool) { return 0.f; }
  static constexpr std::uint32_t value_bias_pair = 0;
  __device__ __forceinline__ static unsigned value_coord(unsigned g, unsigned mt, unsigned r) {
    return 64 * (mt / 4) + 8 * g + 2 * (mt % 4) + r;
  }
};

template <class C>
struct device_codec<C, storage_format::dense_bf16> : device_codec_defaults {
  static constexpr bool rotated = false;
  using slice_reader = dense_bf16_slice_reader<C>;
  using fragments = dense_bf16_fragments<C>;
};

}  // namespace tierkv::cuda::detail
