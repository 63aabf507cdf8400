// SPDX-License-Identifier: Apache-2.0
// The prefill kernel's fetch stage: the tiles of a tier that a block's rows see, their index
// entries (cp.async) and page bytes (bulk copies) into the staging areas, and a landed tile
// decoded through the format's slice reader into a K / V buffer (keys f16, values bf16).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/arch/bulk_copy.cuh"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/kernel/error_flag.cuh"
#include "tierkv/cuda/prefill/kernel.cuh"
namespace tierkv::cuda::detail {

// Position of token v of tier F's entries (from entry e_begin), through the index.
template <class Geometry, class... Tiers>
__device__ inline int prefill_kernel<Geometry, tiers<Tiers...>>::entry_position(
    const format_pages_view& fv, int e_begin, int v) {
  return __ldg(fv.logical + e_begin + v / T) * T + v % T;
}

// Smallest t in [0, n) with pred(t) (n when none), for pred false ... true along t, by all
// threads: rounds of one probe per thread (2 rounds up to 65536 tiles).
template <class Geometry, class... Tiers>
template <class Pred>
__device__ inline int prefill_kernel<Geometry, tiers<Tiers...>>::tile_search(int n, Pred pred) {
  int lo = 0, hi = n;
  while (hi > lo) {
    const int step = (hi - lo + threads - 1) / threads;
    const int t = lo + int(threadIdx.x) * step;
    const int below = __syncthreads_count(t < hi && !pred(t));  // probes lo, lo + step, ..
    if (below == 0) break;                                      // pred(lo)
    lo += (below - 1) * step + 1;
    hi = min(hi, lo - 1 + step);
  }
  return lo;
}

// Tiles [lo, hi) of tier F's entries that some row of the block sees: the causal end (the
// first tile starting past the last row) and, with a window, the first tile ending inside the
// first row's window. Positions grow along the entries (sorted by logical page).
template <class Geometry, class... Tiers>
__device__ inline void prefill_kernel<Geometry, tiers<Tiers...>>::tile_range(
    const prefill_inputs<N>& in, const block& bk, const format_pages_view& fv, int e_begin,
    int e_end, int& lo, int& hi) {
  const int tokens = (e_end - e_begin) * T;
  const int tiles = (tokens + TL - 1) / TL;
  hi = tile_search(tiles, [&](int t) { return entry_position(fv, e_begin, t * TL) > bk.pos_max; });
  lo = 0;
  if (in.window > 0)
    lo = tile_search(hi, [&](int t) {
      const int last = min(t * TL + TL, tokens) - 1;
      return entry_position(fv, e_begin, last) > bk.pos_min - in.window;
    });
}

// cp.async of tile `tile`'s index entries (slot, logical) into buffer `buf` (-1: past the
// tier's entries), by the callers with i in [0, EPT).
template <class Geometry, class... Tiers>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::fetch_entries(
    const format_pages_view& fv, int e_begin, int e_end, int tile, int buf, const smem& sm, int i) {
  if (i >= 0 && i < EPT) {
    const int e = e_begin + (tile * TL) / T + i;
    if (e < e_end) {
      cp_async_4(sm.slots(buf) + i, fv.slot + e);
      cp_async_4(sm.logicals(buf) + i, fv.logical + e);
    } else {
      sm.slots(buf)[i] = -1;
      sm.logicals(buf)[i] = -1;
    }
  }
}

// Tile `tile`'s key / value payloads and metas of the block's KV head (entries in buffer
// `buf`) into staging area `stage` by bulk copies, completing on the area's mbarrier: each is
// one contiguous range of a page (codec/page_layout.hpp), one copy per entry and region by lanes
// of one warp (callers with lane in [0, 32)), which first arrive with the tile's byte count. A
// bad or absent entry's bytes are not fetched (its tokens are decoded as absent).
template <class Geometry, class... Tiers>
template <int F>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::fetch_tile(
    const prefill_inputs<N>& in, const block& bk, int tile, int buf, int stage, const smem& sm,
    int lane) {
  using K = typename tier_t<F>::template key_codec<D>;
  using V = typename tier_t<F>::template value_codec<D>;
  using layout = page_layout<Geometry, K, V>;
  static_assert(
      TE * K::payload_bytes % 16 == 0 && TE * V::payload_bytes % 16 == 0 && TE * 2 % 16 == 0,
      "prefill: an entry's ranges must be whole 16-byte units for bulk copies");
  if (lane < 0 || lane >= 32) return;
  const pool_view pool = in.pools[F];
  const int t0 = T > TL ? (tile * TL) % T : 0;  // first token in its page
  const int j = lane / 4, region = lane % 4;    // entry, and K / V / K meta / V meta
  std::int32_t slot = -1;
  if (j < EPT) slot = sm.slots(buf)[j];
  const bool valid = j < EPT && slot >= 0 && std::uint32_t(slot) < pool.capacity;
  constexpr unsigned kb = TE * K::payload_bytes, vb = TE * V::payload_bytes, mb = TE * 2;
  const unsigned bytes = !valid ? 0u : region == 0 ? kb : region == 1 ? vb : mb;
  warp_expect_bytes(sm.bar(stage), bytes, lane);
  if (bytes != 0) {
    const std::uint8_t* page = pool.page(std::uint32_t(slot));
    std::uint8_t* dst;
    std::size_t src;
    if (region == 0) {
      dst = sm.stage_k(stage) + j * kb;
      src = layout::key_payload(bk.kvh, t0);
    } else if (region == 1) {
      dst = sm.stage_v(stage) + j * vb;
      src = layout::value_payload(bk.kvh, t0);
    } else if (region == 2) {
      dst = reinterpret_cast<std::uint8_t*>(sm.stage_kmeta(stage)) + j * mb;
      src = layout::key_meta(bk.kvh, t0);
    } else {
      dst = reinterpret_cast<std::uint8_t*>(sm.stage_vmeta(stage)) + j * mb;
      src = layout::value_meta(bk.kvh, t0);
    }
    cp_async_bulk(dst, page + src, bytes, sm.bar(stage));
  }
}

// The landed tile (staging area `st`, entries in `buf`) -> decoded buffer `kv`: K (f16) / V
// (bf16), scales and positions, by all threads (share `part` of `parts`). A token past the
// sequence, past the entries or of a bad entry gets position INT_MAX (masked for every row) and
// zero K / V (0 x poison stays out of P V). By `nthreads` threads (this one `thread` of them).
template <class Geometry, class... Tiers>
template <int F, int NThreads>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::unpack_tile(
    const block& bk, int tile, int present, int buf, int st, int kv, const pool_view& pool,
    const smem& sm, int thread) {
  using K = typename tier_t<F>::template key_codec<D>;
  using V = typename tier_t<F>::template value_codec<D>;
  using KR = slice_reader<K>;
  using VR = slice_reader<V>;
  static_assert(token_scaled<K> && token_scaled<V>,
                "prefill: every tier's codecs need a per-token bf16 scale and f16-exact key "
                "codes (dense_bf16 pages are decode-only on the GPU: a bf16 key has no exact f16)");
  constexpr int S = D / 16;  // 16-coordinate slices of a token
  const int t0 = T > TL ? (tile * TL) % T : 0;
  for (int idx = thread; idx < TL * S; idx += NThreads) {
    // core-matrix layout: 8 consecutive threads take 8 consecutive tokens of one slice, so
    // their 16-byte stores land in 8 different rows of a core matrix (8 bank groups); padded
    // rows: consecutive threads take consecutive slices of a token (contiguous loads)
    const int i = wgmma_path ? (idx / (8 * S)) * 8 + idx % 8 : idx / S;
    const int s = wgmma_path ? (idx / 8) % S : idx % S;
    const int j = i / TE;
    const std::int32_t slot = sm.slots(buf)[j], logical = sm.logicals(buf)[j];
    int pos = INT_MAX;
    if (j < present) {  // an entry of the tier
      if (slot < 0 || std::uint32_t(slot) >= pool.capacity || logical < 0) {
        if (s == 0 && i % TE == 0) report_error(bk.err, errc::out_of_range);
      } else {
        const std::int64_t p = std::int64_t(logical) * T + t0 + i % TE;
        if (p < bk.len) pos = int(p);
      }
    }
    uint4* kd0 = reinterpret_cast<uint4*>(sm.k(kv) + SM::k_at(i, 16 * s));
    uint4* kd1 = reinterpret_cast<uint4*>(sm.k(kv) + SM::k_at(i, 16 * s + 8));
    uint4* vd0 = reinterpret_cast<uint4*>(sm.v(kv) + SM::v_at(i, 16 * s));
    uint4* vd1 = reinterpret_cast<uint4*>(sm.v(kv) + SM::v_at(i, 16 * s + 8));
    if (pos != INT_MAX) {
      const typename KR::raw kr =
          KR::template load<true>(sm.stage_k(st) + std::size_t(i) * K::payload_bytes, s);
      const typename VR::raw vr =
          VR::template load<true>(sm.stage_v(st) + std::size_t(i) * V::payload_bytes, s);
      float x[16];
      std::uint32_t w[8];
      if constexpr (has_unpack_h2<KR>) {
        KR::unpack_h2(kr, s, w);
      } else {
        KR::unpack(kr, s, x);
#pragma unroll
        for (int c = 0; c < 8; ++c) w[c] = pack_half2(x[2 * c], x[2 * c + 1]);
      }
      *kd0 = make_uint4(w[0], w[1], w[2], w[3]);
      *kd1 = make_uint4(w[4], w[5], w[6], w[7]);
      if constexpr (has_unpack_bf16x2<VR>) {
        VR::unpack_bf16x2(vr, s, w);
      } else {
        VR::unpack(vr, s, x);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * c], x[2 * c + 1]);
          w[c] = *reinterpret_cast<const std::uint32_t*>(&h);
        }
      }
      *vd0 = make_uint4(w[0], w[1], w[2], w[3]);
      *vd1 = make_uint4(w[4], w[5], w[6], w[7]);
      if (s == 0) {
        sm.kscale(kv)[i] = bf16_bits_to_float(sm.stage_kmeta(st)[i]) * KR::code_scale;
        sm.vscale(kv)[i] = bf16_bits_to_float(sm.stage_vmeta(st)[i]) * VR::code_scale;
      }
    } else {
      *kd0 = *kd1 = *vd0 = *vd1 = make_uint4(0u, 0u, 0u, 0u);
      if (s == 0) sm.kscale(kv)[i] = sm.vscale(kv)[i] = 0.f;
    }
    if (s == 0) sm.kpos(kv)[i] = pos;
  }
}

