// SPDX-License-Identifier: Apache-2.0
// The host tier of a cuda::tiered_cache: whole sequences parked in one pinned host slab in their
// compressed pages (issue 55; docs/gpu-cache.md, "Host tier"). park copies every page of a
// sequence device to host into a range of the slab (the façade then releases the sequence on
// the GPU); unpark builds a NEW sequence of the same pages (build_sequence, the import's
// all-or-nothing path) and copies the bytes back host to device. Each copy is a batch
// (kernel/page_copy.cuh) the host never waits for:
//   - park's is queued on the cache's stream: the released device pages are reused only by
//     work queued later on the stream (appends, forks) or by a retier batch, which waits for
//     the stream first;
//   - unpark's runs on the tier's own copy stream (lowest priority), after the work queued on
//     the cache's stream before it, so later steps of other sequences overlap it (a prefetch).
//     The new sequence's readers wait for it: the façade makes the cache's stream wait (await)
//     before the first work that touches the sequence (a step that includes it, fork, export,
//     offload, prefix insert, release), and a retier batch's stream waits for every restore
//     still running (await_all).
// A slab range is reused only once the copy that reads it has run (an event per range), and the
// copy list a kernel reads lives inside the parked range itself. No page bytes pass through the
// host's caches: no checksum, since the slab is the cache's own memory (page transfers between
// processes keep export_pages' verified format).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/cache/options.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/device_buffer.cuh"
#include "tierkv/cuda/kernel/page_copy.cuh"
#include "tierkv/cuda/retier/async.cuh"
#include "tierkv/memory/range_allocator.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/tiering/conversion.hpp"

namespace tierkv::cuda {

/// A parked sequence's handle (host_tier::park); never reused within a cache.
using parked_id = std::uint64_t;

/// What the host tier holds and has moved.
struct host_tier_stats {
  std::uint64_t capacity_bytes = 0;      ///< the pinned slab (host_pool_bytes, aligned)
  std::uint64_t used_bytes = 0;          ///< ranges of parked sequences and of copies still running
  std::uint64_t largest_free_bytes = 0;  ///< the largest sequence that parks now
  std::uint64_t parked = 0;              ///< sequences parked
  std::uint64_t offloads = 0;            ///< parks since creation
  std::uint64_t restores = 0;            ///< unparks since creation
  std::uint64_t drops = 0;               ///< parked sequences dropped
  std::uint64_t bytes_offloaded = 0;     ///< page bytes copied device to host
  std::uint64_t bytes_restored = 0;      ///< page bytes copied host to device
};

template <class Storage>
class host_tier {
 public:
  /// Ranges start at this alignment (and each page in a range at 16 bytes).
  static constexpr std::uint64_t range_align = 4096;

  /// Allocates the pinned slab (0 bytes: no host tier; park refuses).
  /// A restore launches its copies in chunks of at least `restore_chunk` pages as it builds
  /// the page table (the GPU copies one chunk while the host builds the next).
  status init(std::uint64_t bytes, copy_path path, std::uint32_t restore_chunk) {
    path_ = path;
    chunk_ = restore_chunk;
    ranges_ = range_allocator(bytes, range_align);
    if (ranges_.capacity() == 0) return {};
    if (auto st = slab_.allocate(std::size_t(ranges_.capacity())); !st)
      return status::make(st.code(), "host_pool_bytes = ", bytes, ": ", st.message());
    auto copy = create_side_stream();
    if (!copy) return copy.error_status();
    copy_.adopt(*copy);
    return handoff_.create();
  }
  host_tier() = default;
  host_tier(const host_tier&) = delete;
  host_tier& operator=(const host_tier&) = delete;
  /// Waits for the restore copies still running (they write device pages and read the slab).
  ~host_tier() {
    if (copy_.get() != nullptr) (void)cudaStreamSynchronize(copy_.get());
  }

