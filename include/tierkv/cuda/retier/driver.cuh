// SPDX-License-Identifier: Apache-2.0
// The driver of asynchronous retiering on the GPU: a tier controller's conversions of one
// step are reserved on the host, filled by one cuda::retier launch per (from, to) tier pair
// on a side stream (after the sources are immutable on the main stream), published only once
// that batch has completed without a device error, and the replaced pages' slots go back to
// their pools only once the decodes that could still read them have completed. It runs the
// protocol of retier/async.cuh for a paged_storage whose pools the GPU can address (device
// memory, or page-locked host memory through unified addressing).
//
// Per scheduler step, in this order (one batch in flight at a time):
//   reclaim();                         // old slots of the previous batch whose decodes are done
//   try_publish(ctl, stats);           // publish the previous batch if it has completed
//   ... build index arrays, enqueue appends ...
//   enqueue(ctl, plan, main, stats);   // reserve + launch this step's batch on the side stream
//   ... enqueue this step's decodes on main (they read the old, still published pages) ...
//   mark_decodes_enqueued(main);       // after the last decode whose index arrays predate
//   publication
// Each page of a batch has its own device error code: a page that fails (a non-finite source
// vector, a bad slot) is not published (its old page stays published at its old id and tier,
// its reserved page goes back), and the rest of the batch is published, so one bad page never
// holds other pages' conversions back. A page whose fill found non-finite data is quarantined
// (tier_controller::quarantine: never planned again, counted once in retier_stats::quarantined).
// A batch enqueued all_or_none (memory pressure: a refused step must change nothing) is
// published whole or not at all (its non-finite pages are still quarantined, so the next
// make_room picks others). A conversion_fault_hook sees every conversion at reserve (stage),
// fill (a failing fill fails that page as a device error does) and publish.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/retier/async.cuh"
#include "tierkv/cuda/retier/retier.cuh"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace tierkv::cuda {

/// Drives asynchronous retiering of a paged_storage `Storage` on the GPU, one batch per
/// step (see above).
template <class Storage>
class retier_driver {
  static constexpr int N = Storage::num_tiers;
  using G = typename Storage::geometry;

 public:
  retier_driver(const retier_driver&) = delete;
  retier_driver& operator=(const retier_driver&) = delete;
  // Waits for a batch still on the side stream before freeing its lists. Pages of a batch that
  // was never published stay reserved in the storage, and held pages stay held: publish and
  // reclaim before destroying the driver.
  ~retier_driver() {
    if (in_flight_ > 0 && side_) (void)cudaStreamSynchronize(side_);
    free_buffers();
  }

  /// A driver for `storage` converting up to `max_batch_pages` pages per step on `side`
  /// (create_side_stream(): non-blocking, lowest priority).
  static result<std::unique_ptr<retier_driver>> create(Storage& storage, int max_batch_pages,
                                                       cudaStream_t side) {
    if (max_batch_pages < 1)
      return status::make(errc::invalid_argument,
                          "retier_driver: max_batch_pages = ", max_batch_pages,
                          " must be at least 1");
    std::unique_ptr<retier_driver> p(new retier_driver(storage, max_batch_pages, side));
    retier_driver& d = *p;
    auto ev = retier_async_events::create();
    if (!ev) return ev.error_status();
    d.ev_ = std::move(*ev);
    const std::size_t n = std::size_t(max_batch_pages);
    TIERKV_CUDA_TRY(cudaEventCreateWithFlags(&d.done_, cudaEventDisableTiming));
    TIERKV_CUDA_TRY(cudaMallocHost(&d.h_lists_, lists * n * sizeof(std::int32_t)));
    TIERKV_CUDA_TRY(cudaMalloc(&d.d_lists_, lists * n * sizeof(std::int32_t)));
    d.staged_.resize(n);
    d.filled_.reset(new bool[n]);
    d.retained_.reserve(n);
    d.old_.reserve(n);
    return result<std::unique_ptr<retier_driver>>(std::move(p));
  }

  /// Whether a batch is reserved and launched but not yet published.
  bool batch_in_flight() const noexcept { return in_flight_ > 0; }
  /// Target pages reserved by the batch in flight (allocated, not yet published).
  std::size_t pages_in_flight() const noexcept { return in_flight_; }
  /// Bytes of the lists a batch copies to the device (slots, layers, fault codes).
  std::size_t list_bytes() const noexcept {
    return lists * std::size_t(max_) * sizeof(std::int32_t);
  }
  /// Pages replaced but not yet back in their pools (their decodes may still run).
  std::size_t pages_held() const noexcept { return old_.size(); }
  /// The conversions of the last batch try_publish committed (published or given back: read
  /// the block's page to tell), until the next enqueue. Mirrors of the page table (the GPU
  /// façade's) update these (block, layer) entries.
  std::span<const staged_conversion> last_committed() const noexcept {
    return {staged_.data(), committed_};
  }

