// SPDX-License-Identifier: Apache-2.0
// The tensor-core decode's query prologue pieces (decode/tensor_core.cuh): per head the prepared
// query's exponent (and, for key offsets, its rounded sum), and a lane's column scales and key
// offsets.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cmath>

#include "tierkv/cuda/decode/mma_config.cuh"
namespace tierkv::cuda::detail {

// Per lane, its two columns' (heads 2 qc, 2 qc + 1) score scale and key offset.
struct mma_columns {
  float scale[2];
  float koff[2];
};

// Per head h of warp h % 4 (group_prepare_query's map): the query's exponent e (max |q 2^-e| <
// 1) and, for key offsets, the sum of its int8-rounded elements.
template <class C>
__device__ __forceinline__ void mma_query_exponents(const mma_smem& sm, const mma_lane& at) {
  constexpr int D = C::D;
  for (int h = at.warp; h < C::G; h += mma_warps) {
    float mx = 0.f;
    bool finite = true;
    for (int i = at.lane; i < D; i += 32) {
      const float a = fabsf(sm.acc_part[h * D + i]);
      finite = finite && a < INFINITY;  // false for NaN too
      mx = fmaxf(mx, a);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    int e = 0;
    if (mx > 0.f && mx < INFINITY) frexpf(mx, &e);
    // A non-finite query element would round to an int8 code silently: its head's scores are
    // made NaN instead, as the f16 path's are.
    finite = __all_sync(0xffffffffu, finite);
    if (at.lane == 0) sm.qexp[h] = C::s8_keys && !finite ? NAN : float(e);
    if constexpr (C::key_offset) {  // the int8-rounded query the fragments will hold, summed
      const float qs = exp2f(float(C::s8_query_bits) - float(e));
      int sum = 0;
      for (int i = at.lane; i < D; i += 32) sum += __float2int_rn(sm.acc_part[h * D + i] * qs);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (at.lane == 0) sm.qsum[h] = float(sum);  // |sum| < 2^13 x 512: exact
    }
  }
}

}  // namespace tierkv::cuda::detail
