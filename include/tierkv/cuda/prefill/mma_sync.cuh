// SPDX-License-Identifier: Apache-2.0
// The prefill kernel's portable compute path: a warp's 16 rows over a decoded tile on mma.sync
// (S = Q K^T f16, the online softmax, O += P V bf16), and a tier's tiles through the pipeline of
// one barrier a tile. The online softmax serves the wgmma path too.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "tierkv/attention/logits.hpp"
#include "tierkv/cuda/arch/bulk_copy.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/arch/ldmatrix.cuh"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/arch/mma.cuh"
#include "tierkv/cuda/prefill/fetch.cuh"
#include "tierkv/cuda/prefill/kernel.cuh"
namespace tierkv::cuda::detail {

// S = Q K^T of the warp's 16 rows over decoded tile buffer `kv` (mma.sync f16): s[j] is the
// m16n8 C fragment of tokens 8 j .. 8 j + 7.
template <class Geometry, class... Tiers>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::scores_mma(
    const smem& sm, int kv, float (&s)[ST][4], int warp, int lane) {
#pragma unroll
  for (int j = 0; j < ST; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  // lanes 0-15 address rows 0-15 at the k-step's first 8 dimensions, lanes 16-31 the next 8;
  // a k-step is 16 dimensions, two K-adjacent core matrices (+256 bytes)
  const std::uint8_t* qrow = sm.q + SM::q_at(warp * 16 + lane % 16, (lane / 16) * 8);
  const std::uint8_t* krow = sm.k(kv) + SM::k_at((lane / 16) * 8 + lane % 8, ((lane / 8) % 2) * 8);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    std::uint32_t a[4];
    ldmatrix_x4(a, qrow + SM::q_at(0, 16 * ks));
#pragma unroll
    for (int np = 0; np < ST / 2; ++np) {
      std::uint32_t bb[4];
      ldmatrix_x4(bb, krow + SM::k_at(16 * np, 16 * ks));
      mma_16816(s[2 * np], a, bb[0], bb[1]);
      mma_16816(s[2 * np + 1], a, bb[2], bb[3]);
    }
  }
}

// The online softmax of a tile's scores: logits in log2 units (key scale x row scale, the
// optional soft-cap, masked by position unless Masked is false: every token of the tile valid
// and visible to every row), the running max / sum, O rescaled, and P x value scale as bf16
// pairs (pa[j][r]: rows g and g + 8 of tokens 8 j + 2 (l % 4) + {0, 1}, mma's A fragments).
template <class Geometry, class... Tiers>
template <bool Masked>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::online_softmax(
    const prefill_inputs<N>& in, const smem& sm, int kv, warp_state& st, float (&s)[ST][4],
    std::uint32_t (&pa)[ST][2], int lane) {
  const int cb = 2 * (lane % 4);
  const soft_cap cap = soft_cap::make<log_base::two>(in.soft_cap);  // on the MUFU unit
  float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < ST; ++j) {
    const float2 ksc = *reinterpret_cast<const float2*>(sm.kscale(kv) + 8 * j + cb);
    int2 kp = make_int2(0, 0);
    if constexpr (Masked) kp = *reinterpret_cast<const int2*>(sm.kpos(kv) + 8 * j + cb);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float z = s[j][2 * r + c] * (c ? ksc.y : ksc.x) * st.rq[r];  // rq: x log2 e
        if (cap.on()) z = cap.apply(z, mufu_exp2{}, mufu_rcp{});
        if constexpr (Masked) {
          const int p = c ? kp.y : kp.x;
          const bool masked = p > st.rpos[r] || (in.window > 0 && p <= st.rpos[r] - in.window);
          z = masked ? -INFINITY : z;
        }
        s[j][2 * r + c] = z;
        tmax[r] = fmaxf(tmax[r], z);
      }
  }
  float alpha[2], mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
    tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    const float m_new = fmaxf(st.m[r], tmax[r]);
    mu[r] = m_new == -INFINITY ? 0.f : m_new;  // every logit so far masked: p = alpha = 0
    alpha[r] = fast_exp2(st.m[r] - mu[r]);     // m = -inf: +0
    st.m[r] = m_new;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < ST; ++j) {
    const float2 vsc = *reinterpret_cast<const float2*>(sm.vscale(kv) + 8 * j + cb);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float p0 = fast_exp2(s[j][2 * r] - mu[r]), p1 = fast_exp2(s[j][2 * r + 1] - mu[r]);
      sum[r] += p0 + p1;
      const __nv_bfloat162 h = __floats2bfloat162_rn(p0 * vsc.x, p1 * vsc.y);
      pa[j][r] = *reinterpret_cast<const std::uint32_t*>(&h);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * alpha[r] + sum[r];
  // once the rows' maxima settle, alpha is 1 for the whole warp: skip D / 2 multiplies
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      st.o[nt][0] *= alpha[0];
      st.o[nt][1] *= alpha[0];
      st.o[nt][2] *= alpha[1];
      st.o[nt][3] *= alpha[1];
    }
  }
}

