// SPDX-License-Identifier: Apache-2.0
// A pool of fixed-size pages of one format: one slab from an allocator policy,
// O(1) allocate/release through an intrusive free list, per-slot generations so a
// stale page_id is detected, refcounts, and open/sealed state.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"

// New pages are filled with a poison pattern in debug and test builds, so a reader
// that looks past a page's fill sees garbage it must not use (attention tests check
// that it never does). FP8 has no NaN-free pattern that is "obviously wrong", so the
// pattern is a byte: 0x7F is NaN in E4M3 and a large value in most other formats.
#if !defined(TIERKV_POISON_PAGES)
#if defined(NDEBUG)
#define TIERKV_POISON_PAGES 0
#else
#define TIERKV_POISON_PAGES 1
#endif
#endif

namespace tierkv {

inline constexpr std::uint8_t page_poison_byte =
    0x7F;  ///< the byte new pages are filled with under TIERKV_POISON_PAGES

/// A slot's state: free, open (being written, private) or sealed (immutable, shareable).
enum class page_state : std::uint8_t { free = 0, open = 1, sealed = 2 };

/// Host bookkeeping of one slot, kept apart from the (possibly device) page bytes.
struct page_slot_meta {
  std::uint32_t next_free = 0;          ///< free-list link while free
  std::uint32_t generation = 0;         ///< bumped when the slot is freed
  std::uint32_t refcount = 0;           ///< references held
  page_state state = page_state::free;  ///< free, open or sealed
  std::uint8_t owner_flags =
      0;  ///< for the pool's owner (e.g. "named by a page table"); 0 when freed
};

/// PageAlloc provides the slab, MetaAlloc (host) the slot bookkeeping. Not movable:
/// the owner (a paged storage) keeps pools in place.
template <class Layout, allocator_policy PageAlloc, host_allocator_policy MetaAlloc>
class page_pool {
  static_assert(check_allocator_policy<PageAlloc>());

 public:
  using layout = Layout;                                         ///< the page layout
  static constexpr std::size_t page_bytes = Layout::page_bytes;  ///< bytes per page
  static constexpr std::uint32_t end_of_list =
      std::numeric_limits<std::uint32_t>::max();  ///< free-list terminator

  page_pool() = default;
  page_pool(const page_pool&) = delete;
  page_pool& operator=(const page_pool&) = delete;
  ~page_pool() { reset(); }

  /// Allocates the slab and the bookkeeping; on failure nothing stays allocated.
  status init(PageAlloc& pages, MetaAlloc& meta, std::size_t& bookkeeping_line,
              std::uint32_t capacity, format_index format) {
    if (slab_ != nullptr)
      return status(errc::invalid_argument, "page_pool::init: pool already initialized");
    if (capacity == 0 || capacity >= end_of_list)
      return status::make(errc::invalid_argument, "page_pool::init: capacity = ", capacity,
                          " must lie in [1, ", end_of_list, ")");
    const std::size_t max_pages = std::numeric_limits<std::size_t>::max() / page_bytes;
    if (capacity > max_pages)
      return status::exceeds(errc::invalid_argument, "page_pool::init: capacity", capacity,
                             max_pages);
    auto m = meta.allocate(sizeof(page_slot_meta) * capacity);
    if (!m) return m.error_status();
    auto s = pages.allocate(page_bytes * capacity);
    if (!s) {
      meta.deallocate(*m, sizeof(page_slot_meta) * capacity);
      return s.error_status();
    }
    page_alloc_ = &pages;
    meta_alloc_ = &meta;
    line_ = &bookkeeping_line;
    *line_ += sizeof(page_slot_meta) * capacity;
    slots_ = static_cast<page_slot_meta*>(*m);
    slab_ = static_cast<std::uint8_t*>(*s);
    capacity_ = capacity;
    format_ = format;
    for (std::uint32_t i = 0; i < capacity; ++i) {
      ::new (&slots_[i]) page_slot_meta{};
      slots_[i].next_free = (i + 1 < capacity) ? i + 1 : end_of_list;
    }
    free_head_ = 0;
    free_count_ = capacity;
    return {};
  }

