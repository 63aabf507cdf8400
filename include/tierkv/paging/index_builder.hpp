// SPDX-License-Identifier: Apache-2.0
// Builds the format-partitioned index arrays (batch_index_view, see index_view.hpp)
// for a batch of sequences and one layer, into a caller-provided buffer whose size is
// fixed ahead by capacity_for(max_batch, max_pages), so the same memory can be reused
// by every step (and captured in a CUDA graph). Also: a host export of one layer's
// page tables (the input of cuda/index_builder.cuh), and an adapter from a
// FlashInfer/vLLM-style page table (indptr, indices, last_page_len).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/storage_types.hpp"

namespace tierkv {

/// Where each array lives in an index buffer (byte offsets, each 16-byte aligned):
///   seq_len[max_batch]
///   per format f: indptr[max_batch + 1], slot[max_batch * max_pages], logical[same]
/// Every format gets room for the whole batch, so any mix of formats fits and the
/// pointers never move between steps.
template <int NumFormats>
struct index_layout {
  static_assert(NumFormats >= 1, "index_layout: at least one format");
  int max_batch = 0;  ///< sequences per batch
  int max_pages = 0;  ///< logical pages per sequence

  /// n rounded up to 16.
  static constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }
  /// Bytes of n int32s, 16-aligned.
  static constexpr std::size_t ints(std::size_t n) { return align16(n * sizeof(std::int32_t)); }

  /// Ok when the shape fits int32 indices.
  constexpr status validate() const {
    if (max_batch < 1)
      return status::make(errc::invalid_argument, "index_layout: max_batch = ", max_batch, " < 1");
    if (max_pages < 1)
      return status::make(errc::invalid_argument, "index_layout: max_pages = ", max_pages, " < 1");
    if (std::int64_t(max_batch) * max_pages > std::numeric_limits<std::int32_t>::max())
      return status::exceeds(errc::out_of_range, "index_layout: max_batch * max_pages",
                             std::int64_t(max_batch) * max_pages,
                             std::numeric_limits<std::int32_t>::max());
    return {};
  }
  /// max_batch x max_pages.
  constexpr std::size_t entries() const { return std::size_t(max_batch) * std::size_t(max_pages); }
  /// Offset of seq_len.
  constexpr std::size_t seq_len_offset() const { return 0; }
  /// Bytes of one format's arrays.
  constexpr std::size_t format_bytes() const {
    return ints(std::size_t(max_batch) + 1) + 2 * ints(entries());
  }
  /// Offset of format f's indptr.
  constexpr std::size_t indptr_offset(int f) const {
    return ints(std::size_t(max_batch)) + std::size_t(f) * format_bytes();
  }
  /// Offset of format f's slot array.
  constexpr std::size_t slot_offset(int f) const {
    return indptr_offset(f) + ints(std::size_t(max_batch) + 1);
  }
  /// Offset of format f's logical array.
  constexpr std::size_t logical_offset(int f) const { return slot_offset(f) + ints(entries()); }
  /// Bytes of the whole buffer.
  constexpr std::size_t bytes() const {
    return ints(std::size_t(max_batch)) + NumFormats * format_bytes();
  }

  /// Bytes an index buffer needs for max_batch sequences of up to max_pages logical pages.
  static constexpr std::size_t capacity_for(int max_batch, int max_pages) {
    return index_layout{max_batch, max_pages}.bytes();
  }

  /// The view over a buffer laid out this way (host or device memory; batch filled in).
  batch_index_view<NumFormats> view_of(void* buffer, int batch) const {
    auto* base = static_cast<std::uint8_t*>(buffer);
    batch_index_view<NumFormats> v;
    v.batch = batch;
    v.seq_len = reinterpret_cast<const std::int32_t*>(base + seq_len_offset());
    for (int f = 0; f < NumFormats; ++f) {
      v.formats[f].indptr = reinterpret_cast<const std::int32_t*>(base + indptr_offset(f));
      v.formats[f].slot = reinterpret_cast<const std::int32_t*>(base + slot_offset(f));
      v.formats[f].logical = reinterpret_cast<const std::int32_t*>(base + logical_offset(f));
    }
    return v;
  }
};

namespace detail {
inline status check_index_buffer(std::span<std::uint8_t> buffer, std::size_t need) {
  if (buffer.size() < need)
    return status::make(errc::capacity_exhausted, "index buffer holds ", buffer.size(),
                        " bytes, the layout needs ", need, " (index_layout::capacity_for)");
  if (reinterpret_cast<std::uintptr_t>(buffer.data()) % 16 != 0)
    return status(errc::invalid_argument, "index buffer must be 16-byte aligned");
  return {};
}
template <class T>
T* at(std::span<std::uint8_t> buffer, std::size_t offset) {
  return reinterpret_cast<T*>(buffer.data() + offset);
}
}  // namespace detail

