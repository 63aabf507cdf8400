// SPDX-License-Identifier: Apache-2.0
// The host pass of one (sequence, KV head): a block of query rows over every page of
// the sequence, each page read in its stored format by its tier's tile, one partial
// state per (row, tier), finalized per tier and merged. Shared by host decode and
// host chunked prefill; also the validation of their index arrays.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#include "tierkv/attention/host_workspace.hpp"
#include "tierkv/attention/partial_state.hpp"
#include "tierkv/attention/tile.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv {

/// Which layer of which cache a host attention call reads: codec contexts (rotation
/// seeds) come from make_codec_context(cache_seed, layer, head_base + kv_head, role).
/// head_base is the storage's (storage_options::head_base): the global index of its
/// first KV head, non-zero on tensor-parallel ranks r > 0.
struct layer_source {
  std::uint64_t cache_seed = 0;  ///< storage_options::codec_seed
  int layer = 0;                 ///< the layer read
  int head_base = 0;             ///< storage_options::head_base
};

namespace detail {

/// Index of the first NaN or Inf of x[0, n), or n. Host attention refuses such a query up
/// front: in the softmax it would leave its row's state empty, i.e. a silent zero output.
inline std::size_t first_non_finite(const float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return n;
}

template <class Geometry, class TierList>
struct sequence_pass;

template <class Geometry, class... Tiers>
struct sequence_pass<Geometry, tiers<Tiers...>> {
  static_assert(is_geometry_v<Geometry>, "sequence_pass: Geometry must be a tierkv::geometry<...>");
  static constexpr int head_dim = Geometry::head_dim;
  static constexpr int num_tiers = int(sizeof...(Tiers));
  static constexpr int page_tokens = Geometry::page_tokens;
  /// Tokens per tile call: bounds the score scratch to rows * tile_tokens floats while
  /// keeping the per-tile rescale of the accumulators rare (once per 64 tokens).
  static constexpr int tile_tokens = page_tokens < 64 ? page_tokens : 64;
  using state = partial_state<head_dim>;
  using tier_list = tiers<Tiers...>;
  template <int I>
  using layout_at =
      page_layout<Geometry, typename tier_at_t<tier_list, I>::template key_codec<head_dim>,
                  typename tier_at_t<tier_list, I>::template value_codec<head_dim>>;

  /// Per-worker scratch for `rows` rows, carved from one block.
  struct scratch {
    state* tier_states;  ///< [num_tiers][rows]
    state* merged;       ///< [rows]
    float* prepared;     ///< [rows][head_dim]
    float* scores;       ///< [rows][tile_tokens]
    tile_stats* tstats;  ///< [rows]
    int* row_ntok;       ///< [rows]
    int* row_first;      ///< [rows]
  };
  static constexpr std::size_t round64(std::size_t n) { return (n + 63) / 64 * 64; }
  /// Begins the lifetime of n trivially constructible objects in raw scratch bytes.
  template <class T>
  static T* start_array(std::byte* base, std::size_t n) {
    T* p = reinterpret_cast<T*>(base);
    for (std::size_t i = 0; i < n; ++i) new (p + i) T;
    return p;
  }
  static std::size_t scratch_bytes(int rows) {
    const std::size_t r = std::size_t(rows);
    return round64(sizeof(state) * r * (num_tiers + 1)) + round64(sizeof(float) * r * head_dim) +
           round64(sizeof(float) * r * tile_tokens) + round64(sizeof(tile_stats) * r) +
           2 * round64(sizeof(int) * r);
  }
  static scratch carve(std::byte* base, int rows) {
    const std::size_t r = std::size_t(rows);
    scratch s{};
    s.tier_states = start_array<state>(base, r * (num_tiers + 1));
    s.merged = s.tier_states + r * num_tiers;
    base += round64(sizeof(state) * r * (num_tiers + 1));
    s.prepared = start_array<float>(base, r * head_dim);
    base += round64(sizeof(float) * r * head_dim);
    s.scores = start_array<float>(base, r * tile_tokens);
    base += round64(sizeof(float) * r * tile_tokens);
    s.tstats = start_array<tile_stats>(base, r);
    base += round64(sizeof(tile_stats) * r);
    s.row_ntok = start_array<int>(base, r);
    base += round64(sizeof(int) * r);
    s.row_first = start_array<int>(base, r);
    return s;
  }

