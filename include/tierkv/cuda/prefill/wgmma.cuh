// SPDX-License-Identifier: Apache-2.0
// The prefill kernel's wgmma path (sm_90a, head_dim 256): a warpgroup's 64 rows over a decoded
// tile on wgmma, the producer warpgroup that fetches and decodes the tiles, and the consumer
// warpgroups that compute them, handed over by mbarriers.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/cuda/arch/bulk_copy.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/arch/warp_roles.cuh"
#include "tierkv/cuda/arch/wgmma.cuh"
#include "tierkv/cuda/prefill/fetch.cuh"
#include "tierkv/cuda/prefill/kernel.cuh"
#include "tierkv/cuda/prefill/mma_sync.cuh"
namespace tierkv::cuda::detail {

// The warpgroup's 64 rows (warps 4 wg .. 4 wg + 3) over decoded tile buffer `kv` on wgmma
// (sm_90a, head_dim 256, 32-token tiles): S = Q K^T by 16 m64n32k16 steps from shared memory,
// the softmax as compute_tile's, O += P V by 2 m64n256k16 steps with P in registers.
template <class Geometry, class... Tiers>
template <bool Masked>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::compute_tile_wgmma(
    const prefill_inputs<N>& in, const smem& sm, int kv, warp_state& st, int warp, int lane) {
  static_assert(D == 256 && TL == 32, "prefill: the wgmma path is head_dim 256's");
  float s[ST][4];
  float(&sv)[4 * ST] = reinterpret_cast<float(&)[4 * ST]>(s);
  float(&ov)[4 * NT] = reinterpret_cast<float(&)[4 * NT]>(st.o);
  const int wg = warp / 4;
  // K-major Q / K: K-adjacent core matrices 128 bytes apart, 8-row groups D / 8 x 128
  constexpr std::uint32_t qk_lbo = wgmma_core_bytes, qk_sbo = D / 8 * wgmma_core_bytes;
  // MN-major V: K-adjacent (token) core matrices 128 bytes apart, 8-dimension groups TL / 8 x
  // 128
  constexpr std::uint32_t v_lbo = wgmma_core_bytes, v_sbo = TL / 8 * wgmma_core_bytes;
  const std::uint8_t* q = sm.q + SM::q_at(64 * wg, 0);
  const std::uint8_t* k = sm.k(kv);
#pragma unroll
  for (int i = 0; i < 4 * ST; ++i) sv[i] = 0.f;
  wgmma_fence_operands(sv);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    wgmma_m64n32k16_f16(sv, wgmma_descriptor(q + SM::q_at(0, 16 * ks), qk_lbo, qk_sbo),
                        wgmma_descriptor(k + SM::k_at(0, 16 * ks), qk_lbo, qk_sbo), ks > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(sv);
  std::uint32_t pa[ST][2];
  online_softmax<Masked>(in, sm, kv, st, s, pa, lane);
  wgmma_fence_operands(ov);
  wgmma_fence();
#pragma unroll
  for (int kt = 0; kt < TL / 16; ++kt) {
    const std::uint32_t a[4] = {pa[2 * kt][0], pa[2 * kt][1], pa[2 * kt + 1][0], pa[2 * kt + 1][1]};
    wgmma_m64n256k16_bf16_rs<true>(
        ov, a, wgmma_descriptor(sm.v(kv) + SM::v_at(16 * kt, 0), v_lbo, v_sbo), true);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(ov);
}

// The wgmma path's producer warpgroup over tier F's tiles [a, b) (thread `pt` of its 128): the
// entries (cp.async) and bytes (bulk copies) by its first warp, stages - 1 tiles ahead; tile t
// decoded into buffer (t - a) % 2 once the consumers have freed it, then marked full. One
// barrier a tile among the producer's warps (a staging area is refilled once every thread has
// decoded from it).
template <class Geometry, class... Tiers>
template <int F>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::producer_tiles(
    const prefill_inputs<N>& in, const block& bk, int e_begin, int e_end, int a, int b,
    const smem& sm, pipe_phases& ph, int pt) {
  const format_pages_view fv = in.index.formats[F];
  const pool_view pool = in.pools[F];
  constexpr int NS = SM::stages, EB = SM::entry_buffers, ahead = entries_ahead;
  const int lane = pt < 32 ? pt : -1;  // the fetching warp's lanes
  pipeline_prologue<F>(in, bk, e_begin, e_end, a, b, sm, lane,
                       [] { named_barrier_sync(producer_barrier, 128); });
  for (int t = a; t < b; ++t) {
    const int i = t - a, kv = i & 1, stage = i % NS;
    mbarrier_wait_parity(sm.bar(stage), ((ph.stage >> stage) ^ unsigned(i / NS)) & 1u);
    // the (u = uses so far)-th fill of buffer kv waits for the consumers' u-th release: on a
    // fresh barrier the phase before the first (parity 1) counts as complete
    mbarrier_wait_parity(sm.vacant(kv), ((ph.kv >> kv) ^ unsigned(i / 2) ^ 1u) & 1u);
    unpack_tile<F, 128>(bk, t, present(e_begin, e_end, t), i % EB, stage, kv, pool, sm, pt);
    fence_proxy_async_shared();  // the tile is read by wgmma; the staging area refilled by copies
    mbarrier_arrive(sm.full(kv));
    cp_async_wait<NS - 2>();  // tile t + NS's entries landed (as in tier_tiles)
    named_barrier_sync(producer_barrier, 128);
    if (t + NS < b) fetch_tile<F>(in, bk, t + NS, (i + NS) % EB, stage, sm, lane);
    if (t + ahead < b) fetch_entries(fv, e_begin, e_end, t + ahead, (i + ahead) % EB, sm, lane);
    cp_async_commit();
  }
  cp_async_wait<0>();
  advance_stage_phases(ph.stage, b - a);
  advance_kv_phases(ph.kv, b - a);
}

// The wgmma path's consumer warpgroups over tier F's tiles [a, b): each tile once its buffer is
// full (the warpgroup's 64 rows, compute_tile_wgmma, skipped past them), then the buffer freed.
template <class Geometry, class... Tiers>
template <int F>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::consumer_tiles(
    const prefill_inputs<N>& in, const block& bk, int a, int b, const smem& sm, warp_state& st,
    int warp, int lane) {
  // the warpgroup's positions: its first and last real rows (-1: none)
  const int g_first = bk.row0 + 64 * (warp / 4), g_last = min(bk.rows_total, g_first + 64) - 1;
  const int gmin = g_last >= g_first ? bk.len - bk.n + g_first / G : -1;
  const int gmax = g_last >= g_first ? bk.len - bk.n + g_last / G : -1;
  for (int t = a; t < b; ++t) {
    const int i = t - a, kv = i & 1;
    mbarrier_wait_parity(sm.full(kv), ((st.kv_phases >> kv) ^ unsigned(i / 2)) & 1u);
    const int first = sm.kpos(kv)[0], last = sm.kpos(kv)[TL - 1];  // positions grow in a tile
    if (last <= gmin && (in.window <= 0 || first > gmax - in.window))
      compute_tile_wgmma<false>(in, sm, kv, st, warp, lane);
    else if (first <= gmax)
      compute_tile_wgmma<true>(in, sm, kv, st, warp, lane);
    mbarrier_arrive(sm.vacant(kv));  // its wgmma reads are complete (wgmma_wait)
  }
  advance_kv_phases(st.kv_phases, b - a);
}

// The producer's side of passes: the same tiles in the same order, each pass opened by the
// block barrier that follows the consumers' preparation of it.
template <class Geometry, class... Tiers>
template <int I>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::producer_passes(
    const prefill_inputs<N>& in, const block& bk, const smem& sm, const int (&lo)[N],
    const int (&hi)[N], int split_lo, int split_hi, int skip, pipe_phases& ph, int pt) {
  if constexpr (I < N) {
    constexpr int F = order.at[I];
    const int a = pass_begin<F>(lo, split_lo, skip), b = pass_end<F>(lo, hi, split_hi, skip);
    if (a < b) {
      block_sync_across_roles();  // the consumers' at the pass's opening in passes<I>
      producer_tiles<F>(in, bk, in.index.formats[F].indptr[bk.b],
                        in.index.formats[F].indptr[bk.b + 1], a, b, sm, ph, pt);
    }
    producer_passes<I + 1>(in, bk, sm, lo, hi, split_lo, split_hi, skip + (hi[F] - lo[F]), ph, pt);
  }
}

}  // namespace tierkv::cuda::detail
