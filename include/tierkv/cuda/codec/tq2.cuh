// SPDX-License-Identifier: Apache-2.0
// TQ2 on the device (the Cold tier, issue 52): the CUDA-core slice reader and the tensor-core
// fragments (uint8 keys against int8 queries, biased f16 values through a byte permute); the
// encoder and decoder are the shared TurboQuant ones (codec/turboquant.cuh).
//
// Layout (codec/tq2.hpp, docs/formats.md): 32-bit word k holds coordinates 16k..16k+15,
// coordinate 16k + i in bits 8 (i % 4) + 2 (i / 4): byte j holds coordinates 16k + j + 4f in its
// bit pairs f = 0..3. So one shift and one mask give four codes of consecutive coordinates, one
// per byte: `(w >> 2f) & 0x03030303` is coordinates 16k + 4f .. 16k + 4f + 3, the A register of
// a uint8 x int8 mma; `(w >> 2p) & 0x33333333` is eight codes as byte-permute selectors.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tierkv/codec/tq2.hpp"
#include "tierkv/cuda/arch/bits.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/codec/turboquant.cuh"
#include "tierkv/cuda/warp/payload.cuh"
namespace tierkv::cuda::detail {

// TQ2: 16 codes are one 4-byte load; level c - 1.5 (codec/tq2.hpp).
template <class C>
struct tq2_slice_reader {
  static_assert(C::payload_bytes * 4 == std::size_t(C::head_dim),
                "tq2 reader: payload must be head_dim/4 bytes");
  using raw = std::uint32_t;
  static constexpr float code_scale = 1.f;

  template <bool Shared = false>
  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const std::uint32_t* p = reinterpret_cast<const std::uint32_t*>(payload) + slice;
    return Shared ? *p : __ldg(p);
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      x[i] = float((r >> (8 * (i % 4) + 2 * (i / 4))) & 3u) - C::grid::offset;
  }
  // Coordinates 2m, 2m + 1 are bytes 2m % 4 and 2m % 4 + 1 of bit pair m / 2: one shift puts
  // both codes at bits 0-1 and 8-9. As 16-bit floats whose spacing at Base is 1/2, the bits
  // Base | 2c are Base + c; minus Base + 1.5 (a multiple of 1/2: exact) leaves c - 1.5 exactly.
  template <std::uint32_t BaseBits, class Pair>
  __device__ __forceinline__ static void unpack_pairs(const raw& r, std::uint32_t (&h)[8],
                                                      Pair bias) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const std::uint32_t t = r >> (8 * ((2 * m) % 4) + 2 * (m / 2));
      const std::uint32_t bits = ((t << 1) & 0x6u) | ((t << 9) & 0x60000u) | BaseBits;
      const Pair v = *reinterpret_cast<const Pair*>(&bits) - bias;
      h[m] = *reinterpret_cast<const std::uint32_t*>(&v);
    }
  }
  static_assert(C::grid::offset == 1.5f, "tq2 reader: levels c - 1.5");
  // f16 512 (spacing 1/2 in [512, 1024)), and bf16 64 (spacing 1/2 in [64, 128)).
  __device__ __forceinline__ static void unpack_h2(const raw& r, int, std::uint32_t (&h)[8]) {
    unpack_pairs<0x60006000u>(r, h, __float2half2_rn(513.5f));
  }
  __device__ __forceinline__ static void unpack_bf16x2(const raw& r, int, std::uint32_t (&h)[8]) {
    unpack_pairs<0x42804280u>(r, h, __float2bfloat162_rn(65.5f));
  }
};

// TQ2 keys on uint8 x int8 mma (as TQ4 keys): lane c of a 4-lane column group holds the row's
// words c KW .. c KW + KW - 1 (KW = head_dim / 64); k32 step s is bit pairs 2 (s % 2) and
// 2 (s % 2) + 1 of its word s / 2: coordinates 16 k + 8 (s % 2) + 0..3 (a0) and + 4..7 (a2),
// one shift-and-mask (lop3) per 4 codes. The level is c - 1.5: mma_tier_pages subtracts
// 1.5 x (the head's sum of its int8-rounded query), an exact integer in halves.
// TQ2 values on f16 mma: the 2-bit codes of a word, shifted by 0 or 2 and masked to
// 0x33333333, are eight byte-permute selectors (the "effective words" of TQ3's values) into a
// 4-entry table of biased levels u = L + 128, L = 2c - 3 (level = L / 2): TQ3's widening and
// bias handling (widen_biased_levels, codec/turboquant.cuh) then apply as they are.
template <class C>
struct tq2_fragments : fragment_defaults {
  static constexpr int D = C::head_dim;
  static_assert(D % 64 == 0, "tensor-core decode: tq2 head_dim must be a multiple of 64");
  // ---- keys
  static constexpr int key_words = D / 64;  // per lane; two k32 steps a word
  static constexpr bool s8_keys = true;
  static constexpr bool key_unsigned = true;
  static constexpr float key_level_scale = 1.f, key_level_offset = C::grid::offset;
  static constexpr int query_parts = 2;  // 13 bits: far below TQ2's own error
  template <bool Shared>
  __device__ __forceinline__ static void load_key(const std::uint8_t* row, int c,
                                                  std::uint32_t (&w)[key_words]) {
    if constexpr (key_words == 1) {
      const std::uint32_t* p = reinterpret_cast<const std::uint32_t*>(row) + c;
      w[0] = Shared ? *p : __ldg(p);
    } else {
      load_lane_segments<4 * key_words, 4, Shared>(row, c, w);
    }
  }
  __device__ __forceinline__ static void key_frag_s8(const std::uint32_t (&w)[key_words], int,
                                                     int s, std::uint32_t& a0, std::uint32_t& a2) {
    const std::uint32_t t = w[s / 2] >> (4 * (s % 2));
    a0 = t & 0x03030303u;
    a2 = (t >> 2) & 0x03030303u;
  }
  __device__ __forceinline__ static int key_coord_s8(int c, int s, int j) {
    return 16 * (c * key_words + s / 2) + 8 * (s % 2) + j;
  }
  static constexpr int query_offset_s8(int j) { return j; }

