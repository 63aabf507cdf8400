// SPDX-License-Identifier: Apache-2.0
// A standard-library allocator over a host allocator policy that charges every byte
// to one accounting line (page tables, pool bookkeeping, prefix index, ...), so the
// containers holding host bookkeeping are counted exactly and can be fault-injected.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <limits>
#include <new>
#include <string>

#include "tierkv/memory/allocators.hpp"

namespace tierkv {

/// Thrown by counted_allocator when the policy refuses; callers that promise the
/// strong guarantee catch it before they change anything and return its status.
class allocation_failure : public std::bad_alloc {
 public:
  /// Carries the policy's refusal.
  explicit allocation_failure(status s) : status_(std::move(s)) {}
  /// A fixed message; get_status() has the details.
  const char* what() const noexcept override {
    return "tierkv: host bookkeeping allocation failed";
  }
  /// Why the allocation failed.
  const status& get_status() const noexcept { return status_; }

 private:
  status status_;
};

/// A std allocator over a host allocator policy that adds what it holds to an accounting
/// line (report.hpp); throws allocation_failure when the policy refuses.
template <class T, host_allocator_policy A>
class counted_allocator {
 public:
  using value_type = T;  ///< element type

  /// Allocates from policy and charges `line`; both must outlive the allocator.
  counted_allocator(A& policy, std::size_t& line) noexcept : policy_(&policy), line_(&line) {}
  /// The same policy and line for another element type (rebind).
  template <class U>
  counted_allocator(
      const counted_allocator<U, A>& o) noexcept  // NOLINT(google-explicit-constructor)
      : policy_(o.policy_), line_(o.line_) {}

  /// n elements; throws allocation_failure when the policy refuses.
  T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw allocation_failure(
          status::exceeds(errc::capacity_exhausted, "element count", n,
                          std::numeric_limits<std::size_t>::max() / sizeof(T)));
    auto r = policy_->allocate(n * sizeof(T));
    if (!r) throw allocation_failure(r.error_status());
    *line_ += n * sizeof(T);
    return static_cast<T*>(*r);
  }
  /// Gives back what allocate(n) returned.
  void deallocate(T* p, std::size_t n) noexcept {
    policy_->deallocate(p, n * sizeof(T));
    *line_ -= n * sizeof(T);
  }

  /// Equal when they share the policy and the line.
  template <class U>
  friend bool operator==(const counted_allocator& a, const counted_allocator<U, A>& b) noexcept {
    return a.policy_ == b.policy_ && a.line_ == b.line_;
  }

 private:
  template <class U, host_allocator_policy B>
  friend class counted_allocator;
  A* policy_;
  std::size_t* line_;
};

}  // namespace tierkv
