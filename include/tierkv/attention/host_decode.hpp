// SPDX-License-Identifier: Apache-2.0
// Host decode attention of one layer for a batch of sequences, read directly from
// mixed-format pages (no dense copy of the cache).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "tierkv/attention/host_workspace.hpp"
#include "tierkv/attention/sequence_pass.hpp"
#include "tierkv/attention/tile.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv {

/// One decode step of one layer: query token b of the batch attends every live token
/// of sequence b (index.seq_len[b] tokens). Query head h reads KV head h / group_size
/// (consecutive query heads share a KV head). Queries arrive post-RoPE: positional
/// encoding is the engine's business, applied before keys were appended.
template <int NumTiers>
struct host_decode_args {
  const float* queries = nullptr;      ///< [batch][q_heads][head_dim]; NaN / Inf: non_finite_input
  batch_index_view<NumTiers> index{};  ///< the batch's pages of this layer, per tier
  const pool_view* pools = nullptr;    ///< [NumTiers], in tier order
  layer_source source{};               ///< cache seed, layer and head base (codec contexts)
  logit_params logits{};               ///< softmax scale and soft cap
  float* out = nullptr;                ///< [batch][q_heads][head_dim]; zeros for an empty sequence
  /// Optional: natural-log log-sum-exp of each (sequence, query head)'s logits;
  /// -inf for an empty sequence.
  float* lse = nullptr;  ///< [batch][q_heads]
  /// Optional per-page attention mass: page_mass[b * mass_stride + i] for logical page i
  /// of sequence b is (1 / q_heads) * sum_h l_page,h * exp(m_page,h - lse_h), i.e. the
  /// softmax probability on that page averaged over the layer's query heads (the pages of
  /// a non-empty sequence sum to 1). Entries i >= the sequence's page count are set to 0.
  float* page_mass = nullptr;  ///< [batch][mass_stride]
  int mass_stride = 0;         ///< >= the largest page count of the batch
  /// > 0: the query (at position seq_len - 1) attends only the last `window` positions
  /// (sliding-window layers); 0: every position.
  int window = 0;
};

/// Decode attention of one layer over mixed-format pages on ws's thread pool (see
/// host_decode_args); invalid_argument / out_of_range / non_finite_input before anything is
/// written.
template <class Geometry, class TierList>
status host_decode(host_attention_workspace& ws, const host_decode_args<TierList::size>& a) {
  using pass = detail::sequence_pass<Geometry, TierList>;
  constexpr int D = Geometry::head_dim;
  constexpr int G = Geometry::group_size;
  constexpr int KVH = Geometry::kv_heads;
  constexpr int QH = Geometry::q_heads;

  if (!std::isfinite(a.logits.softmax_scale))
    return status::make(errc::invalid_argument, "logits.softmax_scale = ", a.logits.softmax_scale,
                        " is not finite");
  if (!(a.logits.soft_cap >= 0.f) || !std::isfinite(a.logits.soft_cap))
    return status::make(errc::invalid_argument, "logits.soft_cap = ", a.logits.soft_cap,
                        " must be finite and >= 0 (0 = off)");
  if (a.window < 0)
    return status::make(errc::invalid_argument, "window = ", a.window, " must be >= 0 (0 = off)");
  int max_pages = 0;
  if (status s = pass::validate(a.index, a.pools, ws.bitmap(), &max_pages); !s) return s;
  const int batch = a.index.batch;
  if (batch == 0) return status::ok();
  if (!a.queries || !a.out)
    return status::make(errc::invalid_argument, "queries and out must not be null");
  const std::size_t nq = std::size_t(batch) * QH * D;
  if (const std::size_t i = detail::first_non_finite(a.queries, nq); i < nq)
    return status::make(errc::non_finite_input, "decode: queries[", i, "] = ", a.queries[i],
                        " (batch row ", i / (std::size_t(QH) * D), ", query head ", i / D % QH,
                        ", dim ", i % D, ") is not finite; nothing written");
  if (a.page_mass && a.mass_stride < max_pages)
    return status::exceeds(errc::out_of_range, "largest page count of the batch", max_pages,
                           status::format("mass_stride = ", a.mass_stride));

  const bool want_mass = a.page_mass != nullptr;
  const int stats_stride = want_mass ? (max_pages > 0 ? max_pages : 1) : 0;
  ws.reserve_per_worker(pass::scratch_bytes(G) +
                        sizeof(tile_stats) * std::size_t(G) * std::size_t(stats_stride));
  // Per (sequence, kv head) sums of its group's page masses, reduced over heads below.
  std::vector<float>& head_mass = ws.shared_floats();
  if (want_mass) head_mass.assign(std::size_t(batch) * KVH * std::size_t(stats_stride), 0.f);

  const int tasks = batch * KVH;
  ws.pool().parallel_for(tasks, [&](int task, unsigned worker) {
    const int b = task / KVH, h = task % KVH;
    std::byte* raw = ws.worker_scratch(worker);
    typename pass::scratch s = pass::carve(raw, G);
    tile_stats* stats = nullptr;
    if (want_mass)
      stats = pass::template start_array<tile_stats>(raw + pass::scratch_bytes(G),
                                                     std::size_t(G) * std::size_t(stats_stride));
    const float* qrows[G];
    int limits[G], firsts[G];
    for (int g = 0; g < G; ++g) {
      qrows[g] = a.queries + (std::size_t(b) * QH + std::size_t(h) * G + std::size_t(g)) * D;
      limits[g] = a.index.seq_len[b];
      firsts[g] = a.index.seq_len[b] - a.window;
    }
    typename pass::job j;
    j.seq = b;
    j.kv_head = h;
    j.rows = G;
    j.queries = qrows;
    j.row_limit = limits;
    j.row_first = a.window > 0 ? firsts : nullptr;
    j.page_stats = stats;
    j.stats_stride = stats_stride;
    pass::run(a.index, a.pools, a.source, a.logits, j, s);

    const int pages = (a.index.seq_len[b] + Geometry::page_tokens - 1) / Geometry::page_tokens;
    for (int g = 0; g < G; ++g) {
      const std::size_t qh = std::size_t(b) * QH + std::size_t(h) * G + std::size_t(g);
      s.merged[g].normalize(a.out + qh * D);
      const float lse = s.merged[g].lse();
      if (a.lse) a.lse[qh] = lse;
      if (want_mass) {
        float* hm =
            head_mass.data() + (std::size_t(b) * KVH + std::size_t(h)) * std::size_t(stats_stride);
        const tile_stats* st = stats + std::size_t(g) * std::size_t(stats_stride);
        for (int p = 0; p < pages; ++p) hm[p] += softmax_mass(st[p].m, st[p].l, lse);
      }
    }
  });

  if (want_mass) {
    for (int b = 0; b < batch; ++b) {
      float* row = a.page_mass + std::size_t(b) * std::size_t(a.mass_stride);
      for (int p = 0; p < a.mass_stride; ++p) row[p] = 0.f;
      for (int h = 0; h < KVH; ++h) {
        const float* hm =
            head_mass.data() + (std::size_t(b) * KVH + std::size_t(h)) * std::size_t(stats_stride);
        for (int p = 0; p < max_pages; ++p) row[p] += hm[p];
      }
      for (int p = 0; p < max_pages; ++p) row[p] *= 1.f / float(QH);
    }
  }
  return status::ok();
}

}  // namespace tierkv