  // ---- values: lane g owns effective words g EW .. g EW + EW - 1 (EW = D / 64), effective word
  // e = bit pairs e % 2 and e % 2 + 2 of raw word e / 2
  static constexpr int value_eff_words = D / 64;
  static constexpr int value_words = D >= 128 ? D / 128 : 1;
  template <bool Shared>
  __device__ __forceinline__ static void load_value(const std::uint8_t* row, int g,
                                                    std::uint32_t (&w)[value_words]) {
    const std::uint32_t* p =
        reinterpret_cast<const std::uint32_t*>(row) + (g * value_eff_words) / 2;
#pragma unroll
    for (int i = 0; i < value_words; ++i) w[i] = Shared ? p[i] : __ldg(p + i);
  }
  __device__ __forceinline__ static std::uint32_t value_word(const std::uint32_t (&w)[value_words],
                                                             int g, int k) {
    const int e = g * value_eff_words + k;
    const int local = e / 2 - (g * value_eff_words) / 2;  // compile-time 0 at d = 64
    return w[local] >> (2 * (e % 2));
  }
  // biased levels u = 2c - 3 + 128 of codes 0..3 as the bytes of one word
  static constexpr std::uint32_t value_levels_u8 = 0x83817F7Du;
  __device__ __forceinline__ static std::uint32_t value_table(const void*) {
    return value_levels_u8;
  }
  template <bool Biased>
  __device__ __forceinline__ static void value_pairs(std::uint32_t w0, std::uint32_t w1,
                                                     std::uint32_t (&out)[4][2],
                                                     std::uint32_t table) {
    const std::uint32_t x =
        mask_codes<0x33333333u>(__byte_perm(w0, w1, 0x5140));  // bytes 0, 1 of t0, t1
    const std::uint32_t y = mask_codes<0x33333333u>(__byte_perm(w0, w1, 0x7362));  // bytes 2, 3
    const std::uint32_t sels[4] = {x, x >> 16, y, y >> 16};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const std::uint32_t u = __byte_perm(table, 0u, sels[b] & 0x3333u);
      out[b][0] = widen_biased_levels<0x4240, Biased>(u);
      out[b][1] = widen_biased_levels<0x4341, Biased>(u);
    }
  }
  // L / 1024 = level / 512 (+ 9), or biased (L + 128) 2^-24 = level 2^-23 (+ 23) plus the bias
  // pair, which the tier's loop accumulates alone and subtracts at its end (as TQ3's).
  static constexpr float value_log2_unit(bool biased) { return biased ? 23.f : 9.f; }
  static constexpr std::uint32_t value_bias_pair = 0x00800080u;  // f16 subnormals 128 2^-24
  static constexpr int value_mtiles_per_word = 4;
  static constexpr bool value_codes_finite = true;  // every code is a finite level
  static constexpr bool long_steps_with_s8_keys = true;
  // nibble n of effective word e is coordinate 16 (e / 2) + 8 (n % 2) + 4 (e % 2) + n / 2; m-tile
  // mt's rows g, g + 8 are nibbles 2 (mt % 4) and 2 (mt % 4) + 1 of word g EW + mt / 4
  __device__ __forceinline__ static unsigned value_coord(unsigned g, unsigned mt, unsigned r) {
    const unsigned e = g * value_eff_words + mt / 4;
    return 16 * (e / 2) + 8 * r + 4 * (e % 2) + mt % 4;
  }
};

template <class C>
struct device_codec<C, storage_format::tq2> : turboquant_warp_codec<C> {
  using slice_reader = tq2_slice_reader<C>;
  using fragments = tq2_fragments<C>;
};

}  // namespace tierkv::cuda::detail