  /// Copies every page of s (its open tail page whole) into a new range, queued on `stream`
  /// after everything queued there before; returns its handle and counts the page bytes in
  /// `counters`. The caller releases s on the GPU after this succeeds. A refusal (the slab
  /// short: capacity_exhausted naming the bytes needed and free) or a failed launch changes
  /// nothing (`faults` may fail the launch: tiering/conversion.hpp's transfer_fault_hook).
  template <class Faults>
  result<parked_id> park(const Storage& st, seq_id s, cudaStream_t stream,
                         transfer_counters& counters, Faults& faults) {
    reclaim();
    auto pages = st.logical_pages(s);
    if (!pages) return pages.error_status();
    auto len = st.length(s);
    if (!len) return len.error_status();
    const int L = st.num_layers();
    const auto views = st.views();
    parked p;
    p.length = *len;
    p.logical_pages = std::uint32_t(*pages);
    const std::size_t n = std::size_t(*pages) * std::size_t(L);
    std::vector<page_id> ids(n);  // [logical page][layer], one walk of the page table
    p.tier.resize(n);
    p.at.resize(n);
    std::uint64_t bytes = std::max<std::uint64_t>(list_bytes(n), 16);  // an empty sequence too
    for (std::size_t k = 0; k < n; ++k) {
      ids[k] = *st.page(s, int(k % std::size_t(L)), std::int64_t(k / std::size_t(L)));
      p.tier[k] = std::uint8_t(ids[k].format);
      p.at[k] = bytes;
      bytes += round16(views[ids[k].format].page_bytes);
    }
    if (ranges_.capacity() == 0)
      return status(errc::capacity_exhausted,
                    "offload: the cache has no host tier (host_pool_bytes = 0); nothing moved");
    auto at = ranges_.allocate(bytes);
    if (!at)
      return status::make(errc::capacity_exhausted, "offload: ", s, " needs ", bytes,
                          " bytes of the host pool (", p.logical_pages, " logical pages x ", L,
                          " layers); ", at.error_status().message(), "; nothing moved");
    p.offset = *at;
    std::uint8_t* base = slab_.get() + p.offset;
    page_copy* list = reinterpret_cast<page_copy*>(base);
    std::uint64_t moved = 0;
    for (std::size_t k = 0; k < n; ++k) {
      const pool_view& v = views[ids[k].format];
      list[k] = {v.page(ids[k].slot), base + p.at[k], v.page_bytes};
      moved += v.page_bytes;
    }
    status queued = inject(faults, transfer_step::offload_copy, 0);
    if (queued) queued = copy_pages(std::span<const page_copy>(list, n), path_, stream);
    if (queued) queued = p.written.create();
    if (queued)
      queued = check(cudaEventRecord(p.written.get(), stream), "offload: cudaEventRecord");
    if (!queued) {
      // A launch that failed queued nothing; a record that failed leaves a copy that may run:
      // wait for the stream before the range can be reused.
      (void)cudaStreamSynchronize(stream);
      (void)ranges_.free(p.offset);
      return status::make(queued.code(), "offload: ", queued.message(), "; nothing moved");
    }
    const parked_id id = next_id_++;
    parked_.emplace(id, std::move(p));
    ++stats_.offloads;
    stats_.bytes_offloaded += moved;
    counters.page_bytes += moved;
    return id;
  }

  /// What a restore of `id` needs from the storage (check_import_capacity): a block per logical
  /// page and, per tier, its pages of that tier.
  result<import_need> need(parked_id id) const {
    auto it = parked_.find(id);
    if (it == parked_.end()) return unknown(id, "restore");
    const parked& p = it->second;
    import_need n;
    n.blocks = p.logical_pages;
    n.pages_per_tier.assign(Storage::num_tiers, 0);
    for (const std::uint8_t t : p.tier) ++n.pages_per_tier[t];
    return n;
  }

