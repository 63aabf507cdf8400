// SPDX-License-Identifier: Apache-2.0
// Exact memory accounting of a paged storage: every byte its allocators hold belongs to
// one line, and the lines sum to the allocators' totals (reconciles()).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "tierkv/paging/paged_storage.hpp"

namespace tierkv {

/// The bytes of one tier's pool (a line of memory_report).
struct tier_report {
  std::string name;                ///< "key codec / value codec"
  std::size_t page_bytes = 0;      ///< one physical page (one layer, all KV heads)
  std::size_t capacity_pages = 0;  ///< pages the pool holds
  std::size_t live_pages = 0;      ///< published or held by a caller
  // Bytes of live pages by part; they sum to live_pages * page_bytes.
  std::size_t key_payload = 0;      ///< key codes
  std::size_t value_payload = 0;    ///< value codes
  std::size_t key_meta = 0;         ///< FP8 scales, TQ3 norms
  std::size_t value_meta = 0;       ///< value scales / norms
  std::size_t padding = 0;          ///< 16-byte alignment of the page regions
  std::size_t free_page_bytes = 0;  ///< capacity not in use
  std::uint64_t token_layers = 0;   ///< tokens stored in live pages, summed over layers
  double kib_per_token = 0;         ///< if every layer were in this tier
  double bits_per_scalar = 0;       ///< stored bits per key or value scalar

  /// Bytes of live pages.
  std::size_t live_bytes() const {
    return key_payload + value_payload + key_meta + value_meta + padding;
  }
  /// The pool's whole slab: live and free pages.
  std::size_t slab_bytes() const { return live_bytes() + free_page_bytes; }
};

/// Exact accounting of a storage: every allocated byte on one line (tiered_cache::report()).
/// reconciles() checks the lines against what the allocators handed out.
struct memory_report {
  int num_layers = 0;                  ///< model layers
  int kv_heads = 0;                    ///< KV heads
  int head_dim = 0;                    ///< scalars per head vector
  int page_tokens = 0;                 ///< tokens per page
  std::vector<tier_report> tiers;      ///< one line per tier
  std::size_t pool_bookkeeping = 0;    ///< per-page generation, refcount, state, free list
  std::size_t page_tables = 0;         ///< sequences, logical page lists, blocks
  std::size_t index_arrays = 0;        ///< index_arrays made from this storage
  std::size_t prefix_index = 0;        ///< entries, token ids, hash buckets
  std::size_t scratch = 0;             ///< the host façade's centring means
  std::size_t allocator_total = 0;     ///< page allocator + bookkeeping allocator, as they report
  std::uint64_t live_tokens = 0;       ///< distinct stored tokens (shared pages count once)
  std::uint64_t sequence_tokens = 0;   ///< sum of sequence lengths
  double kib_per_token = 0;            ///< live page bytes per live token, all layers
  double kib_per_token_allocated = 0;  ///< every allocated byte per live token
  double bits_per_scalar = 0;          ///< live page bits per stored key/value scalar

