// SPDX-License-Identifier: Apache-2.0
// A device mirror of a paged storage's two-level page table, and the builder of every
// layer's format-partitioned index arrays (batch_index_view) from it in four launches.
//
// Why two levels: a sequence is a row of block indices (one block = one logical page in every
// layer), and a block holds one page per layer. Appending a page writes one row entry and
// `layers` table entries; a conversion writes one table entry, and it reaches every sequence
// that shares the block (forks, prefixes) at once. The host keeps a shadow of both arrays and
// a journal of the entries it changed; build() uploads only the journal and the batch (metadata,
// never page bytes), so the host cost of a step does not grow with context length. Re-exporting
// every layer's page tables (paging/index_builder.hpp's export_page_tables) costs
// O(batch x pages x layers) host work a step: 16M entries at 256 x 2048 pages x 32 layers.
//
// The index arrays equal build_batch_index's bytes for bytes (tests/cuda/tiered_cache.cpp):
// per layer, per format, the pages of each sequence in logical order, sequences in batch order.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <vector>

#include <cub/block/block_scan.cuh>

#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/paging/index_builder.hpp"

namespace tierkv::cuda {

/// A table entry: the page's tier (format) in the top 8 bits, its pool slot below.
struct packed_page {
  static constexpr int slot_bits = 24;                         ///< bits of the pool slot
  static constexpr std::uint32_t max_slots = 1u << slot_bits;  ///< slots a format's pool may have
  static constexpr std::int32_t none = -1;                     ///< an unmapped entry
  /// The entry of pool slot `slot` of tier `format`.
  static constexpr std::int32_t pack(int format, std::uint32_t slot) {
    return std::int32_t((std::uint32_t(format) << slot_bits) | slot);
  }
  /// The tier (format) of entry e.
  TIERKV_HD_INLINE static int format(std::int32_t e) { return int(std::uint32_t(e) >> slot_bits); }
  /// The pool slot of entry e.
  TIERKV_HD_INLINE static std::int32_t slot(std::int32_t e) {
    return std::int32_t(std::uint32_t(e) & (max_slots - 1));
  }
};

namespace detail {

struct mirror_args {
  const std::int32_t* rows = nullptr;     // [max_rows][max_pages] block indices
  const std::int32_t* table = nullptr;    // [blocks][layers] packed_page
  const std::int32_t* row_of = nullptr;   // [batch]: the mirror row of batch entry b
  const std::int32_t* pages = nullptr;    // [batch]: its committed logical pages
  const std::int32_t* seq_len = nullptr;  // [batch]: its tokens
  int batch = 0;
  int layers = 0;
  int blocks = 0;
  std::uint8_t* out = nullptr;  // layer l's index buffer at out + l * layer_bytes
  std::size_t layer_bytes = 0;
  std::int32_t* counts = nullptr;  // [layers][batch][formats]
  int* error = nullptr;
};

template <int = 0>  // a template, so a header included by many translation units links once
__global__ void apply_mirror_journal(const std::int32_t* journal, int n, std::int32_t* entries) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) entries[journal[2 * i]] = journal[2 * i + 1];
}

__device__ __forceinline__ std::int32_t mirror_entry(const mirror_args& a, int b, int l, int p,
                                                     int max_pages) {
  const std::int32_t block = a.rows[std::int64_t(a.row_of[b]) * max_pages + p];
  if (block < 0 || block >= a.blocks) return packed_page::none;
  return a.table[std::int64_t(block) * a.layers + l];
}

// grid (batch, layers): pages per format of each (layer, sequence).
template <int N>
__global__ void __launch_bounds__(256) mirror_count(mirror_args a, index_layout<N> layout) {
  __shared__ int count[N];
  const int b = int(blockIdx.x), l = int(blockIdx.y);
  if (threadIdx.x < N) count[threadIdx.x] = 0;
  __syncthreads();
  for (int p = int(threadIdx.x); p < a.pages[b]; p += int(blockDim.x)) {
    const std::int32_t e = mirror_entry(a, b, l, p, layout.max_pages);
    const int f = e < 0 ? N : packed_page::format(e);
    if (f >= N) {
      atomicCAS(a.error, 0, int(errc::out_of_range));
      continue;
    }
    atomicAdd(&count[f], 1);
  }
  __syncthreads();
  if (threadIdx.x < N)
    a.counts[(std::int64_t(l) * a.batch + b) * N + threadIdx.x] = count[threadIdx.x];
}