// O += P V of the warp's 16 rows (mma.sync bf16, V by transposing ldmatrix).
template <class Geometry, class... Tiers>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::values_mma(
    const smem& sm, int kv, warp_state& st, const std::uint32_t (&pa)[ST][2], int lane) {
  // lanes 8i..8i+7 address tokens 8 (i % 2) + 0..7 at dimensions 8 (i / 2) of a 16 x 16 block
  const std::uint8_t* vrow = sm.v(kv) + SM::v_at(lane % 8 + ((lane / 8) % 2) * 8, (lane / 16) * 8);
#pragma unroll
  for (int kt = 0; kt < TL / 16; ++kt) {
    const std::uint32_t a[4] = {pa[2 * kt][0], pa[2 * kt][1], pa[2 * kt + 1][0], pa[2 * kt + 1][1]};
#pragma unroll
    for (int dp = 0; dp < NT / 2; ++dp) {
      std::uint32_t bb[4];
      ldmatrix_x4_trans(bb, vrow + SM::v_at(16 * kt, 16 * dp));
      mma_16816_bf16(st.o[2 * dp], a, bb[0], bb[1]);
      mma_16816_bf16(st.o[2 * dp + 1], a, bb[2], bb[3]);
    }
  }
}

// The warp's 16 rows over decoded tile buffer `kv` on mma.sync.
template <class Geometry, class... Tiers>
template <bool Masked>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::compute_tile(
    const prefill_inputs<N>& in, const smem& sm, int kv, warp_state& st, int warp, int lane) {
  float s[ST][4];
  std::uint32_t pa[ST][2];
  scores_mma(sm, kv, s, warp, lane);
  online_softmax<Masked>(in, sm, kv, st, s, pa, lane);
  values_mma(sm, kv, st, pa, lane);
}

// Tier F's tiles [a, b) of this block on mma.sync (the portable path), a pipeline with one
// barrier a tile: while tile t is computed from one decoded buffer, tile t + 1 is decoded from
// its staging area into the other and tiles t + 2 .. t + stages are in flight by bulk copies
// (tile t + stages into the staging area tile t left; the index entries run further ahead). The
// decode is ALU work and the compute tensor-core work, so the block's two warp halves take them
// in opposite orders: each scheduler (warps w and w + 4) has one warp of each kind to issue from.
template <class Geometry, class... Tiers>
template <int F>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::tier_tiles(
    const prefill_inputs<N>& in, const block& bk, int e_begin, int e_end, int a, int b,
    const smem& sm, warp_state& st, int warp, int lane) {
  const format_pages_view fv = in.index.formats[F];
  const pool_view pool = in.pools[F];
  // the warp's row positions: a tile past the largest needs no compute from the warp; one
  // wholly at or before the smallest (and inside every row's window) needs no mask
  int wmax = max(st.rpos[0], st.rpos[1]), wmin = min(st.rpos[0], st.rpos[1]);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
    wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
  }
  const bool decode_first = warp >= prefill_warps / 2;
  const int tid = int(threadIdx.x);
  constexpr int NS = SM::stages, EB = SM::entry_buffers, ahead = entries_ahead;
  // tile t's bytes are the ((t - a) / NS)-th use of staging area (t - a) % NS this pass, whose
  // barrier's phases carry on from the passes before (st.phases)
  auto decode = [&](int t) {
    mbarrier_wait_parity(sm.bar((t - a) % NS),
                         ((st.phases >> ((t - a) % NS)) ^ unsigned((t - a) / NS)) & 1u);
    unpack_tile<F, prefill_threads>(bk, t, present(e_begin, e_end, t), (t - a) % EB, (t - a) % NS,
                                    (t - a) & 1, pool, sm, tid);
  };
  // the staging areas, entry and decoded buffers are free; the generic accesses to them (the
  // passes before, the output scratch over them) ordered before the bulk copies refill them
  fence_proxy_async_shared();
  __syncthreads();
  pipeline_prologue<F>(in, bk, e_begin, e_end, a, b, sm, tid, [] { __syncthreads(); });
  decode(a);
  fence_proxy_async_shared();  // staging refilled by bulk copies
  __syncthreads();
  for (int t = a; t < b; ++t) {
    const int kv = (t - a) & 1;
    if (t + NS < b) fetch_tile<F>(in, bk, t + NS, (t + NS - a) % EB, (t - a) % NS, sm, tid);
    if (t + ahead < b) fetch_entries(fv, e_begin, e_end, t + ahead, (t + ahead - a) % EB, sm, tid);
    cp_async_commit();
    const int first = sm.kpos(kv)[0], last = sm.kpos(kv)[TL - 1];  // positions grow in a tile
    if (decode_first && t + 1 < b) decode(t + 1);
    if (last <= wmin && (in.window <= 0 || first > wmax - in.window))
      compute_tile<false>(in, sm, kv, st, warp, lane);
    else if (first <= wmax)
      compute_tile<true>(in, sm, kv, st, warp, lane);
    if (!decode_first && t + 1 < b) decode(t + 1);
    // tile t + NS + 1's entries landed (the groups of iterations up to t + 2 - NS); tile t + 1
    // decoded; tile t's buffers free (its staging area's reads fenced before bulk copies refill
    // it)
    fence_proxy_async_shared();
    cp_async_wait<NS - 2>();
    __syncthreads();
  }
  cp_async_wait<0>();  // the groups left are empty: nothing lands in the scratch after this
  advance_stage_phases(st.phases, b - a);
}

}  // namespace tierkv::cuda::detail