// A pass's pipeline fill by the fetching threads (`fetcher`: the thread's index among them, -1
// for none; `sync`: a barrier over the threads that decode): the index entries of tiles
// a .. a + entries_ahead - 1, landed and published, then tiles a .. a + stages - 1's bytes, and a
// commit group each (empty: the bytes come by bulk copies, the groups carry the entries): the
// groups iterations a - stages .. a - 1 would have made, so every iteration's wait counts alike.
template <class Geometry, class... Tiers>
template <int F, class Sync>
__device__ __forceinline__ void prefill_kernel<Geometry, tiers<Tiers...>>::pipeline_prologue(
    const prefill_inputs<N>& in, const block& bk, int e_begin, int e_end, int a, int b,
    const smem& sm, int fetcher, Sync sync) {
  constexpr int NS = SM::stages, EB = SM::entry_buffers;
  for (int t = a; t < a + entries_ahead && t < b; ++t)
    fetch_entries(in.index.formats[F], e_begin, e_end, t, (t - a) % EB, sm, fetcher);
  cp_async_commit();
  cp_async_wait<0>();
  sync();
  for (int t = a; t < a + NS; ++t) {
    if (t < b) fetch_tile<F>(in, bk, t, (t - a) % EB, (t - a) % NS, sm, fetcher);
    cp_async_commit();
  }
}

}  // namespace tierkv::cuda::detail