  /// Bytes of live pages, all tiers.
  std::size_t live_page_bytes() const {
    std::size_t n = 0;
    for (const auto& t : tiers) n += t.live_bytes();
    return n;
  }
  /// The sum of every line: slabs and bookkeeping.
  std::size_t lines_total() const {
    std::size_t n = pool_bookkeeping + page_tables + index_arrays + prefix_index + scratch;
    for (const auto& t : tiers) n += t.slab_bytes();
    return n;
  }
  /// True when the lines sum to exactly what the allocators report.
  bool reconciles() const { return lines_total() == allocator_total; }
};

/// The report of a paged_storage.
template <class Storage>
memory_report make_report(const Storage& s) {
  memory_report r;
  r.num_layers = s.num_layers();
  r.kv_heads = Storage::kv_heads;
  r.head_dim = Storage::head_dim;
  r.page_tokens = Storage::page_tokens;
  std::vector<std::uint64_t> token_layers(std::size_t(Storage::num_tiers), 0);
  s.for_each_block([&](block_ref b, int fill, std::uint32_t) {
    r.live_tokens += std::uint64_t(fill);
    for (int l = 0; l < s.num_layers(); ++l)
      token_layers[s.block_page(b, l).format] += std::uint64_t(fill);
  });
  s.for_each_sequence([&](seq_id, std::int64_t len) { r.sequence_tokens += std::uint64_t(len); });
  const double scalars_per_token_layer = 2.0 * Storage::kv_heads * Storage::head_dim;
  detail::for_each_index<Storage::num_tiers>([&](auto I) {
    using L = typename Storage::template layout<I>;
    using K = typename L::key_codec;
    using V = typename L::value_codec;
    const auto& pool = s.template pool<I>();
    tier_report t;
    t.name = std::string(K::name) + " / " + V::name;
    t.page_bytes = L::page_bytes;
    t.capacity_pages = pool.capacity();
    t.live_pages = pool.live_count();
    const std::size_t slots = std::size_t(L::heads) * L::tokens;
    t.key_payload = t.live_pages * slots * K::payload_bytes;
    t.value_payload = t.live_pages * slots * V::payload_bytes;
    t.key_meta = t.live_pages * slots * K::meta_bytes;
    t.value_meta = t.live_pages * slots * V::meta_bytes;
    t.padding =
        t.live_pages * L::page_bytes - t.key_payload - t.value_payload - t.key_meta - t.value_meta;
    t.free_page_bytes = std::size_t(pool.free_count()) * L::page_bytes;
    t.token_layers = token_layers[I];
    if (t.token_layers > 0) {
      t.kib_per_token = double(t.live_bytes()) / double(t.token_layers) * r.num_layers / 1024.0;
      t.bits_per_scalar =
          8.0 * double(t.live_bytes()) / (double(t.token_layers) * scalars_per_token_layer);
    }
    r.tiers.push_back(t);
  });
  r.pool_bookkeeping = s.lines().pool_bookkeeping;
  r.page_tables = s.lines().page_tables;
  r.index_arrays = s.lines().index_arrays;
  r.prefix_index = s.lines().prefix_index;
  r.scratch = s.lines().scratch;
  r.allocator_total = s.page_alloc().bytes_allocated() + s.meta_alloc().bytes_allocated();
  if (r.live_tokens > 0) {
    r.kib_per_token = double(r.live_page_bytes()) / double(r.live_tokens) / 1024.0;
    r.kib_per_token_allocated = double(r.allocator_total) / double(r.live_tokens) / 1024.0;
    r.bits_per_scalar = 8.0 * double(r.live_page_bytes()) /
                        (double(r.live_tokens) * r.num_layers * scalars_per_token_layer);
  }
  return r;
}

/// The report as text, one line per tier and one per bookkeeping line (3 decimals).
inline std::string to_string(const memory_report& r) {
  const auto f3 = [](double v) { return fixed{v, 3}; };
  std::string out =
      concat("tierkv memory report: ", r.num_layers, " layers, ", r.kv_heads,
             " KV heads, head_dim ", r.head_dim, ", ", r.page_tokens, " tokens/page\n");
  for (std::size_t i = 0; i < r.tiers.size(); ++i) {
    const auto& t = r.tiers[i];
    out += concat("  tier ", i, " (", t.name, "): ", t.live_pages, "/", t.capacity_pages,
                  " pages of ", t.page_bytes, " B; live: key payload ", t.key_payload,
                  ", value payload ", t.value_payload, ", key meta ", t.key_meta, ", value meta ",
                  t.value_meta, ", padding ", t.padding, "; free ", t.free_page_bytes, " B; ",
                  f3(t.kib_per_token), " KiB/token, ", f3(t.bits_per_scalar), " bits/scalar\n");
  }
  out += concat("  pool bookkeeping ", r.pool_bookkeeping, " B, page tables ", r.page_tables,
                " B, index arrays ", r.index_arrays, " B, prefix index ", r.prefix_index,
                " B, scratch ", r.scratch, " B\n");
  out += concat("  lines ", r.lines_total(), " B, allocators ", r.allocator_total, " B",
                r.reconciles() ? " (reconciled)" : " (MISMATCH)", "\n");
  out += concat("  live tokens ", r.live_tokens, " (sequence tokens ", r.sequence_tokens,
                "): ", f3(r.kib_per_token), " KiB/token in pages, ", f3(r.kib_per_token_allocated),
                " KiB/token allocated, ", f3(r.bits_per_scalar), " bits/scalar\n");
  return out;
}

/// Writes to_string(r).
inline std::ostream& operator<<(std::ostream& out, const memory_report& r) {
  return out << to_string(r);
}

}  // namespace tierkv