  /// Whether init() gave it a slab.
  bool initialized() const noexcept { return slab_ != nullptr; }
  /// Pages in the slab.
  std::uint32_t capacity() const noexcept { return capacity_; }
  /// Free pages.
  std::uint32_t free_count() const noexcept { return free_count_; }
  /// Pages in use.
  std::uint32_t live_count() const noexcept { return capacity_ - free_count_; }
  /// The tier index its page ids carry.
  format_index format() const noexcept { return format_; }
  /// Bytes of the slab.
  std::size_t slab_bytes() const noexcept { return std::size_t(capacity_) * page_bytes; }
  /// Bytes of the slot bookkeeping.
  std::size_t bookkeeping_bytes() const noexcept { return sizeof(page_slot_meta) * capacity_; }

  /// What kernels index: no host call, no ownership.
  pool_view view() const noexcept { return {slab_, page_bytes, capacity_}; }

  /// A fresh open page with refcount 1 (poisoned in debug builds).
  result<page_id> allocate() {
    if (free_count_ == 0)
      return status::make(errc::capacity_exhausted, "page pool of format ", unsigned(format_),
                          ": all ", capacity_, " pages are in use");
#if TIERKV_POISON_PAGES
    if (auto p = page_alloc_->fill(slab_ + std::size_t(free_head_) * page_bytes, page_poison_byte,
                                   page_bytes);
        !p)
      return p;
#endif
    const std::uint32_t slot = free_head_;
    page_slot_meta& m = slots_[slot];
    free_head_ = m.next_free;
    --free_count_;
    m.next_free = end_of_list;
    m.refcount = 1;
    m.state = page_state::open;
    return page_id{slot, m.generation, format_};
  }

  /// Ok when id names a live page of this pool; otherwise why not (the pool is unchanged).
  status check(page_id id) const {
    if (id.format != format_)
      return status::make(errc::invalid_argument, "page ", id, " has format ", unsigned(id.format),
                          " but this pool holds format ", unsigned(format_));
    if (!id.valid() || id.slot >= capacity_)
      return status::out_of_range("page slot", id.slot, capacity_);
    const page_slot_meta& m = slots_[id.slot];
    if (m.state == page_state::free) {
      // The generation is bumped on free: the id of the page just freed is one behind.
      if (id.generation + 1 == m.generation || id.generation == m.generation)
        return status::make(errc::double_release, "page ", id, " is free (released already)");
      return status::make(errc::stale_id, "page ", id, " is stale: slot is free at generation ",
                          m.generation);
    }
    if (m.generation != id.generation)
      return status::make(errc::stale_id, "page ", id, " is stale: slot now holds generation ",
                          m.generation);
    return {};
  }

  /// One more reference to a live page.
  status retain(page_id id) {
    if (auto s = check(id); !s) return s;
    page_slot_meta& m = slots_[id.slot];
    if (m.refcount == std::numeric_limits<std::uint32_t>::max())
      return status::exceeds(errc::capacity_exhausted, "refcount of page", m.refcount,
                             std::numeric_limits<std::uint32_t>::max() - 1);
    ++m.refcount;
    return {};
  }

  /// Drops one reference; the last one frees the slot (its generation moves on).
  status release(page_id id) {
    if (auto s = check(id); !s) return s;
    page_slot_meta& m = slots_[id.slot];
    if (--m.refcount == 0) {
      m.state = page_state::free;
      m.owner_flags = 0;
      ++m.generation;
      m.next_free = free_head_;
      free_head_ = id.slot;
      ++free_count_;
    }
    return {};
  }

  /// Open -> sealed (immutable from now on). Sealing a sealed page is a no-op.
  status seal(page_id id) {
    if (auto s = check(id); !s) return s;
    slots_[id.slot].state = page_state::sealed;
    return {};
  }

