// SPDX-License-Identifier: Apache-2.0
// Warp specialization: barriers among a subset of a block's warps (named barriers) or across
// roles, and the register-file split between warpgroups of different roles (setmaxnreg, sm_90a
// only): a producer warpgroup that only decodes gives registers to the consumer warpgroups that
// hold the attention accumulators.
#pragma once

#include "tierkv/core/config.hpp"

#include "tierkv/cuda/arch/wgmma.cuh"  // TIERKV_HAS_WGMMA: the sm_90a device pass

namespace tierkv::cuda::detail {

// Hardware barrier `id` (1..15; 0 is __syncthreads') among `threads` threads (a multiple of 32):
// every warp taking part calls it with the same id and count.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A barrier of the whole block that warps of different roles reach from different code, each
// role its own call site. __syncthreads() is `bar.sync 0`, the .aligned form, which requires
// every thread of the block at that same instruction (compute-sanitizer synccheck: "Divergent
// thread(s) in block"); `barrier.sync 0` is the form without .aligned.
__device__ __forceinline__ void block_sync_across_roles() {
  asm volatile("barrier.sync 0;\n" ::: "memory");
}

// The calling warpgroup's registers per thread become `Regs` (a multiple of 8 in [24, 256]);
// all 128 threads of the warpgroup call it together. A warpgroup that releases registers calls
// the `dec` form before one that takes them can proceed past its `inc`.
template <int Regs>
__device__ __forceinline__ void warpgroup_release_registers() {
  static_assert(Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg: 24..256, multiple of 8");
#if TIERKV_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
#else
  __trap();
#endif
}
template <int Regs>
__device__ __forceinline__ void warpgroup_take_registers() {
  static_assert(Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg: 24..256, multiple of 8");
#if TIERKV_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
#else
  __trap();
#endif
}
}  // namespace tierkv::cuda::detail