  struct job {
    int seq = 0;
    int kv_head = 0;
    int rows = 0;
    const float* const* queries = nullptr;  ///< [rows] raw (post-RoPE) queries
    const int* row_limit = nullptr;         ///< [rows]: row r sees token positions < row_limit[r]
    const int* row_first = nullptr;    ///< optional [rows]: and positions >= row_first[r] (windows)
    tile_stats* page_stats = nullptr;  ///< optional [rows][stats_stride], by logical page
    int stats_stride = 0;
  };

  /// On return s.merged[r] holds row r's finalized state over all its visible tokens.
  static void run(const batch_index_view<num_tiers>& index, const pool_view* pools,
                  const layer_source& src, const logit_params& lp, const job& j, scratch& s) {
    for (int r = 0; r < j.rows; ++r) s.merged[r].clear();
    if (j.page_stats)
      for (int r = 0; r < j.rows; ++r)
        for (int p = 0; p < j.stats_stride; ++p)
          j.page_stats[std::size_t(r) * std::size_t(j.stats_stride) + std::size_t(p)] =
              tile_stats{};
    run_tiers(index, pools, src, lp, j, s, std::make_index_sequence<num_tiers>{});
  }

  /// Checks everything the pass would otherwise trust: pool geometry, slots, and that
  /// the formats' entries cover each sequence's logical pages exactly once.
  static status validate(const batch_index_view<num_tiers>& index, const pool_view* pools,
                         std::vector<std::uint8_t>& seen, int* max_pages_out) {
    if (index.batch < 0)
      return status::make(errc::invalid_argument, "batch = ", index.batch, " is negative");
    if (index.batch > 0 && !index.seq_len)
      return status::make(errc::invalid_argument,
                          "index.seq_len is null for batch = ", index.batch);
    if (!pools) return status::make(errc::invalid_argument, "pools is null");
    const std::size_t expect[] = {layout_at_bytes<Tiers>()...};
    for (int f = 0; f < num_tiers; ++f) {
      if (pools[f].page_bytes != expect[f])
        return status::make(errc::geometry_mismatch, "pools[", f,
                            "].page_bytes = ", pools[f].page_bytes, " but tier ", f,
                            "'s page layout needs ", expect[f]);
      if (index.batch > 0 && !index.formats[f].indptr)
        return status::make(errc::invalid_argument, "index.formats[", f, "].indptr is null");
    }
    int max_pages = 0;
    for (int b = 0; b < index.batch; ++b) {
      if (index.seq_len[b] < 0)
        return status::make(errc::invalid_argument, "seq_len[", b, "] = ", index.seq_len[b],
                            " is negative");
      const int pages = (index.seq_len[b] + page_tokens - 1) / page_tokens;
      max_pages = pages > max_pages ? pages : max_pages;
    }
    seen.assign(std::size_t(max_pages), 0);
    for (int b = 0; b < index.batch; ++b) {
      const int pages = (index.seq_len[b] + page_tokens - 1) / page_tokens;
      int covered = 0;
      for (int f = 0; f < num_tiers; ++f) {
        const format_pages_view& v = index.formats[f];
        const int lo = v.indptr[b], hi = v.indptr[b + 1];
        if (hi < lo)
          return status::make(errc::invalid_argument, "index.formats[", f,
                              "].indptr decreases at sequence ", b, ": ", lo, " > ", hi);
        if (hi > lo && (!v.slot || !v.logical))
          return status::make(errc::invalid_argument, "index.formats[", f,
                              "] has entries but null slot/logical");
        if (hi > lo && !pools[f].base)
          return status::make(errc::invalid_argument, "pools[", f, "].base is null but sequence ",
                              b, " uses it");
        for (int e = lo; e < hi; ++e) {
          if (v.slot[e] < 0 || std::uint32_t(v.slot[e]) >= pools[f].capacity)
            return status::out_of_range(status::format("index.formats[", f, "].slot[", e, "]"),
                                        v.slot[e], pools[f].capacity);
          if (v.logical[e] < 0 || v.logical[e] >= pages)
            return status::out_of_range(
                status::format("index.formats[", f, "].logical[", e, "] (sequence ", b, " of ",
                               index.seq_len[b], " tokens)"),
                v.logical[e], pages);
          if (seen[std::size_t(v.logical[e])])
            return status::make(errc::invalid_argument, "sequence ", b, "'s logical page ",
                                v.logical[e], " appears more than once across formats");
          seen[std::size_t(v.logical[e])] = 1;
          ++covered;
        }
      }
      if (covered != pages)
        return status::make(errc::invalid_argument, "sequence ", b, " has ", index.seq_len[b],
                            " tokens = ", pages, " pages but its index entries cover ", covered);
      for (int f = 0; f < num_tiers; ++f) {
        const format_pages_view& v = index.formats[f];
        for (int e = v.indptr[b]; e < v.indptr[b + 1]; ++e) seen[std::size_t(v.logical[e])] = 0;
      }
    }
    if (max_pages_out) *max_pages_out = max_pages;
    return status::ok();
  }

