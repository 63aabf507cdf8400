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
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/arch/bulk_copy.cuh"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/arch/ldmatrix.cuh"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/arch/mma.cuh"
#include "tierkv/cuda/arch/warp_roles.cuh"
#include "tierkv/cuda/arch/wgmma.cuh"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/decode/common.cuh"
#include "tierkv/cuda/prefill/inputs.cuh"
#include "tierkv/cuda/prefill_plan.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
namespace tierkv::cuda::detail {

inline constexpr int prefill_warps = 8;
inline constexpr int prefill_threads = 32 * prefill_warps;
inline constexpr int prefill_rows = prefill_block_rows;  // (query, head) rows of a block
static_assert(prefill_rows == 16 * prefill_warps, "prefill: 16 rows a warp");
// Tokens of a K/V tile: two decoded tiles (and two staged ones) must fit beside the queries, so
// head_dim 256 takes 32-token tiles.
template <int D>
inline constexpr int prefill_tile = D == 256 ? 32 : 64;
inline constexpr int prefill_max_entries = 4;  // index entries of a tile (pages of 16 tokens)

// Shared memory of a block (bytes). Q / K / V rows: with Core (the wgmma path), in the no-swizzle
// core-matrix layouts that wgmma reads (cuda/arch/wgmma.cuh: Q and K K-major, V MN-major, a core
// matrix 8 rows of 16 bytes in 128 contiguous bytes); otherwise row-major, padded by 16 bytes so
// the 8 row addresses of an ldmatrix hit 8 different 16-byte bank groups (on the portable path
// the core layout, with its decode thread order, timed 1-9% slower, record
// bench/results/prefill/prefill-wgmma-2026-12-05.json). The output scratch (f32, one 16-row slab
// per warp, padded by 8 floats: the fragment stores take 2 wavefronts) lies over Q, both K / V
// buffers and the staging areas (all free when it is used). Two decoded tiles (one computed while
// the next is decoded) and the staging areas (the raw payloads and metas cp.async lands).
template <class Geometry, std::size_t KeyPayload, std::size_t ValuePayload, bool Core>
struct prefill_smem {
  static constexpr int D = Geometry::head_dim;
  static constexpr int tile = prefill_tile<D>;
  static constexpr int pitch = Core ? D : D + 8;  // halves per Q / K / V row (row-major)
  static constexpr int o_pitch = D + 8;           // floats per output scratch row
  // Staging areas: tile t + 1 is decoded while tiles t + 2 .. t + stages are in flight
  // (cp.async), so a gathered page has stages - 1 tiles' time to land; index entries run
  // stages - 1 tiles further ahead (entry buffers for tiles t + 1 .. t + 2 stages - 1). Four on
  // the wgmma path (against the same base, the tiered int8_rotated mix gained 3-5% over two and
  // the other mixes stayed within 1%: record bench/results/prefill/prefill-wgmma-2026-12-05.json),
  // two on the portable path (as before the wgmma path; four there is not yet timed).
  static constexpr int stages = Core ? 4 : 2;
  static constexpr int entry_buffers = 2 * stages;
  static constexpr std::size_t kv_bytes = std::size_t(tile) * pitch * 2;  // one K or V tile
  static constexpr std::size_t stage_k_bytes = tile * KeyPayload;
  static constexpr std::size_t stage_v_bytes = tile * ValuePayload;
  static constexpr std::size_t stage_bytes = stage_k_bytes + stage_v_bytes + 2 * tile * 2;
  static constexpr std::size_t q_off = 0;
  static constexpr std::size_t k_off = q_off + std::size_t(prefill_rows) * pitch * 2;  // [2]
  static constexpr std::size_t v_off = k_off + 2 * kv_bytes;                           // [2]
  static constexpr std::size_t stage_off = v_off + 2 * kv_bytes;                       // [stages]
  // [entry buffers][slot, logical][max entries]
  static constexpr std::size_t ent_off = stage_off + stages * stage_bytes;
  static constexpr std::size_t kscale_off =
      ent_off + entry_buffers * 2 * prefill_max_entries * 4;  // [2][tile]
  static constexpr std::size_t vscale_off = kscale_off + 2 * tile * 4;
  static constexpr std::size_t kpos_off = vscale_off + 2 * tile * 4;
  static constexpr std::size_t rscale_off = kpos_off + 2 * tile * 4;
  static constexpr std::size_t rbad_off = rscale_off + prefill_rows * 4;
  // mbarriers: [stages] staging areas, then (Core) [2] decoded tile full and [2] decoded tile free
  static constexpr int barriers = Core ? stages + 4 : stages;
  static constexpr std::size_t bar_off = (rbad_off + prefill_rows * 4 + 7) / 8 * 8;
  static constexpr std::size_t bytes = bar_off + barriers * 8;
  static_assert(std::size_t(prefill_rows) * o_pitch * 4 <= ent_off,
                "prefill: the output scratch must fit over Q, K, V and the staging areas");
  // byte offsets of element (row, d) of Q, (token, d) of a K tile and (token, d) of a V tile
  static __host__ __device__ constexpr std::uint32_t q_at(int row, int d) {
    return Core ? kmajor_offset(row, d, D) : std::uint32_t(row * pitch + d) * 2;
  }
  static __host__ __device__ constexpr std::uint32_t k_at(int token, int d) {
    return Core ? kmajor_offset(token, d, D) : std::uint32_t(token * pitch + d) * 2;
  }
  static __host__ __device__ constexpr std::uint32_t v_at(int token, int d) {
    return Core ? mnmajor_offset(token, d, tile) : std::uint32_t(token * pitch + d) * 2;
  }
  static_assert(stage_k_bytes % 16 == 0 && stage_v_bytes % 16 == 0 && tile * 2 % 16 == 0,
                "prefill: staged tiles are whole 16-byte units");
  static_assert(bytes <= 227 * 1024, "prefill: shared memory beyond the H100 / H200 limit");
};

// Pass order over a tier list: the tiers whose values are rotated first, so O is un-rotated at
// most once (tier order otherwise kept).
template <int N>
struct prefill_pass_order {
  int at[N];
};
template <int D, class... Tiers>
constexpr prefill_pass_order<int(sizeof...(Tiers))> make_prefill_pass_order() {
  constexpr int N = int(sizeof...(Tiers));
  constexpr bool rot[N] = {rotated_format<typename Tiers::template value_codec<D>>...};
  prefill_pass_order<N> o{};
  int k = 0;
  for (int f = 0; f < N; ++f)
    if (rot[f]) o.at[k++] = f;
  for (int f = 0; f < N; ++f)
    if (!rot[f]) o.at[k++] = f;
  return o;
}

// The largest key and value payloads of a tier list (the staging area's rows).
template <int D, class... Tiers>
inline constexpr std::size_t max_key_payload =
    std::max({Tiers::template key_codec<D>::payload_bytes...});
template <int D, class... Tiers>
inline constexpr std::size_t max_value_payload =
    std::max({Tiers::template value_codec<D>::payload_bytes...});

template <class Geometry, class TierList>
struct prefill_kernel;

template <class Geometry, class... Tiers>
struct prefill_kernel<Geometry, tiers<Tiers...>> {
  static constexpr int N = int(sizeof...(Tiers));
  static constexpr int D = Geometry::head_dim, G = Geometry::group_size;
  static constexpr int T = Geometry::page_tokens, QH = Geometry::q_heads;
  static constexpr int TL = prefill_tile<D>;  // tokens of a K / V tile
  static constexpr int P = D / 32;            // coordinates per lane of a row
  static constexpr int NT = D / 8;            // 8-column n-tiles of a row of O
  static constexpr int ST = TL / 8;           // 8-token n-tiles of a score row
  static constexpr int TE = T < TL ? T : TL;  // tokens of an entry in a tile
  static constexpr int EPT = TL / TE;         // entries of a tile
  // Built for sm_90a, head_dim 256 runs its products on wgmma (compute_tile_wgmma): one
  // warpgroup a 64-row half of the block, the next tile's decode issued while they run.
#if TIERKV_HAS_WGMMA
  static constexpr bool wgmma_path = D == 256;
#else
  static constexpr bool wgmma_path = false;
#endif
  // Threads of a block. The wgmma path adds a producer warpgroup (warps 8-11) that fetches and
  // decodes the tiles while the two consumer warpgroups (warps 0-7, the block's rows) compute; the
  // producer gives registers to the consumers, whose 64 x 256 O takes 128 a thread.
  static constexpr int threads = wgmma_path ? prefill_threads + 128 : prefill_threads;
  static constexpr int producer_regs = 56, consumer_regs = 224;
  static_assert(!wgmma_path || 128 * producer_regs + prefill_threads * consumer_regs <= 65536,
                "prefill: the warpgroups' registers exceed the register file");
  template <bool Core>
  using smem_layout =
      prefill_smem<Geometry, max_key_payload<D, Tiers...>, max_value_payload<D, Tiers...>, Core>;
  using SM = smem_layout<wgmma_path>;  // the device pass's layout
  // A pass's iteration t fetches tile t + stages's bytes and tile t + entries_ahead's index
  // entries.
  static constexpr int entries_ahead = 2 * SM::stages - 1;
  // what a launch reserves: the larger layout (the host pass does not know the device's path)
  static constexpr std::size_t smem_bytes =
      std::max(smem_layout<false>::bytes, smem_layout<true>::bytes);
  static_assert(D == 64 || D == 128 || D == 256, "prefill: head_dim 64, 128 or 256");
  static_assert(G >= 1 && G <= 8, "prefill: group_size 1..8");
  static_assert(TL % T == 0 || T % TL == 0,
                "prefill: page_tokens must divide 64 or be a multiple of it");
  static_assert(EPT <= prefill_max_entries, "prefill: pages of at least 16 tokens");