  /// A NEW sequence holding parked `id`'s pages, byte for byte, copied host to device on the
  /// copy stream after the work queued on `stream` so far (the page bytes counted in
  /// `counters`); the handle is consumed and its range freed once the copy has run. Work on the
  /// new sequence waits for the copy through await / await_all. The caller has checked the capacity
  /// (need); any failure (a chunk's launch included, which `faults` may fail) releases the new
  /// sequence and leaves `id` parked.
  template <class Faults>
  result<seq_id> unpark(Storage& st, parked_id id, cudaStream_t stream, transfer_counters& counters,
                        Faults& faults) {
    reclaim();
    auto it = parked_.find(id);
    if (it == parked_.end()) return unknown(id, "restore");
    parked& p = it->second;
    // The copy list is rewritten in the range: the offload's copy, which read the old list,
    // must have run (it has, unless the restore follows the offload at once).
    TIERKV_CUDA_TRY(cudaEventSynchronize(p.written.get()));
    const std::uint32_t L = std::uint32_t(st.num_layers());
    const auto views = st.views();
    std::uint8_t* base = slab_.get() + p.offset;
    page_copy* list = reinterpret_cast<page_copy*>(base);
    // The copies go out in chunks as the page table is built, so the GPU copies one chunk
    // while the host builds the next (bench/results/host-tier/: the table of 131072 pages took
    // as long as their copy).
    std::size_t n = 0, launched = 0;
    std::uint64_t moved = 0, chunks = 0;
    status queued;
    // Each chunk's copy starts after the work queued on `stream` so far: a released sequence's
    // last decode may still read the new pages, and allocating them may have queued fills
    // (TIERKV_POISON_PAGES) there.
    const auto after_stream = [&] {
      status st = check(cudaEventRecord(handoff_.get(), stream), "restore: cudaEventRecord");
      if (st)
        st = check(cudaStreamWaitEvent(copy_.get(), handoff_.get(), 0),
                   "restore: cudaStreamWaitEvent");
      return st;
    };
    const auto flush = [&] {
      if (queued && n > launched) {
        queued = inject(faults, transfer_step::restore_copy, chunks++);
        if (queued) queued = after_stream();
        if (queued)
          queued = copy_pages(std::span<const page_copy>(list + launched, n - launched), path_,
                              copy_.get());
        if (queued) launched = n;
      }
    };
    const auto last_fill = p.length - std::int64_t(p.logical_pages - 1) * Storage::page_tokens;
    auto seq = tierkv::detail::build_sequence(
        st, p.logical_pages, L, "restore",
        [&](std::uint32_t j, std::uint32_t l) {
          if (l == 0 && n - launched >= chunk_) flush();
          const std::size_t k = std::size_t(j) * L + l;
          tierkv::detail::page_record r;
          r.tier = p.tier[k];
          r.fill = j + 1 < p.logical_pages ? Storage::page_tokens : last_fill;
          r.src = base + p.at[k];
          r.bytes = views[r.tier].page_bytes;
          return r;
        },
        [&](page_id to, const tierkv::detail::page_record& r) {
          if (!queued) return queued;  // a chunk's launch failed: roll back
          list[n++] = {r.src, views[to.format].page(to.slot), r.bytes};
          moved += r.bytes;
          return status{};
        });
    if (seq) flush();
    cuda_event done;
    if (seq && queued) queued = done.create();
    if (seq && queued)
      queued = check(cudaEventRecord(done.get(), copy_.get()), "restore: cudaEventRecord");
    if (!seq || !queued) {
      // Chunks already queued read this range's list and write pages the rollback frees: they
      // run before the list is rewritten or a page reused.
      if (launched > 0) (void)cudaStreamSynchronize(copy_.get());
      if (seq) (void)st.release(*seq);
      if (queued) return seq;  // build_sequence refused (its own message)
      return status::make(queued.code(), "restore: ", queued.message(),
                          "; the sequence stays parked");
    }
    pending_.push_back({std::move(done), p.offset, *seq});
    parked_.erase(it);
    ++stats_.restores;
    stats_.bytes_restored += moved;
    counters.page_bytes += moved;
    return seq;
  }

  /// Makes `stream` wait for s's restore copy if it may still be running; from then on work
  /// queued on `stream` is ordered after it (so it is not waited for again).
  status await(seq_id s, cudaStream_t stream) {
    if (pending* p = gate_of(s)) {
      TIERKV_CUDA_TRY(cudaStreamWaitEvent(stream, p->done.get(), 0));
      p->reader.reset();
    }
    return {};
  }
  /// Makes `stream` (a retier batch's, which may read any page) wait for every restore copy
  /// that may still be running.
  status await_all(cudaStream_t stream) {
    reclaim();
    for (const pending& p : pending_)
      if (p.reader) TIERKV_CUDA_TRY(cudaStreamWaitEvent(stream, p.done.get(), 0));
    return {};
  }
  /// Whether s's restore copy may still be running (false once it has run, or once the
  /// cache's stream was made to wait for it).
  bool restoring(seq_id s) {
    reclaim();
    return gate_of(s) != nullptr;
  }

