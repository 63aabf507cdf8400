// SPDX-License-Identifier: Apache-2.0
// Bulk asynchronous copies (sm_90): cp.async.bulk global -> shared of a contiguous 16-byte-aligned
// range, completing on a shared-memory mbarrier's transaction count, and the mbarrier operations
// around it (init / invalidate, arrive with an expected byte count, wait on a phase's parity).
// One thread moves a whole range, so a copy costs one instruction instead of one per 16 bytes.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>

#include "tierkv/cuda/arch/ldmatrix.cuh"  // shared_address

// tierkv's kernels target sm_90 (H100 / H200); an older device pass fails here by name rather
// than in ptxas.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "tierkv: bulk copies and mbarrier transaction counts need sm_90 or newer (-arch=sm_90)"
#endif

namespace tierkv::cuda::detail {

__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(arrivals)
               : "memory");
}
__device__ __forceinline__ void mbarrier_inval(std::uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
// Generic-proxy accesses to shared memory (st.shared, ld.shared, cp.async) ordered with the async
// proxy's (bulk copies, wgmma operand reads): each accessing thread fences, then a barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Makes initialized mbarriers visible to the other threads and to the async proxy (the bulk
// copies' completion); a barrier among the threads follows.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also expects `bytes` more bytes of transactions in the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)),
      "r"(bytes)
      : "memory");
}
// One arrival on a shared-memory mbarrier (release: the thread's earlier accesses are ordered
// before a waiter's later ones).
__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}

// Spins until the phase of parity `parity` has completed (its arrivals and bytes all in).
__device__ __forceinline__ void mbarrier_wait_parity(std::uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nwaiting:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra waiting;\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), counted on
// `bar` when they land.
__device__ __forceinline__ void cp_async_bulk(void* dst, const void* src, unsigned bytes,
                                              std::uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

// A warp about to fill one phase of `bar`, each lane with its own copies of `bytes` bytes in all
// (0: none): lane 0 arrives expecting the whole warp's bytes, so the phase completes when every
// lane's copies have landed. All 32 lanes of one warp call it, with their lane id, before copying.
__device__ __forceinline__ void warp_expect_bytes(std::uint64_t* bar, unsigned bytes, int lane) {
  unsigned total = bytes;
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane == 0) mbarrier_arrive_expect_tx(bar, total);
  __syncwarp();
}

}  // namespace tierkv::cuda::detail