  /// Owner-defined bits kept with the slot (the storage marks pages its tables name).
  status set_owner_flags(page_id id, std::uint8_t flags) {
    if (auto s = check(id); !s) return s;
    slots_[id.slot].owner_flags = flags;
    return {};
  }
  /// The owner's bits of a live page (0 for a stale id).
  std::uint8_t owner_flags(page_id id) const { return check(id) ? slots_[id.slot].owner_flags : 0; }

  /// References to a live page (0 for a stale id).
  std::uint32_t refcount(page_id id) const { return check(id) ? slots_[id.slot].refcount : 0; }
  /// The state of a live page (free for a stale id).
  page_state state(page_id id) const {
    return check(id) ? slots_[id.slot].state : page_state::free;
  }
  /// The bookkeeping of a slot.
  const page_slot_meta& slot_meta(std::uint32_t slot) const { return slots_[slot]; }

  /// Host access to page bytes, only for host-visible memory.
  std::uint8_t* host_page(page_id id) const requires PageAlloc::host_accessible {
    return slab_ + std::size_t(id.slot) * page_bytes;
  }
  std::uint8_t* device_page(page_id id) const noexcept {
    return slab_ + std::size_t(id.slot) * page_bytes;
  }

  /// Copies all bytes of page src into page dst (same pool), in the slab's memory space.
  status copy_page(page_id dst, page_id src) {
    if (auto s = check(dst); !s) return s;
    if (auto s = check(src); !s) return s;
    return page_alloc_->copy(device_page(dst), device_page(src), page_bytes);
  }

  /// Free-list integrity and page-count conservation: every free slot is on the list
  /// exactly once, no live slot is, live slots hold refcount >= 1, and counts add up.
  status check_integrity() const {
    std::uint32_t listed = 0;
    std::uint32_t free_slots = 0;
    for (std::uint32_t i = 0; i < capacity_; ++i) {
      const page_slot_meta& m = slots_[i];
      if (m.state == page_state::free) {
        ++free_slots;
        if (m.refcount != 0)
          return status::make(errc::corrupt_data, "free slot ", i, " has refcount ", m.refcount);
        if (m.owner_flags != 0)
          return status::make(errc::corrupt_data, "free slot ", i, " keeps owner flags");
      } else if (m.refcount == 0) {
        return status::make(errc::corrupt_data, "live slot ", i, " has refcount 0");
      }
    }
    for (std::uint32_t i = free_head_; i != end_of_list; i = slots_[i].next_free) {
      if (i >= capacity_) return status::out_of_range("free-list link", i, capacity_);
      if (slots_[i].state != page_state::free)
        return status::make(errc::corrupt_data, "free list holds live slot ", i);
      if (++listed > capacity_) return status(errc::corrupt_data, "free list has a cycle");
    }
    if (listed != free_slots || listed != free_count_)
      return status::make(errc::corrupt_data, "free list holds ", listed, " slots, ", free_slots,
                          " slots are free, free_count = ", free_count_);
    return {};
  }

 private:
  void reset() noexcept {
    if (slab_ == nullptr) return;
    page_alloc_->deallocate(slab_, slab_bytes());
    meta_alloc_->deallocate(slots_, bookkeeping_bytes());
    *line_ -= bookkeeping_bytes();
    slab_ = nullptr;
    slots_ = nullptr;
  }

  PageAlloc* page_alloc_ = nullptr;
  MetaAlloc* meta_alloc_ = nullptr;
  std::size_t* line_ = nullptr;
  std::uint8_t* slab_ = nullptr;
  page_slot_meta* slots_ = nullptr;
  std::uint32_t capacity_ = 0;
  std::uint32_t free_head_ = end_of_list;
  std::uint32_t free_count_ = 0;
  format_index format_ = 0;
};

}  // namespace tierkv
