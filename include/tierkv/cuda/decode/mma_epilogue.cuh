// SPDX-License-Identifier: Apache-2.0
// The tensor-core decode's epilogue (decode/tensor_core.cuh): the warps' online-softmax states
// of one tier's pages folded into the chunk's, in shared memory.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/decode/common.cuh"
#include "tierkv/cuda/decode/mma_config.cuh"
#include "tierkv/cuda/decode/mma_step.cuh"
#include "tierkv/cuda/warp/lane_group.cuh"

namespace tierkv::cuda::detail {

// the chunk's new running max of head h: previous tiers and every warp with mass
__device__ __forceinline__ float mma_chunk_max(const mma_smem& sm, int h) {
  float x = sm.m[h];
  for (int w = 0; w < mma_warps; ++w)
    if (sm.wstate[w * 24 + 16 + h] > 0.f) x = fmaxf(x, sm.wstate[w * 24 + h]);
  return x;
}

// The warps' states -> shared memory, rebased to the chunk's running max: sm.acc_part holds
// the tier's accumulator (in the codec's domain) and sm.m / sm.l the chunk's max and sum.
template <class Geometry, class C>
__device__ __forceinline__ void mma_fold_warps(const mma_smem& sm, const mma_lane& at,
                                               const mma_warp_state<C>& ws) {
  using VC = typename C::VC;
  constexpr int D = C::D, G = C::G, ST = C::ST;
  const int tid = at.tid, warp = at.warp, lane = at.lane, qg = at.qg, qc = at.qc;
  float(&o)[ST][4] = ws.o;
  float(&ob)[2] = ws.ob;
  float(&m)[2] = ws.m;
  float(&mv)[2] = ws.mv;
  float(&l)[2] = ws.l;
#pragma unroll
  for (int j = 0; j < 2; ++j) l[j] = quad_col_sum(l[j]);
  if (qg == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float* wst = sm.wstate + warp * 24;
      wst[2 * qc + j] = m[j];
      wst[8 + 2 * qc + j] = mv[j];
      wst[16 + 2 * qc + j] = l[j];
    }
  }
  __syncthreads();
  float fac[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * qc + j;
    fac[j] = h < G ? exp2_rel(mv[j], mma_chunk_max(sm, h)) : 0.f;
  }
  const float mnew_t = tid < G ? mma_chunk_max(sm, tid) : 0.f;
  // Each warp writes its rescaled accumulator to its own slice of the (now idle) staging
  // ring (mma_fold); one barrier, then the block sums the slices in a fixed warp order
  // (deterministic). Folding the warps one after another behind a barrier each put 4 x d/16
  // x 4 shared read-modify-writes on every chunk's critical path (ncu, B = 1: ~25% of a
  // warp's instructions).
  using fold_shape = mma_fold<Geometry>;
  float* fold = reinterpret_cast<float*>(sm.ring);
#pragma unroll
  for (int mt = 0; mt < ST; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x = C::value_bias ? o[mt][i] - ob[i % 2] : o[mt][i];
      fold[warp * fold_shape::slice + (4 * mt + i) * fold_shape::row + lane] = x * fac[i % 2];
    }
  __syncthreads();
  static_assert(fold_shape::values * 32 % decode_threads == 0,
                "decode: whole fold rounds per thread");
#pragma unroll 4
  for (unsigned n = 0; n < fold_shape::values * 32 / decode_threads; ++n) {
    // value k of lane src (unsigned: the divisions are shifts); the loads unconditional (a
    // dead column's slots are read, not stored), so the unrolled rounds' loads overlap
    const unsigned e = unsigned(tid) + n * decode_threads;
    const unsigned k = e % fold_shape::values, src = e / fold_shape::values;
    float x = fold[k * fold_shape::row + src];
#pragma unroll
    for (int w = 1; w < mma_warps; ++w)
      x += fold[w * fold_shape::slice + k * fold_shape::row + src];
    const unsigned h = 2 * (src % 4) + k % 2;
    if (h < unsigned(G)) sm.acc_part[h * D + VC::value_coord(src / 4, k / 4, (k % 4) / 2)] = x;
  }
  __syncthreads();
  if (tid < G) {
    float lt = sm.l[tid] * exp2_rel(sm.m[tid], mnew_t);
    for (int w = 0; w < mma_warps; ++w)
      lt += sm.wstate[w * 24 + 16 + tid] * exp2_rel(sm.wstate[w * 24 + tid], mnew_t);
    sm.l[tid] = lt;
    sm.m[tid] = mnew_t;
  }
}

}  // namespace tierkv::cuda::detail
