// SPDX-License-Identifier: Apache-2.0
// Host chunked prefill of one layer: a chunk of new query tokens per sequence, causal,
// attending the sequence's mixed-format pages, the chunk itself included.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tierkv/attention/host_workspace.hpp"
#include "tierkv/attention/sequence_pass.hpp"
#include "tierkv/attention/tile.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv {

/// Design: the engine APPENDS the chunk's keys and values to the cache first (as for
/// decode), then calls prefill. Sequence b's chunk is its last n_b = q_indptr[b+1] -
/// q_indptr[b] tokens: query j sits at position p = seq_len[b] - n_b + j and attends all
/// tokens at positions <= p (causal within the chunk, everything cached before it). The
/// chunk is thus read in its stored format (FP8 in the append tier), exactly as the
/// following decode steps will read it, so prefill and decode see the same keys; one
/// code path serves both, there is no second float copy of the chunk, and a chunk of
/// n_b = 1 is exactly a decode step.
template <int NumTiers>
struct host_prefill_args {
  const float* queries = nullptr;  ///< [total_q][q_heads][head_dim], post-RoPE, packed by sequence;
                                   ///< NaN / Inf: non_finite_input
  const std::int32_t* q_indptr =
      nullptr;  ///< [batch + 1]; sequence b owns query rows [q_indptr[b], q_indptr[b+1])
  batch_index_view<NumTiers> index{};  ///< seq_len counts the chunk (already appended)
  const pool_view* pools = nullptr;    ///< [NumTiers]
  layer_source source{};               ///< cache seed, layer and head base (codec contexts)
  logit_params logits{};               ///< softmax scale and soft cap
  float* out = nullptr;                ///< [total_q][q_heads][head_dim]
  float* lse = nullptr;                ///< optional [total_q][q_heads], natural log
  /// > 0: a query at position p attends positions (p - window, p] only (sliding-window
  /// layers); 0: every position up to p.
  int window = 0;
};

/// Query tokens per task: rows = query_block * group_size share each unpacked key/value
/// of a page, bounded so a task's scores stay in L1/L2.
inline constexpr int host_prefill_query_block = 8;