/// Host builder. Checks everything first; on error the buffer is untouched.
template <class Storage>
result<batch_index_view<Storage::num_tiers>> build_batch_index(
    const Storage& storage, int layer, std::span<const seq_id> batch,
    const index_layout<Storage::num_tiers>& layout, std::span<std::uint8_t> buffer,
    index_scope scope = index_scope::committed) {
  constexpr int N = Storage::num_tiers;
  if (auto st = layout.validate(); !st) return st;
  if (auto st = detail::check_index_buffer(buffer, layout.bytes()); !st) return st;
  if (layer < 0 || layer >= storage.num_layers())
    return status::out_of_range("layer", layer, storage.num_layers());
  if (batch.size() > std::size_t(layout.max_batch))
    return status::exceeds(errc::capacity_exhausted, "batch size", batch.size(), layout.max_batch);
  const bool readable = scope == index_scope::readable;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    auto pages = storage.logical_pages(batch[b], scope);
    if (!pages) return pages.error_status();
    const std::int64_t tokens =
        *storage.length(batch[b]) + (readable ? *storage.reserved(batch[b]) : 0);
    if (tokens > std::numeric_limits<std::int32_t>::max())
      return status::exceeds(errc::out_of_range, "tokens of the sequence", tokens,
                             std::numeric_limits<std::int32_t>::max());
    if (*pages > layout.max_pages)
      return status::make(errc::capacity_exhausted, "sequence ", batch[b], " (batch entry ", b,
                          ") has ", *pages, " logical pages, the index layout holds ",
                          layout.max_pages);
  }
  auto* seq_len = detail::at<std::int32_t>(buffer, layout.seq_len_offset());
  std::int32_t* indptr[N];
  std::int32_t* slot[N];
  std::int32_t* logical[N];
  std::int32_t cursor[N];
  for (int f = 0; f < N; ++f) {
    indptr[f] = detail::at<std::int32_t>(buffer, layout.indptr_offset(f));
    slot[f] = detail::at<std::int32_t>(buffer, layout.slot_offset(f));
    logical[f] = detail::at<std::int32_t>(buffer, layout.logical_offset(f));
    cursor[f] = 0;
    indptr[f][0] = 0;
  }
  for (std::size_t b = 0; b < batch.size(); ++b) {
    seq_len[b] =
        std::int32_t(*storage.length(batch[b]) + (readable ? *storage.reserved(batch[b]) : 0));
    storage.for_each_page(
        batch[b], layer,
        [&](std::int64_t i, page_id p) {
          const int f = p.format;
          slot[f][cursor[f]] = std::int32_t(p.slot);
          logical[f][cursor[f]] = std::int32_t(i);
          ++cursor[f];
        },
        scope);
    for (int f = 0; f < N; ++f) indptr[f][b + 1] = cursor[f];
  }
  return layout.view_of(buffer.data(), int(batch.size()));
}

/// One layer's page tables as flat arrays (the device builder's input), CSR over the batch:
///   indptr[batch + 1], slot[total], format[total] (tier index), seq_len[batch].
struct page_table_arrays {
  int batch = 0;                          ///< sequences
  const std::int32_t* indptr = nullptr;   ///< [batch + 1]
  const std::int32_t* slot = nullptr;     ///< [indptr[batch]] pool slot of each logical page
  const std::int32_t* format = nullptr;   ///< [indptr[batch]] its tier
  const std::int32_t* seq_len = nullptr;  ///< [batch] tokens per sequence
};

/// Same shape limits as index_layout; byte layout: indptr, slot, format, seq_len.
struct page_table_layout {
  int max_batch = 0;  ///< sequences per batch
  int max_pages = 0;  ///< logical pages per sequence
  /// Bytes of n int32s, 16-aligned.
  static constexpr std::size_t ints(std::size_t n) {
    return (n * sizeof(std::int32_t) + 15) / 16 * 16;
  }
  /// max_batch x max_pages.
  constexpr std::size_t entries() const { return std::size_t(max_batch) * std::size_t(max_pages); }
  /// Offset of indptr.
  constexpr std::size_t indptr_offset() const { return 0; }
  /// Offset of slot.
  constexpr std::size_t slot_offset() const { return ints(std::size_t(max_batch) + 1); }
  /// Offset of format.
  constexpr std::size_t format_offset() const { return slot_offset() + ints(entries()); }
  /// Offset of seq_len.
  constexpr std::size_t seq_len_offset() const { return format_offset() + ints(entries()); }
  /// Bytes of the whole buffer.
  constexpr std::size_t bytes() const { return seq_len_offset() + ints(std::size_t(max_batch)); }
  /// Bytes a buffer for this shape needs.
  static constexpr std::size_t capacity_for(int max_batch, int max_pages) {
    return page_table_layout{max_batch, max_pages}.bytes();
  }
  /// The arrays of a buffer laid out like this, for `batch` sequences.
  page_table_arrays view_of(const void* buffer, int batch) const {
    const auto* base = static_cast<const std::uint8_t*>(buffer);
    return {batch, reinterpret_cast<const std::int32_t*>(base + indptr_offset()),
            reinterpret_cast<const std::int32_t*>(base + slot_offset()),
            reinterpret_cast<const std::int32_t*>(base + format_offset()),
            reinterpret_cast<const std::int32_t*>(base + seq_len_offset())};
  }
};

