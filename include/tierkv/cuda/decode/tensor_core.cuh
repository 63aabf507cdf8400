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
// query's exponents, a lane's column scales), decode/mma_step.cuh (one step's products, softmax
// update and mass); here one tier's pages of a chunk and the kernel.
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
#include "tierkv/cuda/decode/mma_prologue.cuh"
#include "tierkv/cuda/decode/mma_staging.cuh"
#include "tierkv/cuda/decode/mma_step.cuh"

namespace tierkv::cuda::detail {

// the chunk's new running max of head h: previous tiers and every warp with mass
__device__ __forceinline__ float mma_chunk_max(const mma_smem& sm, int h) {
  float x = sm.m[h];
  for (int w = 0; w < mma_warps; ++w)
    if (sm.wstate[w * 24 + 16 + h] > 0.f) x = fmaxf(x, sm.wstate[w * 24 + h]);
  return x;
}

// One tier's pages of this chunk on the tensor cores: the warp's first step in flight, the query
// prologue, then per step its key rows, scores, one online-softmax update and value product,
// then the warps' states folded into the chunk's. Local: the launch has a soft-cap or a sliding
// window (decode() picks the instantiation, so the plain kernel carries none of their registers:
// bench/results/decode/ab/ for the A/B).
//
// The query fragments, the column scales, a page's token count and the epilogue stay in this
// body: moved into functions of their own, each changed the code of the kernels checked (the
// clamp of j_end below compiled to another, equivalent sequence; a page's token count, other
// registers; per-function SASS, bench/gpu/sass_compare.py). Issue 51 tried again: any new call
// in this body, even one of two statements at its end, changed the clamp's code in every
// tensor-core kernel, so it stays whole, over the 150-line target.
template <class Geometry, class Tier, int N, bool Local>
__device__ void mma_tier_pages(const decode_inputs<N>& in, const decode_plan& plan, int f, int b,
                               int kvh, int e_begin, int e_end, bool sole, const mma_smem& sm,
                               float* mass_ws, int* err) {
  using C = mma_tier_config<Geometry, Tier>;
  using KC = typename C::KC;
  using VC = typename C::VC;
  constexpr int D = C::D, G = C::G, ST = C::ST, P = C::P, RT = C::RT, SL = C::SL;
  constexpr int KS = C::KS, QP = C::QP;
  const mma_lane at;
  const int tid = at.tid, warp = at.warp, lane = at.lane, qg = at.qg, qc = at.qc;
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
  {
    // The block builds the fragments item by item, reading the prepared query as 16-byte
    // vectors in an order with few bank conflicts: per lane (head qg, column pair qc) its
    // coordinates lie a multiple of 32 words apart across qg and qc, so the per-lane loop of
    // scalar loads (before bench/results/decode/ab/ab-h200-2026-11-30-fold-prologue.txt) was 16- to
    // 32-way conflicted (~1.7 us of a chunk at d = 256).
    if constexpr (C::s8_keys) {
      // item (lane, k step s), s fastest: the 8 coordinates [key_coord_s8(qc, s, 0), +8) of head qg
      uint2* qf = reinterpret_cast<uint2*>(sm.qfrag);
      for (unsigned t = tid; t < KS * 32; t += decode_threads) {
        const unsigned s = t % KS, ln = t / KS, g = ln / 4, c = ln % 4;
        std::uint32_t dg[QP][2] = {};
        if (g < unsigned(G)) {
          const float qs = exp2f(float(C::s8_query_bits) - sm.qexp[g]);
          const float4* src =
              reinterpret_cast<const float4*>(sm.acc_part + g * D + KC::key_coord_s8(c, s, 0));
          const float4 a = src[0], b = src[1];
          const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            int d[QP];
            int8_query_digits<QP>(__float2int_rn(x[KC::query_offset_s8(j)] * qs), d);
#pragma unroll
            for (int p = 0; p < QP; ++p)
              dg[p][j / 4] |= (std::uint32_t(d[p]) & 0xffu) << (8 * (j % 4));
          }
        }
#pragma unroll
        for (int p = 0; p < QP; ++p) qf[(s * QP + p) * 32 + ln] = make_uint2(dg[p][0], dg[p][1]);
      }
    } else {
      // item (k step s, lane), lane fastest: the 4 coordinates [key_coord(qc, s, 0), +4) of head qg
      for (unsigned t = tid; t < KS * 32; t += decode_threads) {
        const unsigned ln = t % 32, s = t / 32, g = ln / 4, c = ln % 4;
        float x[4] = {0.f, 0.f, 0.f, 0.f};
        if (g < unsigned(G)) {
          const float qs = exp2f(-sm.qexp[g]);
          const float4 a =
              *reinterpret_cast<const float4*>(sm.acc_part + g * D + KC::key_coord(c, s, 0));
          x[0] = a.x * qs;
          x[1] = a.y * qs;
          x[2] = a.z * qs;
          x[3] = a.w * qs;
        }
        std::uint32_t fr[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (C::KT == operand_type::f16) {
            const __half2 hh = __floats2half2_rn(x[2 * r], x[2 * r + 1]);
            const float2 back = __half22float2(hh);
            fr[r] = *reinterpret_cast<const std::uint32_t*>(&hh);
            fr[2 + r] = pack_half2(x[2 * r] - back.x, x[2 * r + 1] - back.y);
          } else {  // bf16 hi + lo: 16 bits of the scaled query, about 2^-17 relative
            const std::uint32_t hh = pack_bfloat162(x[2 * r], x[2 * r + 1]);
            fr[r] = hh;
            fr[2 + r] = pack_bfloat162(x[2 * r] - __uint_as_float(hh << 16),
                                       x[2 * r + 1] - __uint_as_float(hh & 0xffff0000u));
          }
        }
        sm.qfrag[s * 32 + ln] = make_uint4(fr[0], fr[1], fr[2], fr[3]);
      }
    }
  }
  __syncthreads();
  // Column scale (heads 2 qc, 2 qc + 1): softmax scale x log2(e) x the query's scale (2^e, or
  // 2^(e - bits) for int8 queries) x the scale of the int8 key levels.
  float colscale[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * qc + j;
    colscale[j] = 0.f;
    if (h < G) {
      if constexpr (C::s8_keys) {
        colscale[j] = in.softmax_scale * log2e * exp2f(sm.qexp[h] - float(C::s8_query_bits)) *
                      KC::key_level_scale;
      } else {
        colscale[j] = in.softmax_scale * log2e * exp2f(sm.qexp[h]);
      }
    }
  }
  float koff[2] = {0.f, 0.f};
  if constexpr (C::key_offset) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      koff[j] = 2 * qc + j < G ? KC::key_level_offset * sm.qsum[2 * qc + j] : 0.f;
  }

  // ---- the warp's state (mma_warp_state)
  float o[ST][4];
