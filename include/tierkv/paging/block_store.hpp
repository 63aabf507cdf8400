// SPDX-License-Identifier: Apache-2.0
// The block store under a paged_storage: one page pool per tier and the block table. A block is
// one logical page across all layers: its refcount (the holders sharing it: sequences, the prefix
// index), fill, open / sealed state and generation, and one physical page per layer, on which it
// holds one reference. The operations on single pages (allocate, retain, release, replace) and on
// blocks (check, retain, release) live here; sequences do not: paged_storage derives from the
// store, keeps the sequence table (sequence_table.hpp) and decides which blocks a sequence holds.
#pragma once

#include "tierkv/core/config.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/memory/page_pool.hpp"
#include "tierkv/paging/storage_types.hpp"

namespace tierkv {

/// The pools and the block table of a paged_storage, with the operations on single pages and
/// blocks (see the file comment). paged_storage is its only user: it derives from it and adds
/// the sequences.
template <class Geometry, class Tiers, allocator_policy PageAlloc, host_allocator_policy MetaAlloc>
class block_store {
  static_assert(is_geometry_v<Geometry>, "paged_storage: Geometry must be a tierkv::geometry<...>");
  static_assert(check_allocator_policy<PageAlloc>());
  static_assert(check_allocator_policy<MetaAlloc>());

 public:
  static constexpr int num_tiers = Tiers::size;  ///< tiers (one pool each)
  /// The pool of tier I.
  template <int I>
  using pool_type =
      page_pool<detail::tier_layout<Geometry, tier_at_t<Tiers, I>>, PageAlloc, MetaAlloc>;

  block_store(const block_store&) = delete;
  block_store& operator=(const block_store&) = delete;

  // ---- sizes and accessors ---------------------------------------------------------------
  /// Model layers.
  int num_layers() const noexcept { return layers_; }
  /// Logical pages (blocks) that can be live at once.
  std::uint32_t block_capacity() const noexcept { return block_capacity_; }
  /// Blocks live now.
  std::uint32_t live_blocks() const noexcept { return live_blocks_; }
  /// The page allocator.
  PageAlloc& page_alloc() noexcept { return page_alloc_; }
  /// The page allocator.
  const PageAlloc& page_alloc() const noexcept { return page_alloc_; }
  /// The bookkeeping allocator.
  MetaAlloc& meta_alloc() noexcept { return meta_alloc_; }
  /// The bookkeeping allocator.
  const MetaAlloc& meta_alloc() const noexcept { return meta_alloc_; }
  /// The bookkeeping byte lines (report.hpp).
  storage_lines& lines() noexcept { return lines_; }
  /// The bookkeeping byte lines (report.hpp).
  const storage_lines& lines() const noexcept { return lines_; }

  /// The pool of tier I.
  template <int I>
  pool_type<I>& pool() noexcept {
    return std::get<I>(pools_);
  }
  /// The pool of tier I.
  template <int I>
  const pool_type<I>& pool() const noexcept {
    return std::get<I>(pools_);
  }
  /// Plain views of every pool, in tier order (what attention and kernels read).
  std::array<pool_view, num_tiers> views() const {
    std::array<pool_view, num_tiers> v{};
    detail::for_each_index<num_tiers>([&](auto I) { v[I] = std::get<I>(pools_).view(); });
    return v;
  }
  /// Free pages of a tier's pool.
  std::uint32_t free_pages(int tier) const {
    std::uint32_t n = 0;
    detail::with_index<num_tiers>(tier, [&](auto I) { n = std::get<I>(pools_).free_count(); });
    return n;
  }

