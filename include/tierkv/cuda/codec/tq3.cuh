// SPDX-License-Identifier: Apache-2.0
// TQ3 on the device: everything the kernels know of the format beyond the shared TurboQuant
// encoder (codec/turboquant.cuh): the byte-permute lookups, the CUDA-core slice reader and the
// tensor-core fragments (int8 keys, biased f16 values).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cstdint>

#include "tierkv/codec/tq3.hpp"
#include "tierkv/cuda/arch/bits.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/codec/turboquant.cuh"
#include "tierkv/cuda/warp/payload.cuh"
namespace tierkv::cuda::detail {

// TQ3 values: the 4 nibbles (3-bit codes) of the low 16 bits of `sel` -> their biased levels
// u = L + 128, one byte each (codec/tq3.hpp has the tables).
__device__ __forceinline__ std::uint32_t tq3_lookup_u8(std::uint32_t sel) {
  return prmt(tierkv::detail::tq3_u8_0, tierkv::detail::tq3_u8_1, sel);
}
// TQ3 keys: the same nibbles -> their int8 levels, one byte each (the A register of an int8 mma).
__device__ __forceinline__ std::uint32_t tq3_lookup_s8(std::uint32_t sel) {
  return prmt(tierkv::detail::tq3_s8_0, tierkv::detail::tq3_s8_1, sel);
}

// TQ3 "effective words" of a token: per group of 32 rotated coordinates W0, W1, W2 and the
// gathered bit-3 word; effective word e, nibble n = coordinate 32 group + 8 e + n (n < 8;
// bit 3 of each nibble is masked by the caller). Lane `lane` owns effective words
// lane*EW .. lane*EW + EW - 1; it loads the raw words of their groups (3 per group) and
// forms an effective word when it is used (fewer registers in flight).
template <int EW>
struct tq3_lane_words {
  static constexpr int groups = EW >= 4 ? EW / 4 : 1;
  static constexpr int raw = 3 * groups;
  static_assert(EW >= 4 ? EW % 4 == 0 : 4 % EW == 0, "tq3: effective words per lane");
  template <bool Shared>
  __device__ __forceinline__ static void load(const std::uint8_t* row, int lane,
                                              std::uint32_t (&w)[raw]) {
    const std::uint32_t* p = reinterpret_cast<const std::uint32_t*>(row) + ((lane * EW) / 4) * 3;
#pragma unroll
    for (int i = 0; i < raw; ++i) w[i] = Shared ? p[i] : __ldg(p + i);
  }
  // bits 3 of the nibbles of a, b, c -> bits 0, 1, 2 by two bit-selects (one lop3 each; bit 3
  // is left as is, since the caller masks it): written as masks and ors, the compiler narrowed
  // the masks and took three lop3
  __device__ __forceinline__ static std::uint32_t gather(std::uint32_t a, std::uint32_t b,
                                                         std::uint32_t c) {
    return bit_select(bit_select(a >> 3, b >> 2, 0x11111111u), c >> 1, 0x33333333u);
  }
  // effective word k (0 <= k < EW) of this lane
  __device__ __forceinline__ static std::uint32_t eff(const std::uint32_t (&w)[raw], int lane,
                                                      int k) {
    if constexpr (EW >= 4) {
      const int gi = k / 4, e = k % 4;
      return e < 3 ? w[3 * gi + e] : gather(w[3 * gi], w[3 * gi + 1], w[3 * gi + 2]);
    } else {
      const int e = (lane * EW) % 4 + k;  // runtime: select without indexing
      const std::uint32_t g = gather(w[0], w[1], w[2]);
      return e == 0 ? w[0] : e == 1 ? w[1] : e == 2 ? w[2] : g;
    }
  }
};

// TQ3: a group of 32 rotated coordinates is three words W0..W2; a slice is half a
// group. Half 0 = coordinates 0..15 = the nibbles of W0 and W1; half 1 = 16..31 = the
// nibbles of W2 and the gathered bit-3 word. Each nibble (masked to 3 bits) is a
// __byte_perm selector into an 8-entry table of the levels' fp16 bytes: one
// byte-permute looks up 4 low bytes, one 4 high bytes, two more interleave them into
// two half2 values.
template <class C>
struct tq3_slice_reader {
  static_assert(C::head_dim % 32 == 0, "tq3 reader: head_dim must be a multiple of 32");
  static_assert(C::payload_bytes * 8 == std::size_t(3 * C::head_dim),
                "tq3 reader: payload must be 3*head_dim/8 bytes (docs/formats.md)");
  using raw = uint3;
  // The codec's domain: dot = alpha * sum q''_i c_i with the grid levels c (L / 64) and
  // the query prepared as H D q / d (codec/tq3.hpp), so no extra factor here.
  static constexpr float code_scale = 1.f;