#pragma unroll
  for (int mt = 0; mt < ST; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[mt][i] = 0.f;
  float ob[2] = {0.f, 0.f};
  float m[2] = {-INFINITY, -INFINITY}, mv[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const mma_warp_state<C> ws{o, ob, m, mv, l};
  const mma_columns cols{{colscale[0], colscale[1]}, {koff[0], koff[1]}};

  // ---- the steps. Sub-step h of a step: key rows 16h + qg, 16h + qg + 8 (kw[h], ks[h]), value
  // rows 16h + 2qc, +1, +8, +9 (vw[h]), log2 value scales lvs[h]. Phased steps (mma_staging)
  // read and reissue the K group before the scores and the V group before the values; the others
  // wait once per step.
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
    if constexpr (C::phased) {
      std::uint32_t pb[P][2];
      {
        cp_async_wait<1>();  // this step's K group (its V group may still be in flight)
        __syncwarp();
        std::uint32_t kw[P][2][KC::key_words];
        float ks[P][2], lvs[P][2];
#pragma unroll
        for (int h = 0; h < P; ++h) slot.read_keys(h, kw[h], ks[h], lvs[h]);
        __syncwarp();  // every lane has read the key rows and metas before they are overwritten
        slot.issue_keys(npage, ns);
        float sc[P][4];
        mma_step_scores<C>(kw, sm, at, sc);
        mma_step_softmax<C, Local>(in, sc, ks, lvs, t0 - t_lo, ntok - t_lo, cols, qg, ws, ps, pb);
      }
      cp_async_wait<1>();  // this step's V group (the next K group may still be in flight)
      __syncwarp();
      // sub-step by sub-step (a sub-step's value words in registers at a time); the next V
      // group is issued once the last sub-step's rows are read
#pragma unroll
      for (int h = 0; h < P; ++h) {
        std::uint32_t vw[4][VC::value_words];
        slot.read_values(h, t0, ntok, vw);
        if (h == P - 1) {
          __syncwarp();  // every lane has read the value rows before they are overwritten
          slot.issue_values(npage, ns);
        }
        mma_step_values<C>(vw, pb[h], sm, qg, ws);
      }
    } else {
      cp_async_wait<0>();
      __syncwarp();
      std::uint32_t kw[P][2][KC::key_words];
      std::uint32_t vw[P][4][VC::value_words];
      float ks[P][2], lvs[P][2];
#pragma unroll
      for (int h = 0; h < P; ++h) {
        slot.read_keys(h, kw[h], ks[h], lvs[h]);
        slot.read_values(h, t0, ntok, vw[h]);
      }
      __syncwarp();  // every lane has read the slot before the next step overwrites it
      slot.issue_keys(npage, ns);
      slot.issue_values(npage, ns);
      std::uint32_t pb[P][2];
      float sc[P][4];
      mma_step_scores<C>(kw, sm, at, sc);
      mma_step_softmax<C, Local>(in, sc, ks, lvs, t0 - t_lo, ntok - t_lo, cols, qg, ws, ps, pb);
#pragma unroll
      for (int h = 0; h < P; ++h) mma_step_values<C>(vw[h], pb[h], sm, qg, ws);
    }
    if (mass_ws != nullptr) mma_step_mass<C>(plan, mass_ws, b, kvh, logical, step, ps, ws, at, err);
    if (!same_page) logical = -1;
    page = npage;
    j = nj;
  }
  cp_async_wait<0>();  // the empty groups of the last step

  // ---- the epilogue: the warps' states -> shared memory; rebase to the chunk's running max
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