// SPDX-License-Identifier: Apache-2.0
// Tensor-core fragments of the byte-per-coordinate formats (FP8 E4M3, int8_rotated): one
// converter of two codes to a half2 apart, the same key and value operand builders.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>
#include <type_traits>

#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/warp/payload.cuh"
namespace tierkv::cuda::detail {

struct fp8_to_h2 {
  __device__ __forceinline__ static std::uint32_t x2(std::uint32_t w) { return fp8x2_to_h2(w); }
  __device__ __forceinline__ static std::uint32_t x2_hi(std::uint32_t w) {
    return fp8x2_hi_to_h2(w);
  }
};
struct s8_to_h2 {
  __device__ __forceinline__ static std::uint32_t x2(std::uint32_t w) {
    return s8x2_to_h2<0x4140>(w);
  }
  __device__ __forceinline__ static std::uint32_t x2_hi(std::uint32_t w) {
    return s8x2_to_h2<0x4342>(w);
  }
};

// One byte per coordinate (FP8 E4M3, int8_rotated): Cvt turns two codes into a half2.
template <class C, class Cvt>
struct mma_byte_codec : fragment_defaults {
  static constexpr int D = C::head_dim;
  static_assert(D % 64 == 0, "tensor-core decode: fp8 / int8 head_dim must be a multiple of 64");
  // keys: lane c reads 16 bytes at 64 seg + 16 c; word w of segment seg is step 4 seg + w
  static constexpr int key_words = D / 16;
  template <bool Shared>
  __device__ __forceinline__ static void load_key(const std::uint8_t* row, int c,
                                                  std::uint32_t (&w)[key_words]) {
    load_lane_segments<16, 4, Shared>(row, c, w);
  }
  // FP8 keys convert to their f16 levels (int8_rotated keys take key_frag_s8 below).
  __device__ __forceinline__ static void key_frag(const std::uint32_t (&w)[key_words], int, int s,
                                                  std::uint32_t& lo, std::uint32_t& hi) {
    lo = Cvt::x2(w[s]);
    hi = Cvt::x2_hi(w[s]);
  }
  __device__ __forceinline__ static int key_coord(int c, int s, int j) {
    return 64 * (s / 4) + 16 * c + 4 * (s % 4) + j;
  }
  // int8 codes (int8_rotated) are their own levels: they enter an int8 mma as loaded. k32 step
  // s takes words 2s (k slots 4c..4c+3) and 2s + 1 (slots 16+4c..); key_coord_s8's j = 0..7.
  static constexpr bool s8_keys = std::is_same_v<Cvt, s8_to_h2>;
  static constexpr bool key_unsigned = false;
  static constexpr float key_level_scale = 1.f, key_level_offset = 0.f;
  // 20-bit queries (3 int8 digits): int8_rotated's own inner-product error is ~0.0065/sqrt(d),
  // so its scores are checked against the host path at ~fp32 precision; 13 bits moved the LSE
  // by up to 6e-4 (test_cuda_decode; docs/history/gpu-runs.md, run 10).
  static constexpr int query_parts = 3;
  __device__ __forceinline__ static void key_frag_s8(const std::uint32_t (&w)[key_words], int,
                                                     int s, std::uint32_t& a0, std::uint32_t& a2) {
    a0 = w[2 * s];
    a2 = w[2 * s + 1];
  }
  __device__ __forceinline__ static int key_coord_s8(int c, int s, int j) {
    return key_coord(c, 2 * s + j / 4, j % 4);
  }
  // The 8 coordinates of (c, s) are [key_coord_s8(c, s, 0), +8) (mma_tier_pages reads them as
  // two 16-byte vectors): slot j is coordinate base + query_offset_s8(j).
  static constexpr int query_offset_s8(int j) { return j; }

  // values: segments of SEG dims; lane g reads SEG/8 bytes at SEG seg + (SEG/8) g.
  static constexpr int SEG = D >= 128 ? 128 : 64;
  static constexpr int value_words = D / 32;
  static constexpr int value_eff_words = value_words;
  __device__ __forceinline__ static std::uint32_t value_word(const std::uint32_t (&w)[value_words],
                                                             int, int k) {
    return w[k];
  }
  template <bool Shared>
  __device__ __forceinline__ static void load_value(const std::uint8_t* row, int g,
                                                    std::uint32_t (&w)[value_words]) {
    load_lane_segments<SEG / 8, 8, Shared>(row, g, w);
  }
  // word wi of tokens t0, t1 -> m-tiles 2 wi (bytes 0, 1) and 2 wi + 1 (bytes 2, 3):
  // out[m][r] = (row g + 8 r: token t0, token t1)
  // (no lookup table and no bias: Cvt converts the codes; the parameters keep one value_pairs
  // interface)
  __device__ __forceinline__ static std::uint32_t value_table(const void*) { return 0; }
  template <bool Biased>
  __device__ __forceinline__ static void value_pairs(std::uint32_t w0, std::uint32_t w1,
                                                     std::uint32_t (&out)[2][2], std::uint32_t) {
    const std::uint32_t x = __byte_perm(w0, w1, 0x5140);
    const std::uint32_t y = __byte_perm(w0, w1, 0x7362);
    out[0][0] = Cvt::x2(x);
    out[0][1] = Cvt::x2_hi(x);
    out[1][0] = Cvt::x2(y);
    out[1][1] = Cvt::x2_hi(y);
  }
  static constexpr int value_mtiles_per_word = 2;
  // int8 codes are all finite levels; E4M3 0x7F / 0xFF are NaN, so FP8 value codes past a
  // page's tokens must not reach the product (0 x NaN)
  static constexpr bool value_codes_finite = s8_keys;
  // FP8 tiers take 32-token steps at d <= 128 (a 66 KB slot per block at d = 256 would leave 2
  // blocks per SM); int8_rotated tiers keep 16-token steps (not measured)
  static constexpr int long_steps_max_head_dim = s8_keys ? 0 : 128;
  // the fragments hold the code values, with no bias
  static constexpr float value_log2_unit(bool) { return 0.f; }
  static constexpr std::uint32_t value_bias_pair = 0;
  __device__ __forceinline__ static unsigned value_coord(unsigned g, unsigned mt, unsigned r) {
    const unsigned wi = mt / 2, j = 2 * (mt % 2) + r;  // byte j of word wi
    constexpr unsigned wps = SEG / 32;                 // words per segment and lane
    return SEG * (wi / wps) + (SEG / 8) * g + 4 * (wi % wps) + j;
  }
};

}  // namespace tierkv::cuda::detail