  template <int F>
  using tier_t = tier_at_t<tiers<Tiers...>, F>;
  template <int F>
  static constexpr bool value_rotated = rotated_format<typename tier_t<F>::template value_codec<D>>;
  template <int F>
  static constexpr bool key_rotated = rotated_format<typename tier_t<F>::template key_codec<D>>;
  static constexpr prefill_pass_order<N> order = make_prefill_pass_order<D, Tiers...>();

  struct block {
    int b, kvh, row0, rows_total, n, len, q0;
    int pos_min, pos_max;  // positions of the block's first and last real rows
    int split;
    int* err;
  };
  // Shared-memory views; the double buffers are addressed from their first (kv, st: 0 or 1).
  struct smem {
    std::uint8_t* base;
    std::uint8_t* q;    // SM::q_at
    std::int32_t* ent;  // [buffer][slot, logical][prefill_max_entries]
    float* rscale;
    int* rbad;
    float* scratch;                             // over q, k, v and the staging areas
    __device__ std::uint8_t* k(int kv) const {  // f16, SM::k_at
      return base + SM::k_off + kv * SM::kv_bytes;
    }
    __device__ std::uint8_t* v(int kv) const {  // bf16, SM::v_at
      return base + SM::v_off + kv * SM::kv_bytes;
    }
    __device__ float* kscale(int kv) const {
      return reinterpret_cast<float*>(base + SM::kscale_off) + kv * TL;
    }
    __device__ float* vscale(int kv) const {
      return reinterpret_cast<float*>(base + SM::vscale_off) + kv * TL;
    }
    __device__ int* kpos(int kv) const {
      return reinterpret_cast<int*>(base + SM::kpos_off) + kv * TL;
    }
    __device__ std::uint8_t* stage_k(int st) const {
      return base + SM::stage_off + st * SM::stage_bytes;
    }
    __device__ std::uint8_t* stage_v(int st) const { return stage_k(st) + SM::stage_k_bytes; }
    __device__ std::uint64_t* bar(int st) const {  // staging area st's mbarrier
      return reinterpret_cast<std::uint64_t*>(base + SM::bar_off) + st;
    }
    // wgmma path: decoded buffer kv holds a tile (producer -> consumers), is free again
    // (consumers -> producer)
    __device__ std::uint64_t* full(int kv) const { return bar(SM::stages + kv); }
    __device__ std::uint64_t* vacant(int kv) const { return bar(SM::stages + 2 + kv); }
    __device__ std::uint16_t* stage_kmeta(int st) const {
      return reinterpret_cast<std::uint16_t*>(stage_v(st) + SM::stage_v_bytes);
    }
    __device__ std::uint16_t* stage_vmeta(int st) const { return stage_kmeta(st) + TL; }
    __device__ std::int32_t* slots(int buf) const { return ent + buf * 2 * prefill_max_entries; }
    __device__ std::int32_t* logicals(int buf) const {
      return ent + (buf * 2 + 1) * prefill_max_entries;
    }
  };
  // One warp's running state of its 16 rows: lane l holds rows l / 4 and l / 4 + 8 (index 0, 1),
  // O columns 8 nt + 2 (l % 4) + {0, 1}; l is this lane's partial sum (its quad adds them last).
  struct warp_state {
    float o[NT][4];
    float m[2], l[2];
    float rq[2];  // row scale: the query's power-of-two factor x softmax_scale
    int rpos[2];
    unsigned phases;     // bit s: the parity of staging area s's next mbarrier phase (portable)
    unsigned kv_phases;  // wgmma path: pipe_phases::kv
  };

