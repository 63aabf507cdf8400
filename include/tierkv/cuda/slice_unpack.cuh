// SPDX-License-Identifier: Apache-2.0
// Device inner-loop readers of token payloads, one per storage format, in slices of 16
// scalars (docs/formats.md is the byte contract; docs/gpu.md counts the instructions).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/tq3.hpp"

namespace tierkv::cuda::detail {

// Every reader exposes: raw (the registers one load fills), load(payload, slice),
// unpack(raw, slice, x[16]) giving the 16 scalars of slice `slice` of the token
// (element 16*slice + i of the codec's own domain), and code_scale, a constant factor
// the caller folds into the per-token scalar instead of multiplying each element.
template <class C, storage_format F = C::format>
struct slice_reader {
  static_assert(tierkv::detail::dependent_false<C>,
                "cuda decode: no device inner loop for this codec's storage_format; "
                "supported: fp8_e4m3, tq3, tq4 (keys), int8_rotated");
};

// bf16 bits (per-token scale or norm, docs/formats.md) to float: exact.
__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t bits) {
  return __uint_as_float(std::uint32_t(bits) << 16);
}

// FP8 E4M3: 16 codes are one 16-byte load; two codes convert per instruction to half2
// (exact: every E4M3 value is a half), then to float.
template <class C>
struct slice_reader<C, storage_format::fp8_e4m3> {
  static_assert(C::payload_bytes == std::size_t(C::head_dim),
                "fp8 reader: payload must be head_dim bytes (docs/formats.md)");
  using raw = uint4;
  static constexpr float code_scale = 1.f;

  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    return __ldg(reinterpret_cast<const uint4*>(payload) + slice);
  }
  __device__ __forceinline__ static void unpack4(std::uint32_t w, float* x) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    const float2 a = __half22float2(__half2(lo));
    const float2 b = __half22float2(__half2(hi));
    x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
    unpack4(r.x, x + 0);
    unpack4(r.y, x + 4);
    unpack4(r.z, x + 8);
    unpack4(r.w, x + 12);
  }
};

// int8_rotated: 16 codes are one 16-byte load; each signed byte converts exactly.
template <class C>
struct slice_reader<C, storage_format::int8_rotated> {
  static_assert(C::payload_bytes == std::size_t(C::head_dim),
                "int8_rotated reader: payload must be head_dim bytes (docs/formats.md)");
  using raw = uint4;
  static constexpr float code_scale = 1.f;  // dot = alpha * sum q''_i c_i (codec/int8_rotated.hpp)

  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    return __ldg(reinterpret_cast<const uint4*>(payload) + slice);
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
};

// TQ3: a group of 32 rotated coordinates is three words W0..W2; a slice is half a
// group. Half 0 = coordinates 0..15 = the nibbles of W0 and W1; half 1 = 16..31 = the
// nibbles of W2 and the gathered bit-3 word. Each nibble (masked to 3 bits) is a
// __byte_perm selector into an 8-entry table of the levels' fp16 bytes: one
// byte-permute looks up 4 low bytes, one 4 high bytes, two more interleave them into
// two half2 values.
template <class C>
struct slice_reader<C, storage_format::tq3> {
  static_assert(C::head_dim % 32 == 0, "tq3 reader: head_dim must be a multiple of 32");
  static_assert(C::payload_bytes * 8 == std::size_t(3 * C::head_dim),
                "tq3 reader: payload must be 3*head_dim/8 bytes (docs/formats.md)");
  using raw = uint3;
  // The codec's domain: dot = alpha * sum q''_i c_i with the grid levels c (L / 64) and
  // the query prepared as H D q / d (codec/tq3.hpp), so no extra factor here.
  static constexpr float code_scale = 1.f;

  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(payload) + (slice >> 1) * 3;
    return make_uint3(__ldg(w), __ldg(w + 1), __ldg(w + 2));
  }
  // fp16 of the levels (exact), code 0 = -127/64 ... code 7 = +127/64 (codec/tq3.hpp):
  // 0xBFF0 0xBCF0 0xB980 0xB300 0x3300 0x3980 0x3CF0 0x3FF0.
  __device__ __forceinline__ static void lookup4(std::uint32_t sel, float* x) {
    constexpr std::uint32_t lo0 = tierkv::detail::tq3_f16_lo0, lo1 = tierkv::detail::tq3_f16_lo1;  // low bytes, codes 0-3 / 4-7
    constexpr std::uint32_t hi0 = tierkv::detail::tq3_f16_hi0, hi1 = tierkv::detail::tq3_f16_hi1;  // high bytes
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
    x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
  }
  __device__ __forceinline__ static void lookup8(std::uint32_t nibbles, float* x) {
    lookup4(nibbles & 0x7777u, x);
    lookup4((nibbles >> 16) & 0x7777u, x + 4);
  }
  __device__ __forceinline__ static void unpack(const raw& r, int slice, float (&x)[16]) {
    if (slice & 1) {
      const std::uint32_t g = ((r.x >> 3) & 0x11111111u) | ((r.y >> 2) & 0x22222222u) |
                              ((r.z >> 1) & 0x44444444u);
      lookup8(r.z, x);
      lookup8(g, x + 8);
    } else {
      lookup8(r.x, x);
      lookup8(r.y, x + 8);
    }
  }
};

// TQ4: 16 nibble codes are one 8-byte load (docs/formats.md: word w holds coordinates
// 8w..8w+7); level c - 7.5 (codec/tq4.hpp).
template <class C>
struct slice_reader<C, storage_format::tq4> {
  static_assert(C::payload_bytes * 2 == std::size_t(C::head_dim), "tq4 reader: payload must be head_dim/2 bytes");
  using raw = uint2;
  static constexpr float code_scale = 1.f;

  __device__ __forceinline__ static raw load(const std::uint8_t* payload, int slice) {
    return __ldg(reinterpret_cast<const uint2*>(payload) + slice);
  }
  __device__ __forceinline__ static void unpack8(std::uint32_t w, float* x) {
#pragma unroll
    for (int n = 0; n < 8; ++n) x[n] = float((w >> (4 * n)) & 15u) - C::grid::offset;
  }
  __device__ __forceinline__ static void unpack(const raw& r, int, float (&x)[16]) {
    unpack8(r.x, x);
    unpack8(r.y, x + 8);
  }
};

}  // namespace tierkv::cuda::detail