  // ---- pages -----------------------------------------------------------------------------
  /// A page of `tier` owned by the caller (refcount 1, open) until it is published by
  /// replace_page or dropped by release_page. The conversion path fills it first.
  result<page_id> allocate_page(int tier) {
    if (tier < 0 || tier >= num_tiers) return status::out_of_range("tier", tier, num_tiers);
    result<page_id> out = status(errc::invalid_argument, "unreachable");
    detail::with_index<num_tiers>(tier,
                                  [&](auto I) { (void)(out = std::get<I>(pools_).allocate()); });
    return out;
  }
  /// Drops a caller-owned reference: a page from allocate_page that was not published, or
  /// one taken by retain_page. The page table's own reference is never dropped here.
  status release_page(page_id p) {
    return on_pool(p, [&](auto& pl) {
      if (auto c = pl.check(p); !c) return c;
      if ((pl.owner_flags(p) & published_flag) && pl.refcount(p) <= 1)
        return status::make(errc::not_writable, "release_page: ", p,
                            " is published in a page table; release its sequences instead");
      return pl.release(p);
    });
  }
  /// One more reference to a live page, owned by the caller until release_page. A device
  /// driver takes one on a page it is about to replace, so the slot is not handed out again
  /// while decodes in flight may still read it (cuda/retier/driver.cuh).
  status retain_page(page_id p) {
    return on_pool(p, [&](auto& pl) { return pl.retain(p); });
  }
  /// Whether p is the page a block names now (not a caller-owned or retired page).
  bool page_published(page_id p) const {
    bool out = false;
    (void)on_pool(p, [&](const auto& pl) {
      out = (pl.owner_flags(p) & published_flag) != 0;
      return status{};
    });
    return out;
  }
  /// stale_id / out_of_range unless p names a live page.
  status check_page(page_id p) const {
    return on_pool(p, [&](const auto& pl) { return pl.check(p); });
  }
  /// References held on p.
  std::uint32_t page_refcount(page_id p) const {
    std::uint32_t n = 0;
    (void)on_pool(p, [&](const auto& pl) {
      n = pl.refcount(p);
      return status{};
    });
    return n;
  }

  /// Host pointer to a page's bytes (host-visible pools only).
  result<std::span<std::uint8_t>> page_bytes(page_id p) requires(PageAlloc::host_accessible) {
    std::span<std::uint8_t> out;
    auto st = on_pool(p, [&](auto& pl) {
      if (auto c = pl.check(p); !c) return c;
      out = std::span<std::uint8_t>(pl.host_page(p), pl.page_bytes);
      return status{};
    });
    if (!st) return st;
    return out;
  }

  /// paged_storage::replace_page(seq, ...) for a block: its layer `layer` becomes new_page for
  /// every holder.
  status replace_page(block_ref b, int layer, page_id expected_old, page_id new_page) {
    if (auto st = can_replace_page(b, layer, expected_old, new_page); !st) return st;
    (void)on_pool(new_page, [&](auto& pl) {
      (void)pl.seal(new_page);
      return pl.set_owner_flags(new_page, published_flag);
    });
    page_id& slot =
        (*block_pages_)[std::size_t(b.index) * std::size_t(layers_) + std::size_t(layer)];
    const page_id old = slot;
    slot = new_page;
    return unpublish(old);
  }
  /// replace_page's checks alone, changing nothing: once they pass, replace_page with the same
  /// arguments cannot fail (a caller publishing several conversions at once checks them all
  /// first, tier_controller::make_room).
  status can_replace_page(block_ref b, int layer, page_id expected_old, page_id new_page) const {
    if (auto st = check_block(b); !st) return st;
    if (layer < 0 || layer >= layers_) return status::out_of_range("layer", layer, layers_);
    const block_meta& m = (*block_meta_)[b.index];
    if (m.state != page_state::sealed)
      return status::make(errc::not_writable, "replace_page: logical page (block ", b.index,
                          ") is open; only sealed pages are converted");
    const page_id slot = page_of(b.index, layer);
    if (!(slot == expected_old))
      return status::make(errc::stale_id, "replace_page: expected ", expected_old, " at layer ",
                          layer, " but ", slot, " is published");
    return check_fresh_page(new_page, "replace_page");
  }

