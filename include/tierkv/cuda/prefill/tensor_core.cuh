// SPDX-License-Identifier: Apache-2.0
// The chunked-prefill kernels over mixed pages on the tensor cores (design: docs/gpu-prefill.md).
// A block is 128 (query, head) rows of one sequence and KV head (row r: query r / group, head
// r % group, so a GQA group shares every K/V tile) and one of the plan's KV splits. Per tier
// (value-rotated tiers first) the block walks its share of the tier's 64-token tiles, trimmed to
// the rows' causal (and sliding-window) range: the next tiles' raw bytes come by bulk copies and
// their index entries by cp.async while the current one computes; a landed tile is decoded once
// through the format's slice reader into shared memory (keys f16, values bf16: every format's
// codes are exact in both); then each warp runs its 16 rows FA2-style: S = Q K^T on mma.sync f16
// (queries in the key codec's domain, each row scaled by a power of two to |q| < 1), masked by
// position, online softmax in log2 units (ex2.approx), O += (P x value scale) V on mma.sync bf16.
// Built for sm_90a, head_dim 256 runs both products on wgmma instead, a warpgroup per 64 rows,
// and a third (producer) warpgroup fetches and decodes the tiles into two buffers handed over by
// mbarriers. Value-rotated tiers' O is un-rotated once, through shared memory. One split writes the
// output; several write partial states that prefill_merge_kernel combines by log-sum-exp.
//
// The kernel's type is prefill/kernel.cuh; its stages are defined in prefill/fetch.cuh,
// prefill/mma_sync.cuh, prefill/wgmma.cuh and prefill/output.cuh; here its body and entries.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/arch/bulk_copy.cuh"
#include "tierkv/cuda/arch/warp_roles.cuh"
#include "tierkv/cuda/kernel/error_flag.cuh"
#include "tierkv/cuda/prefill/fetch.cuh"
#include "tierkv/cuda/prefill/inputs.cuh"
#include "tierkv/cuda/prefill/kernel.cuh"
#include "tierkv/cuda/prefill/mma_sync.cuh"
#include "tierkv/cuda/prefill/output.cuh"
#include "tierkv/cuda/prefill/wgmma.cuh"
#include "tierkv/cuda/prefill_plan.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
namespace tierkv::cuda::detail {

// The warp's 16 query rows in the key domain (rotated: H_un D q / d, the codecs'
// prepare_query), each scaled by 2^-e to |x| < 1 and stored as f16; rscale <- 2^e (0 for a row
// with a NaN or an infinity, whose output is NaN: rbad).
template <class Geometry, class... Tiers>
template <bool Rotated>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::prepare_queries(
    const prefill_inputs<N>& in, const block& bk, std::uint64_t key_seed, const smem& sm, int warp,
    int lane) {
  constexpr int RB = 4;  // rows with loads in flight
  const bool bf16 = in.queries_type == query_type::bf16;
  for (int r0 = 0; r0 < 16; r0 += RB) {
    float x[RB][P];
#pragma unroll
    for (int u = 0; u < RB; ++u) {
      const int r = bk.row0 + warp * 16 + r0 + u;
      if (r < bk.rows_total) {
        const std::size_t at =
            (std::size_t(bk.q0 + r / G) * QH + std::size_t(bk.kvh * G + r % G)) * D +
            std::size_t(lane * P);
#pragma unroll
        for (int i = 0; i < P; ++i)
          x[u][i] = bf16 ? __bfloat162float(
                               static_cast<const __nv_bfloat16*>(in.queries)[at + std::size_t(i)])
                         : __ldg(static_cast<const float*>(in.queries) + at + std::size_t(i));
      } else {
#pragma unroll
        for (int i = 0; i < P; ++i) x[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < RB; ++u) {
      const int rl = warp * 16 + r0 + u;
      bool bad = false;
#pragma unroll
      for (int i = 0; i < P; ++i) bad |= !isfinite(x[u][i]);
      bad = __any_sync(0xffffffffu, bad);
      if (bad)
#pragma unroll
        for (int i = 0; i < P; ++i) x[u][i] = 0.f;
      if constexpr (Rotated) {
        warp_signs<P>(x[u], key_seed, lane);
        warp_wht<P>(x[u], lane);
        const float inv_d = tierkv::detail::exp2i(-tierkv::detail::log2_of<D>);
#pragma unroll
        for (int i = 0; i < P; ++i) x[u][i] *= inv_d;
      }
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < P; ++i) amax = fmaxf(amax, fabsf(x[u][i]));
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      int e = 0;
      if (amax > 0.f) (void)frexpf(amax, &e);  // amax = f 2^e, f in [0.5, 1)
      __half h[P];
#pragma unroll
      for (int i = 0; i < P; ++i) h[i] = __float2half_rn(ldexpf(x[u][i], -e));
      __half* dst = reinterpret_cast<__half*>(sm.q + SM::q_at(rl, lane * P));
      if constexpr (P == 8) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(h);
      } else if constexpr (P == 4) {
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(h);
      } else {
        *reinterpret_cast<std::uint32_t*>(dst) = *reinterpret_cast<const std::uint32_t*>(h);
      }
      if (lane == 0) {
        sm.rscale[rl] = bad ? 0.f : ldexpf(1.f, e);
        sm.rbad[rl] = bad ? 1 : 0;
      }
    }
  }
  if constexpr (wgmma_path) fence_proxy_async_shared();  // Q is read by wgmma
  __syncwarp();
}

// Pass I (tier order.at[I]) over this split's share [lo, hi) of the tiers' concatenated tile
// line (skip: tiles of the passes before it).
template <class Geometry, class... Tiers>
template <int I>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::passes(
    const prefill_inputs<N>& in, const block& bk, const smem& sm, warp_state& st,
    const int (&lo)[N], const int (&hi)[N], int split_lo, int split_hi, int skip, int& q_domain,
    bool& o_rotated, int warp, int lane) {
  if constexpr (I < N) {
    constexpr int F = order.at[I];
    const int a = pass_begin<F>(lo, split_lo, skip), b = pass_end<F>(lo, hi, split_hi, skip);
    if (a < b) {  // uniform over the block
      const codec_context kctx =
          make_codec_context(in.cache_seed, in.layer, in.head_base + bk.kvh, kv_role::key);
      const codec_context vctx =
          make_codec_context(in.cache_seed, in.layer, in.head_base + bk.kvh, kv_role::value);
      if (o_rotated && !value_rotated<F>) {  // O back to the raw domain before raw values
        rows_sync();                         // the scratch lies over Q, K and V
        float* slab = sm.scratch + warp * 16 * SM::o_pitch;
        o_store(st, slab, lane);
        unrotate_slab(slab, vctx.seed, lane);
        o_load(st, slab, lane);
        o_rotated = false;
        q_domain = -1;  // Q was overwritten
        rows_sync();
      }
      if (q_domain != int(key_rotated<F>)) {
        prepare_queries<key_rotated<F>>(in, bk, kctx.seed, sm, warp, lane);
        q_domain = int(key_rotated<F>);
#pragma unroll
        for (int r = 0; r < 2; ++r)
          st.rq[r] = sm.rscale[warp * 16 + lane / 4 + 8 * r] * in.softmax_scale * log2e;
      }
      if constexpr (wgmma_path) {
        // the scratch's and Q's generic writes ordered before the producer's bulk copies (and
        // Q published to the warpgroups' wgmma), then the producer starts the pass
        fence_proxy_async_shared();
        block_sync_across_roles();  // the producer's in producer_passes<I>
        consumer_tiles<F>(in, bk, a, b, sm, st, warp, lane);
      } else {
        tier_tiles<F>(in, bk, in.index.formats[F].indptr[bk.b],
                      in.index.formats[F].indptr[bk.b + 1], a, b, sm, st, warp, lane);
      }
      if (value_rotated<F>) o_rotated = true;
    }
    passes<I + 1>(in, bk, sm, st, lo, hi, split_lo, split_hi, skip + (hi[F] - lo[F]), q_domain,
                  o_rotated, warp, lane);
  }
}

template <class Geometry, class... Tiers>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::run(
    const prefill_inputs<N>& in, const prefill_plan& plan, std::uint8_t* workspace) {
  extern __shared__ __align__(16) std::uint8_t prefill_shared[];
  if (blockDim.x != unsigned(threads)) __trap();  // the launch reads it from __launch_bounds__
  const int b = int(blockIdx.z), kvh = int(blockIdx.y);
  const int splits = plan.kv_splits;
  const int rb = plan.row_blocks - 1 - int(blockIdx.x) / splits;  // the longest rows first
  if (b >= in.index.batch) return;
  block bk;
  bk.b = b;
  bk.kvh = kvh;
  bk.split = int(blockIdx.x) % splits;
  bk.err = reinterpret_cast<int*>(workspace + plan.error_offset);
  bk.q0 = in.q_indptr[b];
  bk.n = in.q_indptr[b + 1] - bk.q0;
  bk.len = in.index.seq_len[b];
  if (bk.q0 < 0 || bk.n < 0 || bk.n > bk.len || bk.n > plan.max_chunk_tokens ||
      bk.q0 + bk.n > plan.max_total_q) {
    if (rb == 0 && bk.split == 0 && kvh == 0 && threadIdx.x == 0)
      report_error(bk.err, errc::out_of_range);
    return;
  }
  bk.rows_total = bk.n * G;
  bk.row0 = rb * prefill_rows;
  if (bk.row0 >= bk.rows_total) return;
  const int last_row = min(bk.rows_total, bk.row0 + prefill_rows) - 1;
  bk.pos_min = bk.len - bk.n + bk.row0 / G;
  bk.pos_max = bk.len - bk.n + last_row / G;

  smem sm;
  std::uint8_t* base = prefill_shared;
  sm.base = base;
  sm.q = base + SM::q_off;
  sm.ent = reinterpret_cast<std::int32_t*>(base + SM::ent_off);
  sm.rscale = reinterpret_cast<float*>(base + SM::rscale_off);
  sm.rbad = reinterpret_cast<int*>(base + SM::rbad_off);
  sm.scratch = reinterpret_cast<float*>(base + SM::q_off);

  // every tier's tiles that the block's rows see, and this split's share of them
  int lo[N], hi[N], total = 0;
#pragma unroll
  for (int f = 0; f < N; ++f) {
    const format_pages_view fv = in.index.formats[f];
    const int e_begin = fv.indptr[b], e_end = fv.indptr[b + 1];
    lo[f] = hi[f] = 0;
    if (e_end > e_begin) tile_range(in, bk, fv, e_begin, e_end, lo[f], hi[f]);
    total += hi[f] - lo[f];
  }
  const int split_lo = int(std::int64_t(total) * bk.split / splits);
  const int split_hi = int(std::int64_t(total) * (bk.split + 1) / splits);

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (threadIdx.x == 0) {  // the staging areas' barriers, one arrival a phase (the fetching
                           // warp's, with the tile's byte count); on the wgmma path the decoded
                           // buffers' (full: the producer's 128 threads; free: the consumers')
#pragma unroll
    for (int s = 0; s < SM::stages; ++s) mbarrier_init(sm.bar(s), 1);
    if constexpr (wgmma_path) {
      for (int k = 0; k < 2; ++k) {
        mbarrier_init(sm.full(k), 128);
        mbarrier_init(sm.vacant(k), prefill_threads);
      }
    }
    fence_mbarrier_init();  // published by the passes' first block barrier
  }
  if constexpr (wgmma_path) {
    if (warp >= prefill_warps) {
      warpgroup_release_registers<producer_regs>();
      pipe_phases ph;
      producer_passes<0>(in, bk, sm, lo, hi, split_lo, split_hi, 0, ph,
                         int(threadIdx.x) - prefill_threads);
      return;
    }
    warpgroup_take_registers<consumer_regs>();
  }
  warp_state st;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) st.o[nt][0] = st.o[nt][1] = st.o[nt][2] = st.o[nt][3] = 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = bk.row0 + warp * 16 + lane / 4 + 8 * r;
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
    st.rq[r] = 0.f;
    st.rpos[r] = row < bk.rows_total ? bk.len - bk.n + row / G : -1;  // padding: all masked
  }
  st.phases = 0;
  st.kv_phases = 0;
  int q_domain = -1;
  bool o_rotated = false;
  passes<0>(in, bk, sm, st, lo, hi, split_lo, split_hi, 0, q_domain, o_rotated, warp, lane);
  // A split that computed nothing still checks its queries (a NaN row is NaN in every split).
  if (q_domain < 0) {
    rows_sync();
    prepare_queries<false>(in, bk, 0, sm, warp, lane);
  }
  epilogue(in, plan, workspace, bk, sm, st, o_rotated, warp, lane);
}

template <class Geometry, class TierList>
__global__ void __launch_bounds__((prefill_kernel<Geometry, TierList>::threads), 1)
    prefill_kernel_entry(prefill_inputs<TierList::size> in, prefill_plan plan,
                         std::uint8_t* workspace) {
  prefill_kernel<Geometry, TierList>::run(in, plan, workspace);
}
template <class Geometry, class TierList>
__global__ void __launch_bounds__(prefill_threads)
    prefill_merge_kernel(prefill_inputs<TierList::size> in, prefill_plan plan,
                         const std::uint8_t* workspace) {
  prefill_kernel<Geometry, TierList>::merge(in, plan, workspace);
}

}  // namespace tierkv::cuda::detail
