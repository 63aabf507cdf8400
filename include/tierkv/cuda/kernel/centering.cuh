// SPDX-License-Identifier: Apache-2.0
// Centring's lse term of a query row (tierkv/centering.hpp: the pages hold keys minus their
// mean), as the decode merge, the decode page mass and the prefill epilogue all take it.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstddef>

#include "tierkv/cuda/kernel/io_types.cuh"
namespace tierkv::cuda::detail {

// Centring's lse term for query row `row` (D elements, f32 or bf16) against its KV head's key
// mean: softmax_scale * q.mean, summed in a fixed order by one thread (the merge adds it to the
// lse, the page mass takes it off again: both get the same float).
template <int D>
__device__ __forceinline__ float query_mean_logit(const void* queries, query_type type,
                                                  std::size_t row, const float* mean, float scale) {
  float s = 0.f;
  for (int i = 0; i < D; ++i) {
    const std::size_t at = row * D + std::size_t(i);
    const float q = type == query_type::bf16
                        ? __bfloat162float(static_cast<const __nv_bfloat16*>(queries)[at])
                        : static_cast<const float*>(queries)[at];
    s = fmaf(q, mean[i], s);
  }
  return scale * s;
}

}  // namespace tierkv::cuda::detail
