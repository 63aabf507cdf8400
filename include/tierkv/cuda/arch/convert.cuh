// SPDX-License-Identifier: Apache-2.0
// Register-level conversions of packed codes: f16x2 from two floats, two E4M3 codes or two
// int8 bytes (exact), bf16x2 from two int8 bytes (exact), and bf16 bits to float. One to four
// instructions each.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
namespace tierkv::cuda::detail {

__device__ __forceinline__ std::uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}
__device__ __forceinline__ std::uint32_t pack_bfloat162(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

// The 16-bit float type of a tensor-core operand: f16 (10 mantissa bits: the quantized formats'
// codes are exact in it) or bf16 (f32's range: dense bf16 pages).
enum class operand_type : std::uint8_t { f16, bf16 };
// Two floats as one operand register (round to nearest even).
template <operand_type T>
__device__ __forceinline__ std::uint32_t pack_operand2(float lo, float hi) {
  if constexpr (T == operand_type::bf16)
    return pack_bfloat162(lo, hi);
  else
    return pack_half2(lo, hi);
}
// Two E4M3 codes (low 16 bits) -> f16x2, exact.
__device__ __forceinline__ std::uint32_t fp8x2_to_h2(std::uint32_t w) {
  const __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return std::uint32_t(r.x) | (std::uint32_t(r.y) << 16);
}
// Two E4M3 codes (high 16 bits) -> f16x2, exact: the cvt reads the register's high half
// (F2FP ... .H1), where `w >> 16` took a shift per pair.
__device__ __forceinline__ std::uint32_t fp8x2_hi_to_h2(std::uint32_t w) {
  std::uint32_t r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}"
      : "=r"(r)
      : "r"(w));
  return r;
}
// int8 x2 (bytes 0, 1: Sel = 0x4140; bytes 2, 3: 0x4342) -> half2, exact: byte b + 128 placed
// in the mantissa of 1024 (0x6400 | u = 1024 + u), minus 1152.
template <unsigned Sel>
__device__ __forceinline__ std::uint32_t s8x2_to_h2(std::uint32_t w) {
  const std::uint32_t h = __byte_perm(w ^ 0x80808080u, 0x64646464u, Sel);
  const __half2 r =
      __hsub2(*reinterpret_cast<const __half2*>(&h), __half2(__half(1152.f), __half(1152.f)));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

// int8 x2 (Sel as s8x2_to_h2) -> bf16x2, exact without a float: a byte c = l - 128 s (l its low
// 7 bits, s its sign bit) under the bf16 exponent of 128 is 0x4300 | l = 128 + l; minus
// 0x4300 | (c & 0x80), that is 128 or 256, it is c (an integer of at most 8 bits, exact in bf16).
template <unsigned Sel>
__device__ __forceinline__ std::uint32_t s8x2_to_bf16x2(std::uint32_t w) {
  const std::uint32_t t = __byte_perm(w, 0x43434343u, Sel);
  const std::uint32_t a = t & 0xff7fff7fu, b = (t & 0x00800080u) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

// bf16 bits (per-token scale or norm, docs/formats.md) to float: exact.
__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t bits) {
  return __uint_as_float(std::uint32_t(bits) << 16);
}

}  // namespace tierkv::cuda::detail
