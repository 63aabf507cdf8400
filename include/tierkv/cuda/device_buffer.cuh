// SPDX-License-Identifier: Apache-2.0
// Move-only owners of CUDA runtime resources: device memory, page-locked host memory, an event
// and a stream. Each gives back what it holds when destroyed, so a class built of them needs no
// hand-written destructor, and an early return from a function frees what it allocated so far.
// Allocation failures are errc::cuda_error naming the runtime call (cuda::check).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"

namespace tierkv::cuda {

namespace detail {
// The one owner all four share: a handle and the runtime call that gives it back.
template <class Handle, cudaError_t (*Free)(Handle)>
class unique_handle {
 public:
  unique_handle() = default;
  unique_handle(const unique_handle&) = delete;
  unique_handle& operator=(const unique_handle&) = delete;
  unique_handle(unique_handle&& o) noexcept : h_(std::exchange(o.h_, Handle{})) {}
  unique_handle& operator=(unique_handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, Handle{});
    }
    return *this;
  }
  ~unique_handle() { reset(); }
  void reset() noexcept {
    if (h_) (void)Free(h_);
    h_ = Handle{};
  }

 protected:
  Handle h_{};
};
inline cudaError_t free_device(void* p) { return cudaFree(p); }
inline cudaError_t free_pinned(void* p) { return cudaFreeHost(p); }
inline cudaError_t destroy_event(cudaEvent_t e) { return cudaEventDestroy(e); }
inline cudaError_t destroy_stream(cudaStream_t s) { return cudaStreamDestroy(s); }
inline status allocate_device(void** p, std::size_t bytes) {
  return check(cudaMalloc(p, bytes), "cudaMalloc");
}
inline status allocate_pinned(void** p, std::size_t bytes) {
  return check(cudaMallocHost(p, bytes), "cudaMallocHost");
}

// `count` Ts of memory that Allocate gives and Free gives back.
template <class T, status (*Allocate)(void**, std::size_t), cudaError_t (*Free)(void*)>
class unique_memory : public unique_handle<void*, Free> {
 public:
  // Allocates `count` Ts, freeing what it held first.
  status allocate(std::size_t count) {
    this->reset();
    return Allocate(&this->h_, count * sizeof(T));
  }
  // The pointer (nullptr before allocate).
  T* get() const noexcept { return static_cast<T*>(this->h_); }
};
}  // namespace detail

/// `count` Ts of device memory (cudaMalloc), freed when the owner is destroyed: allocate(count)
/// (a status), get().
template <class T>
using device_buffer = detail::unique_memory<T, detail::allocate_device, detail::free_device>;

/// `count` Ts of page-locked host memory (cudaMallocHost), freed when the owner is destroyed:
/// allocate(count) (a status), get().
template <class T>
using pinned_buffer = detail::unique_memory<T, detail::allocate_pinned, detail::free_pinned>;

/// A CUDA event without timing (cudaEventDisableTiming), destroyed with its owner.
class cuda_event : public detail::unique_handle<cudaEvent_t, detail::destroy_event> {
 public:
  /// Creates the event, destroying the one it held first.
  status create() {
    reset();
    return check(cudaEventCreateWithFlags(&h_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  /// The event (nullptr before create).
  cudaEvent_t get() const noexcept { return h_; }
};

/// A stream this owner destroys (a stream the caller gave is never owned).
class owned_stream : public detail::unique_handle<cudaStream_t, detail::destroy_stream> {
 public:
  /// Takes ownership of `s`, destroying the stream it held first.
  void adopt(cudaStream_t s) noexcept {
    reset();
    h_ = s;
  }
  /// The stream (nullptr before adopt).
  cudaStream_t get() const noexcept { return h_; }
};

}  // namespace tierkv::cuda
