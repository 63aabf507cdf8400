// SPDX-License-Identifier: Apache-2.0
// Allocator policies: where a pool's slab (and the host bookkeeping) comes from.
// Every policy counts the bytes it currently holds, so memory reports reconcile
// exactly with what was allocated.
#pragma once

#include "tierkv/core/config.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>

#include "tierkv/core/status.hpp"

// CUDA-backed policies (pinned host, device) exist only when the CUDA runtime is
// available: always under nvcc, and in host translation units that define
// TIERKV_WITH_CUDA_RUNTIME=1 and link cudart. Host-only builds never need CUDA.
#if !defined(TIERKV_WITH_CUDA_RUNTIME)
#if defined(__CUDACC__)
#define TIERKV_WITH_CUDA_RUNTIME 1
#else
#define TIERKV_WITH_CUDA_RUNTIME 0
#endif
#endif
#if TIERKV_WITH_CUDA_RUNTIME
#if !__has_include(<cuda_runtime_api.h>)
#error "TIERKV_WITH_CUDA_RUNTIME=1 but <cuda_runtime_api.h> is not on the include path"
#endif
#include <cuda_runtime_api.h>
#endif

namespace tierkv {

/// Where an allocator policy's bytes live.
enum class memory_space : std::uint8_t { host = 0, pinned_host = 1, device = 2 };

/// What a pool needs from an allocator policy:
///   A::space                      memory_space of the bytes it returns
///   A::host_accessible            whether host code may read/write them
///   a.allocate(n)                 result<void*>, 256-byte aligned, never managed memory
///   a.deallocate(p, n)            returns exactly what allocate(n) gave
///   a.bytes_allocated()           bytes currently held (sum of live allocate(n) sizes)
///   a.copy(dst, src, n), a.fill(p, byte, n)   status; in the policy's memory space
namespace detail {
template <class A>
concept has_space = requires {
  { A::space } -> std::convertible_to<memory_space>;
};
template <class A>
concept has_host_accessible = requires {
  { A::host_accessible } -> std::convertible_to<bool>;
};
template <class A>
concept has_allocate = requires(A& a, std::size_t n) {
  { a.allocate(n) } -> std::same_as<result<void*>>;
};
template <class A>
concept has_deallocate = requires(A& a, void* p, std::size_t n) {
  a.deallocate(p, n);
};
template <class A>
concept has_bytes_allocated = requires(const A& a) {
  { a.bytes_allocated() } -> std::convertible_to<std::size_t>;
};
template <class A>
concept has_copy_fill = requires(A& a, void* p, const void* q, std::size_t n, std::uint8_t b) {
  { a.copy(p, q, n) } -> std::same_as<status>;
  { a.fill(p, b, n) } -> std::same_as<status>;
};
}  // namespace detail

template <class A>
concept allocator_policy =
    detail::has_space<A> && detail::has_host_accessible<A> && detail::has_allocate<A> &&
    detail::has_deallocate<A> && detail::has_bytes_allocated<A> && detail::has_copy_fill<A>;

/// static_assert(check_allocator_policy<A>()) names the first missing member.
template <class A>
constexpr bool check_allocator_policy() {
  static_assert(detail::has_space<A>,
                "allocator policy: missing `static constexpr memory_space space`");
  static_assert(detail::has_host_accessible<A>,
                "allocator policy: missing `static constexpr bool host_accessible`");
  static_assert(detail::has_allocate<A>,
                "allocator policy: missing `result<void*> allocate(std::size_t bytes)`");
  static_assert(detail::has_deallocate<A>,
                "allocator policy: missing `void deallocate(void* p, std::size_t bytes)`");
  static_assert(detail::has_bytes_allocated<A>,
                "allocator policy: missing `std::size_t bytes_allocated() const`");
  static_assert(detail::has_copy_fill<A>,
                "allocator policy: missing `status copy(void*, const void*, std::size_t)` or "
                "`status fill(void*, std::uint8_t, std::size_t)`");
  return allocator_policy<A>;
}

/// Host-accessible policies: pools hand out host pointers to page bytes.
template <class A>
concept host_allocator_policy = allocator_policy<A> && A::host_accessible;

inline constexpr std::size_t allocation_alignment = 256;  ///< alignment of every host allocation

namespace detail {
/// Bookkeeping shared by every policy: bytes and allocations currently held.
class allocation_counter {
 public:
  allocation_counter() = default;
  allocation_counter(allocation_counter&& o) noexcept
      : bytes_(std::exchange(o.bytes_, 0)), count_(std::exchange(o.count_, 0)) {}
  allocation_counter& operator=(allocation_counter&& o) noexcept {
    bytes_ = std::exchange(o.bytes_, 0);
    count_ = std::exchange(o.count_, 0);
    return *this;
  }
  std::size_t bytes_allocated() const noexcept { return bytes_; }
  std::size_t live_allocations() const noexcept { return count_; }