// grid (layers): indptr of every format (a serial prefix per format over the batch) and seq_len.
template <int N>
__global__ void __launch_bounds__(256) mirror_indptr(mirror_args a, index_layout<N> layout) {
  const int l = int(blockIdx.x);
  std::uint8_t* o = a.out + std::size_t(l) * a.layer_bytes;
  auto* seq_len = reinterpret_cast<std::int32_t*>(o + layout.seq_len_offset());
  for (int b = int(threadIdx.x); b < a.batch; b += int(blockDim.x)) seq_len[b] = a.seq_len[b];
  if (threadIdx.x >= N) return;
  const int f = int(threadIdx.x);
  auto* indptr = reinterpret_cast<std::int32_t*>(o + layout.indptr_offset(f));
  std::int32_t run = 0;
  indptr[0] = 0;
  for (int b = 0; b < a.batch; ++b) {
    run += a.counts[(std::int64_t(l) * a.batch + b) * N + f];
    indptr[b + 1] = run;
  }
}

// grid (batch, layers): each format's pages of the sequence, in logical order, at its CSR
// position (a block scan per format over tiles of 256 pages).
template <int N>
__global__ void __launch_bounds__(256) mirror_scatter(mirror_args a, index_layout<N> layout) {
  using scan = cub::BlockScan<int, 256>;
  __shared__ typename scan::TempStorage temp;
  const int b = int(blockIdx.x), l = int(blockIdx.y);
  std::uint8_t* o = a.out + std::size_t(l) * a.layer_bytes;
  std::int32_t base[N];
#pragma unroll
  for (int f = 0; f < N; ++f)
    base[f] = reinterpret_cast<const std::int32_t*>(o + layout.indptr_offset(f))[b];
  const int pages = a.pages[b];
  for (int tile = 0; tile < pages; tile += 256) {
    const int p = tile + int(threadIdx.x);
    const std::int32_t e = p < pages ? mirror_entry(a, b, l, p, layout.max_pages) : -1;
    const int fmt = e < 0 ? N : packed_page::format(e);
#pragma unroll
    for (int f = 0; f < N; ++f) {
      int rank = 0, total = 0;
      scan(temp).ExclusiveSum(fmt == f ? 1 : 0, rank, total);
      __syncthreads();  // temp is reused by the next format's scan
      if (fmt == f) {
        const std::int32_t at = base[f] + rank;
        reinterpret_cast<std::int32_t*>(o + layout.slot_offset(f))[at] = packed_page::slot(e);
        reinterpret_cast<std::int32_t*>(o + layout.logical_offset(f))[at] = p;
      }
      base[f] += total;
    }
  }
}

}  // namespace detail

/// The mirror of up to `max_rows` sequences of up to `max_pages` logical pages over `blocks`
/// blocks of `layers` pages. Host edits (set_row, set_page) go to the shadow and the journal;
/// build() applies the journal on the device, then writes every layer's index arrays of a
/// batch. One stream at a time; build() waits for its previous upload before reusing the
/// page-locked staging buffer (done long before in a step loop).
template <int NumFormats>
class page_table_mirror {
 public:
  page_table_mirror(const page_table_mirror&) = delete;
  page_table_mirror& operator=(const page_table_mirror&) = delete;
  ~page_table_mirror() { free_all(); }

  /// A mirror with its device arrays, sized for the capacity (see above) and up to `max_batch`
  /// sequences a build.
  static result<std::unique_ptr<page_table_mirror>> create(int max_rows, int max_pages, int blocks,
                                                           int layers, int max_batch) {
    if (max_rows < 1 || max_pages < 1 || blocks < 1 || layers < 1 || max_batch < 1)
      return status::make(errc::invalid_argument, "page_table_mirror: max_rows = ", max_rows,
                          ", max_pages = ", max_pages, ", blocks = ", blocks, ", layers = ", layers,
                          ", max_batch = ", max_batch, " must all be positive");
    const index_layout<NumFormats> layout{max_batch, max_pages};
    if (auto st = layout.validate(); !st) return st;
    std::unique_ptr<page_table_mirror> m(new page_table_mirror());
    m->layout_ = layout;
    m->max_pages_ = max_pages;
    m->layers_ = layers;
    m->blocks_ = blocks;
    m->row_entries_ = std::size_t(max_rows) * std::size_t(max_pages);
    const std::size_t entries = m->row_entries_ + std::size_t(blocks) * std::size_t(layers);
    try {
      m->shadow_.assign(entries, packed_page::none);
      m->journal_.reserve(1024);
    } catch (const std::bad_alloc&) {
      return status::make(errc::capacity_exhausted, "page_table_mirror: ", entries,
                          " shadow entries do not fit in host memory");
    }
    m->layer_bytes_ = layout.bytes();
    TIERKV_CUDA_TRY(cudaMalloc(&m->entries_, entries * sizeof(std::int32_t)));
    TIERKV_CUDA_TRY(cudaMemset(m->entries_, 0xFF, entries * sizeof(std::int32_t)));
    TIERKV_CUDA_TRY(cudaMalloc(&m->index_, m->layer_bytes_ * std::size_t(layers)));
    TIERKV_CUDA_TRY(cudaMemset(m->index_, 0, m->layer_bytes_ * std::size_t(layers)));
    const std::size_t scratch = (3 * std::size_t(max_batch) +
                                 std::size_t(layers) * std::size_t(max_batch) * NumFormats + 4) *
                                sizeof(std::int32_t);
    TIERKV_CUDA_TRY(cudaMalloc(&m->scratch_, scratch));
    TIERKV_CUDA_TRY(cudaMemset(m->scratch_, 0, scratch));
    TIERKV_CUDA_TRY(cudaEventCreateWithFlags(&m->uploaded_, cudaEventDisableTiming));
    if (auto st = m->grow_staging(1024); !st) return st;
    return result<std::unique_ptr<page_table_mirror>>(std::move(m));
  }