  // ---- blocks (for the prefix index) ------------------------------------------------------
  /// stale_id / out_of_range unless b names a live block (its slot at b's generation).
  status check_block(block_ref b) const {
    if (!b.valid() || b.index >= block_capacity_)
      return status::out_of_range("block", b.index, block_capacity_);
    const block_meta& m = (*block_meta_)[b.index];
    if (m.state == page_state::free || m.generation != b.generation)
      return status::make(errc::stale_id, "block ", b.index, "@", b.generation, " is stale (now ",
                          m.state == page_state::free ? "free" : "reused", ")");
    return {};
  }
  /// References held on b (0 when b is stale).
  std::uint32_t block_refcount(block_ref b) const {
    return check_block(b) ? (*block_meta_)[b.index].refcount : 0;
  }
  /// Whether b is live and sealed (full, immutable).
  bool block_sealed(block_ref b) const {
    return check_block(b) && (*block_meta_)[b.index].state == page_state::sealed;
  }
  /// The page layer `layer` of b names (b live, layer valid).
  page_id block_page(block_ref b, int layer) const { return page_of(b.index, layer); }
  /// One more reference to sealed block b, owned by the caller until release_block.
  status retain_block(block_ref b) {
    if (auto st = check_block(b); !st) return st;
    if ((*block_meta_)[b.index].state != page_state::sealed)
      return status::make(errc::not_writable, "retain_block: block ", b.index,
                          " is open (private)");
    ++(*block_meta_)[b.index].refcount;
    return {};
  }
  /// Drops one reference to a block (taken by retain_block); its pages are freed with the last.
  status release_block(block_ref b) {
    if (auto st = check_block(b); !st) return st;
    drop_block(b.index);
    return {};
  }
  /// f(block_ref, fill, refcount) for each live block.
  template <class F>
  void for_each_block(F&& f) const {
    for (std::uint32_t b = 0; b < block_capacity_; ++b) {
      const block_meta& m = (*block_meta_)[b];
      if (m.state != page_state::free) f(block_ref{b, m.generation}, int(m.fill), m.refcount);
    }
  }
  /// Whether p is free, open or sealed.
  page_state page_state_of(page_id p) const {
    page_state st = page_state::free;
    (void)on_pool(p, [&](const auto& pl) {
      st = pl.state(p);
      return status{};
    });
    return st;
  }

 protected:
  /// The owner flag of a page a block names (published): release_page refuses to drop the
  /// block's reference.
  static constexpr std::uint8_t published_flag = 1;

  /// Drops a block's reference to one of its pages. A page is named by one block slot, so
  /// it is no longer published even when the caller still holds a reference (retain_page).
  status unpublish(page_id p) {
    return on_pool(p, [&](auto& pl) {
      if (auto c = pl.check(p); !c) return c;
      (void)pl.set_owner_flags(p, 0);
      return pl.release(p);
    });
  }
  /// A block: its holders, its slot's generation (bumped when freed), its tokens and its state.
  struct block_meta {
    std::uint32_t refcount = 0;           ///< holders (sequences, prefix index)
    std::uint32_t generation = 0;         ///< of the slot: a block_ref of another one is stale
    std::uint32_t fill = 0;               ///< tokens written
    page_state state = page_state::free;  ///< free, open (private to one sequence) or sealed
  };
  /// A bookkeeping vector charged to an accounting line.
  template <class T>
  using counted_vector = std::vector<T, counted_allocator<T, MetaAlloc>>;
  /// Allocates nothing: init_pools and init_blocks do (paged_storage::create).
  block_store(int layers, PageAlloc&& pa, MetaAlloc&& ma)
      : layers_(layers), page_alloc_(std::move(pa)), meta_alloc_(std::move(ma)) {}
  ~block_store() {
    // Blocks first (they hold page references), then the pools.
    block_meta_.reset();
    block_pages_.reset();
    block_free_.reset();
  }

  /// A vector allocator charged to the page_tables line.
  template <class T>
  counted_allocator<T, MetaAlloc> table_alloc() {
    return counted_allocator<T, MetaAlloc>(meta_alloc_, lines_.page_tables);
  }
  /// Every tier's pool, pages_per_tier[t] pages in tier t.
  status init_pools(const std::array<std::uint32_t, num_tiers>& pages_per_tier) {
    status st;
    detail::for_each_index<num_tiers>([&](auto I) {
      if (st)
        (void)(st = std::get<I>(pools_).init(page_alloc_, meta_alloc_, lines_.pool_bookkeeping,
                                             pages_per_tier[I], format_index(I)));
    });
    return st;
  }
  /// The block table, for total_pages pages over all pools.
  status init_blocks(std::uint64_t total_pages) {
    // A live block holds num_layers distinct live pages, so this many blocks can exist.
    block_capacity_ = std::uint32_t(total_pages / std::uint64_t(layers_));
    try {
      block_meta_.emplace(std::size_t(block_capacity_), block_meta{}, table_alloc<block_meta>());
      block_pages_.emplace(std::size_t(block_capacity_) * std::size_t(layers_), page_id{},
                           table_alloc<page_id>());
      block_free_.emplace(table_alloc<std::uint32_t>());
      block_free_->reserve(block_capacity_);
      for (std::uint32_t i = block_capacity_; i-- > 0;) block_free_->push_back(i);
    } catch (const allocation_failure& e) {
      return e.get_status();
    }
    return {};
  }

