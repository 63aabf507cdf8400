// SPDX-License-Identifier: Apache-2.0
// Asynchronous retiering: one batch of page conversions (cuda::retier) per step on a side
// stream, ordered against decode on the main stream with events, so that decode never reads a
// page being written and never waits for a conversion.
//
// Protocol, per step (host thread of the scheduler; `ev` = one retier_async_events per batch
// in flight):
//  1. Host: reserve the destination pages (unpublished: no index array names them).
//  2. mark_sources_ready(ev, main): records ev.sources_ready on the main stream at the point
//     after which the source pages are immutable (after the append that sealed them; before
//     this step's decode, so that decode and conversion overlap: both only READ the sources).
//  3. Enqueue this step's decode on the main stream (it reads the old, published pages).
//  4. enqueue_retier_async<G, From, To>(in, ev, side): the side stream waits for
//     sources_ready, runs the batch, records ev.converted. The side stream should be created
//     with create_side_stream (non-blocking, lowest priority) so decode blocks go first.
//  5. Host: publish the destination pages in the page table only once conversion_complete(ev)
//     is true (cudaEventQuery, or wait_converted to block); index arrays built after that
//     name the new pages. Until then the old pages stay published: nothing is lost if the
//     batch fails (read the retier error flag before publishing).
//  6. mark_old_pages_last_read(ev, main) right after enqueuing the last decode whose index
//     arrays can still name the old pages (the decode of step 3, or a later one built before
//     publication); the old slots go back to their pool's free list only once
//     old_pages_idle(ev) is true: until then a new page written into such a slot could be
//     read by a decode still in flight.
// Dst pages are never read by decode before publication, and src pages are only read by
// both streams, so the decode outputs with a concurrent batch equal those without it bit for
// bit (measured: bench/cuda/retier_overlap.cu, docs/tiering.md).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <utility>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/retier/retier.cuh"

namespace tierkv::cuda {

/// The three events of one batch in flight (timing disabled: they only order and signal).
class retier_async_events {
 public:
  retier_async_events() = default;
  retier_async_events(const retier_async_events&) = delete;
  retier_async_events& operator=(const retier_async_events&) = delete;
  /// Moves the events of o (o is left empty).
  retier_async_events(retier_async_events&& o) noexcept { swap(o); }
  /// Moves the events of o; the events held before are destroyed.
  retier_async_events& operator=(retier_async_events&& o) noexcept {
    retier_async_events t(std::move(o));
    swap(t);
    return *this;
  }
  ~retier_async_events() { release(); }

  /// Creates the three events.
  static result<retier_async_events> create() {
    retier_async_events e;
    for (cudaEvent_t* p : {&e.sources_ready_, &e.converted_, &e.old_pages_idle_}) {
      status s = check(cudaEventCreateWithFlags(p, cudaEventDisableTiming),
                       "retier_async_events: cudaEventCreate");
      if (!s.is_ok()) return s;
    }
    return result<retier_async_events>(std::move(e));
  }

  /// Recorded on the main stream once the source pages are immutable (step 2).
  cudaEvent_t sources_ready() const { return sources_ready_; }
  /// Recorded on the side stream once the batch is converted (step 4).
  cudaEvent_t converted() const { return converted_; }
  /// Recorded on the main stream after the last decode that may read the old pages (step 6).
  cudaEvent_t old_pages_idle() const { return old_pages_idle_; }

 private:
  void swap(retier_async_events& o) noexcept {
    std::swap(sources_ready_, o.sources_ready_);
    std::swap(converted_, o.converted_);
    std::swap(old_pages_idle_, o.old_pages_idle_);
  }
  void release() noexcept {
    for (cudaEvent_t e : {sources_ready_, converted_, old_pages_idle_})
      if (e) cudaEventDestroy(e);
    sources_ready_ = converted_ = old_pages_idle_ = nullptr;
  }
  cudaEvent_t sources_ready_ = nullptr;
  cudaEvent_t converted_ = nullptr;
  cudaEvent_t old_pages_idle_ = nullptr;
};

/// A non-blocking stream at the device's lowest priority (the side stream of the protocol).
inline result<cudaStream_t> create_side_stream() {
  int least = 0, greatest = 0;
  status s = check(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                   "create_side_stream: priority range");
  if (!s.is_ok()) return s;
  cudaStream_t st = nullptr;
  s = check(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, least), "create_side_stream");
  if (!s.is_ok()) return s;
  return st;
}

/// Step 2: the sources are immutable from this point of the main stream on.
inline status mark_sources_ready(const retier_async_events& ev, cudaStream_t main_stream) {
  if (!ev.sources_ready())
    return status::make(errc::invalid_argument, "mark_sources_ready: events not created");
  return check(cudaEventRecord(ev.sources_ready(), main_stream),
               "mark_sources_ready: cudaEventRecord");
}

/// Step 4: side waits for sources_ready, converts, records converted. Fails without enqueuing
/// anything if the inputs are rejected by cuda::retier's host checks.
template <class Geometry, class From, class To>
status enqueue_retier_async(const retier_inputs& in, const retier_async_events& ev,
                            cudaStream_t side_stream) {
  if (!ev.converted())
    return status::make(errc::invalid_argument, "enqueue_retier_async: events not created");
  TIERKV_CUDA_TRY(cudaStreamWaitEvent(side_stream, ev.sources_ready(), 0));
  status s = retier<Geometry, From, To>(in, side_stream);
  if (!s.is_ok()) return s;
  return check(cudaEventRecord(ev.converted(), side_stream),
               "enqueue_retier_async: cudaEventRecord");
}

namespace detail {
// cudaEventQuery as a result: true = done, false = still running, status = a device error.
inline result<bool> event_done(cudaEvent_t e, const char* what) {
  if (!e) return status::make(errc::invalid_argument, what, ": events not created");
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) return false;
  return check(r, what);
}
}  // namespace detail

/// Step 5: may the destination pages be published?
inline result<bool> conversion_complete(const retier_async_events& ev) {
  return detail::event_done(ev.converted(), "conversion_complete: cudaEventQuery");
}
/// Step 5, blocking: waits until the batch is converted.
inline status wait_converted(const retier_async_events& ev) {
  return check(cudaEventSynchronize(ev.converted()), "wait_converted: cudaEventSynchronize");
}

/// Step 6: after the last decode that may read the old pages has been enqueued on main.
inline status mark_old_pages_last_read(const retier_async_events& ev, cudaStream_t main_stream) {
  return check(cudaEventRecord(ev.old_pages_idle(), main_stream),
               "mark_old_pages_last_read: cudaEventRecord");
}
/// May the old slots be handed out again?
inline result<bool> old_pages_idle(const retier_async_events& ev) {
  return detail::event_done(ev.old_pages_idle(), "old_pages_idle: cudaEventQuery");
}

}  // namespace tierkv::cuda
