// SPDX-License-Identifier: Apache-2.0
// One step of the tensor-core decode (decode/tensor_core.cuh): the warp's running state, the key
// product, the online-softmax update, the value product and the step's page mass.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/attention/logits.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/arch/mma.cuh"
#include "tierkv/cuda/decode/common.cuh"
#include "tierkv/cuda/decode/mma_config.cuh"
#include "tierkv/cuda/decode/mma_prologue.cuh"
#include "tierkv/cuda/decode/mma_staging.cuh"
namespace tierkv::cuda::detail {

// A warp's running state over the tier's steps. The value product accumulates p x value_scale
// relative to its own running max mv (so the f16 probabilities are <= 1 whatever the scales); l
// keeps the score max m; both are rebased at the tier's end. References to arrays of
// mma_tier_pages, as its lambdas held them: the arrays as members of one struct took other
// registers (per-function SASS, bench/gpu/sass_compare.py).
template <class C>
struct mma_warp_state {
  float (&o)[C::ST][4];  // O^T fragments: value k = 4 mt + i of o[mt][i] (mma_fold)
  float (&ob)[2];        // the value bias's share of o (C::value_bias)
  float (&m)[2];
  float (&mv)[2];
  float (&l)[2];
};

// The key product of one step: S^T of each sub-step (rows tokens qg, qg + 8; columns heads
// 2qc, 2qc + 1), unscaled. Query hi and lo parts in two independent accumulator chains
// (summed at the end) where it measured faster: one chain of 2 x d/16 dependent mma was the
// step's critical path at d = 256 (ncu: 6.3 cycles per issued instruction per warp, 3 warps
// per scheduler).
template <class C>
__device__ __forceinline__ void mma_step_scores(
    const std::uint32_t (&kw)[C::P][2][C::KC::key_words], const mma_smem& sm, const mma_lane& at,
    float (&sc)[C::P][4]) {
  using KC = typename C::KC;
  constexpr int P = C::P, QP = C::QP;
  const int lane = at.lane, qc = at.qc;
  if constexpr (C::s8_keys) {  // int8 levels x int8 query digits: one chain per digit and sub-step
    int acc[P][QP][4] = {};
    const uint2* qf = reinterpret_cast<const uint2*>(sm.qfrag);
#pragma unroll
    for (int s = 0; s < C::KS; ++s) {
      uint2 q[QP];  // one shared load per k step serves every sub-step
#pragma unroll
      for (int p = 0; p < QP; ++p) q[p] = qf[(s * QP + p) * 32 + lane];
#pragma unroll
      for (int h = 0; h < P; ++h) {
        std::uint32_t a[4];
        KC::key_frag_s8(kw[h][0], qc, s, a[0], a[2]);
        KC::key_frag_s8(kw[h][1], qc, s, a[1], a[3]);
#pragma unroll
        for (int p = 0; p < QP; ++p) mma_16832_s8<KC::key_unsigned>(acc[h][p], a, q[p].x, q[p].y);
      }
    }
#pragma unroll
    for (int h = 0; h < P; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // |acc| <= 64 x 127 x 512 < 2^23: exact in f32
        float x = float(acc[h][QP - 1][i]);
#pragma unroll
        for (int p = QP - 2; p >= 0; --p) x = fmaf(x, 128.f, float(acc[h][p][i]));
        sc[h][i] = x;
      }
  } else {
    // f16 keys (FP8): query hi and lo parts, one shared load per k step for every sub-step
    float lo[P][4];
#pragma unroll
    for (int h = 0; h < P; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[h][i] = lo[h][i] = 0.f;
#pragma unroll
    for (int s = 0; s < C::ST; ++s) {
      const uint4 q = sm.qfrag[s * 32 + lane];
#pragma unroll
      for (int h = 0; h < P; ++h) {
        std::uint32_t a[4];
        KC::key_frag(kw[h][0], qc, s, a[0], a[2]);
        KC::key_frag(kw[h][1], qc, s, a[1], a[3]);
        mma_16816_of<C::KT>(sc[h], a, q.x, q.y);
        mma_16816_of<C::KT>(C::S::score_chains == 2 ? lo[h] : sc[h], a, q.z, q.w);
      }
    }
    if constexpr (C::S::score_chains == 2) {
#pragma unroll
      for (int h = 0; h < P; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[h][i] += lo[h][i];
    }
  }
}

// One online-softmax update for the step's 16 P tokens, from the raw scores sc: scaled per row
// (key scale) and column (cols), masked, soft-capped (Local), then the column maxima, rescales
// of l and o, and P^T of each sub-step as the value product's B fragments pb. ps: the step's
// column sums, relative to the new m. Rows at or past ntok are masked, and so are the rows
// before the window's first token t_lo of the page: t0 and ntok come relative to t_lo (0
// without a window), so one unsigned compare a row does both.
template <class C, bool Local, int N>
__device__ __forceinline__ void mma_step_softmax(const decode_inputs<N>& in, float (&sc)[C::P][4],
                                                 const float (&ks)[C::P][2],
                                                 const float (&lvs)[C::P][2], int t0, int ntok,
                                                 const mma_columns& cols, int qg,
                                                 const mma_warp_state<C>& ws, float (&ps)[2],
                                                 std::uint32_t (&pb)[C::P][2]) {
  constexpr int P = C::P;
  // rows at or past ntok: -inf (their key and value metas may be anything, NaN included); rows
  // before the window's first token too
  float sv[P][4];  // log2 of p x value scale, up to the running max
#pragma unroll
  for (int h = 0; h < P; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (C::key_offset) sc[h][i] -= cols.koff[i % 2];
      const int r = i / 2;
      const bool live = Local ? unsigned(t0 + 16 * h + qg + 8 * r) < unsigned(ntok)
                              : t0 + 16 * h + qg + 8 * r < ntok;
      sc[h][i] = live ? sc[h][i] * ks[h][r] * cols.scale[i % 2] : -INFINITY;
      sv[h][i] = live ? sc[h][i] + lvs[h][r] : -INFINITY;
    }
  if (Local && in.soft_cap > 0.f) {  // uniform (a launch parameter): masked scores stay -inf
    const soft_cap cap = soft_cap::make<log_base::two>(in.soft_cap);  // on the MUFU unit
#pragma unroll
    for (int h = 0; h < P; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool masked = sc[h][i] == -INFINITY;
        const float z = cap.apply(sc[h][i], mufu_exp2{}, mufu_rcp{});
        sc[h][i] = masked ? sc[h][i] : z;
        sv[h][i] = masked ? sv[h][i] : z + lvs[h][i / 2];
      }
  }
  // ---- online softmax per column over the step's tokens; p for l, pv = p x value scale for
  // the value product
  float pv[P][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float smax = -INFINITY, vmax = -INFINITY;
#pragma unroll
    for (int h = 0; h < P; ++h) {
      smax = fmax_nan(smax, fmax_nan(sc[h][j], sc[h][j + 2]));
      vmax = fmax_nan(vmax, fmax_nan(sv[h][j], sv[h][j + 2]));
    }
    const float mn = fmax_nan(ws.m[j], quad_col_max(smax));
    const float mvn = fmax_nan(ws.mv[j], quad_col_max(vmax));
    const float alpha = exp2_rel(ws.m[j], mn);
    float psum = 0.f;
#pragma unroll
    for (int h = 0; h < P; ++h) {
      psum += exp2_rel(sc[h][j], mn) + exp2_rel(sc[h][j + 2], mn);
      pv[h][j] = exp2_rel(sv[h][j], mvn);
      pv[h][j + 2] = exp2_rel(sv[h][j + 2], mvn);
    }
    ws.l[j] = ws.l[j] * alpha + psum;
    ps[j] = psum;  // relative to mn: the step's log2 mass is mn + log2 of its column sum
    ws.m[j] = mn;
    const float av = exp2_rel(ws.mv[j], mvn);
    ws.mv[j] = mvn;
    if (__any_sync(0xffffffffu, av != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < C::ST; ++mt) {
        ws.o[mt][j] *= av;
        ws.o[mt][j + 2] *= av;
      }
      if constexpr (C::value_bias) ws.ob[j] *= av;
    }
  }
  // ---- P^T as B fragments (k = tokens, n = head qg) by two 8x8 transposes per sub-step
#pragma unroll
  for (int h = 0; h < P; ++h) {
    pb[h][0] = movmatrix_trans(pack_operand2<C::VT>(pv[h][0], pv[h][1]));
    pb[h][1] = movmatrix_trans(pack_operand2<C::VT>(pv[h][2], pv[h][3]));
  }
}

// The value product of one sub-step: O^T += V^T P^T, value rows vw read by mma_slot::read_values.
template <class C>
__device__ __forceinline__ void mma_step_values(const std::uint32_t (&vw)[4][C::VC::value_words],
                                                const std::uint32_t (&pb)[2], const mma_smem& sm,
                                                int qg, const mma_warp_state<C>& ws) {
  using VC = typename C::VC;
  const std::uint32_t table = VC::value_table(sm.table);
#pragma unroll
  for (int wi = 0; wi < VC::value_eff_words; ++wi) {
    constexpr int MPW = VC::value_mtiles_per_word;
    std::uint32_t lo[MPW][2], hi[MPW][2];
    VC::template value_pairs<C::value_bias>(VC::value_word(vw[0], qg, wi),
                                            VC::value_word(vw[1], qg, wi), lo,
                                            table);  // tokens 2qc, 2qc + 1
    VC::template value_pairs<C::value_bias>(VC::value_word(vw[2], qg, wi),
                                            VC::value_word(vw[3], qg, wi), hi,
                                            table);  // 2qc + 8, 2qc + 9
#pragma unroll
    for (int k = 0; k < MPW; ++k) {
      const std::uint32_t a[4] = {lo[k][0], lo[k][1], hi[k][0], hi[k][1]};
      mma_16816_of<C::VT>(ws.o[wi * MPW + k], a, pb[0], pb[1]);
    }
  }
  if constexpr (C::value_bias) mma_16816_uniform_a(ws.ob, VC::value_bias_pair, pb[0], pb[1]);
}

// One step's log2 mass per query head (relative to nothing: m + log2 of its tokens' sum of
// p) in the slot of its first 16 tokens (logical page, P x step) of the mass workspace
// (mass_slots_per_page a page), -inf in its other sub-steps' slots; the page-mass kernel
// adds the slots. Per step, because a page's steps may be split between two warps.
template <class C>
__device__ __forceinline__ void mma_step_mass(const decode_plan& plan, float* mass_ws, int b,
                                              int kvh, std::int32_t logical, int step,
                                              float (&ps)[2], const mma_warp_state<C>& ws,
                                              const mma_lane& at, int* err) {
  constexpr int G = C::G, P = C::P;
#pragma unroll
  for (int j = 0; j < 2; ++j) ps[j] = quad_col_sum(ps[j]);
  if (logical < plan.max_pages) {
    if (at.qg == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = 2 * at.qc + j;
        if (h < G) {
          const std::size_t row = std::size_t(b) * C::S::qh + std::size_t(kvh) * G + std::size_t(h);
          float* slots = mass_ws +
                         (row * std::size_t(plan.max_pages) + std::size_t(logical)) *
                             std::size_t(mass_slots_per_page<typename C::geometry>) +
                         std::size_t(P * step);
          slots[0] = ws.m[j] + fast_log2(ps[j]);
#pragma unroll
          for (int k = 1; k < P; ++k) slots[k] = -INFINITY;
        }
      }
    }
  } else if (at.lane == 0) {
    report_error(err, errc::out_of_range);
  }
}

// One step of a warp: its key rows read from the slot, the next step's keys issued, the scores,
// one online-softmax update (ps: the step's probability mass per column), its value rows, the
// next step's values issued, the value product. Phased tiers (mma_staging) read and reissue the
// K group before the scores and the V group before the values; the others wait once per step.
template <class C, bool Local, int N>
__device__ __forceinline__ void mma_step(const decode_inputs<N>& in, const mma_slot<C>& slot,
                                         const mma_smem& sm, const mma_lane& at,
                                         const std::uint8_t* npage, int ns, int t0, int t_lo,
                                         int ntok, const mma_columns& cols,
                                         const mma_warp_state<C>& ws, float (&ps)[2]) {
  using KC = typename C::KC;
  using VC = typename C::VC;
  constexpr int P = C::P;
  const int qg = at.qg;
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
}

}  // namespace tierkv::cuda::detail
