// SPDX-License-Identifier: Apache-2.0
// The prefill kernel's output: O / l through the shared scratch (un-rotated where its values
// were rotated) to the output, or to the split's partial state, and the merge of the splits'
// states by log-sum-exp.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/attention/partial_state.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/cuda/kernel/centering.cuh"
#include "tierkv/cuda/kernel/lane_floats.cuh"
#include "tierkv/cuda/prefill/kernel.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
namespace tierkv::cuda::detail {

// O fragments <-> the warp's 16-row f32 slab of the scratch.
template <class Geometry, class... Tiers>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::o_store(const warp_state& st,
                                                                          float* slab, int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    *reinterpret_cast<float2*>(slab + g * SM::o_pitch + 8 * nt + c) =
        make_float2(st.o[nt][0], st.o[nt][1]);
    *reinterpret_cast<float2*>(slab + (g + 8) * SM::o_pitch + 8 * nt + c) =
        make_float2(st.o[nt][2], st.o[nt][3]);
  }
}

template <class Geometry, class... Tiers>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::o_load(warp_state& st,
                                                                         const float* slab,
                                                                         int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float2 a = *reinterpret_cast<const float2*>(slab + g * SM::o_pitch + 8 * nt + c);
    const float2 b = *reinterpret_cast<const float2*>(slab + (g + 8) * SM::o_pitch + 8 * nt + c);
    st.o[nt][0] = a.x;
    st.o[nt][1] = a.y;
    st.o[nt][2] = b.x;
    st.o[nt][3] = b.y;
  }
}

// The slab's 16 rows <- D H_un row / D (the rotated value codecs' finalize, warp/rotation.cuh).
template <class Geometry, class... Tiers>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::unrotate_slab(
    float* slab, std::uint64_t value_seed, int lane) {
  __syncwarp();
  for (int r = 0; r < 16; ++r) {
    float x[P];
    load_lane_floats<P>(slab + r * SM::o_pitch + lane * P, x);
    warp_inverse_rotation<D, P>(x, value_seed, lane);
    store_lane_floats<P>(slab + r * SM::o_pitch + lane * P, x);
  }
  __syncwarp();
}

// A lane's P output elements at `at` (f32 or bf16, NaN for a row with a non-finite query).
// Row `row` (query x q_heads + head) of the output: at = row * D + lane * P; with centring
// the row's value mean is added here.
template <class Geometry, class... Tiers>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::store_output(
    const prefill_inputs<N>& in, std::size_t row, int lane, const float (&x)[P], bool bad) {
  const std::size_t at = row * D + std::size_t(lane * P);
  float y[P];
  const float* mean = in.value_mean ? in.value_mean + (int(row % QH) / G) * D + lane * P : nullptr;
#pragma unroll
  for (int i = 0; i < P; ++i) y[i] = bad ? NAN : mean ? x[i] + mean[i] : x[i];
  if (in.out_type == output_type::bf16) {
    __nv_bfloat16* o = static_cast<__nv_bfloat16*>(in.out) + at;
#pragma unroll
    for (int i = 0; i < P; ++i) o[i] = __float2bfloat16_rn(y[i]);
  } else {
    float* o = static_cast<float*>(in.out) + at;
#pragma unroll
    for (int i = 0; i < P; ++i) o[i] = y[i];
  }
}

// Centring's lse term of output row `row` (0 without centring): query_mean_logit.
template <class Geometry, class... Tiers>
__device__ inline float prefill_kernel<Geometry, tiers<Tiers...>>::lse_shift(
    const prefill_inputs<N>& in, std::size_t row) {
  return in.key_mean ? query_mean_logit<D>(in.queries, in.queries_type, row,
                                           in.key_mean + (int(row % QH) / G) * D, in.softmax_scale)
                     : 0.f;
}