  /// capacity_exhausted unless n blocks can be opened (entries only).
  status can_allocate_block_entries(std::size_t n) const {
    if (block_free_->size() < n)
      return status::make(errc::capacity_exhausted, "block table has ", block_free_->size(),
                          " free entries, ", n, " needed");
    return {};
  }
  /// capacity_exhausted unless n blocks can be opened (entries and tier-0 pages).
  status can_allocate_blocks(std::size_t n) const {
    if (n == 0) return {};
    const std::uint64_t pages = std::uint64_t(n) * std::uint64_t(layers_);
    if (pool<0>().free_count() < pages)
      return status::make(errc::capacity_exhausted, "tier 0 pool has ", pool<0>().free_count(),
                          " free pages, ", n, " new logical pages x ", layers_, " layers need ",
                          pages);
    return can_allocate_block_entries(n);
  }

  /// Caller checked can_allocate_blocks: the tier-0 allocations below cannot fail.
  std::uint32_t new_block() {
    const std::uint32_t b = block_free_->back();
    block_free_->pop_back();
    block_meta& m = (*block_meta_)[b];
    m.refcount = 1;
    m.fill = 0;
    m.state = page_state::open;
    for (int l = 0; l < layers_; ++l) {
      const page_id p = *pool<0>().allocate();
      (void)pool<0>().set_owner_flags(p, published_flag);
      (*block_pages_)[std::size_t(b) * std::size_t(layers_) + std::size_t(l)] = p;
    }
    ++live_blocks_;
    return b;
  }

  /// invalid_argument unless p is a fresh caller-owned page (allocate_page's: open, one
  /// reference, named by no block): what replace_page and adopt_block take.
  status check_fresh_page(page_id p, const char* what) const {
    return on_pool(p, [&](const auto& pl) -> status {  // one lookup (a restore's 130K pages)
      if (auto st = pl.check(p); !st) return st;
      const page_slot_meta& m = pl.slot_meta(p.slot);
      if ((m.owner_flags & published_flag) != 0 || m.state != page_state::open || m.refcount != 1)
        return status::make(errc::invalid_argument, what, ": ", p,
                            " is not a fresh caller-owned page from allocate_page");
      return status{};
    });
  }

  /// A new block of `fill` tokens holding the caller's fresh pages, one per layer (each passed
  /// check_fresh_page, no two alike), sealed with its pages when full. The caller checked
  /// can_allocate_block_entries(1): nothing here can fail.
  std::uint32_t adopt_block(std::span<const page_id> pages, std::uint32_t fill) {
    const std::uint32_t b = block_free_->back();
    block_free_->pop_back();
    block_meta& m = (*block_meta_)[b];
    m.refcount = 1;
    m.fill = fill;
    const bool full = fill == std::uint32_t(Geometry::page_tokens);
    m.state = full ? page_state::sealed : page_state::open;
    for (int l = 0; l < layers_; ++l) {
      const page_id p = pages[std::size_t(l)];
      (void)on_pool(p, [&](auto& pl) {
        if (full) (void)pl.seal(p);
        return pl.set_owner_flags(p, published_flag);
      });
      (*block_pages_)[std::size_t(b) * std::size_t(layers_) + std::size_t(l)] = p;
    }
    ++live_blocks_;
    return b;
  }

  /// Drops one reference to block b; the last frees its pages and the entry.
  void drop_block(std::uint32_t b) {
    block_meta& m = (*block_meta_)[b];
    if (--m.refcount != 0) return;
    for (int l = 0; l < layers_; ++l) {
      page_id& p = (*block_pages_)[std::size_t(b) * std::size_t(layers_) + std::size_t(l)];
      (void)unpublish(p);
      p = page_id{};
    }
    m.state = page_state::free;
    m.fill = 0;
    ++m.generation;
    block_free_->push_back(b);
    --live_blocks_;
    ++structure_epoch_;
  }

