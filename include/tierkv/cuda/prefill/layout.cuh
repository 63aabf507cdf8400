// SPDX-License-Identifier: Apache-2.0
// The prefill block's shape and shared-memory layout (prefill/tensor_core.cuh's kernel), and the
// order of its passes over a tier list.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/tier.hpp"
#include "tierkv/cuda/arch/wgmma.cuh"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/prefill_plan.cuh"
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

}  // namespace tierkv::cuda::detail