  template <bool Shared = false>
  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(payload) + (slice >> 1) * 3;
    if constexpr (Shared) return make_uint3(w[0], w[1], w[2]);
    return make_uint3(__ldg(w), __ldg(w + 1), __ldg(w + 2));
  }
  // fp16 of the levels (exact), code 0 = -127/64 ... code 7 = +127/64 (codec/tq3.hpp):
  // 0xBFF0 0xBCF0 0xB980 0xB300 0x3300 0x3980 0x3CF0 0x3FF0.
  __device__ __forceinline__ static void lookup4(std::uint32_t sel, float* x) {
    constexpr std::uint32_t lo0 = tierkv::detail::tq3_f16_lo0,
                            lo1 = tierkv::detail::tq3_f16_lo1;  // low bytes, codes 0-3 / 4-7
    constexpr std::uint32_t hi0 = tierkv::detail::tq3_f16_hi0,
                            hi1 = tierkv::detail::tq3_f16_hi1;  // high bytes
    const std::uint32_t lo = __byte_perm(lo0, lo1, sel);
    const std::uint32_t hi = __byte_perm(hi0, hi1, sel);
    const std::uint32_t h01 = __byte_perm(lo, hi, 0x5140);
    const std::uint32_t h23 = __byte_perm(lo, hi, 0x7362);
    __half2_raw r01, r23;
    r01.x = static_cast<unsigned short>(h01 & 0xffffu);
    r01.y = static_cast<unsigned short>(h01 >> 16);
    r23.x = static_cast<unsigned short>(h23 & 0xffffu);
    r23.y = static_cast<unsigned short>(h23 >> 16);
    const float2 a = __half22float2(__half2(r01));
    const float2 b = __half22float2(__half2(r23));
    x[0] = a.x;
    x[1] = a.y;
    x[2] = b.x;
    x[3] = b.y;
  }
  // The same 4 levels as two 16-bit pairs (codes 0, 1 and 2, 3 of the selector) from byte tables
  // (low bytes of codes 0-3 / 4-7, high bytes): f16 or bf16 levels.
  template <std::uint32_t Lo0, std::uint32_t Lo1, std::uint32_t Hi0, std::uint32_t Hi1>
  __device__ __forceinline__ static void lookup4_pairs(std::uint32_t sel, std::uint32_t* h) {
    const std::uint32_t lo = __byte_perm(Lo0, Lo1, sel);
    const std::uint32_t hi = __byte_perm(Hi0, Hi1, sel);
    h[0] = __byte_perm(lo, hi, 0x5140);
    h[1] = __byte_perm(lo, hi, 0x7362);
  }
  __device__ __forceinline__ static void lookup4_h2(std::uint32_t sel, std::uint32_t* h) {
    using namespace tierkv::detail;
    lookup4_pairs<tq3_f16_lo0, tq3_f16_lo1, tq3_f16_hi0, tq3_f16_hi1>(sel, h);
  }
  __device__ __forceinline__ static void lookup4_bf16x2(std::uint32_t sel, std::uint32_t* h) {
    using namespace tierkv::detail;
    lookup4_pairs<tq3_bf16_lo0, tq3_bf16_lo1, tq3_bf16_hi0, tq3_bf16_hi1>(sel, h);
  }
  __device__ __forceinline__ static void lookup8(std::uint32_t nibbles, float* x) {
    lookup4(nibbles & 0x7777u, x);
    lookup4((nibbles >> 16) & 0x7777u, x + 4);
  }
  __device__ __forceinline__ static void unpack(const raw& r, int slice, float (&x)[16]) {
    if (slice & 1) {
      const std::uint32_t g =
          ((r.x >> 3) & 0x11111111u) | ((r.y >> 2) & 0x22222222u) | ((r.z >> 1) & 0x44444444u);
      lookup8(r.z, x);
      lookup8(g, x + 8);
    } else {
      lookup8(r.x, x);
      lookup8(r.y, x + 8);
    }
  }
  // The same 16 levels as f16 (unpack_h2) or bf16 (unpack_bf16x2) pairs (x[2c], x[2c + 1]) in
  // h[c], exact (no float round trip).
  template <bool Bf16>
  __device__ __forceinline__ static void unpack_pairs(const raw& r, int slice,
                                                      std::uint32_t (&h)[8]) {
    std::uint32_t a = r.x, b = r.y;
    if (slice & 1) {
      a = r.z;
      b = ((r.x >> 3) & 0x11111111u) | ((r.y >> 2) & 0x22222222u) | ((r.z >> 1) & 0x44444444u);
    }
    const std::uint32_t sel[4] = {a & 0x7777u, (a >> 16) & 0x7777u, b & 0x7777u,
                                  (b >> 16) & 0x7777u};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (Bf16)
        lookup4_bf16x2(sel[i], h + 2 * i);
      else
        lookup4_h2(sel[i], h + 2 * i);
    }
  }
  __device__ __forceinline__ static void unpack_h2(const raw& r, int slice, std::uint32_t (&h)[8]) {
    unpack_pairs<false>(r, slice, h);
  }
  __device__ __forceinline__ static void unpack_bf16x2(const raw& r, int slice,
                                                       std::uint32_t (&h)[8]) {
    unpack_pairs<true>(r, slice, h);
  }
};

