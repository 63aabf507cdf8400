// SPDX-License-Identifier: Apache-2.0
// The sequences of a paged_storage over its block store: a sequence is an ordered list of blocks
// (logical pages) in a sequence_table slot. Creating, forking (sealed pages shared, the open
// tail page copied) and releasing sequences, sequences started from shared blocks (a cached
// prefix), the page and the block behind a logical page, iteration, and the invariants of the
// whole storage. Tokens are neither written nor read here: paged_storage derives from it and
// adds append, reserve / write_layer / commit and the reads.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/block_store.hpp"
#include "tierkv/paging/sequence_table.hpp"
#include "tierkv/paging/storage_types.hpp"

namespace tierkv {

/// The sequences of a paged_storage over its pools and blocks (see the file comment).
/// paged_storage is its only user: it derives from it and adds the token writes and reads.
template <class Geometry, class Tiers, allocator_policy PageAlloc, host_allocator_policy MetaAlloc>
class sequence_store : public block_store<Geometry, Tiers, PageAlloc, MetaAlloc> {
  using store = block_store<Geometry, Tiers, PageAlloc, MetaAlloc>;

 public:
  static constexpr int page_tokens = Geometry::page_tokens;  ///< tokens per page
  static constexpr std::int64_t max_sequence_tokens =
      std::numeric_limits<std::int32_t>::max();       ///< longest sequence (int32 lengths)
  using options = storage_options<store::num_tiers>;  ///< what paged_storage::create takes

  sequence_store(const sequence_store&) = delete;
  sequence_store& operator=(const sequence_store&) = delete;

  // ---- sizes and accessors ---------------------------------------------------------------
  /// Sequence slots.
  std::uint32_t max_sequences() const noexcept { return opt_.max_sequences; }
  /// Sequences live now.
  std::uint32_t live_sequences() const noexcept { return seqs_.live(); }
  /// Counts the changes to which sequences hold which blocks other than a sequence growing:
  /// a block freed, a fork, a release, a sequence started from shared blocks. Between two
  /// equal values every block keeps its holders and logical positions, and only a sequence's
  /// own length (its new and newly sealed pages) moves its blocks' facts
  /// (tier_controller::refresh uses this to visit only the sequences that grew).
  std::uint64_t structure_epoch() const noexcept { return structure_epoch_; }
  /// The options it was created with.
  const options& config() const noexcept { return opt_; }

  // ---- sequences ---------------------------------------------------------------------------
  /// A new empty sequence (capacity_exhausted when every slot is in use).
  result<seq_id> create_sequence() {
    if (seqs_.full())
      return status::make(errc::capacity_exhausted, "all ", opt_.max_sequences,
                          " sequence slots are in use");
    return seqs_.open(0);
  }

  /// Whether s is a live sequence of this storage.
  bool contains(seq_id s) const noexcept { return find(s) != nullptr; }

