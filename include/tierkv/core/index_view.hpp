// SPDX-License-Identifier: Apache-2.0
// Format-partitioned index arrays for one layer of one decode/prefill batch: what the
// host attention path and the CUDA kernels read. Plain pointers (host or device
// memory), no ownership; built by paging/index_builder (host) and cuda/ (device).
#pragma once

#include <cstdint>

#include "tierkv/core/config.hpp"

namespace tierkv {

/// The pages of one format (one tier's pool) across the batch, as CSR:
///   sequence b owns entries [indptr[b], indptr[b+1]);
///   entry e is physical page slot[e] of this format's pool holding the sequence's
///   logical page logical[e] (0-based; entries of a sequence sorted by logical page).
/// A sequence's logical pages are the disjoint union of its entries over all formats,
/// so logical order is preserved through every format change.
struct format_pages_view {
  const std::int32_t* indptr = nullptr;   ///< [batch + 1]
  const std::int32_t* slot = nullptr;     ///< [indptr[batch]]
  const std::int32_t* logical = nullptr;  ///< [indptr[batch]]

  /// Entries of sequence b in this format.
  TIERKV_HD int count(int b) const { return indptr[b + 1] - indptr[b]; }
};

/// A batch over NumFormats formats (in the cache's compile-time tier order).
/// seq_len[b] tokens are live in sequence b: logical page i holds tokens
/// [i * page_tokens, min((i + 1) * page_tokens, seq_len[b])), so only the last
/// page may be partial (its fill is seq_len - (pages - 1) * page_tokens).
template <int NumFormats>
struct batch_index_view {
  static_assert(NumFormats >= 1, "batch_index_view: at least one format");
  static constexpr int num_formats = NumFormats;  ///< formats (tiers) in the view

  int batch = 0;                          ///< sequences in the batch
  const std::int32_t* seq_len = nullptr;  ///< [batch]
  format_pages_view formats[NumFormats];  ///< the pages of each format, in tier order

  /// Tokens of logical page `logical_page` that are live in sequence b.
  TIERKV_HD int tokens_in_page(int b, int logical_page, int page_tokens) const {
    return tokens_in_page_of(seq_len[b], logical_page, page_tokens);
  }
  /// The same, given the sequence's length (a kernel that loaded it ahead of its use).
  TIERKV_HD static int tokens_in_page_of(int length, int logical_page, int page_tokens) {
    const int left = length - logical_page * page_tokens;
    return left < page_tokens ? (left < 0 ? 0 : left) : page_tokens;
  }
};

}  // namespace tierkv
