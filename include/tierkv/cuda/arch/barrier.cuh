// SPDX-License-Identifier: Apache-2.0
// Named barriers: a few warps of a block meet without stopping the others.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
namespace tierkv::cuda::detail {

// bar.sync `id`, `threads` (a multiple of 32): the first `threads` threads to arrive at barrier
// `id` go on together. Barrier 0 is __syncthreads' (and __syncthreads_count's): use 1..15.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace tierkv::cuda::detail
