// SPDX-License-Identifier: Apache-2.0
// First-fit allocation of byte ranges inside [0, capacity): how the host tier carves its one
// pinned slab into parked sequences (cuda/cache/host_tier.cuh). Offsets only: the memory is
// the owner's. Every range starts at a multiple of `align`; a freed range coalesces with its
// free neighbours, so freeing everything gives back one run of `capacity` bytes.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>
#include <iterator>
#include <map>

#include "tierkv/core/status.hpp"

namespace tierkv {

class range_allocator {
 public:
  /// An allocator over [0, capacity) whose ranges start at multiples of align (a power of two).
  explicit range_allocator(std::uint64_t capacity = 0, std::uint64_t align = 256)
      : capacity_(capacity - capacity % (align == 0 ? 1 : align)), align_(align == 0 ? 1 : align) {
    if (capacity_ > 0) free_.emplace(0, capacity_);
  }

  /// The offset of a new range of `bytes` (rounded up to align); capacity_exhausted naming the
  /// request, the largest free run and the total free when no free run holds it, and
  /// invalid_argument for 0 bytes. A refusal changes nothing.
  result<std::uint64_t> allocate(std::uint64_t bytes) {
    if (bytes == 0) return status(errc::invalid_argument, "range_allocator: a range of 0 bytes");
    if (bytes > capacity_)
      return status::exceeds(errc::capacity_exhausted, "host range bytes", bytes, capacity_);
    const std::uint64_t need = round_up(bytes);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const std::uint64_t at = it->first, left = it->second - need;
      free_.erase(it);
      if (left > 0) free_.emplace(at + need, left);
      used_.emplace(at, need);
      used_bytes_ += need;
      return at;
    }
    return status::make(errc::capacity_exhausted, "range_allocator: ", bytes,
                        " bytes requested, the largest free run is ", largest_free(), " of ",
                        capacity_ - used_bytes_, " free bytes (capacity ", capacity_, ")");
  }

  /// Frees the range that allocate returned at `offset`; invalid_argument (and no change) for
  /// an offset that is not a live range's start.
  status free(std::uint64_t offset) {
    auto u = used_.find(offset);
    if (u == used_.end())
      return status::make(errc::invalid_argument, "range_allocator: offset ", offset,
                          " is not the start of an allocated range");
    std::uint64_t at = offset, bytes = u->second;
    used_.erase(u);
    used_bytes_ -= bytes;
    auto next = free_.lower_bound(at);
    if (next != free_.end() && next->first == at + bytes) {  // merge the run after
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {  // merge the run before
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        at = prev->first;
        bytes += prev->second;
        free_.erase(prev);
      }
    }
    free_.emplace(at, bytes);
    return {};
  }

  /// Bytes the allocator manages (the constructor's capacity rounded down to align).
  std::uint64_t capacity() const noexcept { return capacity_; }
  /// Bytes in live ranges (each rounded up to align).
  std::uint64_t used() const noexcept { return used_bytes_; }
  /// Live ranges.
  std::size_t ranges() const noexcept { return used_.size(); }
  /// The longest free run: the largest range allocate would grant now.
  std::uint64_t largest_free() const noexcept {
    std::uint64_t best = 0;
    for (const auto& [at, bytes] : free_) best = bytes > best ? bytes : best;
    return best;
  }
  /// The bytes a range of `bytes` takes.
  std::uint64_t round_up(std::uint64_t bytes) const noexcept {
    return (bytes + align_ - 1) / align_ * align_;
  }

 private:
  std::uint64_t capacity_, align_;
  std::uint64_t used_bytes_ = 0;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> bytes, disjoint, never adjacent
  std::map<std::uint64_t, std::uint64_t> used_;  // offset -> bytes of each live range
};

}  // namespace tierkv
