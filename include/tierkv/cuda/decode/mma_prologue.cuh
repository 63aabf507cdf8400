// SPDX-License-Identifier: Apache-2.0
// The tensor-core decode's query prologue (decode/tensor_core.cuh): per head the prepared
// query's exponent (and, for key offsets, its rounded sum), the query's B fragments, and a lane's
// column scales and key offsets.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "tierkv/attention/int8_query.hpp"
#include "tierkv/attention/partial_state.hpp"
#include "tierkv/cuda/arch/convert.cuh"
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

// The query's B fragments in sm.qfrag (the whole block, between two barriers): f16 hi + lo
// parts, or int8 digits for int8 keys; column n = head qg, k slots of lane qc.
template <class C>
__device__ __forceinline__ void mma_query_fragments(const mma_smem& sm, const mma_lane& at) {
  using KC = typename C::KC;
  constexpr int D = C::D, G = C::G, KS = C::KS, QP = C::QP;
  const int tid = at.tid;
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

// Column scale (heads 2 qc, 2 qc + 1): softmax scale x log2(e) x the query's scale (2^e, or
// 2^(e - bits) for int8 queries) x the scale of the int8 key levels.
template <class C>
__device__ __forceinline__ mma_columns mma_lane_columns(const mma_smem& sm, float softmax_scale,
                                                        int qc) {
  using KC = typename C::KC;
  constexpr int G = C::G;
  mma_columns cols{{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * qc + j;
    if (h < G) {
      if constexpr (C::s8_keys) {
        cols.scale[j] = softmax_scale * log2e * exp2f(sm.qexp[h] - float(C::s8_query_bits)) *
                        KC::key_level_scale;
      } else {
        cols.scale[j] = softmax_scale * log2e * exp2f(sm.qexp[h]);
      }
    }
  }
  if constexpr (C::key_offset) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      cols.koff[j] = 2 * qc + j < G ? KC::key_level_offset * sm.qsum[2 * qc + j] : 0.f;
  }
  return cols;
}

}  // namespace tierkv::cuda::detail
