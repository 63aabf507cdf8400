// SPDX-License-Identifier: Apache-2.0
// How a cuda::tiered_cache drives its retier_driver (retier/driver.cuh): the side stream the
// conversions run on, the batch a step enqueues from the controller's plan, publishing a
// completed batch into the page-table mirror, and demotions under memory pressure (make_room:
// staged through the driver, blocking). It keeps the retier totals and the conversion fault
// hook.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/cache/options.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/device_buffer.cuh"
#include "tierkv/cuda/retier/async.cuh"
#include "tierkv/cuda/retier/driver.cuh"
#include "tierkv/tiering/tier_controller.hpp"

namespace tierkv::cuda::detail {

// Storage: the paged storage; Controller: its tier controller; Index: the step_index whose
// mirror shows the published pages; Faults: the conversion fault hook.
template <class Storage, class Controller, class Index, class Faults>
class retier_loop {
 public:
  using driver_type = retier_driver<Storage>;

  // The side stream, then the driver of up to `max_batch_pages` conversions a batch.
  status create(Storage& storage, Controller& controller, Index& index, transfer_counters& counters,
                int max_batch_pages) {
    storage_ = &storage;
    controller_ = &controller;
    index_ = &index;
    counters_ = &counters;
    max_batch_pages_ = max_batch_pages;
    auto side = create_side_stream();
    if (!side) return side.error_status();
    side_.adopt(*side);
    auto d = driver_type::create(storage, max_batch_pages, side_.get());
    if (!d) return d.error_status();
    driver_ = std::move(*d);
    return {};
  }
  // Before the cache goes (`stream` synchronized): publishes or drops what is in flight and
  // gives held pages back.
  void shutdown(cudaStream_t stream) {
    if (!driver_) return;
    if (side_.get()) (void)cudaStreamSynchronize(side_.get());
    retier_stats st;
    (void)driver_->try_publish(*controller_, st);
    (void)driver_->mark_decodes_enqueued(stream);
    (void)cudaStreamSynchronize(stream);
    (void)driver_->reclaim();
  }

  // Publishes a completed batch (wait: waits for it) and mirrors its pages; marks the decodes
  // enqueued on `stream` so far as the last readers of the replaced pages; gives those back
  // once idle (wait: waits for the stream).
  status collect(bool wait, cudaStream_t stream) {
    if (wait && driver_->batch_in_flight()) TIERKV_CUDA_TRY(cudaStreamSynchronize(side_.get()));
    auto published = driver_->try_publish(*controller_, last_batch_, faults_);
    if (!published) return published.error_status();
    if (*published) {
      counters_->d2h_metadata_bytes += sizeof(int);
      for (const staged_conversion& sc : driver_->last_committed()) {
        if (!storage_->check_block(sc.block)) continue;
        index_->mirror_page(*storage_, sc.block, sc.layer);
      }
      if (auto st = driver_->mark_decodes_enqueued(stream); !st) return st;
    }
    if (wait && driver_->pages_held() > 0) TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));
    auto back = driver_->reclaim();
    if (!back) return back.error_status();
    return {};
  }

  // A step's batch: the first max_batch_pages conversions of `todo` on the side stream, after
  // `stream`'s work so far.
  status enqueue(std::span<const conversion> todo, cudaStream_t stream, retier_stats& st) {
    const std::size_t n = std::min(todo.size(), std::size_t(max_batch_pages_));
    auto queued = driver_->enqueue(*controller_, todo.first(n), stream, st, faults_);
    if (!queued) return queued.error_status();
    if (*queued > 0) counters_->h2d_metadata_bytes += driver_->list_bytes();
    return {};
  }

  // Frees tier-0 pages until `pages` are free, demoting on the GPU and waiting for it. Each
  // batch is published whole or not at all (pressure_plan refuses what demotions cannot free
  // before anything changes), so a refusal changes nothing, the totals included, as long as
  // the need fits one batch (max_batch_pages; a larger one keeps its earlier batches).
  status make_room(std::uint32_t pages, cudaStream_t stream) {
    if (storage_->free_pages(0) >= pages) return {};
    if (auto st = collect(true, stream); !st) return st;
    fold_last_batch();  // the end_step batch just published, before this call's own
    while (storage_->free_pages(0) < pages) {
      auto todo = controller_->pressure_plan(pages);
      if (!todo) return todo.error_status();
      if (todo->empty()) break;
      const std::size_t n = std::min(todo->size(), std::size_t(max_batch_pages_));
      retier_stats st;
      auto queued = driver_->enqueue(*controller_, todo->first(n), stream, st, faults_,
                                     /*all_or_none=*/true);
      if (!queued) return queued.error_status();
      if (*queued == 0) break;
      counters_->h2d_metadata_bytes += driver_->list_bytes();
      if (auto c = collect(true, stream); !c) return c;
      st.add(std::exchange(last_batch_, retier_stats{}));
      st.pressure_demoted += st.demoted;
      totals_.add(st);
    }
    if (storage_->free_pages(0) >= pages) return {};
    return status::make(errc::capacity_exhausted, "make_room: tier 0 still has ",
                        storage_->free_pages(0), " free pages of ", pages, " needed");
  }

  // A step's stats: `st` (its enqueue) plus what the last publication committed, added to the
  // totals.
  retier_stats finish_step(retier_stats st) {
    st.add(std::exchange(last_batch_, retier_stats{}));
    totals_.add(st);
    return st;
  }
  // What the last publication committed, added to the totals.
  void fold_last_batch() { totals_.add(std::exchange(last_batch_, retier_stats{})); }

  // Pages the driver holds: a batch in flight, replaced pages not yet back.
  std::uint32_t pages_outstanding() const {
    return std::uint32_t(driver_->pages_held() + driver_->pages_in_flight());
  }
  const retier_stats& totals() const noexcept { return totals_; }
  Faults& faults() noexcept { return faults_; }
  cudaStream_t side_stream() const noexcept { return side_.get(); }

 private:
  Storage* storage_ = nullptr;
  Controller* controller_ = nullptr;
  Index* index_ = nullptr;
  transfer_counters* counters_ = nullptr;
  int max_batch_pages_ = 0;
  owned_stream side_;  // destroyed after the driver, which waits on it
  std::unique_ptr<driver_type> driver_;
  [[no_unique_address]] Faults faults_{};
  retier_stats last_batch_;  // what try_publish committed, folded into the next step's stats
  retier_stats totals_;
};

}  // namespace tierkv::cuda::detail