  /// Reserves the target pages of `plan` (through ctl.stage), and enqueues their fill: the side
  /// stream waits until this point of `main` (the sources are immutable from here on), then one
  /// retier launch per tier pair. Returns the number of staged conversions (0: nothing to do,
  /// or a batch or its old pages are still in flight -- call reclaim / try_publish first).
  /// all_or_none: the batch is published whole or not at all (try_publish), and a plan that
  /// does not stage whole is refused here with every reserved page given back.
  template <class Controller, conversion_fault_hook Faults = no_faults>
  result<std::size_t> enqueue(Controller& ctl, std::span<const conversion> plan, cudaStream_t main,
                              retier_stats& stats, Faults&& faults = {}, bool all_or_none = false) {
    if (in_flight_ > 0 || !old_.empty() || plan.empty()) return std::size_t(0);
    committed_ = 0;
    retier_stats staging;
    const std::size_t n = ctl.stage(plan, std::span<staged_conversion>(staged_), staging, faults);
    if (all_or_none && n < plan.size()) {
      ctl.abandon(std::span<staged_conversion>(staged_.data(), n));
      if (!staging.first_error.is_ok())
        return status::make(staging.first_error.code(), staging.first_error.message(),
                            "; nothing was converted");
      return status::make(errc::capacity_exhausted, "retier_driver: ", n, " of ", plan.size(),
                          " conversions could be staged; nothing was converted");
    }
    stats.add(staging);
    all_or_none_ = all_or_none;
    if (n == 0) return std::size_t(0);
    // Group by (from, to) so each pair is one contiguous launch.
    std::stable_sort(staged_.begin(), staged_.begin() + std::ptrdiff_t(n),
                     [](const auto& a, const auto& b) {
                       return std::pair(int(a.from.format), int(a.to.format)) <
                              std::pair(int(b.from.format), int(b.to.format));
                     });
    const std::size_t cap = std::size_t(max_);
    std::int32_t* hs = h_lists_;
    std::int32_t* hd = h_lists_ + cap;
    std::int32_t* hl = h_lists_ + 2 * cap;
    for (std::size_t i = 0; i < n; ++i) {
      hs[i] = std::int32_t(staged_[i].from.slot);
      hd[i] = std::int32_t(staged_[i].to.slot);
      hl[i] = staged_[i].layer;
    }
    std::int32_t* he = h_lists_ + 3 * cap;  // set before the kernels' atomicCAS, which keeps it
    for (std::size_t i = 0; i < n; ++i)
      he[i] = std::int32_t(faults(conversion_step::fill, staged_[i].block, staged_[i].layer));
    status st = launch(n, main);
    if (!st) {
      // Nothing was published; the stream may hold part of the batch: let it finish before
      // the reserved pages go back, then abort them all.
      (void)cudaStreamSynchronize(side_);
      for (std::size_t i = 0; i < n; ++i) filled_[i] = false;
      ctl.commit(std::span<staged_conversion>(staged_.data(), n),
                 std::span<const bool>(filled_.get(), n), stats);
      return st;
    }
    in_flight_ = n;
    return n;
  }

  /// Publishes the batch in flight once it has completed (non-blocking: false while it runs).
  /// The replaced pages are held (retain_page) until mark_decodes_enqueued's event completes.
  /// Pages that failed on the device are given back (their old pages stay published), the
  /// non-finite ones quarantined, and the first failure goes to stats.first_error. A batch
  /// enqueued all_or_none that cannot be published whole returns the failure, nothing
  /// published and `stats` untouched but for the pages it quarantined.
  template <class Controller, conversion_fault_hook Faults = no_faults>
  result<bool> try_publish(Controller& ctl, retier_stats& stats, Faults&& faults = {}) {
    if (in_flight_ == 0) return false;
    auto done = detail::event_done(done_, "retier_driver: cudaEventQuery");
    if (!done) return done.error_status();
    if (!*done) return false;
    const std::size_t n = in_flight_;
    in_flight_ = 0;
    committed_ = n;
    const std::int32_t* he = h_lists_ + 3 * std::size_t(max_);
    std::size_t bad = 0, first_bad = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (he[i] != 0 && bad++ == 0) first_bad = i;
    retained_.clear();
    for (std::size_t i = 0; i < n; ++i) {
      filled_[i] = he[i] == 0 && (!all_or_none_ || bad == 0) &&
                   storage_->retain_page(staged_[i].from).is_ok();
      retained_.push_back(filled_[i] ? staged_[i].from : page_id{});
      if (static_cast<errc>(he[i]) == errc::non_finite_input)
        ctl.quarantine(staged_[i].block, staged_[i].layer, stats);
    }
    const std::span<staged_conversion> batch(staged_.data(), n);
    const std::span<const bool> filled(filled_.get(), n);
    status failed;
    if (bad > 0) {
      const staged_conversion& b = staged_[first_bad];
      const auto e = static_cast<errc>(he[first_bad]);
      failed = status::make(
          e, "retier_driver: ", bad, " of ", n, " pages failed on the device (", to_string(e),
          "; the first: block ", b.block.index, " layer ", b.layer, ")",
          e == errc::non_finite_input ? ", quarantined" : "",
          all_or_none_ ? "; nothing was published" : "; their old pages stay published");
    }
    if (all_or_none_) {
      if (failed.is_ok()) {
        retier_stats st;
        failed = ctl.commit_all(batch, filled, st, faults);
        if (failed.is_ok()) stats.add(st);
      } else {
        ctl.abandon(batch);
      }
    } else {
      if (!failed.is_ok()) stats.first_error = failed;
      ctl.commit(batch, filled, stats, faults);
    }
    for (const page_id p : retained_) {
      if (!p.valid()) continue;
      if (storage_->page_published(p))
        (void)storage_->release_page(p);  // its publish failed: drop the extra reference only
      else
        old_.push_back(p);
    }
    if (all_or_none_ && !failed.is_ok()) return failed;
    return true;
  }