/// Writes one layer's page tables for a batch into a host buffer (to be copied to the device).
template <class Storage>
result<page_table_arrays> export_page_tables(const Storage& storage, int layer,
                                             std::span<const seq_id> batch,
                                             const page_table_layout& layout,
                                             std::span<std::uint8_t> buffer) {
  if (auto st = index_layout<1>{layout.max_batch, layout.max_pages}.validate(); !st) return st;
  if (auto st = detail::check_index_buffer(buffer, layout.bytes()); !st) return st;
  if (layer < 0 || layer >= storage.num_layers())
    return status::out_of_range("layer", layer, storage.num_layers());
  if (batch.size() > std::size_t(layout.max_batch))
    return status::exceeds(errc::capacity_exhausted, "batch size", batch.size(), layout.max_batch);
  for (std::size_t b = 0; b < batch.size(); ++b) {
    auto pages = storage.logical_pages(batch[b]);
    if (!pages) return pages.error_status();
    if (*pages > layout.max_pages)
      return status::make(errc::capacity_exhausted, "sequence ", batch[b], " has ", *pages,
                          " logical pages, the layout holds ", layout.max_pages);
  }
  auto* indptr = detail::at<std::int32_t>(buffer, layout.indptr_offset());
  auto* slot = detail::at<std::int32_t>(buffer, layout.slot_offset());
  auto* format = detail::at<std::int32_t>(buffer, layout.format_offset());
  auto* seq_len = detail::at<std::int32_t>(buffer, layout.seq_len_offset());
  std::int32_t e = 0;
  indptr[0] = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    seq_len[b] = std::int32_t(*storage.length(batch[b]));
    storage.for_each_page(batch[b], layer, [&](std::int64_t, page_id p) {
      slot[e] = std::int32_t(p.slot);
      format[e] = std::int32_t(p.format);
      ++e;
    });
    indptr[b + 1] = e;
  }
  return layout.view_of(buffer.data(), int(batch.size()));
}

/// A FlashInfer/vLLM-style page table of a cache whose pages all have one format:
/// sequence b owns pages indices[indptr[b] .. indptr[b+1]) in logical order, and its
/// last page holds last_page_len[b] tokens (1..page_tokens; 0 only when it has no pages).
struct paged_kv_table {
  int batch = 0;                                ///< sequences
  int page_tokens = 0;                          ///< tokens per page
  const std::int32_t* indptr = nullptr;         ///< [batch + 1]
  const std::int32_t* indices = nullptr;        ///< [indptr[batch]]
  const std::int32_t* last_page_len = nullptr;  ///< [batch]
};

/// Checks a paged_kv_table (host memory) against a layout and a pool capacity.
inline status validate_paged_kv_table(const paged_kv_table& t, int max_batch, int max_pages,
                                      std::uint32_t pool_capacity) {
  if (t.batch < 0 || t.batch > max_batch)
    return status::exceeds(errc::capacity_exhausted, "batch", t.batch, max_batch);
  if (t.page_tokens < 1)
    return status::make(errc::invalid_argument, "page_tokens = ", t.page_tokens, " < 1");
  if (t.batch > 0 && (t.indptr == nullptr || t.last_page_len == nullptr))
    return status(errc::invalid_argument, "paged_kv_table: null indptr or last_page_len");
  if (t.batch > 0 && t.indptr[0] != 0)
    return status::make(errc::invalid_argument, "indptr[0] = ", t.indptr[0], " (must be 0)");
  for (int b = 0; b < t.batch; ++b) {
    const std::int64_t n = std::int64_t(t.indptr[b + 1]) - t.indptr[b];
    if (n < 0) return status::make(errc::invalid_argument, "indptr decreases at sequence ", b);
    if (n > max_pages)
      return status::make(errc::capacity_exhausted, "sequence ", b, " has ", n,
                          " pages, the layout holds ", max_pages);
    const int last = t.last_page_len[b];
    if (n == 0 ? last != 0 : (last < 1 || last > t.page_tokens))
      return status::make(errc::invalid_argument, "last_page_len[", b, "] = ", last,
                          " must lie in [1, ", t.page_tokens, "] (0 for a sequence without pages)");
    if (n > 0 && (n - 1) * t.page_tokens + last > std::numeric_limits<std::int32_t>::max())
      return status::exceeds(errc::out_of_range, "sequence length", (n - 1) * t.page_tokens + last,
                             std::numeric_limits<std::int32_t>::max());
    for (std::int32_t e = t.indptr[b]; e < t.indptr[b + 1]; ++e)
      if (t.indices[e] < 0 || std::uint32_t(t.indices[e]) >= pool_capacity)
        return status::out_of_range("indices[" + std::to_string(e) + "]", t.indices[e],
                                    pool_capacity);
  }
  return {};
}