  // The warp's 16 query rows in the key domain (rotated: H_un D q / d, the codecs'
  // prepare_query), each scaled by 2^-e to |x| < 1 and stored as f16; rscale <- 2^e (0 for a row
  // with a NaN or an infinity, whose output is NaN: rbad).
  template <bool Rotated>
  static __device__ __forceinline__ void prepare_queries(const prefill_inputs<N>& in,
                                                         const block& bk, std::uint64_t key_seed,
                                                         const smem& sm, int warp, int lane) {
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

  // Position of token v of tier F's entries (from entry e_begin), through the index.
  static __device__ int entry_position(const format_pages_view& fv, int e_begin, int v) {
    return __ldg(fv.logical + e_begin + v / T) * T + v % T;
  }
  // Smallest t in [0, n) with pred(t) (n when none), for pred false ... true along t, by all
  // threads: rounds of one probe per thread (2 rounds up to 65536 tiles).
  template <class Pred>
  static __device__ int tile_search(int n, Pred pred) {
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
  static __device__ void tile_range(const prefill_inputs<N>& in, const block& bk,
                                    const format_pages_view& fv, int e_begin, int e_end, int& lo,
                                    int& hi) {
    const int tokens = (e_end - e_begin) * T;
    const int tiles = (tokens + TL - 1) / TL;
    hi =
        tile_search(tiles, [&](int t) { return entry_position(fv, e_begin, t * TL) > bk.pos_max; });
    lo = 0;
    if (in.window > 0)
      lo = tile_search(hi, [&](int t) {
        const int last = min(t * TL + TL, tokens) - 1;
        return entry_position(fv, e_begin, last) > bk.pos_min - in.window;
      });
  }

  // cp.async of tile `tile`'s index entries (slot, logical) into buffer `buf` (-1: past the
  // tier's entries), by the callers with i in [0, EPT).
  static __device__ __forceinline__ void fetch_entries(const format_pages_view& fv, int e_begin,
                                                       int e_end, int tile, int buf, const smem& sm,
                                                       int i) {
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
  template <int F>
  static __device__ __forceinline__ void fetch_tile(const prefill_inputs<N>& in, const block& bk,
                                                    int tile, int buf, int stage, const smem& sm,
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
  template <int F, int NThreads>
  static __device__ __forceinline__ void unpack_tile(const block& bk, int tile, int present,
                                                     int buf, int st, int kv, const pool_view& pool,
                                                     const smem& sm, int thread) {
    using K = typename tier_t<F>::template key_codec<D>;
    using V = typename tier_t<F>::template value_codec<D>;
    using KR = slice_reader<K>;
    using VR = slice_reader<V>;
    static_assert(
        token_scaled<K> && token_scaled<V>,
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

  // S = Q K^T of the warp's 16 rows over decoded tile buffer `kv` (mma.sync f16): s[j] is the
  // m16n8 C fragment of tokens 8 j .. 8 j + 7.
  static __device__ __forceinline__ void scores_mma(const smem& sm, int kv, float (&s)[ST][4],
                                                    int warp, int lane) {
#pragma unroll
    for (int j = 0; j < ST; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    // lanes 0-15 address rows 0-15 at the k-step's first 8 dimensions, lanes 16-31 the next 8;
    // a k-step is 16 dimensions, two K-adjacent core matrices (+256 bytes)
    const std::uint8_t* qrow = sm.q + SM::q_at(warp * 16 + lane % 16, (lane / 16) * 8);
    const std::uint8_t* krow =
        sm.k(kv) + SM::k_at((lane / 16) * 8 + lane % 8, ((lane / 8) % 2) * 8);
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
  template <bool Masked>
  static __device__ __forceinline__ void online_softmax(const prefill_inputs<N>& in, const smem& sm,
                                                        int kv, warp_state& st, float (&s)[ST][4],
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
  static __device__ __forceinline__ void values_mma(const smem& sm, int kv, warp_state& st,
                                                    const std::uint32_t (&pa)[ST][2], int lane) {
    // lanes 8i..8i+7 address tokens 8 (i % 2) + 0..7 at dimensions 8 (i / 2) of a 16 x 16 block
    const std::uint8_t* vrow =
        sm.v(kv) + SM::v_at(lane % 8 + ((lane / 8) % 2) * 8, (lane / 16) * 8);
#pragma unroll
    for (int kt = 0; kt < TL / 16; ++kt) {
      const std::uint32_t a[4] = {pa[2 * kt][0], pa[2 * kt][1], pa[2 * kt + 1][0],
                                  pa[2 * kt + 1][1]};
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
  template <bool Masked>
  static __device__ void compute_tile(const prefill_inputs<N>& in, const smem& sm, int kv,
                                      warp_state& st, int warp, int lane) {
    float s[ST][4];
    std::uint32_t pa[ST][2];
    scores_mma(sm, kv, s, warp, lane);
    online_softmax<Masked>(in, sm, kv, st, s, pa, lane);
    values_mma(sm, kv, st, pa, lane);
  }

  // The warpgroup's 64 rows (warps 4 wg .. 4 wg + 3) over decoded tile buffer `kv` on wgmma
  // (sm_90a, head_dim 256, 32-token tiles): S = Q K^T by 16 m64n32k16 steps from shared memory,
  // the softmax as compute_tile's, O += P V by 2 m64n256k16 steps with P in registers.
  template <bool Masked>
  static __device__ __forceinline__ void compute_tile_wgmma(const prefill_inputs<N>& in,
                                                            const smem& sm, int kv, warp_state& st,
                                                            int warp, int lane) {
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
      const std::uint32_t a[4] = {pa[2 * kt][0], pa[2 * kt][1], pa[2 * kt + 1][0],
                                  pa[2 * kt + 1][1]};
      wgmma_m64n256k16_bf16_rs<true>(
          ov, a, wgmma_descriptor(sm.v(kv) + SM::v_at(16 * kt, 0), v_lbo, v_sbo), true);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(ov);
  }

  // O fragments <-> the warp's 16-row f32 slab of the scratch.
  static __device__ void o_store(const warp_state& st, float* slab, int lane) {
    const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      *reinterpret_cast<float2*>(slab + g * SM::o_pitch + 8 * nt + c) =
          make_float2(st.o[nt][0], st.o[nt][1]);
      *reinterpret_cast<float2*>(slab + (g + 8) * SM::o_pitch + 8 * nt + c) =
          make_float2(st.o[nt][2], st.o[nt][3]);
    }
  }
  static __device__ void o_load(warp_state& st, const float* slab, int lane) {
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
  static __device__ void unrotate_slab(float* slab, std::uint64_t value_seed, int lane) {
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      float x[P];
      load_lane_floats<P>(slab + r * SM::o_pitch + lane * P, x);
      warp_inverse_rotation<D, P>(x, value_seed, lane);
      store_lane_floats<P>(slab + r * SM::o_pitch + lane * P, x);
    }
    __syncwarp();
  }

  // Tier F's tiles [a, b) of this block on mma.sync (the portable path), a pipeline with one
  // barrier a tile: while tile t is computed from one decoded buffer, tile t + 1 is decoded from
  // its staging area into the other and tiles t + 2 .. t + stages are in flight by bulk copies
  // (tile t + stages into the staging area tile t left; the index entries run further ahead). The
  // decode is ALU work and the compute tensor-core work, so the block's two warp halves take them
  // in opposite orders: each scheduler (warps w and w + 4) has one warp of each kind to issue from.
  template <int F>
  static __device__ __forceinline__ void tier_tiles(const prefill_inputs<N>& in, const block& bk,
                                                    int e_begin, int e_end, int a, int b,
                                                    const smem& sm, warp_state& st, int warp,
                                                    int lane) {
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
      if (t + ahead < b)
        fetch_entries(fv, e_begin, e_end, t + ahead, (t + ahead - a) % EB, sm, tid);
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

  // A pass's pipeline fill by the fetching threads (`fetcher`: the thread's index among them, -1
  // for none; `sync`: a barrier over the threads that decode): the index entries of tiles
  // a .. a + entries_ahead - 1, landed and published, then tiles a .. a + stages - 1's bytes, and a
  // commit group each (empty: the bytes come by bulk copies, the groups carry the entries): the
  // groups iterations a - stages .. a - 1 would have made, so every iteration's wait counts alike.
  template <int F, class Sync>
  static __device__ __forceinline__ void pipeline_prologue(const prefill_inputs<N>& in,
                                                           const block& bk, int e_begin, int e_end,
                                                           int a, int b, const smem& sm,
                                                           int fetcher, Sync sync) {
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

  // Entries of tier F's tile t that belong to the tier (the rest of the tile is past them).
  static __device__ __forceinline__ int present(int e_begin, int e_end, int t) {
    return min(EPT, e_end - (e_begin + (t * TL) / T));
  }
  // Every fetched tile of a pass is decoded, so every bulk copy has landed: staging area s served
  // ceil((n - s) / stages) of the pass's n tiles, each one phase of its barrier.
  static __device__ __forceinline__ void advance_stage_phases(unsigned& phases, int n) {
#pragma unroll
    for (int s = 0; s < SM::stages; ++s)
      if (n > s) phases ^= unsigned(((n - s + SM::stages - 1) / SM::stages) & 1) << s;
  }
  // The wgmma path's barrier phases, carried from pass to pass (both roles count alike): bit s of
  // stage, the parity of staging area s's next phase (producer); bit k of kv, the parity of the
  // uses decoded buffer k has served (tile t of a pass is buffer (t - a) % 2).
  struct pipe_phases {
    unsigned stage = 0, kv = 0;
  };
  static __device__ __forceinline__ void advance_kv_phases(unsigned& kv, int n) {
    kv ^= unsigned(((n + 1) / 2) & 1) | (unsigned((n / 2) & 1) << 1);
  }
  static constexpr int consumer_barrier = 1, producer_barrier = 2;  // named barrier ids
  // A barrier among the threads that hold rows: the consumer warpgroups on the wgmma path, the
  // whole block otherwise.
  static __device__ __forceinline__ void rows_sync() {
    if constexpr (wgmma_path)
      named_barrier_sync(consumer_barrier, prefill_threads);
    else
      __syncthreads();
  }

  // The wgmma path's producer warpgroup over tier F's tiles [a, b) (thread `pt` of its 128): the
  // entries (cp.async) and bytes (bulk copies) by its first warp, stages - 1 tiles ahead; tile t
  // decoded into buffer (t - a) % 2 once the consumers have freed it, then marked full. One
  // barrier a tile among the producer's warps (a staging area is refilled once every thread has
  // decoded from it).
  template <int F>
  static __device__ __forceinline__ void producer_tiles(const prefill_inputs<N>& in,
                                                        const block& bk, int e_begin, int e_end,
                                                        int a, int b, const smem& sm,
                                                        pipe_phases& ph, int pt) {
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
  template <int F>
  static __device__ __forceinline__ void consumer_tiles(const prefill_inputs<N>& in,
                                                        const block& bk, int a, int b,
                                                        const smem& sm, warp_state& st, int warp,
                                                        int lane) {
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

  // Pass I's tiles of tier F: this split's share [split_lo, split_hi) of the tiers' concatenated
  // tile line, less the `skip` tiles of the passes before it, within the tier's [lo, hi).
  template <int F>
  static __device__ __forceinline__ int pass_begin(const int (&lo)[N], int split_lo, int skip) {
    return max(lo[F], lo[F] + split_lo - skip);
  }
  template <int F>
  static __device__ __forceinline__ int pass_end(const int (&lo)[N], const int (&hi)[N],
                                                 int split_hi, int skip) {
    return min(hi[F], lo[F] + split_hi - skip);
  }

  // The producer's side of passes: the same tiles in the same order, each pass opened by the
  // block barrier that follows the consumers' preparation of it.
  template <int I>
  static __device__ __forceinline__ void producer_passes(const prefill_inputs<N>& in,
                                                         const block& bk, const smem& sm,
                                                         const int (&lo)[N], const int (&hi)[N],
                                                         int split_lo, int split_hi, int skip,
                                                         pipe_phases& ph, int pt) {
    if constexpr (I < N) {
      constexpr int F = order.at[I];
      const int a = pass_begin<F>(lo, split_lo, skip), b = pass_end<F>(lo, hi, split_hi, skip);
      if (a < b) {
        block_sync_across_roles();  // the consumers' at the pass's opening in passes<I>
        producer_tiles<F>(in, bk, in.index.formats[F].indptr[bk.b],
                          in.index.formats[F].indptr[bk.b + 1], a, b, sm, ph, pt);
      }
      producer_passes<I + 1>(in, bk, sm, lo, hi, split_lo, split_hi, skip + (hi[F] - lo[F]), ph,
                             pt);
    }
  }

  // Pass I (tier order.at[I]) over this split's share [lo, hi) of the tiers' concatenated tile
  // line (skip: tiles of the passes before it).
  template <int I>
  static __device__ __forceinline__ void passes(const prefill_inputs<N>& in, const block& bk,
                                                const smem& sm, warp_state& st, const int (&lo)[N],
                                                const int (&hi)[N], int split_lo, int split_hi,
                                                int skip, int& q_domain, bool& o_rotated, int warp,
                                                int lane) {
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

  static __device__ __forceinline__ void run(const prefill_inputs<N>& in, const prefill_plan& plan,
                                             std::uint8_t* workspace) {
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

  // A lane's P output elements at `at` (f32 or bf16, NaN for a row with a non-finite query).
  // Row `row` (query x q_heads + head) of the output: at = row * D + lane * P; with centring
  // the row's value mean is added here.
  static __device__ void store_output(const prefill_inputs<N>& in, std::size_t row, int lane,
                                      const float (&x)[P], bool bad) {
    const std::size_t at = row * D + std::size_t(lane * P);
    float y[P];
    const float* mean =
        in.value_mean ? in.value_mean + (int(row % QH) / G) * D + lane * P : nullptr;
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
  static __device__ float lse_shift(const prefill_inputs<N>& in, std::size_t row) {
    return in.key_mean
               ? query_mean_logit<D>(in.queries, in.queries_type, row,
                                     in.key_mean + (int(row % QH) / G) * D, in.softmax_scale)
               : 0.f;
  }

  // O / l through the scratch (un-rotated if its last values were rotated) to the output, or to
  // the split's partial state (O / l and lse in log2 units) for prefill_merge_kernel.
  static __device__ __forceinline__ void epilogue(const prefill_inputs<N>& in,
                                                  const prefill_plan& plan, std::uint8_t* workspace,
                                                  const block& bk, const smem& sm, warp_state& st,
                                                  bool o_rotated, int warp, int lane) {
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
      const std::size_t grow =
          std::size_t(bk.q0 + row / G) * QH + std::size_t(bk.kvh * G + row % G);
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
  static __device__ void merge(const prefill_inputs<N>& in, const prefill_plan& plan,
                               const std::uint8_t* workspace) {
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
      load_lane_floats<P>(part_o + (std::size_t(s) * max_rows + row) * D + std::size_t(lane * P),
                          x);
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
};

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
