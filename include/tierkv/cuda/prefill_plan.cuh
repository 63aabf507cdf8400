// SPDX-License-Identifier: Apache-2.0
// Host planner of the chunked prefill: the grid's fixed size (so a prefill is CUDA-graph
// capturable) and the workspace (its error word).
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::cuda {

/// (query, head) rows of one prefill block: 8 warps of 16 (prefill/tensor_core.cuh). H200,
/// (24, 4, 256) chunk 512 over 32K: 3.04 ms against 3.30 ms for 4 warps of 16 rows over 32-token
/// tiles at two blocks per SM (docs/gpu-prefill.md).
inline constexpr int prefill_block_rows = 128;
/// Blocks per SM the planner counts on: one (shared memory ~170 KB a block at head_dim 256; 256
/// threads at up to 255 registers each fill the register file).
inline constexpr int prefill_blocks_per_sm = 1;
/// The most KV splits of a block's tiles (the workspace holds a partial state per split).
inline constexpr int prefill_max_splits = 64;

/// A plan is plain data (a captured graph replays it): the grid covers max_chunk_tokens queries
/// of each of max_batch sequences, each (sequence, KV head, row block) cut in kv_splits equal
/// shares of the tiles its rows see; with more than one, the workspace holds each split's partial
/// state and a second kernel merges them.
struct prefill_plan {
  int max_batch = 0;         ///< largest batch
  int max_chunk_tokens = 0;  ///< queries of one sequence
  int max_total_q = 0;       ///< queries of the whole batch (the partial states' rows / q_heads)
  int row_blocks = 0;  ///< blocks per (sequence, KV head): ceil(max_chunk_tokens x group / rows)
  int kv_splits = 1;   ///< KV splits per (sequence, KV head, row block)
  std::size_t workspace_bytes = 0;  ///< bytes of device workspace the run needs
  std::size_t error_offset = 0;     ///< int: the first device-side errc since the last read
  std::size_t partial_offset = 0;   ///< float [kv_splits][max_total_q x q_heads][head_dim] (O / l)
  std::size_t partial_lse_offset = 0;  ///< float [kv_splits][max_total_q x q_heads] (log2 units)
};

/// A plan for batches of up to max_batch sequences with chunks of up to max_chunk_tokens queries
/// and max_total_q queries in all (0: max_batch x max_chunk_tokens) on a GPU of `sms`
/// multiprocessors. kv_splits = 0 picks the fewest splits (up to
/// prefill_max_splits) that fill the GPU's resident blocks to >= 85% in whole waves; a given
/// value is used as is (1: no merge pass, no partial states).
template <class Geometry>
result<prefill_plan> plan_prefill(int max_batch, int max_chunk_tokens, int max_total_q = 0,
                                  int sms = 132, int kv_splits = 0) {
  if (max_batch < 1 || max_batch > 65535)  // the grid's z dimension
    return status::make(errc::out_of_range, "plan_prefill: max_batch = ", max_batch,
                        " must be in [1, 65535]");
  if (max_chunk_tokens < 1 || max_chunk_tokens > (1 << 24))
    return status::make(errc::out_of_range, "plan_prefill: max_chunk_tokens = ", max_chunk_tokens,
                        " must be in [1, 2^24]");
  if (max_total_q == 0)
    max_total_q = int(std::min<std::int64_t>(std::int64_t(max_batch) * max_chunk_tokens, 1 << 26));
  if (max_total_q < max_chunk_tokens || max_total_q > (1 << 26))
    return status::make(errc::out_of_range, "plan_prefill: max_total_q = ", max_total_q,
                        " must be in [max_chunk_tokens = ", max_chunk_tokens, ", 2^26]");
  if (sms < 1) return status::make(errc::invalid_argument, "plan_prefill: sms = ", sms, " < 1");
  if (kv_splits < 0 || kv_splits > prefill_max_splits)
    return status::make(errc::out_of_range, "plan_prefill: kv_splits = ", kv_splits,
                        " must be in [0, ", prefill_max_splits, "]");
  prefill_plan p;
  p.max_batch = max_batch;
  p.max_chunk_tokens = max_chunk_tokens;
  p.max_total_q = max_total_q;
  p.row_blocks =
      int((std::int64_t(max_chunk_tokens) * Geometry::group_size + prefill_block_rows - 1) /
          prefill_block_rows);
  if (kv_splits == 0) {
    const std::int64_t blocks = std::int64_t(max_batch) * p.row_blocks * Geometry::kv_heads;
    const std::int64_t slots = std::int64_t(sms) * prefill_blocks_per_sm;
    kv_splits = 1;
    double best = 0;
    for (int s = 1; s <= prefill_max_splits; ++s) {
      const std::int64_t n = blocks * s;
      const double fill = double(n) / double((n + slots - 1) / slots * slots);
      if (n >= slots && fill >= 0.85) {
        kv_splits = s;
        break;
      }
      if (fill > best + 1e-9) {
        best = fill;
        kv_splits = s;
      }
    }
  }
  p.kv_splits = kv_splits;
  auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
  const std::size_t rows = std::size_t(max_total_q) * std::size_t(Geometry::q_heads);
  p.error_offset = 0;
  std::size_t at = 256;
  if (kv_splits > 1) {
    p.partial_offset = at;
    at = align(at + std::size_t(kv_splits) * rows * Geometry::head_dim * sizeof(float));
    p.partial_lse_offset = at;
    at = align(at + std::size_t(kv_splits) * rows * sizeof(float));
  }
  p.workspace_bytes = at;
  return p;
}

}  // namespace tierkv::cuda