/// Adapter: the table's pages all belong to format `format`; other formats are empty.
template <int NumFormats>
result<batch_index_view<NumFormats>> index_from_paged_kv_table(
    const paged_kv_table& t, int format, std::uint32_t pool_capacity,
    const index_layout<NumFormats>& layout, std::span<std::uint8_t> buffer) {
  if (auto st = layout.validate(); !st) return st;
  if (auto st = detail::check_index_buffer(buffer, layout.bytes()); !st) return st;
  if (format < 0 || format >= NumFormats) return status::out_of_range("format", format, NumFormats);
  if (auto st = validate_paged_kv_table(t, layout.max_batch, layout.max_pages, pool_capacity); !st)
    return st;
  auto* seq_len = detail::at<std::int32_t>(buffer, layout.seq_len_offset());
  for (int f = 0; f < NumFormats; ++f) {
    auto* indptr = detail::at<std::int32_t>(buffer, layout.indptr_offset(f));
    auto* slot = detail::at<std::int32_t>(buffer, layout.slot_offset(f));
    auto* logical = detail::at<std::int32_t>(buffer, layout.logical_offset(f));
    indptr[0] = 0;
    for (int b = 0; b < t.batch; ++b) {
      indptr[b + 1] = (f == format) ? t.indptr[b + 1] : 0;
      if (f != format) continue;
      for (std::int32_t e = t.indptr[b]; e < t.indptr[b + 1]; ++e) {
        slot[e] = t.indices[e];
        logical[e] = e - t.indptr[b];
      }
    }
  }
  for (int b = 0; b < t.batch; ++b) {
    const std::int32_t n = t.indptr[b + 1] - t.indptr[b];
    seq_len[b] = n == 0 ? 0 : (n - 1) * t.page_tokens + t.last_page_len[b];
  }
  return layout.view_of(buffer.data(), t.batch);
}

/// An index buffer owned by a storage's bookkeeping allocator and charged to its
/// index_arrays accounting line (host memory; kernels on the device use their own).
template <class Storage>
class index_arrays {
 public:
  static constexpr int num_formats = Storage::num_tiers;    ///< tiers of the storage
  using meta_allocator = typename Storage::meta_allocator;  ///< the storage's bookkeeping allocator

  /// A buffer for max_batch sequences of up to max_pages logical pages (the storage must
  /// outlive it).
  static result<index_arrays> create(Storage& storage, int max_batch, int max_pages) {
    const index_layout<num_formats> layout{max_batch, max_pages};
    if (auto st = layout.validate(); !st) return st;
    auto p = storage.meta_alloc().allocate(layout.bytes());
    if (!p) return p.error_status();
    storage.lines().index_arrays += layout.bytes();
    return index_arrays(storage, layout, static_cast<std::uint8_t*>(*p));
  }
  /// Takes over o's buffer.
  index_arrays(index_arrays&& o) noexcept
      : storage_(o.storage_), layout_(o.layout_), data_(std::exchange(o.data_, nullptr)) {}
  index_arrays& operator=(index_arrays&&) = delete;
  ~index_arrays() {
    if (data_ == nullptr) return;
    storage_->meta_alloc().deallocate(data_, layout_.bytes());
    storage_->lines().index_arrays -= layout_.bytes();
  }

  /// Where each array lives.
  const index_layout<num_formats>& layout() const noexcept { return layout_; }
  /// The buffer.
  std::span<std::uint8_t> bytes() noexcept { return {data_, layout_.bytes()}; }

  /// The index view of `batch` at `layer` (build_batch_index into this buffer).
  result<batch_index_view<num_formats>> build(int layer, std::span<const seq_id> batch,
                                              index_scope scope = index_scope::committed) {
    return build_batch_index(*storage_, layer, batch, layout_, bytes(), scope);
  }

 private:
  index_arrays(Storage& s, index_layout<num_formats> l, std::uint8_t* d)
      : storage_(&s), layout_(l), data_(d) {}
  Storage* storage_;
  index_layout<num_formats> layout_;
  std::uint8_t* data_;
};

}  // namespace tierkv