  /// Committed tokens of s.
  result<std::int64_t> length(seq_id s) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    return r->length;
  }
  /// Committed logical pages (a reservation's new pages are not counted until commit); with
  /// index_scope::readable, the pages holding committed or reserved tokens.
  result<std::int64_t> logical_pages(seq_id s, index_scope scope = index_scope::committed) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    return std::int64_t(pages_in(*r, scope));
  }
  /// Tier-0 pages that n more tokens open (one per layer of each new logical page), counted
  /// from the sequence's committed and reserved tokens: a scheduler asks make_room once for a
  /// step's whole batch rather than once per reservation.
  result<std::uint64_t> pages_to_open(seq_id s, std::int64_t n) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (n < 0)
      return status::make(errc::invalid_argument, "pages_to_open: token count = ", n,
                          " is negative");
    const std::int64_t now = r->length + r->reserved;
    if (n > max_sequence_tokens - now)
      return status::exceeds(errc::out_of_range, "pages_to_open: sequence length", now + n,
                             max_sequence_tokens);
    return std::uint64_t(pages_for(now + n) - pages_for(now)) * std::uint64_t(layers_);
  }
  /// Tokens of the sequence's outstanding reservation (0: none).
  result<std::int64_t> reserved(seq_id s) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    return r->reserved;
  }

  /// A new sequence sharing every sealed logical page of parent; the open tail page
  /// (if the length is not a multiple of page_tokens) is copied, so both may append.
  /// Every refusal (slot, block table, bookkeeping memory) comes before make_room
  /// (room_hook) is asked for the tail copy's tier-0 pages; nothing changes on refusal.
  template <room_hook MakeRoom = no_room>
  result<seq_id> fork(seq_id parent, MakeRoom&& make_room = {}) {
    seq_record* p = find(parent);
    if (p == nullptr) return bad_seq(parent);
    if (seqs_.full())
      return status::make(errc::capacity_exhausted, "fork: all ", opt_.max_sequences,
                          " sequence slots are in use");
    // Committed pages only: a reservation of the parent stays the parent's.
    const std::size_t pages = committed_pages(*p);
    const bool open_tail = (p->length % page_tokens) != 0;
    if (open_tail)
      if (auto st = can_allocate_block_entries(1); !st) return st;
    seq_record& c = seqs_.at(seqs_.next_free());
    if (auto st = reserve_list(c.blocks, pages); !st) return st;
    if (open_tail) {
      status room = make_room(std::uint32_t(layers_));
      if (room) room = can_allocate_blocks(1);
      if (!room) {
        block_list(c.blocks.get_allocator()).swap(c.blocks);  // give the reservation back
        return room;
      }
    }

    std::uint32_t tail_copy = no_block;
    if (open_tail) {
      tail_copy = new_block();
      const std::uint32_t src = p->blocks[pages - 1];
      status copied;
      for (int l = 0; l < layers_ && copied; ++l)
        (void)(copied = std::get<0>(pools_).copy_page(page_of(tail_copy, l), page_of(src, l)));
      if (!copied) {
        drop_block(tail_copy);
        block_list(c.blocks.get_allocator()).swap(c.blocks);  // give the reservation back
        return copied;
      }
      (*block_meta_)[tail_copy].fill = (*block_meta_)[src].fill;
    }
    for (std::size_t i = 0; i < pages; ++i) {
      if (open_tail && i + 1 == pages) {
        c.blocks.push_back(tail_copy);
      } else {
        ++(*block_meta_)[p->blocks[i]].refcount;
        c.blocks.push_back(p->blocks[i]);
      }
    }
    ++structure_epoch_;
    return seqs_.open(p->length);
  }

  /// Drops the sequence's references; pages nobody else holds return to their pools.
  status release(seq_id s) {
    seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    for (std::uint32_t b : r->blocks) drop_block(b);
    seqs_.close(s);  // gives the list's memory back
    ++structure_epoch_;
    return {};
  }

  // ---- pages -----------------------------------------------------------------------------
  /// The physical page (tier in page_id::format) of layer `layer` of logical page `logical` of s.
  result<page_id> page(seq_id s, int layer, std::int64_t logical) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (layer < 0 || layer >= layers_) return status::out_of_range("layer", layer, layers_);
    if (logical < 0 || logical >= std::int64_t(committed_pages(*r)))
      return status::out_of_range("logical page", logical, committed_pages(*r));
    return page_of(r->blocks[std::size_t(logical)], layer);
  }

  /// The block (logical page, all layers) behind logical page `logical` of s.
  result<block_ref> block_of(seq_id s, std::int64_t logical) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (logical < 0 || logical >= std::int64_t(committed_pages(*r)))
      return status::out_of_range("logical page", logical, committed_pages(*r));
    const std::uint32_t b = r->blocks[std::size_t(logical)];
    return block_ref{b, (*block_meta_)[b].generation};
  }

  /// The conversion hook: layer `layer` of the logical page (seq, logical) becomes
  /// new_page, for every holder of that logical page (sequences and prefix index).
  /// expected_old must be the page published now (the one the conversion read);
  /// new_page must come from allocate_page (open, refcount 1). Publish, then release:
  /// the block takes over the caller's reference to new_page and drops its old page.
  /// Any failed check changes nothing and leaves the caller owning new_page.
  status replace_page(seq_id s, int layer, std::int64_t logical, page_id expected_old,
                      page_id new_page) {
    auto b = block_of(s, logical);
    if (!b) return b.error_status();
    return replace_page(*b, layer, expected_old, new_page);
  }
  /// block_store::check_block (named here: a dependent base's names are not found unqualified).
  using store::check_block;
  /// block_store::replace_page(block_ref, ...), beside the overload above.
  using store::replace_page;

  /// A new sequence made of the given sealed logical pages (a cached prefix).
  result<seq_id> create_sequence_from_blocks(std::span<const block_ref> blocks) {
    for (const block_ref& b : blocks) {
      if (auto st = check_block(b); !st) return st;
      if ((*block_meta_)[b.index].state != page_state::sealed)
        return status::make(errc::not_writable, "block ", b.index,
                            " is open; only sealed pages are shared");
    }
    if (std::int64_t(blocks.size()) > max_sequence_tokens / page_tokens)
      return status::exceeds(errc::out_of_range, "prefix pages", blocks.size(),
                             max_sequence_tokens / page_tokens);
    if (seqs_.full())
      return status::make(errc::capacity_exhausted, "all ", opt_.max_sequences,
                          " sequence slots are in use");
    seq_record& c = seqs_.at(seqs_.next_free());
    if (auto st = reserve_list(c.blocks, blocks.size()); !st) return st;
    for (const block_ref& b : blocks) {
      ++(*block_meta_)[b.index].refcount;
      c.blocks.push_back(b.index);
    }
    ++structure_epoch_;
    return seqs_.open(std::int64_t(blocks.size()) * page_tokens);
  }

  // ---- iteration (index builder, accounting, tests) ----------------------------------------
  /// f(logical, page_id) for each committed logical page of s at one layer (readable: the
  /// outstanding reservation's pages too, all in tier 0, as attention before commit reads them);
  /// s and layer must be valid.
  template <class F>
  void for_each_page(seq_id s, int layer, F&& f, index_scope scope = index_scope::committed) const {
    const seq_record* r = find(s);
    for (std::size_t i = 0, n = pages_in(*r, scope); i < n; ++i)
      f(std::int64_t(i), page_of(r->blocks[i], layer));
  }
  /// f(logical, block_ref) for each committed logical page of s (valid; readable: the
  /// reservation's too): what block_of(s, i) gives for every i, in one pass.
  template <class F>
  void for_each_logical_block(seq_id s, F&& f, index_scope scope = index_scope::committed) const {
    const seq_record* r = find(s);
    for (std::size_t i = 0, n = pages_in(*r, scope); i < n; ++i)
      f(std::int64_t(i), block_ref{r->blocks[i], (*block_meta_)[r->blocks[i]].generation});
  }
  /// Calls f(seq_id, length) for every live sequence.
  template <class F>
  void for_each_sequence(F&& f) const {
    for (std::uint32_t i = 0; i < opt_.max_sequences; ++i) {
      const seq_record& r = seqs_.at(i);
      if (r.live) f(seqs_.id_of(i, r.generation), r.length);
    }
  }
  /// Calls f(slot, seq_id, length) for every live sequence (slot < max_sequences()).
  template <class F>
  void for_each_sequence_slot(F&& f) const {
    for (std::uint32_t i = 0; i < opt_.max_sequences; ++i) {
      const seq_record& r = seqs_.at(i);
      if (r.live) f(i, seqs_.id_of(i, r.generation), r.length);
    }
  }

  /// Every structural invariant: each pool's free list and counts, block and sequence
  /// bookkeeping, and that page refcounts equal the number of blocks naming them (plus
  /// pages the caller holds, which the caller passes as `outstanding`).
  status check_invariants(std::uint32_t outstanding_pages = 0) const {
    status st;
    detail::for_each_index<num_tiers>([&](auto I) {
      if (st) (void)(st = std::get<I>(pools_).check_integrity());
    });
    if (!st) return st;
    // Block refcounts: sequences' references plus external ones (prefix index) are
    // at least the sequences' count.
    std::vector<std::uint32_t> seq_refs(block_capacity_, 0);
    std::uint32_t seqs = 0;
    for (std::uint32_t i = 0; i < opt_.max_sequences; ++i) {
      const seq_record& r = seqs_.at(i);
      if (!r.live) {
        if (!r.blocks.empty() || r.reserved != 0)
          return status::make(errc::corrupt_data, "free sequence slot ", i,
                              " holds pages or a reservation");
        continue;
      }
      ++seqs;
      if (r.reserved < 0 || r.reserved > max_sequence_tokens - r.length ||
          r.blocks.size() != pages_for(r.length + r.reserved))
        return status::make(errc::corrupt_data, "sequence slot ", i, " has ", r.blocks.size(),
                            " logical pages for ", r.length, " tokens and ", r.reserved,
                            " reserved");
      const std::size_t committed = committed_pages(r);
      for (std::size_t j = 0; j < r.blocks.size(); ++j) {
        const std::uint32_t b = r.blocks[j];
        const block_meta& m = (*block_meta_)[b];
        if (m.state == page_state::free)
          return status::make(errc::corrupt_data, "sequence slot ", i, " names free block ", b);
        // Pages past the committed ones belong to the reservation only: open and empty.
        const bool last = j + 1 == committed;
        const std::int64_t fill = j >= committed ? 0
                                  : last         ? r.length - std::int64_t(j) * page_tokens
                                                 : page_tokens;
        if (std::int64_t(m.fill) != fill)
          return status::make(errc::corrupt_data, "block ", b, " fill ", m.fill, " != ", fill);
        if ((m.state == page_state::open) != (fill < page_tokens))
          return status::make(errc::corrupt_data, "block ", b,
                              " open/sealed state disagrees with its fill");
        ++seq_refs[b];
      }
    }
    if (seqs != seqs_.live())
      return status::make(errc::corrupt_data, "live sequence count ", seqs_.live(), " != ", seqs);
    return check_blocks(seq_refs, outstanding_pages);
  }

 protected:
  /// No block (a page list entry not made yet).
  static constexpr std::uint32_t no_block = std::numeric_limits<std::uint32_t>::max();
  // The store's members the sequence operations use (a dependent base's names are not found
  // unqualified).
  using store::block_capacity_;
  using store::block_meta_;
  using store::can_allocate_block_entries;
  using store::can_allocate_blocks;
  using store::check_blocks;
  using store::drop_block;
  using store::layers_;
  using store::new_block;
  using store::num_tiers;
  using store::page_of;
  using store::pools_;
  using store::structure_epoch_;
  using typename store::block_meta;

  using seq_table = sequence_table<MetaAlloc>;        ///< the sequence slots
  using block_list = typename seq_table::block_list;  ///< a slot's block indices
  using seq_record = typename seq_table::record;      ///< one slot

  /// Allocates nothing: init_pools, seqs_.init and init_blocks do (paged_storage::create).
  sequence_store(const options& opt, PageAlloc&& pa, MetaAlloc&& ma)
      : store(opt.num_layers, std::move(pa), std::move(ma)), opt_(opt) {}
  ~sequence_store() {
    // Sequences first (they hold block references), then the blocks and pools (~block_store).
    seqs_.reset();
  }

  /// The record of live sequence s, or nullptr (bad_seq(s) says why).
  const seq_record* find(seq_id s) const { return seqs_.find(s); }
  /// The record of live sequence s, or nullptr (bad_seq(s) says why).
  seq_record* find(seq_id s) { return seqs_.find(s); }
  /// Why find(s) failed.
  status bad_seq(seq_id s) const { return seqs_.bad(s); }

  /// capacity_exhausted (nothing changed) unless v can hold n entries.
  template <class V>
  static status reserve_list(V& v, std::size_t n) {
    try {
      v.reserve(n);
    } catch (const allocation_failure& e) {
      return status::make(errc::capacity_exhausted, "page table growth to ", n,
                          " entries failed; nothing changed (", e.get_status(), ")");
    }
    return {};
  }

  /// Logical pages that hold `tokens` tokens.
  static std::size_t pages_for(std::int64_t tokens) {
    return std::size_t((tokens + page_tokens - 1) / page_tokens);
  }
  /// Logical pages of r's committed tokens.
  static std::size_t committed_pages(const seq_record& r) { return pages_for(r.length); }
  /// Logical pages of r's tokens in `scope`.
  static std::size_t pages_in(const seq_record& r, index_scope scope) {
    return pages_for(r.length + (scope == index_scope::readable ? r.reserved : 0));
  }

  options opt_;     ///< what create was given
  seq_table seqs_;  ///< the sequence slots
};

}  // namespace tierkv
