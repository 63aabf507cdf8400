// SPDX-License-Identifier: Apache-2.0
// The sequence table of a paged_storage: a fixed number of sequence slots, each holding a
// sequence's logical page list (block indices), its committed length and its outstanding
// reservation; the free-slot list; and the ids (slot + generation, so a released id is
// detected as stale). It knows nothing of blocks or pages: the storage decides what the lists
// hold and drops the references before it closes a slot.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/counted_allocator.hpp"

namespace tierkv {

/// The fixed sequence slots of a paged_storage: each slot's page list, length and reservation,
/// a free-slot list, and ids with generations so a released id is detected.
template <host_allocator_policy MetaAlloc>
class sequence_table {
 public:
  using block_list =
      std::vector<std::uint32_t,
                  counted_allocator<std::uint32_t, MetaAlloc>>;  ///< a sequence's block indices, in
                                                                 ///< logical order
  /// One slot.
  struct record {
    block_list blocks;          ///< committed pages, then the pages opened only for the reservation
    std::int64_t length = 0;    ///< committed tokens
    std::int64_t reserved = 0;  ///< tokens of the outstanding reservation, after length
    std::uint32_t generation = 0;  ///< bumped on release
    bool live = false;             ///< whether a sequence holds the slot
  };

  /// Allocates every slot's record and the free list from `alloc`, charged to `line`; the
  /// allocator and the line must outlive the table. Allocation failures are returned.
  status init(MetaAlloc& alloc, std::size_t& line, std::uint32_t capacity) {
    capacity_ = capacity;
    std::uint32_t bits = 1;
    while ((std::uint64_t(1) << bits) < capacity) ++bits;
    slot_bits_ = bits;
    try {
      records_.emplace(counted_allocator<record, MetaAlloc>(alloc, line));
      records_->reserve(capacity);
      for (std::uint32_t i = 0; i < capacity; ++i)
        records_->push_back(record{
            block_list(counted_allocator<std::uint32_t, MetaAlloc>(alloc, line)), 0, 0, 0, false});
      free_.emplace(counted_allocator<std::uint32_t, MetaAlloc>(alloc, line));
      free_->reserve(capacity);
      for (std::uint32_t i = capacity; i-- > 0;) free_->push_back(i);
    } catch (const allocation_failure& e) {
      return e.get_status();
    }
    return {};
  }
  /// Gives every record's memory back (before the allocator it was charged to goes).
  void reset() {
    records_.reset();
    free_.reset();
  }

  /// Slots.
  std::uint32_t capacity() const noexcept { return capacity_; }
  /// Live sequences.
  std::uint32_t live() const noexcept { return live_; }
  /// Whether every slot is in use.
  bool full() const noexcept { return free_->empty(); }
  /// The slot the next open() takes (not full()); its record may be prepared first (a page
  /// list reserved), so a refusal before open() changes nothing.
  std::uint32_t next_free() const { return free_->back(); }
  /// The record of a slot.
  record& at(std::uint32_t slot) { return (*records_)[slot]; }
  /// The record of a slot.
  const record& at(std::uint32_t slot) const { return (*records_)[slot]; }

  /// Makes next_free() a live sequence of `length` committed tokens (its list already filled).
  seq_id open(std::int64_t length) {
    const std::uint32_t slot = free_->back();
    free_->pop_back();
    record& r = (*records_)[slot];
    r.live = true;
    r.length = length;
    r.reserved = 0;
    ++live_;
    return id_of(slot, r.generation);
  }
  /// Ends a live sequence (the caller dropped its references): its list's memory goes back and
  /// the slot's generation moves on, so the id is stale from now on.
  void close(seq_id s) {
    const std::uint32_t slot = slot_of(s);
    record& r = (*records_)[slot];
    block_list(r.blocks.get_allocator()).swap(r.blocks);
    r.live = false;
    r.length = 0;
    r.reserved = 0;
    ++r.generation;
    free_->push_back(slot);
    --live_;
  }

  /// The record of live sequence s, or nullptr (bad(s) says why).
  const record* find(seq_id s) const {
    if (!s.valid()) return nullptr;
    const std::uint32_t slot = slot_of(s);
    if (slot >= capacity_) return nullptr;
    const record& r = (*records_)[slot];
    if (!r.live || !(id_of(slot, r.generation) == s)) return nullptr;
    return &r;
  }
  /// The record of live sequence s, or nullptr.
  record* find(seq_id s) { return const_cast<record*>(std::as_const(*this).find(s)); }
  /// Why find(s) failed: stale_id for a slot of this table, out_of_range otherwise.
  status bad(seq_id s) const {
    if (s.valid() && slot_of(s) < capacity_)
      return status::make(errc::stale_id, s,
                          " is not a live sequence (released, or never created)");
    return status::make(errc::out_of_range, s, " is not a sequence id of this storage (", capacity_,
                        " slots)");
  }

  /// The id of a slot at a generation.
  seq_id id_of(std::uint32_t slot, std::uint32_t generation) const {
    const std::uint32_t gen_mask = (slot_bits_ >= 32) ? 0u : (~0u >> slot_bits_);
    std::uint32_t v = ((generation & gen_mask) << slot_bits_) | slot;
    if (v == seq_id::invalid_value) v = slot;  // all-ones is reserved for "invalid"
    return seq_id(v);
  }
  /// The slot an id names.
  std::uint32_t slot_of(seq_id s) const { return s.value & ((1u << slot_bits_) - 1u); }

 private:
  template <class T>
  using counted_vector = std::vector<T, counted_allocator<T, MetaAlloc>>;
  std::optional<counted_vector<record>> records_;
  std::optional<counted_vector<std::uint32_t>> free_;
  std::uint32_t capacity_ = 0;
  std::uint32_t slot_bits_ = 1;
  std::uint32_t live_ = 0;
};

}  // namespace tierkv