  /// The page layer `layer` of block b names.
  page_id page_of(std::uint32_t b, int layer) const {
    return (*block_pages_)[std::size_t(b) * std::size_t(layers_) + std::size_t(layer)];
  }

  /// f(the pool of p's tier); out_of_range for a tier that does not exist.
  template <class F>
  status on_pool(page_id p, F&& f) const {
    if (p.format >= num_tiers)
      return status::out_of_range("page format (tier)", unsigned(p.format), num_tiers);
    status st;
    detail::with_index<num_tiers>(p.format, [&](auto I) { (void)(st = f(std::get<I>(pools_))); });
    return st;
  }
  /// f(the pool of p's tier), mutable.
  template <class F>
  status on_pool(page_id p, F&& f) {
    if (p.format >= num_tiers)
      return status::out_of_range("page format (tier)", unsigned(p.format), num_tiers);
    status st;
    detail::with_index<num_tiers>(p.format, [&](auto I) { (void)(st = f(std::get<I>(pools_))); });
    return st;
  }

  /// The block and page half of paged_storage::check_invariants, given the references the
  /// sequences hold on each block (seq_refs) and the pages the caller holds.
  status check_blocks(const std::vector<std::uint32_t>& seq_refs,
                      std::uint32_t outstanding_pages) const {
    std::array<std::uint64_t, num_tiers> named{};
    std::uint32_t blocks = 0;
    for (std::uint32_t b = 0; b < block_capacity_; ++b) {
      const block_meta& m = (*block_meta_)[b];
      if (m.state == page_state::free) {
        if (m.refcount != 0)
          return status::make(errc::corrupt_data, "free block ", b, " has refcount ", m.refcount);
        continue;
      }
      ++blocks;
      if (m.refcount < seq_refs[b] || m.refcount == 0)
        return status::make(errc::corrupt_data, "block ", b, " refcount ", m.refcount, " < ",
                            seq_refs[b], " sequence references");
      if (m.state == page_state::open && m.refcount != 1)
        return status::make(errc::corrupt_data, "open block ", b, " is shared (refcount ",
                            m.refcount, ")");
      for (int l = 0; l < layers_; ++l) {
        const page_id p = page_of(b, l);
        if (auto c = check_page(p); !c) return c;
        ++named[p.format];
        if (!page_published(p))
          return status::make(errc::corrupt_data, "block ", b, " layer ", l, " names unpublished ",
                              p);
        const page_state ps = page_state_of(p);
        if (ps != m.state)
          return status::make(errc::corrupt_data, "block ", b, " layer ", l,
                              " page state differs from the block's");
      }
    }
    if (blocks != live_blocks_)
      return status::make(errc::corrupt_data, "live block count ", live_blocks_, " != ", blocks);
    std::uint64_t live_total = 0;
    std::uint64_t named_total = 0;
    detail::for_each_index<num_tiers>([&](auto I) {
      live_total += std::get<I>(pools_).live_count();
      named_total += named[I];
    });
    // Each block holds exactly one reference to each of its pages and pages are never
    // shared between blocks, so live pages = named pages + the caller's outstanding pages.
    if (live_total != named_total + outstanding_pages)
      return status::make(errc::corrupt_data, "pools hold ", live_total,
                          " live pages, blocks name ", named_total, ", caller holds ",
                          outstanding_pages);
    return {};
  }

  int layers_ = 1;        ///< model layers: pages per block
  PageAlloc page_alloc_;  ///< allocates the pools' page slabs
  MetaAlloc meta_alloc_;  ///< allocates the host bookkeeping
  storage_lines lines_;   ///< what the bookkeeping is charged to
  /// Tier t's pool at index t.
  typename detail::pool_tuple<Geometry, Tiers, PageAlloc, MetaAlloc>::type pools_;
  std::optional<counted_vector<block_meta>> block_meta_;  ///< per block
  std::optional<counted_vector<page_id>> block_pages_;    ///< per block and layer, [block][layer]
  std::optional<counted_vector<std::uint32_t>> block_free_;  ///< free block entries, a stack
  std::uint32_t block_capacity_ = 0;                         ///< block entries
  std::uint32_t live_blocks_ = 0;                            ///< blocks not free
  /// Changes to which sequences hold which blocks (paged_storage::structure_epoch).
  std::uint64_t structure_epoch_ = 0;
};

}  // namespace tierkv