 protected:
  void add(std::size_t n) noexcept {
    bytes_ += n;
    ++count_;
  }
  void remove(std::size_t n) noexcept {
    bytes_ -= n;
    --count_;
  }

 private:
  std::size_t bytes_ = 0;
  std::size_t count_ = 0;
};

inline result<void*> host_aligned_new(std::size_t n) {
  if (n == 0)
    return status(errc::invalid_argument, "allocate: bytes = 0 (a pool needs at least one page)");
  void* p = ::operator new (n, std::align_val_t{allocation_alignment}, std::nothrow);
  if (p == nullptr)
    return status::make(errc::capacity_exhausted, "host allocation of ", n, " bytes failed");
  return p;
}
inline void host_aligned_delete(void* p) noexcept {
  ::operator delete (p, std::align_val_t{allocation_alignment});
}
}  // namespace detail

/// Ordinary host memory, 256-byte aligned.
class host_allocator : public detail::allocation_counter {
 public:
  static constexpr memory_space space = memory_space::host;  ///< host memory
  static constexpr bool host_accessible = true;              ///< pools may hand out host pointers

  /// n bytes, allocation_alignment-aligned, counted in bytes_allocated().
  result<void*> allocate(std::size_t n) {
    auto r = detail::host_aligned_new(n);
    if (r) add(n);
    return r;
  }
  /// Frees what allocate(n) returned (nullptr is ignored).
  void deallocate(void* p, std::size_t n) noexcept {
    if (p == nullptr) return;
    detail::host_aligned_delete(p);
    remove(n);
  }
  /// memcpy.
  status copy(void* dst, const void* src, std::size_t n) {
    std::memcpy(dst, src, n);
    return {};
  }
  /// memset.
  status fill(void* p, std::uint8_t byte, std::size_t n) {
    std::memset(p, byte, n);
    return {};
  }
};

/// Host memory that fails on a chosen request (fault injection) and counts requests.
/// fail_on(k): the k-th allocate() from now (1 = the next one) returns
/// errc::injected_fault; fail_every(): every request fails until reset().
class failing_allocator : public detail::allocation_counter {
 public:
  static constexpr memory_space space = memory_space::host;  ///< host memory
  static constexpr bool host_accessible = true;              ///< pools may hand out host pointers

  /// The k-th allocate() from now fails (1 = the next one).
  void fail_on(std::uint64_t k) noexcept {
    fail_at_ = requests_ + k;
    always_ = false;
  }
  /// Every allocate() fails until reset().
  void fail_every() noexcept { always_ = true; }
  /// No more injected failures.
  void reset() noexcept {
    fail_at_ = 0;
    always_ = false;
  }
  /// allocate() calls so far.
  std::uint64_t requests() const noexcept { return requests_; }
  /// Failures injected so far.
  std::uint64_t faults_injected() const noexcept { return faults_; }

