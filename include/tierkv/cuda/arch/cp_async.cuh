// SPDX-License-Identifier: Apache-2.0
// cp.async global -> shared copies with their commit / wait groups (sm_80+), as thin PTX
// wrappers, and the row / region copies a warp issues with immediate offsets.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>
namespace tierkv::cuda::detail {

// cp.async of 16 bytes global -> shared (both 16-byte aligned), bypassing L1.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}
// 16 bytes global + GOff -> shared + SOff (immediates of one base address pair: a register pair
// per chunk address spilled the FP8 step at d = 256, 17 copies per lane, 168 registers).
template <int GOff, int SOff>
__device__ __forceinline__ void cp_async_16_at(unsigned smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%3], 16;\n" ::"r"(smem), "l"(gmem),
               "n"(SOff), "n"(GOff)
               : "memory");
}
// cp.async of 4 bytes global -> shared (both 4-byte aligned), through L1.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  cp_async_16_at<0, 0>(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem);
}
// Rows of Cpr 16-byte chunks (Cpr divides 32), contiguous in global memory, to shared memory
// rows `Stride` bytes apart, by a warp's lanes (lane i: chunks i, i + 32, ...): chunk
// q = lane + 32 I is row q / Cpr, column q % Cpr, so a lane's shared address is a base of its
// own plus an immediate per I.
template <int Chunks, int Cpr, int Stride, int I = 0>
__device__ __forceinline__ void cp_async_rows_from(unsigned smem, const std::uint8_t* gmem,
                                                   int lane) {
  if constexpr (I < (Chunks + 31) / 32) {
    if (Chunks % 32 == 0 || lane + 32 * I < Chunks)
      cp_async_16_at<512 * I, (32 / Cpr) * Stride * I>(smem, gmem);
    cp_async_rows_from<Chunks, Cpr, Stride, I + 1>(smem, gmem, lane);
  }
}
template <int Chunks, int Cpr, int Stride>
__device__ __forceinline__ void cp_async_rows(std::uint8_t* dst, const std::uint8_t* src,
                                              int lane) {
  static_assert(32 % Cpr == 0, "cp_async_rows: chunks per row must divide 32");
  const int row = lane / Cpr, col = lane % Cpr;
  cp_async_rows_from<Chunks, Cpr, Stride>(
      static_cast<unsigned>(__cvta_generic_to_shared(dst + row * Stride + 16 * col)),
      src + 16 * lane, lane);
}
// Chunks x 16 contiguous bytes to contiguous shared memory: one 512-byte "row" per 32 chunks.
template <int Chunks>
__device__ __forceinline__ void cp_async_region(std::uint8_t* dst, const std::uint8_t* src,
                                                int lane) {
  cp_async_rows<Chunks, 32, 512>(dst, src, lane);
}

}  // namespace tierkv::cuda::detail