template <class C>
struct tq3_fragments : fragment_defaults {
  static constexpr int D = C::head_dim;
  static_assert(D % 64 == 0, "tensor-core decode: tq3 head_dim must be a multiple of 64");
  // keys: lane c owns D/32 effective words, word s is k32 step s
  using KL = tq3_lane_words<D / 32>;
  static constexpr int key_words = KL::raw;
  template <bool Shared>
  __device__ __forceinline__ static void load_key(const std::uint8_t* row, int c,
                                                  std::uint32_t (&w)[key_words]) {
    KL::template load<Shared>(row, c, w);
  }
  // Keys score on int8 mma: k32 step s is effective word s, its nibbles 0-3 (k slots 4c..4c+3)
  // and 4-7 (16+4c..) one byte-permute each into int8 levels (L, level = L / 64). The f16 path
  // took 4 permutes per 4 codes (two table halves and two interleaves) on the ALU pipe, the
  // bound of a TQ3 step (ncu at 128K B = 32: PRMT 37% of its instructions).
  static constexpr bool s8_keys = true;
  static constexpr bool key_unsigned = false;
  static constexpr float key_level_scale = tierkv::detail::tq3_level_scale, key_level_offset = 0.f;
  // 13-bit queries (2 int8 digits): rounding at 2^-14 of the head's largest element, far below
  // TQ3's own inner-product error (rms 0.12/sqrt(d)).
  static constexpr int query_parts = 2;
  __device__ __forceinline__ static void key_frag_s8(const std::uint32_t (&w)[key_words], int c,
                                                     int s, std::uint32_t& a0, std::uint32_t& a2) {
    const std::uint32_t e = mask_codes<0x77777777u>(KL::eff(w, c, s));
    a0 = tq3_lookup_s8(e);
    a2 = tq3_lookup_s8(e >> 16);
  }
  __device__ __forceinline__ static int key_coord_s8(int c, int s, int j) {
    const int idx = c * (D / 32) + s;
    return 32 * (idx / 4) + 8 * (idx % 4) + j;
  }
  static constexpr int query_offset_s8(int j) { return j; }
  // values: lane g owns D/64 effective words; byte b of word k is m-tile 4 k + b, its
  // nibbles 2b, 2b+1 rows g, g + 8
  using VL = tq3_lane_words<D / 64>;
  static constexpr int value_words = VL::raw;
  static constexpr int value_eff_words = D / 64;
  template <bool Shared>
  __device__ __forceinline__ static void load_value(const std::uint8_t* row, int g,
                                                    std::uint32_t (&w)[value_words]) {
    VL::template load<Shared>(row, g, w);
  }
  __device__ __forceinline__ static std::uint32_t value_word(const std::uint32_t (&w)[value_words],
                                                             int g, int k) {
    return VL::eff(w, g, k);
  }
  // The lookup table's low word (the high one is an immediate). At d = 256 it is loaded from
  // shared memory once per sub-step: as a constant, ptxas re-made it from a uniform register
  // before every lookup at the register cap (IMAD.U32, 64 per 32-token step; H200 A/B: TQ3 and
  // tiered rows -0.7..-2.6% at B = 32). At d <= 128 the load measured up to 4% slower at B = 1
  // (one more spill in the step), so there it stays a constant.
  __device__ __forceinline__ static std::uint32_t value_table(const void* smem_word) {
    if constexpr (D >= 256)
      return *static_cast<const volatile std::uint32_t*>(smem_word);
    else
      return tierkv::detail::tq3_u8_0;
  }
  template <bool Biased>
  __device__ __forceinline__ static void value_pairs(std::uint32_t w0, std::uint32_t w1,
                                                     std::uint32_t (&out)[4][2],
                                                     std::uint32_t table) {
    const std::uint32_t x =
        mask_codes<0x77777777u>(__byte_perm(w0, w1, 0x5140));  // bytes 0, 1 of t0, t1
    const std::uint32_t y = mask_codes<0x77777777u>(__byte_perm(w0, w1, 0x7362));  // bytes 2, 3
    const std::uint32_t sels[4] = {x, x >> 16, y, y >> 16};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const std::uint32_t u =
          prmt(table, tierkv::detail::tq3_u8_1, sels[b]);  // t0 n_2b, t0 n_2b+1, t1 n_2b, t1 n_2b+1
      out[b][0] = widen_biased_levels<0x4240, Biased>(u);
      out[b][1] = widen_biased_levels<0x4341, Biased>(u);
    }
  }
  // The fragments hold L / 1024, 1/16 of the levels L / 64 (the value scale's log2 takes + 4),
  // or biased (L + 128) 2^-24: the levels times 2^-18 (+ 18) plus 128 2^-24, the f16 pair
  // value_bias_pair, which the tier's loop accumulates alone (one more mma per sub-step) and
  // subtracts at its end. The biased sums lose ~log2(128 / |mean L|) of f32's 24 bits: GPU
  // tests' rel_l2 against float64 unchanged to 2 digits (f16 probabilities dominate them).
  static constexpr float value_log2_unit(bool biased) { return biased ? 18.f : 4.f; }
  static constexpr std::uint32_t value_bias_pair = 0x00800080u;  // f16 subnormals 128 2^-24
  static constexpr int value_mtiles_per_word = 4;
  static constexpr bool value_codes_finite = true;  // every code is a finite centroid
  // 32-token steps with int8-scored keys (TQ3 and TQ4 tiers): their unpacking is about half of
  // a 16-token step's instructions, the rest is per step (decode/tensor_core.cuh mma_staging)
  static constexpr bool long_steps_with_s8_keys = true;
  __device__ __forceinline__ static unsigned value_coord(unsigned g, unsigned mt, unsigned r) {
    const unsigned idx = g * value_eff_words + mt / 4;
    return 32 * (idx / 4) + 8 * (idx % 4) + 2 * (mt % 4) + r;
  }
};

template <class C>
struct device_codec<C, storage_format::tq3> : turboquant_warp_codec<C> {
  // from an FP8 source in a one-path retier: through the layout exchange (ptxas: with an
  // int8_rotated source, or roles on two code paths, it spills under the 128-register limit)
  static constexpr bool exchange_encode = true;
  using slice_reader = tq3_slice_reader<C>;
  using fragments = tq3_fragments<C>;
};

}  // namespace tierkv::cuda::detail
