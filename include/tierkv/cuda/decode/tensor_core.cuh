// SPDX-License-Identifier: Apache-2.0
// The tensor-core split kernel of the mixed-format decode (decode_path::tensor_core, the
// default): the chunking, workspace states and second pass of decode/common.cuh, with the score
// and value products on mma.sync: m16n8k16 (f16 in, f32 acc) for values and FP8 keys, m16n8k32
// (int8 in, int32 acc) for TQ3, TQ4 and int8_rotated keys. Each format's fragments come from
// its device codec (cuda/codec/).
//
// Shape (docs/gpu.md): each warp walks a stream of steps (16 tokens, 32 for TQ3 / TQ4 tiers:
// mma_staging::substeps) of the chunk's pages (whole pages round robin, or a balanced range of
// steps in small chunks), each step staged global -> shared memory by cp.async and read into
// registers. Tokens are the M rows, the group's query heads the N = 8 columns:
//   S^T[16 tok x 8 heads] = K[16 x d] . Q^T[d x 8]   (A = key codes, B = queries)
//   O^T[d x 8 heads]     += V^T[d x 16 tok] . P^T     (A = value codes, B = probabilities)
// so codes become f16 (or int8) A fragments in registers, with no shared-memory transpose.
// The k slots of a fragment may be mapped to any coordinates as long as the other operand
// uses the same map: keys take 4 contiguous codes per slot quadruple, values take the token
// pair of a lane by one byte-permute. Queries are split into f16 hi + lo parts (FP8 keys:
// scores keep ~fp32 precision) or int8 digits (13 or 20 bits); per-token key scales and value
// scales multiply S^T rows.
//
// The pieces: decode/mma_config.cuh (shapes, shared memory, a tier's configuration),
// decode/mma_staging.cuh (the warp's slot and its stream of steps), decode/mma_prologue.cuh (the
// query's exponents and fragments, a lane's column scales), decode/mma_step.cuh (one step's
// reads, products, softmax update and mass), decode/mma_epilogue.cuh (the warps' fold); here
// one tier's pages of a chunk and the kernel.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "tierkv/attention/int8_query.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/decode/common.cuh"
#include "tierkv/cuda/decode/mma_config.cuh"
#include "tierkv/cuda/decode/mma_epilogue.cuh"
#include "tierkv/cuda/decode/mma_prologue.cuh"
#include "tierkv/cuda/decode/mma_staging.cuh"
#include "tierkv/cuda/decode/mma_step.cuh"

namespace tierkv::cuda::detail {

// One tier's pages of this chunk on the tensor cores: the warp's first step in flight, the query
// prologue, then per step its key rows, scores, one online-softmax update and value product,
// then the warps' states folded into the chunk's. Local: the launch has a soft-cap or a sliding
// window (decode() picks the instantiation, so the plain kernel carries none of their registers:
// bench/results/decode/ab/ for the A/B).
//
// The prologue (decode/mma_prologue.cuh) and the epilogue (decode/mma_epilogue.cuh) are
// functions of their own. Moving them out changes the kernels' SASS (the clamp of j_end below
// compiles to another, equivalent sequence; bench/gpu/sass_compare.py), so the split was
// measured against the whole body in one device call:
// bench/results/restructure/mma-split-ab-2026-12-07.txt.
template <class Geometry, class Tier, int N, bool Local>
__device__ void mma_tier_pages(const decode_inputs<N>& in, const decode_plan& plan, int f, int b,
                               int kvh, int e_begin, int e_end, bool sole, const mma_smem& sm,
                               float* mass_ws, int* err) {
  using C = mma_tier_config<Geometry, Tier>;
  constexpr int D = C::D, G = C::G, ST = C::ST, RT = C::RT, SL = C::SL;
  const mma_lane at;
  const int tid = at.tid, warp = at.warp, qc = at.qc;
  const codec_context kctx =
      make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::key);
  const codec_context vctx =
      make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::value);
  __syncthreads();

  // ---- the warp's steps (mma_page_stream) through its staging slot (mma_slot). Small chunks (<
  // 4 pages per warp): the steps of the tier's pages in this chunk split into 4 contiguous
  // ranges, balanced to a step (whole pages per warp left up to a page of 4 steps idle per warp
  // on the critical path of small batches; part of
  // bench/results/decode/ab/ab-h200-2026-11-30-run9.txt: B = 1 -10..-18% at d = 256). Larger
  // chunks: whole pages round robin (stride 4 pages), as before; contiguous ranges there
  // measured the same (+-1%). The ranges split the steps as if every page were full, so the
  // first step's address needs no index load but its slot; the sequence's last page may be
  // partial, and j_end is clamped to its tokens once that step is in flight. Step indices are
  // unsigned: j / SL and j % SL are shifts for the usual page sizes.
  const format_pages_view fv = in.index.formats[f];
  const pool_view pool = in.pools[f];
  const mma_slot<C> slot(sm.ring, kvh, at);
  const int pages = e_end - e_begin;
  const bool ranges = pages < 4 * mma_warps;
  const int stride = ranges ? 1 : mma_warps;
  const unsigned nominal = unsigned(pages) * SL;
  unsigned j_end = ranges ? nominal * unsigned(warp + 1) / mma_warps : nominal;
  const mma_page_stream<C> stream{fv, pool, e_begin, stride, j_end, err};
  // The warp's first step is copied before the query prologue, which hides its memory round
  // trip (B = 1: 1-2 us of a chunk, per-CTA %clock64 trace). The last page's index and the
  // sequence's length load alongside the first step's slot (used after that step is issued).
  const std::int32_t last = pages > 0 ? __ldg(fv.logical + e_end - 1) : -1;
  const int length = __ldg(in.index.seq_len + b);
  unsigned j =
      stream.valid_from(ranges ? nominal * unsigned(warp) / mma_warps : unsigned(warp) * SL);
  const std::uint8_t* page = stream.page_at(j);
  slot.issue_keys(page, int(j % SL));
  slot.issue_values(page, int(j % SL));
  if (pages > 0) {  // every page has SL steps but the last (a step past a page's tokens is masked)
    const int last_tok = last >= 0 ? in.index.tokens_in_page_of(length, last, Geometry::page_tokens)
                                   : Geometry::page_tokens;
    const unsigned total_steps =
        unsigned(pages - 1) * SL + unsigned(std::max(1, (last_tok + RT - 1) / RT));
    if (j_end > total_steps) j_end = total_steps;
  }

  // ---- the query prologue: queries in the key codec's domain, per head scaled by 2^-e (max |q|
  // < 1) and split into hi + lo B fragments (f16, or int8 digits for int8 keys): column n = head
  // qg, k slots of lane qc.
  group_prepare_query<typename C::K, G>(sm.q_raw, sm.acc_part, kctx);
  // group_prepare_query gives head h to warp h % 4, as mma_query_exponents does: a warp reads
  // only what it wrote (no block barrier; at B = 1 the per-chunk prologue and epilogue are
  // about half of the split kernel's stall samples, ncu; docs/history/gpu-runs.md).
  static_assert(mma_warps == decode_warps, "decode: the prologue's head-to-warp map");
  __syncwarp();
  mma_query_exponents<C>(sm, at);
  __syncthreads();
  mma_query_fragments<C>(sm, at);
  __syncthreads();
  // ---- the warp's state (mma_warp_state)
  float o[ST][4];