/// Chunked causal prefill attention of one layer over mixed-format pages on ws's thread pool
/// (see host_prefill_args; the chunk's K/V are appended first).
template <class Geometry, class TierList>
status host_prefill(host_attention_workspace& ws, const host_prefill_args<TierList::size>& a) {
  using pass = detail::sequence_pass<Geometry, TierList>;
  constexpr int D = Geometry::head_dim;
  constexpr int G = Geometry::group_size;
  constexpr int KVH = Geometry::kv_heads;
  constexpr int QH = Geometry::q_heads;
  constexpr int QB = host_prefill_query_block;
  constexpr int rows_max = QB * G;

  if (!std::isfinite(a.logits.softmax_scale))
    return status::make(errc::invalid_argument, "logits.softmax_scale = ", a.logits.softmax_scale,
                        " is not finite");
  if (!(a.logits.soft_cap >= 0.f) || !std::isfinite(a.logits.soft_cap))
    return status::make(errc::invalid_argument, "logits.soft_cap = ", a.logits.soft_cap,
                        " must be finite and >= 0 (0 = off)");
  if (a.window < 0)
    return status::make(errc::invalid_argument, "window = ", a.window, " must be >= 0 (0 = off)");
  if (status s = pass::validate(a.index, a.pools, ws.bitmap(), nullptr); !s) return s;
  const int batch = a.index.batch;
  if (batch == 0) return status::ok();
  if (!a.q_indptr) return status::make(errc::invalid_argument, "q_indptr is null");
  std::vector<int>& block_start = ws.shared_ints();  // first task of each sequence
  block_start.assign(std::size_t(batch) + 1, 0);
  for (int b = 0; b < batch; ++b) {
    const int n = a.q_indptr[b + 1] - a.q_indptr[b];
    if (n < 0)
      return status::make(errc::invalid_argument, "q_indptr decreases at sequence ", b, ": ",
                          a.q_indptr[b], " > ", a.q_indptr[b + 1]);
    if (n > a.index.seq_len[b])
      return status::exceeds(errc::out_of_range, status::format("chunk length of sequence ", b), n,
                             status::format("seq_len = ", a.index.seq_len[b],
                                            " (append the chunk's K/V before prefill)"));
    block_start[std::size_t(b) + 1] = block_start[std::size_t(b)] + (n + QB - 1) / QB;
  }
  if (block_start[std::size_t(batch)] == 0) return status::ok();
  if (!a.queries || !a.out)
    return status::make(errc::invalid_argument, "queries and out must not be null");
  const std::size_t row0 = std::size_t(a.q_indptr[0]) * QH * D;
  const std::size_t floats = std::size_t(a.q_indptr[batch] - a.q_indptr[0]) * QH * D;
  if (const std::size_t i = detail::first_non_finite(a.queries + row0, floats); i < floats) {
    const int t = a.q_indptr[0] + int(i / (std::size_t(QH) * D));
    int b = 0;
    while (a.q_indptr[b + 1] <= t) ++b;
    return status::make(errc::non_finite_input, "prefill: queries[", row0 + i,
                        "] = ", a.queries[row0 + i], " (query token ", t, " of sequence ", b,
                        ", query head ", i / D % QH, ", dim ", i % D,
                        ") is not finite; nothing written");
  }

  ws.reserve_per_worker(pass::scratch_bytes(rows_max));
  const int tasks = block_start[std::size_t(batch)] * KVH;
  ws.pool().parallel_for(tasks, [&](int task, unsigned worker) {
    const int h = task % KVH, blk = task / KVH;
    int b = 0, hi = batch;  // sequence of this block: first b with block_start[b+1] > blk
    while (b < hi) {
      const int mid = (b + hi) / 2;
      if (block_start[std::size_t(mid) + 1] <= blk)
        b = mid + 1;
      else
        hi = mid;
    }
    const int n = a.q_indptr[b + 1] - a.q_indptr[b];
    const int j0 = (blk - block_start[std::size_t(b)]) * QB;
    const int nq = n - j0 < QB ? n - j0 : QB;
    const int rows = nq * G;
    typename pass::scratch s = pass::carve(ws.worker_scratch(worker), rows);
    const float* qrows[rows_max];
    int limits[rows_max], firsts[rows_max];
    for (int jj = 0; jj < nq; ++jj) {
      const std::size_t qtok = std::size_t(a.q_indptr[b]) + std::size_t(j0 + jj);
      const int pos = a.index.seq_len[b] - n + j0 + jj;
      for (int g = 0; g < G; ++g) {
        qrows[jj * G + g] = a.queries + (qtok * QH + std::size_t(h) * G + std::size_t(g)) * D;
        limits[jj * G + g] = pos + 1;
        firsts[jj * G + g] = pos + 1 - a.window;
      }
    }
    typename pass::job j;
    j.seq = b;
    j.kv_head = h;
    j.rows = rows;
    j.queries = qrows;
    j.row_limit = limits;
    j.row_first = a.window > 0 ? firsts : nullptr;
    pass::run(a.index, a.pools, a.source, a.logits, j, s);
    for (int jj = 0; jj < nq; ++jj) {
      const std::size_t qtok = std::size_t(a.q_indptr[b]) + std::size_t(j0 + jj);
      for (int g = 0; g < G; ++g) {
        const std::size_t qh = qtok * QH + std::size_t(h) * G + std::size_t(g);
        s.merged[jj * G + g].normalize(a.out + qh * D);
        if (a.lse) a.lse[qh] = s.merged[jj * G + g].lse();
      }
    }
  });
  return status::ok();
}

}  // namespace tierkv