  /// Records, on `main`, the point after which no enqueued decode can read the replaced pages.
  status mark_decodes_enqueued(cudaStream_t main) {
    if (old_.empty()) return {};
    marked_ = true;
    return mark_old_pages_last_read(ev_, main);
  }

  /// Gives the replaced pages back to their pools once their decodes have completed
  /// (non-blocking). Returns how many went back.
  result<std::size_t> reclaim() {
    if (old_.empty() || !marked_) return std::size_t(0);
    auto idle = old_pages_idle(ev_);
    if (!idle) return idle.error_status();
    if (!*idle) return std::size_t(0);
    const std::size_t n = old_.size();
    for (const page_id p : old_) (void)storage_->release_page(p);
    old_.clear();
    marked_ = false;
    return n;
  }

 private:
  retier_driver(Storage& s, int max_batch_pages, cudaStream_t side)
      : storage_(&s), max_(max_batch_pages), side_(side) {}

  status launch(std::size_t n, cudaStream_t main) {
    const std::size_t cap = std::size_t(max_);
    TIERKV_CUDA_TRY(cudaMemcpyAsync(d_lists_, h_lists_, lists * cap * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, side_));
    if (auto st = mark_sources_ready(ev_, main); !st) return st;
    const auto views = storage_->views();
    std::size_t i = 0;
    while (i < n) {
      const int from = int(staged_[i].from.format), to = int(staged_[i].to.format);
      std::size_t j = i;
      while (j < n && int(staged_[j].from.format) == from && int(staged_[j].to.format) == to) ++j;
      retier_inputs in;
      in.src = views[std::size_t(from)];
      in.dst = views[std::size_t(to)];
      in.src_slot = d_lists_ + i;
      in.dst_slot = d_lists_ + cap + i;
      in.layer_of = d_lists_ + 2 * cap + i;
      in.pages = int(j - i);
      in.cache_seed = storage_->config().codec_seed;
      in.head_base = storage_->config().head_base;
      in.page_error = d_lists_ + 3 * cap + i;
      status st;
      tierkv::detail::with_index<N>(from, [&](auto F) {
        tierkv::detail::with_index<N>(to, [&](auto T) {
          using tl = typename Storage::tier_list;
          if constexpr (F.value != T.value)
            st = enqueue_retier_async<G, tier_at_t<tl, F.value>, tier_at_t<tl, T.value>>(in, ev_,
                                                                                         side_);
        });
      });
      if (!st) return st;
      i = j;
    }
    TIERKV_CUDA_TRY(cudaMemcpyAsync(h_lists_ + 3 * cap, d_lists_ + 3 * cap,
                                    n * sizeof(std::int32_t), cudaMemcpyDeviceToHost, side_));
    return check(cudaEventRecord(done_, side_), "retier_driver: cudaEventRecord");
  }

  void free_buffers() noexcept {
    if (done_) cudaEventDestroy(done_);
    if (h_lists_) cudaFreeHost(h_lists_);
    if (d_lists_) cudaFree(d_lists_);
    done_ = nullptr;
    h_lists_ = nullptr;
    d_lists_ = nullptr;
  }

  Storage* storage_ = nullptr;
  int max_ = 0;
  cudaStream_t side_ = nullptr;
  retier_async_events ev_;
  cudaEvent_t done_ = nullptr;  // the batch and its error flag copy have completed
  // pinned: src slots, dst slots, layers, each page's errc (the fault hook's on the way in, the
  // device's on the way back) [max_ each]
  static constexpr std::size_t lists = 4;
  std::int32_t* h_lists_ = nullptr;
  std::int32_t* d_lists_ = nullptr;  // their device copy
  std::vector<staged_conversion> staged_;
  std::unique_ptr<bool[]> filled_;
  std::vector<page_id> retained_;
  std::vector<page_id> old_;  // replaced pages held until their decodes completed
  std::size_t in_flight_ = 0;
  std::size_t committed_ = 0;  // conversions of the last committed batch (last_committed)
  bool marked_ = false;
  bool all_or_none_ = false;  // the batch in flight is published whole or not at all
};

}  // namespace tierkv::cuda