  /// Forgets parked `id`; its range is reused once its offload copy has run.
  status drop(parked_id id) {
    auto it = parked_.find(id);
    if (it == parked_.end()) return unknown(id, "drop_parked");
    pending_.push_back({std::move(it->second.written), it->second.offset, std::nullopt});
    parked_.erase(it);
    ++stats_.drops;
    reclaim();
    return {};
  }

  /// Tokens of parked `id`.
  result<std::int64_t> length(parked_id id) const {
    auto it = parked_.find(id);
    if (it == parked_.end()) return unknown(id, "parked_length");
    return it->second.length;
  }
  /// Sequences parked.
  std::size_t parked_count() const noexcept { return parked_.size(); }

  /// The tier's figures (frees the ranges whose copies have run first).
  host_tier_stats stats() {
    reclaim();
    host_tier_stats s = stats_;
    s.capacity_bytes = ranges_.capacity();
    s.used_bytes = ranges_.used();
    s.largest_free_bytes = ranges_.largest_free();
    s.parked = parked_.size();
    return s;
  }

 private:
  struct parked {
    std::uint64_t offset = 0;  // its range of the slab
    std::int64_t length = 0;   // tokens
    std::uint32_t logical_pages = 0;
    std::vector<std::uint8_t> tier;  // [logical page][layer]
    std::vector<std::uint64_t> at;   // each page's offset in the range
    cuda_event written;              // the offload copy has run
  };
  struct pending {
    cuda_event done;  // the copy reading or writing the range has run
    std::uint64_t offset = 0;
    std::optional<seq_id> reader;  // a restore's new sequence, until its readers wait for `done`
  };
  pending* gate_of(seq_id s) {
    for (pending& p : pending_)
      if (p.reader == s) return &p;
    return nullptr;
  }

  static std::uint64_t round16(std::uint64_t b) { return (b + 15) / 16 * 16; }
  // The copy list at the start of a range: n entries, rounded to 16 bytes.
  static std::uint64_t list_bytes(std::size_t n) { return round16(n * sizeof(page_copy)); }
  template <class Faults>
  static status inject(Faults& faults, transfer_step s, std::uint64_t index) {
    if constexpr (transfer_fault_hook<Faults>) {
      if (const errc e = faults(s, index); e != errc::ok)
        return status::make(e, "fault injected before ", to_string(s), " ", index);
    }
    return {};
  }
  static status unknown(parked_id id, const char* what) {
    return status::make(errc::stale_id, what, ": parked sequence ", id,
                        " is not parked (never, or already restored or dropped)");
  }
  // Frees the ranges whose copies have run (a range whose copy faulted stays taken).
  void reclaim() {
    std::size_t keep = 0;
    for (std::size_t i = 0; i < pending_.size(); ++i) {
      const auto done = detail::event_done(pending_[i].done.get(), "host tier: cudaEventQuery");
      if (done && *done) {
        (void)ranges_.free(pending_[i].offset);
        continue;
      }
      if (keep != i) pending_[keep] = std::move(pending_[i]);
      ++keep;
    }
    pending_.resize(keep);
  }

  copy_path path_ = copy_path::kernel;
  owned_stream copy_;   // restore copies (lowest priority: decode blocks go first)
  cuda_event handoff_;  // the cache's stream so far, for the copy stream to wait on
  std::size_t chunk_ = 8192;
  pinned_buffer<std::uint8_t> slab_;
  range_allocator ranges_;
  std::map<parked_id, parked> parked_;
  std::vector<pending> pending_;
  parked_id next_id_ = 1;
  host_tier_stats stats_;
};

}  // namespace tierkv::cuda