 private:
  template <class Tier>
  static constexpr std::size_t layout_at_bytes() {
    return page_layout<Geometry, typename Tier::template key_codec<head_dim>,
                       typename Tier::template value_codec<head_dim>>::page_bytes;
  }

  template <std::size_t... I>
  static void run_tiers(const batch_index_view<num_tiers>& index, const pool_view* pools,
                        const layer_source& src, const logit_params& lp, const job& j, scratch& s,
                        std::index_sequence<I...>) {
    (run_tier<int(I)>(index, pools, src, lp, j, s), ...);
  }

  template <int I>
  static void run_tier(const batch_index_view<num_tiers>& index, const pool_view* pools,
                       const layer_source& src, const logit_params& lp, const job& j, scratch& s) {
    using layout = layout_at<I>;
    using key_codec = typename layout::key_codec;
    using value_codec = typename layout::value_codec;
    using tile = attention_tile<key_codec, value_codec>;
    const format_pages_view& v = index.formats[I];
    const int lo = v.indptr[j.seq], hi = v.indptr[j.seq + 1];
    if (hi <= lo) return;

    // Queries prepared once per (row, tier) with the KEY context; the states of this
    // tier accumulate in the VALUE codec's domain until finalize below.
    const int g = src.head_base + j.kv_head;
    const codec_context kctx = make_codec_context(src.cache_seed, src.layer, g, kv_role::key);
    const codec_context vctx = make_codec_context(src.cache_seed, src.layer, g, kv_role::value);
    for (int r = 0; r < j.rows; ++r)
      key_codec::prepare_query(j.queries[r], s.prepared + std::size_t(r) * head_dim, kctx);
    state* st = s.tier_states + std::size_t(I) * std::size_t(j.rows);
    for (int r = 0; r < j.rows; ++r) st[r].clear();
    // With windows, pages wholly before every row's window are not visited at all.
    int window_start = 0;
    if (j.row_first) {
      window_start = j.row_first[0];
      for (int r = 1; r < j.rows; ++r) window_start = std::min(window_start, j.row_first[r]);
    }

    for (int e = lo; e < hi; ++e) {
      const int lpage = v.logical[e];
      const int ntok = index.tokens_in_page(j.seq, lpage, page_tokens);
      const int page_start = lpage * page_tokens;
      if (page_start + ntok <= window_start) continue;  // its stats stay empty (run() cleared them)
      const std::uint8_t* page = pools[I].page(std::uint32_t(v.slot[e]));
      if (j.page_stats)
        for (int r = 0; r < j.rows; ++r) s.tstats[r] = tile_stats{};
      for (int t0 = 0; t0 < ntok; t0 += tile_tokens) {
        const int n = ntok - t0 < tile_tokens ? ntok - t0 : tile_tokens;
        bool any = false, later = false;  // a row sees some of this tile / of a later one
        for (int r = 0; r < j.rows; ++r) {
          const int vis = j.row_limit[r] - (page_start + t0);
          s.row_ntok[r] = vis < 0 ? 0 : (vis > n ? n : vis);
          const int first = j.row_first ? j.row_first[r] - (page_start + t0) : 0;
          s.row_first[r] = first < 0 ? 0 : first;
          any = any || s.row_ntok[r] > s.row_first[r];
          later = later || vis > n;
        }
        if (!any) {
          if (!later) break;  // the limits cut the tail: later tiles of the page are hidden too
          continue;           // before every row's window
        }
        const auto span = tile::span::template in_page<layout>(page, j.kv_head, t0);
        tile::run(s.prepared, j.rows, s.row_ntok, span, n, lp, st,
                  j.page_stats ? s.tstats : nullptr, s.scores, j.row_first ? s.row_first : nullptr);
      }
      if (j.page_stats)
        for (int r = 0; r < j.rows; ++r)
          j.page_stats[std::size_t(r) * std::size_t(j.stats_stride) + std::size_t(lpage)] =
              s.tstats[r];
    }
    for (int r = 0; r < j.rows; ++r) {
      value_codec::finalize(st[r].acc, vctx);  // inverse rotation for TQ3 values
      s.merged[r].merge(st[r]);
    }
  }
};

}  // namespace detail
}  // namespace tierkv