// O / l through the scratch (un-rotated if its last values were rotated) to the output, or to
// the split's partial state (O / l and lse in log2 units) for prefill_merge_kernel.
template <class Geometry, class... Tiers>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::epilogue(
    const prefill_inputs<N>& in, const prefill_plan& plan, std::uint8_t* workspace, const block& bk,
    const smem& sm, warp_state& st, bool o_rotated, int warp, int lane) {
  float inv[2], lse2[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
    st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    inv[r] = st.l[r] > 0.f ? 1.f / st.l[r] : 0.f;
    lse2[r] = softmax_merge::state_lse<log_base::two>(st.m[r], st.l[r]);
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    st.o[nt][0] *= inv[0];
    st.o[nt][1] *= inv[0];
    st.o[nt][2] *= inv[1];
    st.o[nt][3] *= inv[1];
  }
  rows_sync();  // Q, K and V are no longer read (on the wgmma path the producer is done: every
                // tile it decoded was consumed)
  float* slab = sm.scratch + warp * 16 * SM::o_pitch;
  o_store(st, slab, lane);
  if (o_rotated)
    unrotate_slab(
        slab,
        make_codec_context(in.cache_seed, in.layer, in.head_base + bk.kvh, kv_role::value).seed,
        lane);
  __syncwarp();
  const bool partial = plan.kv_splits > 1;
  const std::size_t max_rows = std::size_t(plan.max_total_q) * QH;
  float* part_o = reinterpret_cast<float*>(workspace + plan.partial_offset) +
                  std::size_t(bk.split) * max_rows * D;
  float* part_lse = reinterpret_cast<float*>(workspace + plan.partial_lse_offset) +
                    std::size_t(bk.split) * max_rows;
  for (int r = 0; r < 16; ++r) {
    const int row = bk.row0 + warp * 16 + r;
    if (row >= bk.rows_total) break;
    const bool bad = sm.rbad[warp * 16 + r] != 0;
    const std::size_t grow = std::size_t(bk.q0 + row / G) * QH + std::size_t(bk.kvh * G + row % G);
    float x[P];
    load_lane_floats<P>(slab + r * SM::o_pitch + lane * P, x);
    if (partial)
      store_lane_floats<P>(part_o + grow * D + std::size_t(lane * P), x);
    else
      store_output(in, grow, lane, x, bad);
  }
  if (lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rl = warp * 16 + lane / 4 + 8 * r, row = bk.row0 + rl;
      if (row >= bk.rows_total) continue;
      const bool bad = sm.rbad[rl] != 0;
      const std::size_t grow =
          std::size_t(bk.q0 + row / G) * QH + std::size_t(bk.kvh * G + row % G);
      if (partial)
        part_lse[grow] = bad ? NAN : lse2[r];
      else if (in.lse != nullptr)
        in.lse[grow] =
            bad ? NAN : softmax_merge::to_natural<log_base::two>(lse2[r]) + lse_shift(in, grow);
    }
  }
}

// grid (ceil(max_total_q x q_heads / warps)): one warp a (query, head) row; the splits' states
// merged by log-sum-exp in a fixed order (deterministic). A NaN state (a non-finite query) gives
// NaN.
template <class Geometry, class... Tiers>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::merge(
    const prefill_inputs<N>& in, const prefill_plan& plan, const std::uint8_t* workspace) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const std::size_t row = std::size_t(blockIdx.x) * prefill_warps + std::size_t(warp);
  const std::int32_t total_q = in.q_indptr[in.index.batch];
  if (total_q < 0 || total_q > plan.max_total_q || row >= std::size_t(total_q) * QH) return;
  const std::size_t max_rows = std::size_t(plan.max_total_q) * QH;
  const float* part_o = reinterpret_cast<const float*>(workspace + plan.partial_offset);
  const float* part_lse = reinterpret_cast<const float*>(workspace + plan.partial_lse_offset);
  const int S = plan.kv_splits;
  float mx = -INFINITY;
  bool nan = false;
  for (int s = lane; s < S; s += 32) {
    const float l = part_lse[std::size_t(s) * max_rows + row];
    nan |= isnan(l);
    mx = fmaxf(mx, l);
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  nan = __any_sync(0xffffffffu, nan);
  float acc[P] = {}, wsum = 0.f;
  for (int s = 0; s < S; ++s) {
    const float l = part_lse[std::size_t(s) * max_rows + row];
    if (!(l > -INFINITY)) continue;  // an empty split (or NaN, handled above)
    const float w = softmax_merge::lse_weight<log_base::two>(l, mx);
    float x[P];
    load_lane_floats<P>(part_o + (std::size_t(s) * max_rows + row) * D + std::size_t(lane * P), x);
#pragma unroll
    for (int i = 0; i < P; ++i) acc[i] = fmaf(w, x[i], acc[i]);
    wsum += w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
  for (int i = 0; i < P; ++i) acc[i] *= inv;
  store_output(in, row, lane, acc, nan);
  if (lane == 0 && in.lse != nullptr)
    in.lse[row] = nan          ? NAN
                  : wsum > 0.f ? softmax_merge::to_natural<log_base::two>(
                                     softmax_merge::state_lse<log_base::two>(mx, wsum)) +
                                     lse_shift(in, row)
                               : -INFINITY;
}

}  // namespace tierkv::cuda::detail
