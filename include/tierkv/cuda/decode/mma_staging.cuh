// SPDX-License-Identifier: Apache-2.0
// The tensor-core decode's staging (decode/tensor_core.cuh): a warp's slot, one step's rows
// copied in by cp.async and read into fragment registers, and the stream of steps a warp takes
// over its pages.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/decode/common.cuh"
#include "tierkv/cuda/decode/mma_config.cuh"
namespace tierkv::cuda::detail {

// A warp's staging slot (mma_staging): one step's key rows + metas (cp.async group K) and value
// rows (group V) copied in, then read into fragment registers. Region by region with
// compile-time trip counts: no per-chunk branch (a generic loop compiled to ~200 instructions
// per step, SASS before the staging). An empty group when there is no next step keeps the wait
// counts uniform.
template <class C>
struct mma_slot {
  using K = typename C::K;
  using V = typename C::V;
  using KC = typename C::KC;
  using VC = typename C::VC;
  using layout = typename C::layout;
  using staging = typename C::staging;
  std::uint8_t* p;
  const std::uint8_t* kst;
  const std::uint8_t* vst;
  const std::uint16_t* kms;
  const std::uint16_t* vms;
  int kvh;
  mma_lane at;

  __device__ __forceinline__ mma_slot(std::uint8_t* ring, int kvh_, const mma_lane& at_)
      : p(ring + std::size_t(at_.warp) * staging::slot_bytes),
        kst(p),
        vst(p + staging::key_bytes),
        kms(reinterpret_cast<const std::uint16_t*>(vst + staging::value_bytes)),
        vms(kms + (token_scaled<K> ? C::RT : 0)),
        kvh(kvh_),
        at(at_) {}

  __device__ __forceinline__ void issue_keys(const std::uint8_t* page, int step) const {
    if (page != nullptr) {
      cp_async_region<staging::key_chunks>(p, page + layout::key_payload(kvh, C::RT * step),
                                           at.lane);
      constexpr int KMC = staging::key_meta_chunks, VMC = staging::value_meta_chunks;
      // the step's bf16 key metas, then its value metas, 16 bytes a lane
      if (at.lane < KMC + VMC) {
        const std::uint8_t* src =
            at.lane < KMC ? page + layout::key_meta(kvh, C::RT * step) + 16 * at.lane
                          : page + layout::value_meta(kvh, C::RT * step) + 16 * (at.lane - KMC);
        cp_async_16(p + staging::key_bytes + staging::value_bytes + 16 * at.lane, src);
      }
    }
    cp_async_commit();
  }
  __device__ __forceinline__ void issue_values(const std::uint8_t* page, int step) const {
    if (page != nullptr) {
      const std::uint8_t* src = page + layout::value_payload(kvh, C::RT * step);
      if constexpr (staging::pad_values)
        cp_async_rows<staging::value_chunks, staging::value_cpr, int(staging::value_stride)>(
            p + staging::key_bytes, src, at.lane);
      else
        cp_async_region<staging::value_chunks>(p + staging::key_bytes, src, at.lane);
    }
    cp_async_commit();
  }
  // Key rows and metas of sub-step h (rows 16h + qg, 16h + qg + 8). Rows past the page's
  // tokens are read as staged (mma_step_softmax masks them): at fixed offsets from one base, the
  // loads take immediates (clamping the row to a real token cost ~6 instructions a row).
  __device__ __forceinline__ void read_keys(int h, std::uint32_t (&kw)[2][KC::key_words],
                                            float (&ks)[2], float (&lvs)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * h + at.qg + 8 * r;
      KC::template load_key<true>(kst + std::size_t(row) * K::payload_bytes, at.qc, kw[r]);
      ks[r] = token_scaled<K> ? bf16_bits_to_float(kms[row]) : 1.f;
      lvs[r] = token_scaled<V> ? fast_log2(bf16_bits_to_float(vms[row])) : 0.f;
      if constexpr (C::value_log2_unit != 0.f)
        lvs[r] += C::value_log2_unit;  // (x + 0 is not x for -0)
    }
  }
  // Value rows of sub-step h (tokens 2qc, 2qc + 1, 2qc + 8, 2qc + 9); those at or past ntok
  // zeroed where their codes may be non-finite (C::zero_tail_values).
  __device__ __forceinline__ void read_values(int h, int t0, int ntok,
                                              std::uint32_t (&vw)[4][VC::value_words]) const {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int row = 16 * h + 2 * at.qc + (v & 1) + 8 * (v >> 1);
      VC::template load_value<true>(vst + std::size_t(row) * staging::value_stride, at.qg, vw[v]);
    }
    if constexpr (C::zero_tail_values) {
      // the last step of a partial page only (uniform across the warp)
      if (t0 + 16 * (h + 1) > ntok) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const bool tail = t0 + 16 * h + 2 * at.qc + (v & 1) + 8 * (v >> 1) >= ntok;
#pragma unroll
          for (int i = 0; i < VC::value_words; ++i) vw[v][i] = tail ? 0u : vw[v][i];
        }
      }
    }
  }
};

// Which steps a warp takes, and where their pages are: the warp's pages are one stream of steps
// (C::RT tokens); valid_from skips the pages without a valid slot (reported), page_at is the
// page of a step. It refers to fv, pool and j_end of mma_tier_pages (j_end is clamped once the
// first step is in flight), as the lambdas it replaces did.
template <class C>
struct mma_page_stream {
  static constexpr int SL = C::SL;
  const format_pages_view& fv;
  const pool_view& pool;
  int e_begin;
  int stride;  // pages from one of the warp's pages to its next
  const unsigned& j_end;
  int* err;

  __device__ __forceinline__ bool valid_page(int e) const {
    const std::int32_t s = fv.slot[e];
    return s >= 0 && std::uint32_t(s) < pool.capacity && fv.logical[e] >= 0;
  }
  // j, or the first step of the warp's next page with a valid slot (j_end when none is left)
  __device__ __forceinline__ unsigned valid_from(unsigned j) const {
    while (j < j_end && !valid_page(e_begin + int(j / SL))) {
      report_error(err, errc::out_of_range);
      j = (j / SL + stride) * SL;
    }
    return j < j_end ? j : j_end;
  }
  // the page of step j; null past the warp's steps
  __device__ __forceinline__ const std::uint8_t* page_at(unsigned j) const {
    return j < j_end ? pool.page(std::uint32_t(fv.slot[e_begin + int(j / SL)])) : nullptr;
  }
};

}  // namespace tierkv::cuda::detail