  /// n bytes, allocation_alignment-aligned, counted in bytes_allocated().
  result<void*> allocate(std::size_t n) {
    ++requests_;
    if (always_ || requests_ == fail_at_) {
      ++faults_;
      return status::make(errc::injected_fault, "failing_allocator: request #", requests_, " of ",
                          n, " bytes failed by injection");
    }
    auto r = detail::host_aligned_new(n);
    if (r) add(n);
    return r;
  }
  /// Frees what allocate(n) returned (nullptr is ignored).
  void deallocate(void* p, std::size_t n) noexcept {
    if (p == nullptr) return;
    detail::host_aligned_delete(p);
    remove(n);
  }
  /// memcpy.
  status copy(void* dst, const void* src, std::size_t n) {
    std::memcpy(dst, src, n);
    return {};
  }
  /// memset.
  status fill(void* p, std::uint8_t byte, std::size_t n) {
    std::memset(p, byte, n);
    return {};
  }

 private:
  std::uint64_t requests_ = 0;
  std::uint64_t fail_at_ = 0;
  std::uint64_t faults_ = 0;
  bool always_ = false;
};

#if TIERKV_WITH_CUDA_RUNTIME
namespace detail {
inline status cuda_status(cudaError_t e, const char* what, std::size_t n) {
  if (e == cudaSuccess) return {};
  const errc code = (e == cudaErrorMemoryAllocation) ? errc::capacity_exhausted : errc::cuda_error;
  return status::make(code, what, " of ", n, " bytes failed: ", cudaGetErrorString(e));
}
}  // namespace detail

/// Page-locked host memory (cudaMallocHost): host-visible and fast to copy to the device.
class pinned_host_allocator : public detail::allocation_counter {
 public:
  static constexpr memory_space space = memory_space::pinned_host;
  static constexpr bool host_accessible = true;

  result<void*> allocate(std::size_t n) {
    if (n == 0) return status(errc::invalid_argument, "allocate: bytes = 0");
    void* p = nullptr;
    if (auto s = detail::cuda_status(cudaMallocHost(&p, n), "cudaMallocHost", n); !s) return s;
    add(n);
    return p;
  }
  void deallocate(void* p, std::size_t n) noexcept {
    if (p == nullptr) return;
    (void)cudaFreeHost(p);
    remove(n);
  }
  status copy(void* dst, const void* src, std::size_t n) {
    std::memcpy(dst, src, n);
    return {};
  }
  status fill(void* p, std::uint8_t byte, std::size_t n) {
    std::memset(p, byte, n);
    return {};
  }
};

/// Device memory (cudaMalloc; never managed memory, so no page faults in kernels).
/// Copies and fills (fork's open-tail copy, lossless tier moves, page poisoning) are enqueued
/// device-to-device on stream() and return without waiting: the host never touches these
/// bytes, so nothing needs to. The default stream is the legacy one, which orders with every
/// blocking stream; an engine whose kernels write pages on its own stream sets that stream
/// first (set_stream), so a fork's copy of a tail page comes after the append that wrote it.
class device_allocator : public detail::allocation_counter {
 public:
  static constexpr memory_space space = memory_space::device;
  static constexpr bool host_accessible = false;

  void set_stream(cudaStream_t s) noexcept { stream_ = s; }
  cudaStream_t stream() const noexcept { return stream_; }

  result<void*> allocate(std::size_t n) {
    if (n == 0) return status(errc::invalid_argument, "allocate: bytes = 0");
    void* p = nullptr;
    if (auto s = detail::cuda_status(cudaMalloc(&p, n), "cudaMalloc", n); !s) return s;
    add(n);
    return p;
  }
  void deallocate(void* p, std::size_t n) noexcept {
    if (p == nullptr) return;
    (void)cudaFree(p);
    remove(n);
  }
  status copy(void* dst, const void* src, std::size_t n) {
    return detail::cuda_status(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream_),
                               "cudaMemcpyAsync (device to device)", n);
  }
  status fill(void* p, std::uint8_t byte, std::size_t n) {
    return detail::cuda_status(cudaMemsetAsync(p, byte, n, stream_), "cudaMemsetAsync", n);
  }

 private:
  cudaStream_t stream_ = nullptr;
};
static_assert(check_allocator_policy<pinned_host_allocator>());
static_assert(check_allocator_policy<device_allocator>());
#endif

static_assert(check_allocator_policy<host_allocator>());
static_assert(check_allocator_policy<failing_allocator>());

}  // namespace tierkv