  /// The capacity and byte layout of one layer's index arrays.
  const index_layout<NumFormats>& layout() const noexcept { return layout_; }
  /// Layers of every block.
  int layers() const noexcept { return layers_; }
  /// Row `row`'s logical page `logical` is block `block` (host edit, journaled).
  void set_row(int row, int logical, std::int32_t block) {
    put(std::size_t(row) * std::size_t(max_pages_) + std::size_t(logical), block);
  }
  /// Block `block`'s page of layer `layer` is pool slot `slot` of tier `format` (host edit,
  /// journaled).
  void set_page(std::uint32_t block, int layer, int format, std::uint32_t slot) {
    put(row_entries_ + std::size_t(block) * std::size_t(layers_) + std::size_t(layer),
        packed_page::pack(format, slot));
  }
  /// Bytes of the last build()'s upload (journal and batch: metadata only).
  std::size_t last_upload_bytes() const noexcept { return last_upload_; }

  /// Applies the journal and builds the index arrays of every layer for the batch (rows[b]:
  /// the mirror row of entry b, pages[b] its committed logical pages, seq_len[b] its tokens).
  /// Asynchronous on `stream`; error() reads the device check.
  status build(std::span<const std::int32_t> rows, std::span<const std::int32_t> pages,
               std::span<const std::int32_t> seq_len, cudaStream_t stream) {
    const int batch = int(rows.size());
    if (batch > layout_.max_batch)
      return status::exceeds(errc::capacity_exhausted, "page_table_mirror: batch", batch,
                             layout_.max_batch);
    if (pages.size() != rows.size() || seq_len.size() != rows.size())
      return status::make(errc::invalid_argument, "page_table_mirror: ", rows.size(), " rows, ",
                          pages.size(), " page counts and ", seq_len.size(), " lengths");
    for (int b = 0; b < batch; ++b)
      if (pages[b] < 0 || pages[b] > max_pages_)
        return status::out_of_range("page_table_mirror: pages of batch entry", pages[b],
                                    max_pages_ + 1);
    const std::size_t j = journal_.size();
    const std::size_t ints = 2 * j + 3 * std::size_t(batch);
    TIERKV_CUDA_TRY(cudaEventSynchronize(uploaded_));  // the staging buffer is free again
    if (auto st = grow_staging(ints, stream); !st) return st;
    for (std::size_t i = 0; i < j; ++i) {
      staging_[2 * i] = std::int32_t(journal_[i]);
      staging_[2 * i + 1] = shadow_[journal_[i]];
    }
    std::int32_t* hb = staging_ + 2 * j;
    std::memcpy(hb, rows.data(), rows.size_bytes());
    std::memcpy(hb + batch, pages.data(), pages.size_bytes());
    std::memcpy(hb + 2 * batch, seq_len.data(), seq_len.size_bytes());
    last_upload_ = ints * sizeof(std::int32_t);
    if (ints > 0)
      TIERKV_CUDA_TRY(
          cudaMemcpyAsync(d_staging_, staging_, last_upload_, cudaMemcpyHostToDevice, stream));
    TIERKV_CUDA_TRY(cudaEventRecord(uploaded_, stream));
    journal_.clear();
    if (j > 0) {
      detail::apply_mirror_journal<>
          <<<unsigned((j + 255) / 256), 256, 0, stream>>>(d_staging_, int(j), entries_);
      TIERKV_CUDA_TRY(cudaGetLastError());
    }
    batch_ = batch;
    if (batch == 0) return status::ok();
    detail::mirror_args a;
    a.rows = entries_;
    a.table = entries_ + row_entries_;
    a.row_of = d_staging_ + 2 * j;
    a.pages = a.row_of + batch;
    a.seq_len = a.pages + batch;
    a.batch = batch;
    a.layers = layers_;
    a.blocks = blocks_;
    a.out = static_cast<std::uint8_t*>(index_);
    a.layer_bytes = layer_bytes_;
    a.counts = scratch_ + 4;
    a.error = scratch_;
    // The row arrays live in the staging copy, which the next build overwrites only after
    // this one's kernels: they run before the next upload on the same stream.
    TIERKV_CUDA_TRY(cudaMemsetAsync(scratch_, 0, sizeof(int), stream));
    const dim3 grid{unsigned(batch), unsigned(layers_)};
    detail::mirror_count<NumFormats><<<grid, 256, 0, stream>>>(a, layout_);
    detail::mirror_indptr<NumFormats><<<unsigned(layers_), 256, 0, stream>>>(a, layout_);
    detail::mirror_scatter<NumFormats><<<grid, 256, 0, stream>>>(a, layout_);
    return check(cudaGetLastError(), "page_table_mirror: build launch");
  }

