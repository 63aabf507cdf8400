// SPDX-License-Identifier: Apache-2.0
// Payload access by lanes: words and bytes in the widest aligned accesses, code words,
// per-lane segments of a row (coalesced across lanes), biased bytes as floats.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/float_bits.hpp"
namespace tierkv::cuda::detail {

// ---- payload access ------------------------------------------------------------------------

// Alignment of a lane's `lane_bytes` bytes at row + gl * lane_bytes in a payload row of
// `row_bytes`: page regions are 16-byte aligned and rows packed, so a row starts at a multiple
// of the largest power of two <= 16 dividing row_bytes.
constexpr int lane_alignment(std::size_t row_bytes, std::size_t lane_bytes) {
  int a = 16;
  while (a > 1 && (row_bytes % std::size_t(a) != 0 || lane_bytes % std::size_t(a) != 0)) a /= 2;
  return a;
}

// W 32-bit words at p (A-byte aligned, A >= 4) in the widest aligned accesses.
template <int A, int W>
__device__ __forceinline__ void load_words(const std::uint8_t* p, std::uint32_t (&w)[W]) {
  static_assert(A >= 4, "load_words: 4-byte alignment at least");
  if constexpr (A >= 16 && W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (A >= 8 && W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = reinterpret_cast<const std::uint32_t*>(p)[i];
  }
}
template <int A, int W>
__device__ __forceinline__ void store_words(std::uint8_t* p, const std::uint32_t (&w)[W]) {
  static_assert(A >= 4, "store_words: 4-byte alignment at least");
  if constexpr (A >= 16 && W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i)
      reinterpret_cast<uint4*>(p)[i] =
          make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  } else if constexpr (A >= 8 && W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i)
      reinterpret_cast<uint2*>(p)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) reinterpret_cast<std::uint32_t*>(p)[i] = w[i];
  }
}

// B bytes at p (A-byte aligned): whole words when B is a multiple of 4, else bytes.
template <int A, int B>
__device__ __forceinline__ void load_bytes(const std::uint8_t* p, std::uint8_t (&b)[B]) {
  if constexpr (A >= 4 && B % 4 == 0) {
    std::uint32_t w[B / 4];
    load_words<A>(p, w);
#pragma unroll
    for (int j = 0; j < B; ++j) b[j] = std::uint8_t(w[j / 4] >> (8 * (j % 4)));
  } else {
#pragma unroll
    for (int j = 0; j < B; ++j) b[j] = p[j];
  }
}
template <int A, int B>
__device__ __forceinline__ void store_bytes(std::uint8_t* p, const std::uint8_t (&b)[B]) {
  if constexpr (A >= 4 && B % 4 == 0) {
    std::uint32_t w[B / 4];
#pragma unroll
    for (int i = 0; i < B / 4; ++i)
      w[i] = std::uint32_t(b[4 * i]) | (std::uint32_t(b[4 * i + 1]) << 8) |
             (std::uint32_t(b[4 * i + 2]) << 16) | (std::uint32_t(b[4 * i + 3]) << 24);
    store_words<A>(p, w);
  } else {
#pragma unroll
    for (int j = 0; j < B; ++j) p[j] = b[j];
  }
}

// N one-byte codes held four to a word (code r in byte r % 4 of word r / 4), or N zero bytes
// where `keep` is false, at p (A-byte aligned).
template <int A, int N>
__device__ __forceinline__ void store_code_words(std::uint8_t* p, std::uint32_t (&w)[(N + 3) / 4],
                                                 bool keep) {
#pragma unroll
  for (int i = 0; i < (N + 3) / 4; ++i) w[i] = keep ? w[i] : 0u;
  if constexpr (N % 4 == 0 && A >= 4) {
    store_words<A>(p, w);
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) p[r] = std::uint8_t(w[r / 4] >> (8 * (r % 4)));
  }
}

// x = float(b - 128) for byte k of `bytes` (exact): 2^23 + b built by one byte permute, minus
// 2^23 + 128. Bytes hold a level or code L as L ^ 0x80 (two's complement, biased by 128).
__device__ __forceinline__ float biased_byte_value(std::uint32_t bytes, int k) {
  return __uint_as_float(__byte_perm(bytes, 0x4B000000u, 0x7440u + unsigned(k))) - 8388736.0f;
}

// Lane i of `Lanes` reads `Bytes` (8 or 16) of every Lanes*Bytes-byte segment of a row, in
// one load each (coalesced across the lanes): words [Bytes/4 seg, Bytes/4 (seg + 1)) hold
// bytes [Bytes i, Bytes (i + 1)) of segment seg.
template <int Bytes, int Lanes, bool Shared, int Words>
__device__ __forceinline__ void load_lane_segments(const std::uint8_t* row, int i,
                                                   std::uint32_t (&w)[Words]) {
  static_assert(Bytes == 8 || Bytes == 16, "load_lane_segments: 8- or 16-byte loads");
  constexpr int per = Bytes / 4;
  static_assert(Words % per == 0, "load_lane_segments: whole loads per lane");
#pragma unroll
  for (int seg = 0; seg < Words / per; ++seg) {
    const std::uint8_t* p = row + Lanes * Bytes * seg + Bytes * i;
    if constexpr (Bytes == 16) {
      const uint4* a = reinterpret_cast<const uint4*>(p);
      const uint4 v = Shared ? *a : __ldg(a);
      w[4 * seg + 0] = v.x;
      w[4 * seg + 1] = v.y;
      w[4 * seg + 2] = v.z;
      w[4 * seg + 3] = v.w;
    } else {
      const uint2* a = reinterpret_cast<const uint2*>(p);
      const uint2 v = Shared ? *a : __ldg(a);
      w[2 * seg + 0] = v.x;
      w[2 * seg + 1] = v.y;
    }
  }
}

}  // namespace tierkv::cuda::detail