#pragma unroll
  for (int mt = 0; mt < ST; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[mt][i] = 0.f;
  float ob[2] = {0.f, 0.f};
  float m[2] = {-INFINITY, -INFINITY}, mv[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const mma_warp_state<C> ws{o, ob, m, mv, l};
  const mma_columns cols = mma_lane_columns<C>(sm, in.softmax_scale, qc);

  // ---- the steps (mma_step). Sub-step h of a step: key rows 16h + qg, 16h + qg + 8, value rows
  // 16h + 2qc, +1, +8, +9.
  int ntok = 0, t_lo = 0;
  std::int32_t logical = -1;
  while (j < j_end) {
    const int step = int(j % SL);
    if (logical < 0) {  // a new page (or the first step, which may start mid-page)
      logical = fv.logical[e_begin + int(j / SL)];
      if constexpr (Local) {
        const int len = in.index.seq_len[b];
        ntok = in.index.tokens_in_page_of(len, logical, Geometry::page_tokens);
        // tokens before t_lo are outside the window (0 without one)
        t_lo = first_in_page<Geometry::page_tokens>(logical, window_first(in.window, len), ntok);
      } else {
        ntok = in.index.tokens_in_page(b, logical, Geometry::page_tokens);
      }
    }
    // the next step: in this page (same address), else the warp's next valid page
    const bool same_page = (j + 1) % SL != 0;
    const unsigned nj = same_page ? j + 1 : stream.valid_from((j / SL + stride) * SL);
    const std::uint8_t* npage = same_page ? (nj < j_end ? page : nullptr) : stream.page_at(nj);
    const int ns = int(nj % SL);
    float ps[2] = {0.f, 0.f};
    const int t0 = RT * step;
    mma_step<C, Local>(in, slot, sm, at, npage, ns, t0, t_lo, ntok, cols, ws, ps);
    if (mass_ws != nullptr) mma_step_mass<C>(plan, mass_ws, b, kvh, logical, step, ps, ws, at, err);
    if (!same_page) logical = -1;
    page = npage;
    j = nj;
  }
  cp_async_wait<0>();  // the empty groups of the last step

  mma_fold_warps<Geometry, C>(sm, at, ws);
  // Back to the model's domain once per tier (identity for FP8, inverse rotation for TQ3).
  group_finalize<typename C::V, G>(sm.acc_part, vctx);
  // The chunk's only tier: acc_part is the chunk's accumulator, relative to m (the split
  // kernel stores it after its barrier). Otherwise fold it into acc_total.
  if (sole) return;
  __syncthreads();
  for (int i = tid; i < G * D; i += decode_threads) {
    const int h = i / D;
    sm.acc_total[i] = sm.acc_total[i] * exp2_rel(sm.m_ref[h], sm.m[h]) + sm.acc_part[i];
  }
  __syncthreads();
  if (tid < G) sm.m_ref[tid] = sm.m[tid];
  __syncthreads();
}

template <class Geometry, class TierList, bool Local>
struct mma_kernels;

template <class Geometry, class... Tiers, bool Local>
struct mma_kernels<Geometry, tiers<Tiers...>, Local> {
  static constexpr int N = int(sizeof...(Tiers));
  using S = mma_shape<Geometry>;

  // One chunk (run_split_block, decode/common.cuh): its tiers' pages, then its state to the
  // workspace.
  static __device__ __forceinline__ void chunk(const decode_inputs<N>& in, const decode_plan& plan,
                                               std::uint8_t* workspace, int kvh, int c, int b,
                                               const chunking<N>& ch, const std::int64_t (&cost)[N],
                                               int* err, float* mass_ws) {
    constexpr int D = S::d, G = S::g;
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    mma_smem sm;
    sm.q_raw = smem;
    sm.acc_part = sm.q_raw + G * D;
    sm.acc_total = sm.acc_part + G * D;
    sm.wstate = sm.acc_total + G * D;
    sm.m = sm.wstate + mma_warps * 24;
    sm.l = sm.m + 8;
    sm.m_ref = sm.l + 8;
    sm.qexp = sm.m_ref + 8;
    sm.qsum = sm.qexp + 8;
    sm.table = reinterpret_cast<std::uint32_t*>(sm.qsum + 8);
    sm.qfrag = reinterpret_cast<uint4*>(sm.qsum + 16);
    sm.ring = reinterpret_cast<std::uint8_t*>(sm.qfrag + S::steps * 32);

    const int tid = int(threadIdx.x);
    const std::size_t qrow = std::size_t(b) * S::qh + std::size_t(kvh) * G;
    load_group_queries<G, D>(in, qrow, sm.q_raw, sm.acc_total);
    if (tid == 0) sm.table[0] = tierkv::detail::tq3_u8_0;
    if (tid < G) {
      sm.m[tid] = -INFINITY;
      sm.l[tid] = 0.f;
      sm.m_ref[tid] = -INFINITY;
    }
    // The tiers with pages in this chunk (by-format chunks, the usual case, have one), less the
    // pages wholly before the window (not read; a chunk left without pages stores an empty state).
    int lo[N], hi[N], with_pages = 0;
    if constexpr (!Local) {
#pragma unroll
      for (int f = 0; f < N; ++f) {
        chunk_range<N>(ch, cost, c, f, lo[f], hi[f]);
        with_pages += hi[f] > lo[f];
      }
    } else {
#pragma unroll
      for (int f = 0; f < N; ++f) chunk_range<N>(ch, cost, c, f, lo[f], hi[f]);
      if (in.window > 0) {
        const int first = window_first(in, b);
#pragma unroll
        for (int f = 0; f < N; ++f)
          if (hi[f] > lo[f])
            lo[f] = first_window_entry<Geometry::page_tokens>(
                        in.index.formats[f], ch.first[f] + lo[f], ch.first[f] + hi[f], first) -
                    ch.first[f];
      }
#pragma unroll
      for (int f = 0; f < N; ++f) with_pages += hi[f] > lo[f];
    }
    const bool sole = with_pages == 1;
    run_tiers(in, plan, ch, lo, hi, sole, b, kvh, sm, mass_ws, err, std::make_index_sequence<N>{});
    __syncthreads();

    store_chunk_state<G, D>(plan, workspace, qrow, c, sm.m, sm.l,
                            sole ? sm.acc_part : sm.acc_total);
  }

  template <std::size_t... I>
  static __device__ void run_tiers(const decode_inputs<N>& in, const decode_plan& plan,
                                   const chunking<N>& ch, const int (&lo)[N], const int (&hi)[N],
                                   bool sole, int b, int kvh, const mma_smem& sm, float* mass_ws,
                                   int* err, std::index_sequence<I...>) {
    ((hi[I] > lo[I]
          ? mma_tier_pages<Geometry, Tiers, N, Local>(in, plan, int(I), b, kvh, ch.first[I] + lo[I],
                                                      ch.first[I] + hi[I], sole, sm, mass_ws, err)
          : void()),
     ...);
  }
};

template <class Geometry, class TierList, bool Local>
__global__ void __launch_bounds__(decode_threads, mma_shape<Geometry>::min_blocks)
    decode_mma_split_kernel(decode_inputs<TierList::size> in, decode_plan plan,
                            std::uint8_t* workspace) {
  allow_dependent_launch();  // the merge kernel's programmatic launch (arch/pdl.cuh)
  run_split_block<mma_kernels<Geometry, TierList, Local>>(in, plan, workspace);
}

}  // namespace tierkv::cuda::detail