  /// Layer l's index arrays of the last build (device memory).
  batch_index_view<NumFormats> view(int layer) const {
    return layout_.view_of(static_cast<std::uint8_t*>(index_) + std::size_t(layer) * layer_bytes_,
                           batch_);
  }
  /// Layer `layer`'s index arrays of the last build as bytes (device memory).
  const void* index_bytes(int layer) const {
    return static_cast<const std::uint8_t*>(index_) + std::size_t(layer) * layer_bytes_;
  }
  /// Bytes of one layer's index arrays.
  std::size_t layer_bytes() const noexcept { return layer_bytes_; }

  /// The device check of the last build (synchronizes `stream`): a row naming no block or a
  /// table entry of no format.
  status error(cudaStream_t stream) const {
    int code = 0;
    TIERKV_CUDA_TRY(cudaMemcpyAsync(&code, scratch_, sizeof(int), cudaMemcpyDeviceToHost, stream));
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));
    if (code != 0)
      return status::make(errc(code),
                          "page_table_mirror: a batch row names a page the mirror does not hold "
                          "(the mirror is out of step with the storage)");
    return status::ok();
  }

 private:
  page_table_mirror() = default;

  void put(std::size_t at, std::int32_t v) {
    if (shadow_[at] == v) return;
    shadow_[at] = v;
    journal_.push_back(std::uint32_t(at));
  }

  status grow_staging(std::size_t ints, cudaStream_t stream = nullptr) {
    if (ints <= staging_ints_) return status::ok();
    const std::size_t n = ints * 2;
    if (staging_ != nullptr) {
      TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));  // the last build's kernels read d_staging_
      cudaFreeHost(staging_);
      cudaFree(d_staging_);
      staging_ = nullptr;
      d_staging_ = nullptr;
    }
    TIERKV_CUDA_TRY(cudaMallocHost(&staging_, n * sizeof(std::int32_t)));
    TIERKV_CUDA_TRY(cudaMalloc(&d_staging_, n * sizeof(std::int32_t)));
    staging_ints_ = n;
    return status::ok();
  }

  void free_all() noexcept {
    if (uploaded_) cudaEventDestroy(uploaded_);
    if (staging_) cudaFreeHost(staging_);
    if (d_staging_) cudaFree(d_staging_);
    if (entries_) cudaFree(entries_);
    if (index_) cudaFree(index_);
    if (scratch_) cudaFree(scratch_);
  }

  index_layout<NumFormats> layout_{};
  int max_pages_ = 0, layers_ = 0, blocks_ = 0, batch_ = 0;
  std::size_t row_entries_ = 0, layer_bytes_ = 0, last_upload_ = 0;
  std::vector<std::int32_t> shadow_;
  std::vector<std::uint32_t> journal_;  // shadow positions changed since the last build
  std::int32_t* entries_ = nullptr;     // device: rows, then table
  void* index_ = nullptr;               // device: every layer's index arrays
  std::int32_t* scratch_ = nullptr;     // device: error word, 3 spare, counts
  std::int32_t* staging_ = nullptr;     // page-locked: journal pairs, then the batch arrays
  std::int32_t* d_staging_ = nullptr;
  std::size_t staging_ints_ = 0;
  cudaEvent_t uploaded_ = nullptr;
};

}  // namespace tierkv::cuda
