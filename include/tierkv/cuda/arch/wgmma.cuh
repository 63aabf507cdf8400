// SPDX-License-Identifier: Apache-2.0
// Hopper warpgroup MMA (wgmma, sm_90a only): shared-memory matrix descriptors for the
// no-swizzle K-major layout, the fence / commit / wait protocol, and the two shapes a
// warpgroup-per-64-rows attention needs: S = Q K^T (m64n32k16, f16 operands from shared memory)
// and O += P V (m64n256k16, P in bf16 registers, V from shared memory K- or MN-major), f32
// accumulators.
// Layouts (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): a core matrix is
// 8 rows x 16 bytes stored as 128 contiguous bytes; kmajor_offset() places element (row, k) of a
// rows x K tile so that K-adjacent core matrices are 128 bytes apart (the leading byte offset)
// and 8-row groups K / 8 x 128 bytes apart (the stride byte offset). Accumulators: thread t of
// the warpgroup holds, for each 8-column block j, rows 16 (t / 32) + (t % 32) / 4 (+ 8) and
// columns 8 j + 2 (t % 4) (+ 1), as mma.sync's m16n8 C fragment per warp. Compiled for another
// target (sm_90 without "a") every call traps: TIERKV_HAS_WGMMA says which.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstdint>

#include "tierkv/cuda/arch/bulk_copy.cuh"  // fence_proxy_async_shared: wgmma reads the async proxy

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TIERKV_HAS_WGMMA 1
#else
#define TIERKV_HAS_WGMMA 0
#endif

namespace tierkv::cuda::detail {

inline constexpr int wgmma_core_bytes = 128;  // a core matrix: 8 rows x 16 bytes

// Byte offset of element (row, k) of a rows x `k_elems` tile of 2-byte elements in the
// no-swizzle K-major layout (k_elems a multiple of 8).
__host__ __device__ constexpr std::uint32_t kmajor_offset(int row, int k, int k_elems) {
  return std::uint32_t(((row / 8) * (k_elems / 8) + k / 8) * wgmma_core_bytes + (row % 8) * 16 +
                       (k % 8) * 2);
}

// Byte offset of element (k, n) of a `k_elems` x N tile of 2-byte elements in the no-swizzle
// MN-major layout (a B operand read with its transpose flag set): a core matrix is 8 k-rows of 8
// n-adjacent elements; K-adjacent core matrices are 128 bytes apart (the leading byte offset),
// 8-column groups k_elems / 8 x 128 bytes apart (the stride byte offset). A token-major V tile
// (k = token, n = dimension) is this layout with 16-byte rows of 8 dimensions.
__host__ __device__ constexpr std::uint32_t mnmajor_offset(int k, int n, int k_elems) {
  return std::uint32_t(((n / 8) * (k_elems / 8) + k / 8) * wgmma_core_bytes + (k % 8) * 16 +
                       (n % 8) * 2);
}

// The 64-bit shared-memory descriptor of a no-swizzle operand starting at `smem` (16-byte
// aligned): start address, leading byte offset (K-adjacent core matrices) and stride byte offset
// (8-row groups), each in 16-byte units.
__device__ __forceinline__ std::uint64_t wgmma_descriptor(const void* smem, std::uint32_t lbo_bytes,
                                                          std::uint32_t sbo_bytes) {
  const auto addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  return std::uint64_t((addr & 0x3FFFFu) >> 4) | (std::uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (std::uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32);
}

// Keeps the compiler from moving reads or writes of an accumulator register across the
// asynchronous region (wgmma_fence ... wgmma_wait): each register is "written" here.
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Orders the warpgroup's register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void wgmma_fence() {
#if TIERKV_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if TIERKV_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
// Waits until at most N committed groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if TIERKV_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#else
  __trap();
#endif
}

// d (64 x 32, f32) = A (64 x 16) B^T (32 x 16) + (accumulate ? d : 0); A and B f16, K-major in
// shared memory (descriptors).
__device__ __forceinline__ void wgmma_m64n32k16_f16(float (&d)[16], std::uint64_t a_desc,
                                                    std::uint64_t b_desc, bool accumulate) {
#if TIERKV_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
      "%10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(a_desc), "l"(b_desc), "r"(int(accumulate)));
#else
  (void)d, (void)a_desc, (void)b_desc, (void)accumulate;
  __trap();
#endif
}

// d (64 x 256, f32) += A (64 x 16, bf16 in registers: mma.sync's m16n8k16 A fragment of the
// warp's 16 rows) B (16 x 256, bf16 in shared memory): K-major (B^T's rows are the 256 columns,
// kmajor_offset) or, with MnMajor, MN-major (B's 16 rows of 256 columns, mnmajor_offset; the
// transpose flag).
template <bool MnMajor = false>
__device__ __forceinline__ void wgmma_m64n256k16_bf16_rs(float (&d)[128],
                                                         const std::uint32_t (&a)[4],
                                                         std::uint64_t b_desc, bool accumulate) {
#if TIERKV_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "
      "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, "
      "%99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "
      "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, "
      "%129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(int(accumulate)),
        "n"(int(MnMajor)));
#else
  (void)d, (void)a, (void)b_desc, (void)accumulate;
  __trap();
#endif
}

}  // namespace tierkv::cuda::detail
