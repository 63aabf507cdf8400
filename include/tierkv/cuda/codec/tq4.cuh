// SPDX-License-Identifier: Apache-2.0
// TQ4 on the device (Stale keys): the CUDA-core slice reader and the tensor-core key fragments;
// the encoder and decoder are the shared TurboQuant ones (codec/turboquant.cuh).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>

#include <cstdint>

#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/codec/turboquant.cuh"
#include "tierkv/cuda/warp/payload.cuh"
namespace tierkv::cuda::detail {

// TQ4: 16 nibble codes are one 8-byte load (docs/formats.md: word w holds coordinates
// 8w..8w+7); level c - 7.5 (codec/tq4.hpp).
template <class C>
struct tq4_slice_reader {
  static_assert(C::payload_bytes * 2 == std::size_t(C::head_dim),
                "tq4 reader: payload must be head_dim/2 bytes");
  using raw = uint2;
  static constexpr float code_scale = 1.f;

  template <bool Shared = false>
  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const uint2* p = reinterpret_cast<const uint2*>(payload) + slice;
    return Shared ? *p : __ldg(p);
  }
  __device__ __forceinline__ static void unpack8(std::uint32_t w, float* x) {
#pragma unroll
    for (int n = 0; n < 8; ++n) x[n] = float((w >> (4 * n)) & 15u) - C::grid::offset;
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
    unpack8(r.x, x);
    unpack8(r.y, x + 8);
  }
  // The same 16 levels as exact f16 pairs: the bits 0x6000 | 2c are the f16 512 + c (spacing 1/2
  // in [512, 1024)), and 512 + offset is an f16 too, so their difference c - offset is exact.
  static constexpr float biased_offset = 512.f + C::grid::offset;
  static_assert(C::grid::offset * 2 == float(int(C::grid::offset * 2)) && C::grid::offset < 256,
                "tq4 reader: the offset must be a multiple of 1/2 below 256 (exact in f16)");
  __device__ __forceinline__ static void unpack_h2(const raw& r, int, std::uint32_t (&h)[8]) {
    const __half2 bias = __float2half2_rn(biased_offset);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t b = (i < 4 ? r.x : r.y) >> (8 * (i % 4));  // codes 2i, 2i + 1
      const std::uint32_t bits = ((b << 1) & 0x1Eu) | ((b << 13) & 0x1E0000u) | 0x60006000u;
      const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&bits), bias);
      h[i] = *reinterpret_cast<const std::uint32_t*>(&v);
    }
  }
};

// TQ4 keys: a lane's words hold 8 nibble codes each (docs/formats.md: coordinate 2b in the
// low nibble of byte b); lane c reads 16 bytes at 64 seg + 16 c (8 bytes at 8 c when a row is
// 32 bytes). k32 step s is word s: `w & 0x0F0F0F0F` (the low nibbles: k slots 4c..4c+3) and
// `(w >> 4) & 0x0F0F0F0F` (the high nibbles: 16+4c..) are 4 codes c each as uint8, one lop3
// per 4 codes, into a uint8 x int8 mma. The level is c - 7.5: mma_tier_pages subtracts
// 7.5 x (the head's sum of its int8-rounded query), an exact integer. (Run 8-9: f16 (1024 + c)
// against the f16 hi query, one lop3 per 2 codes.) Keys only: values would need the offset
// times each head's sum of p in the accumulator.
template <class C>
struct tq4_key_fragments : fragment_defaults {
  static constexpr int D = C::head_dim;
  static_assert(D % 64 == 0, "tensor-core decode: tq4 head_dim must be a multiple of 64");
  static constexpr int row_bytes = D / 2;
  static constexpr int lane_bytes = row_bytes >= 64 ? 16 : 8;  // per lane and 4-lane segment
  static constexpr int seg_bytes = 4 * lane_bytes;
  static constexpr int words_per_seg = lane_bytes / 4;
  static constexpr int key_words = D / 32;  // 8 codes = one k32 step per word
  static constexpr bool s8_keys = true;
  static constexpr bool key_unsigned = true;
  static constexpr float key_level_scale = 1.f, key_level_offset = C::grid::offset;
  static constexpr int query_parts = 2;  // 13 bits: as TQ3, far below TQ4's own error
  template <bool Shared>
  __device__ __forceinline__ static void load_key(const std::uint8_t* row, int c,
                                                  std::uint32_t (&w)[key_words]) {
    load_lane_segments<lane_bytes, 4, Shared>(row, c, w);
  }
  __device__ __forceinline__ static void key_frag_s8(const std::uint32_t (&w)[key_words], int,
                                                     int s, std::uint32_t& a0, std::uint32_t& a2) {
    a0 = w[s] & 0x0F0F0F0Fu;
    a2 = (w[s] >> 4) & 0x0F0F0F0Fu;
  }
  __device__ __forceinline__ static int key_coord_s8(int c, int s, int j) {
    const int byte =
        (s / words_per_seg) * seg_bytes + lane_bytes * c + 4 * (s % words_per_seg) + j % 4;
    return 2 * byte + (j >= 4 ? 1 : 0);
  }
  static constexpr int query_offset_s8(int j) { return 2 * (j % 4) + (j >= 4 ? 1 : 0); }
};

template <class C>
struct device_codec<C, storage_format::tq4> : turboquant_warp_codec<C> {
  using slice_reader = tq4_slice_reader<C>;
  using fragments = tq4_key_fragments<C>;  // keys only (decode/tensor_core.cuh refuses TQ4 values)
};

}  // namespace tierkv::cuda::detail
