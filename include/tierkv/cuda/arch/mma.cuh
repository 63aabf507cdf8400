// SPDX-License-Identifier: Apache-2.0
// Tensor-core matrix instructions (mma.sync, movmatrix) as thin PTX wrappers: the
// fragments' register layouts are PTX's (m16n8k16 f16 / bf16, m16n8k32 s8/u8).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>

#include "tierkv/cuda/arch/convert.cuh"
namespace tierkv::cuda::detail {

__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// bf16 x bf16 -> f32 (the prefill's P V: probabilities times per-token value scales keep f32's
// range, where f16 would overflow on large value scales).
__device__ __forceinline__ void mma_16816_bf16(float (&c)[4], const std::uint32_t (&a)[4],
                                               std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// m16n8k16 on operands of type T.
template <operand_type T>
__device__ __forceinline__ void mma_16816_of(float (&c)[4], const std::uint32_t (&a)[4],
                                             std::uint32_t b0, std::uint32_t b1) {
  if constexpr (T == operand_type::bf16)
    mma_16816_bf16(c, a, b0, b1);
  else
    mma_16816(c, a, b0, b1);
}
// A with every element a (a bias): rows g and g + 8 of the product are equal, so only row g's
// two columns are accumulated (2 live registers instead of 4; d = 128 spills at the cap).
__device__ __forceinline__ void mma_16816_uniform_a(float (&c)[2], std::uint32_t a,
                                                    std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "{\n.reg .f32 d2, d3;\n"
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,d2,d3}, {%2,%2,%2,%2}, {%3,%4}, "
      "{%0,%1,%5,%5};\n}\n"
      : "+f"(c[0]), "+f"(c[1])
      : "r"(a), "r"(b0), "r"(b1), "f"(0.f));
}
// int8 (or uint8: UnsignedA) x int8 -> int32, exact: the key products of TQ3, TQ4 and
// int8_rotated (native IMMA.16832 on sm_90).
template <bool UnsignedA>
__device__ __forceinline__ void mma_16832_s8(int (&c)[4], const std::uint32_t (&a)[4],
                                             std::uint32_t b0, std::uint32_t b1) {
  if constexpr (UnsignedA) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
__device__ __forceinline__ std::uint32_t movmatrix_trans(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace tierkv::cuda::detail
