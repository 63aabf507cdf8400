// SPDX-License-Identifier: Apache-2.0
// Paged KV storage: one page pool per tier, sequences as ordered lists of logical
// pages, per-layer physical pages, refcounted sharing (fork, prefix reuse), and the
// replace hook the tiering engine converts pages through.
//
// Parts, one idea per header: storage_types.hpp (options, block_ref, room hook, slot_mapping,
// tier loops), sequence_table.hpp (sequence slots, ids, page lists), token_writer.hpp (host
// encode / decode of token vectors); this header holds the block table, the pools and the
// operations that tie them together (append, reserve / write_layer / commit, fork, replace).
//
// Ownership, two levels:
//   sequence --(logical page i)--> block --(layer l)--> physical page (tier, slot, generation)
// A block is one logical page across all layers. Sequences and the prefix index hold
// references to blocks (fork and prefix reuse share whole logical pages); a block
// holds one reference to each of its num_layers physical pages. Replacing a layer's
// page inside a block is seen at once by every holder of the block, which is what
// "all holders of a shared page see the new one" needs, with one update.
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/memory/page_pool.hpp"
#include "tierkv/paging/sequence_table.hpp"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/paging/token_writer.hpp"

namespace tierkv {

/// Sequences, per-layer page tables and one page pool per tier, with refcounted sharing of
/// sealed pages (fork, prefix reuse) and page replacement for conversions (see the file
/// comment and docs/paging.md). One thread at a time (docs/threading.md).
template <class Geometry, class Tiers, allocator_policy PageAlloc = host_allocator,
          host_allocator_policy MetaAlloc = host_allocator>
class paged_storage {
  static_assert(is_geometry_v<Geometry>, "paged_storage: Geometry must be a tierkv::geometry<...>");
  static_assert(check_allocator_policy<PageAlloc>());
  static_assert(check_allocator_policy<MetaAlloc>());

 public:
  using geometry = Geometry;                                 ///< the cache's shape
  using tier_list = Tiers;                                   ///< the tiers, tier 0 first
  using page_allocator = PageAlloc;                          ///< allocator of the page slabs
  using meta_allocator = MetaAlloc;                          ///< allocator of the host bookkeeping
  static constexpr int num_tiers = Tiers::size;              ///< tiers (one pool each)
  static constexpr int page_tokens = Geometry::page_tokens;  ///< tokens per page
  static constexpr int kv_heads = Geometry::kv_heads;        ///< KV heads
  static constexpr int head_dim = Geometry::head_dim;        ///< scalars per head vector
  static constexpr std::int64_t max_sequence_tokens =
      std::numeric_limits<std::int32_t>::max();  ///< longest sequence (int32 lengths)
  /// The page layout of tier I.
  template <int I>
  using layout = detail::tier_layout<Geometry, tier_at_t<Tiers, I>>;
  /// The key codec of tier I.
  template <int I>
  using key_codec = typename layout<I>::key_codec;
  /// The value codec of tier I.
  template <int I>
  using value_codec = typename layout<I>::value_codec;
  /// The pool of tier I.
  template <int I>
  using pool_type = page_pool<layout<I>, PageAlloc, MetaAlloc>;
  using options = storage_options<num_tiers>;  ///< what create() takes

  paged_storage(const paged_storage&) = delete;
  paged_storage& operator=(const paged_storage&) = delete;
  ~paged_storage() {
    // Sequences and blocks first (they hold page references), then the pools.
    seqs_.reset();
    block_meta_.reset();
    block_pages_.reset();
    block_free_.reset();
  }

  /// Builds a storage; every allocation failure is returned, nothing leaks.
  static result<std::unique_ptr<paged_storage>> create(const options& opt,
                                                       PageAlloc page_alloc = {},
                                                       MetaAlloc meta_alloc = {}) {
    if (auto st = validate(opt); !st) return st;
    std::uint64_t total_pages = 0;
    for (std::uint32_t n : opt.pages_per_tier) total_pages += n;
    std::unique_ptr<paged_storage> s(
        new paged_storage(opt, std::move(page_alloc), std::move(meta_alloc)));
    if (auto st = s->init(total_pages); !st) return st;
    return result<std::unique_ptr<paged_storage>>(std::move(s));
  }

  /// Every option against its limit, allocating nothing (create calls it first).
  static status validate(const options& opt) {
    if (opt.num_layers < 1 || opt.num_layers > 4096)
      return status::make(errc::invalid_argument, "num_layers = ", opt.num_layers,
                          " must lie in [1, 4096]");
    const std::uint32_t max_seqs = opt.max_sequences;
    if (max_seqs < 1 || max_seqs > (1u << 24))
      return status::make(errc::invalid_argument, "max_sequences = ", max_seqs,
                          " must lie in [1, 2^24]");
    const int head_base = opt.head_base;
    if (head_base < 0 || head_base > (1 << 24))
      return status::make(errc::invalid_argument, "head_base = ", head_base,
                          " must lie in [0, 2^24]");
    for (int t = 0; t < num_tiers; ++t)
      if (opt.pages_per_tier[std::size_t(t)] == 0)
        return status::make(errc::invalid_argument, "pages_per_tier[", t,
                            "] = 0: every tier needs a pool");
    if (opt.pages_per_tier[0] < std::uint32_t(opt.num_layers))
      return status::make(errc::invalid_argument, "pages_per_tier[0] = ", opt.pages_per_tier[0],
                          " is below num_layers = ", opt.num_layers,
                          ": not even one logical page fits");
    return {};
  }

  // ---- sizes and accessors ---------------------------------------------------------------
  /// Model layers.
  int num_layers() const noexcept { return layers_; }
  /// Sequence slots.
  std::uint32_t max_sequences() const noexcept { return opt_.max_sequences; }
  /// Logical pages (blocks) that can be live at once.
  std::uint32_t block_capacity() const noexcept { return block_capacity_; }
  /// Sequences live now.
  std::uint32_t live_sequences() const noexcept { return seqs_.live(); }
  /// Blocks live now.
  std::uint32_t live_blocks() const noexcept { return live_blocks_; }
  /// Counts the changes to which sequences hold which blocks other than a sequence growing:
  /// a block freed, a fork, a release, a sequence started from shared blocks. Between two
  /// equal values every block keeps its holders and logical positions, and only a sequence's
  /// own length (its new and newly sealed pages) moves its blocks' facts
  /// (tier_controller::refresh uses this to visit only the sequences that grew).
  std::uint64_t structure_epoch() const noexcept { return structure_epoch_; }
  /// Scalars clipped by encoders so far (encode_stats).
  std::uint64_t saturations() const noexcept { return stats_.saturated; }
  /// The options it was created with.
  const options& config() const noexcept { return opt_; }
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

  /// Appends n tokens to every layer. keys and values hold n * num_layers * kv_heads *
  /// head_dim floats, laid out [layer][token][kv_head][dim]. Either all tokens are
  /// appended or nothing changes (strong guarantee): sizes, finiteness, the block table
  /// and bookkeeping memory are checked and reserved first, then make_room is called
  /// (room_hook), then the tier-0 pool's free pages are checked, then the first write.
  /// The same pages and bytes as reserve + write_layer for every layer + commit (tested);
  /// refused while the sequence has a reservation outstanding. n = 0 with empty buffers
  /// appends nothing; n = 0 with data is a size mismatch (invalid_argument).
  template <room_hook MakeRoom = no_room>
  status append(seq_id s, std::int64_t n, std::span<const float> keys,
                std::span<const float> values,
                MakeRoom&& make_room = {}) requires PageAlloc::host_accessible {
    seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (n < 0)
      return status::make(errc::invalid_argument, "append: token count = ", n, " is negative");
    // Zero tokens with empty buffers is a no-op; with data, the count disagrees with the
    // buffers (a caller's bug), refused as any other size mismatch.
    if (n == 0) return check_append_sizes(0, keys, values);
    if (r->reserved != 0) return reservation_outstanding(s, *r, "append");
    if (n > max_sequence_tokens - r->length)
      return status::exceeds(errc::out_of_range, "append: sequence length after append",
                             r->length + n, max_sequence_tokens);
    const std::size_t per_layer = std::size_t(n) * kv_heads * head_dim;
    if (auto st = check_append_sizes(n, keys, values); !st) return st;
    if (auto st = check_finite(keys, "keys", n, "append", 0, "appended"); !st) return st;
    if (auto st = check_finite(values, "values", n, "append", 0, "appended"); !st) return st;
    if (auto st = open_pages(*r, n, make_room); !st) return st;
    const std::int64_t len = r->length;
    for (int l = 0; l < layers_; ++l)
      encode_layer(*r, len, n, l, keys.data() + std::size_t(l) * per_layer,
                   values.data() + std::size_t(l) * per_layer);
    seal_filled(*r, len, n);
    r->length = len + n;
    return {};
  }

  // ---- layer-by-layer writes: reserve, write every layer, commit ----------------------------
  /// reserve makes room for the sequence's next n tokens in the append tier (tier 0), opening
  /// ceil((length + n) / page_tokens) - logical pages new logical pages (one tier-0 page per
  /// layer each), and fills `out` (slot_mapping: the slot of every (layer, token) and the
  /// offset of every token), which cuda::append_inputs takes as is. Metadata only: nothing is
  /// encoded and no bookkeeping is allocated once the page list has grown to its length. The
  /// checks come in append's order (the sequence, n, the mapping's sizes, the length limit,
  /// the block table and page-list memory, then make_room (room_hook), then the tier-0 pool),
  /// and a refused reserve changes nothing. One reservation per sequence at a time.
  ///
  /// Until commit the reserved tokens are not part of the sequence: length, logical_pages,
  /// page, block_of, read_token, the index builders and so attention see only committed
  /// tokens; a reservation's pages are open and private, so no conversion, fork or prefix
  /// index touches them and its slots stay valid. commit(s, m), m <= reserved, makes the
  /// first m tokens live (length grows by m; pages they fill are sealed, as append seals them)
  /// and ends the reservation: the pages opened only for the other reserved tokens go back to
  /// their pool (speculative tokens that were not accepted). cancel(s) is commit(s, 0);
  /// release(s) drops a reservation with the sequence. Every layer of a committed token must
  /// have been written (write_layer, cuda::append or the engine's own kernel) before commit:
  /// the storage cannot tell, and an unwritten slot holds whatever bytes the page held.
  template <room_hook MakeRoom = no_room>
  status reserve(seq_id s, std::int64_t n, slot_mapping out = {}, MakeRoom&& make_room = {}) {
    seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (n < 0)
      return status::make(errc::invalid_argument, "reserve: token count = ", n, " is negative");
    if (r->reserved != 0) return reservation_outstanding(s, *r, "reserve");
    if (auto st = check_mapping(out, n); !st) return st;
    if (n == 0) return {};
    if (n > max_sequence_tokens - r->length)
      return status::exceeds(errc::out_of_range, "reserve: sequence length after commit",
                             r->length + n, max_sequence_tokens);
    if (auto st = open_pages(*r, n, make_room); !st) return st;
    r->reserved = n;
    fill_mapping(*r, out);
    return {};
  }

  /// The slot mapping of the sequence's outstanding reservation again (same layout as
  /// reserve's); invalid_argument when there is none.
  status slots(seq_id s, slot_mapping out) const {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (r->reserved == 0)
      return status::make(errc::invalid_argument, "slots: ", s, " has no reservation");
    if (auto st = check_mapping(out, r->reserved); !st) return st;
    fill_mapping(*r, out);
    return {};
  }

  /// Encodes one layer of every reserved token on the host with tier 0's codecs, exactly as
  /// append encodes that layer (byte for byte). keys and values hold reserved * kv_heads *
  /// head_dim floats, [token][kv_head][dim]. Sizes and finiteness are checked first; a refusal
  /// writes nothing. Writing a layer again overwrites it (the tokens are not live yet).
  status write_layer(seq_id s, int layer, std::span<const float> keys,
                     std::span<const float> values) requires PageAlloc::host_accessible {
    seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (r->reserved == 0)
      return status::make(errc::invalid_argument, "write_layer: ", s,
                          " has no reservation (reserve first)");
    if (layer < 0 || layer >= layers_) return status::out_of_range("layer", layer, layers_);
    const std::int64_t n = r->reserved;
    const std::size_t expect = std::size_t(n) * kv_heads * head_dim;
    if (keys.size() != expect || values.size() != expect)
      return status::make(errc::invalid_argument, "write_layer: ", n, " reserved tokens need ",
                          expect, " floats for keys and for values ([token][kv_head][dim]), got ",
                          keys.size(), " and ", values.size());
    if (auto st = check_finite(keys, "keys", n, "write_layer", layer, "written"); !st) return st;
    if (auto st = check_finite(values, "values", n, "write_layer", layer, "written"); !st)
      return st;
    encode_layer(*r, r->length, n, layer, keys.data(), values.data());
    return {};
  }

  /// Makes the first n reserved tokens live and ends the reservation (see reserve). n = 0
  /// with no reservation is a no-op; n beyond the reservation is refused, changing nothing.
  status commit(seq_id s, std::int64_t n) {
    seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (n < 0 || n > r->reserved)
      return status::make(errc::invalid_argument, "commit: ", n, " tokens, but ", s, " has ",
                          r->reserved, " reserved; nothing committed");
    const std::int64_t len = r->length;
    seal_filled(*r, len, n);
    const std::size_t keep = pages_for(len + n);
    while (r->blocks.size() > keep) {  // opened for tokens not committed: back to the pool
      drop_block(r->blocks.back());
      r->blocks.pop_back();
    }
    r->length = len + n;
    r->reserved = 0;
    return {};
  }
  /// commit(s, 0): gives back the whole reservation.
  status cancel(seq_id s) { return commit(s, 0); }

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
        (void)(copied = pool<0>().copy_page(page_of(tail_copy, l), page_of(src, l)));
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
  result<std::span<std::uint8_t>> page_bytes(page_id p) requires PageAlloc::host_accessible {
    std::span<std::uint8_t> out;
    auto st = on_pool(p, [&](auto& pl) {
      if (auto c = pl.check(p); !c) return c;
      out = std::span<std::uint8_t>(pl.host_page(p), pl.page_bytes);
      return status{};
    });
    if (!st) return st;
    return out;
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
  /// replace_page(seq, ...) for a block.
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
    if (auto st = check_page(new_page); !st) return st;
    if (page_published(new_page) || page_state_of(new_page) != page_state::open ||
        page_refcount(new_page) != 1)
      return status::make(errc::invalid_argument, "replace_page: ", new_page,
                          " is not a fresh caller-owned page from allocate_page");
    return {};
  }

  /// Decodes (layer, token, kv head) of a sequence through its page's tier codecs.
  status read_token(seq_id s, int layer, std::int64_t token, int head, float* key,
                    float* value) const requires PageAlloc::host_accessible {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (layer < 0 || layer >= layers_) return status::out_of_range("layer", layer, layers_);
    if (token < 0 || token >= r->length) return status::out_of_range("token", token, r->length);
    if (head < 0 || head >= kv_heads) return status::out_of_range("kv head", head, kv_heads);
    const page_id p = page_of(r->blocks[std::size_t(token / page_tokens)], layer);
    const int t = int(token % page_tokens);
    const int g = opt_.head_base + head;  // the global head names the rotation
    detail::with_index<num_tiers>(p.format, [&](auto I) {
      decode_token<layout<I>>(std::get<I>(pools_).host_page(p), t, head, layer, g, opt_.codec_seed,
                              key, value);
    });
    return {};
  }

  /// Decodes tokens [first, first + n) of one layer into keys and values ([token][kv_head][dim],
  /// n * kv_heads * head_dim floats each) through each page's tier codecs. The outstanding
  /// reservation's tokens are readable too (first + n <= length + reserved): a chunked prefill
  /// attends to its own chunk's layer before commit, reading what write_layer (or the engine's
  /// kernel) wrote there. Every check comes first; a refusal writes nothing.
  status read_layer(seq_id s, int layer, std::int64_t first, std::int64_t n, std::span<float> keys,
                    std::span<float> values) const requires PageAlloc::host_accessible {
    const seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (layer < 0 || layer >= layers_) return status::out_of_range("layer", layer, layers_);
    const std::int64_t readable = r->length + r->reserved;
    if (first < 0 || n < 0 || first > readable - n)
      return status::make(errc::out_of_range, "read_layer: tokens [", first, ", ", first + n,
                          ") of ", s, ", which has ", r->length, " tokens and ", r->reserved,
                          " reserved");
    const std::size_t expect = std::size_t(n) * kv_heads * head_dim;
    if (keys.size() < expect || values.size() < expect)
      return status::make(errc::invalid_argument, "read_layer: ", n, " tokens need ", expect,
                          " floats for keys and for values, got ", keys.size(), " and ",
                          values.size());
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t pos = first + i;
      const page_id p = page_of(r->blocks[std::size_t(pos / page_tokens)], layer);
      const int t = int(pos % page_tokens);
      for (int h = 0; h < kv_heads; ++h) {
        const std::size_t at = (std::size_t(i) * kv_heads + std::size_t(h)) * head_dim;
        detail::with_index<num_tiers>(p.format, [&](auto I) {
          decode_token<layout<I>>(std::get<I>(pools_).host_page(p), t, h, layer, opt_.head_base + h,
                                  opt_.codec_seed, keys.data() + at, values.data() + at);
        });
      }
    }
    return {};
  }

  // ---- blocks (for the prefix index) ------------------------------------------------------
  status check_block(block_ref b) const {
    if (!b.valid() || b.index >= block_capacity_)
      return status::out_of_range("block", b.index, block_capacity_);
    const block_meta& m = (*block_meta_)[b.index];
    if (m.state == page_state::free || m.generation != b.generation)
      return status::make(errc::stale_id, "block ", b.index, "@", b.generation, " is stale (now ",
                          m.state == page_state::free ? "free" : "reused", ")");
    return {};
  }
  std::uint32_t block_refcount(block_ref b) const {
    return check_block(b) ? (*block_meta_)[b.index].refcount : 0;
  }
  bool block_sealed(block_ref b) const {
    return check_block(b) && (*block_meta_)[b.index].state == page_state::sealed;
  }
  page_id block_page(block_ref b, int layer) const { return page_of(b.index, layer); }
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
  /// f(block_ref, fill, refcount) for each live block.
  template <class F>
  void for_each_block(F&& f) const {
    for (std::uint32_t b = 0; b < block_capacity_; ++b) {
      const block_meta& m = (*block_meta_)[b];
      if (m.state != page_state::free) f(block_ref{b, m.generation}, int(m.fill), m.refcount);
    }
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
  /// Whether p is free, open or sealed.
  page_state page_state_of(page_id p) const {
    page_state st = page_state::free;
    (void)on_pool(p, [&](const auto& pl) {
      st = pl.state(p);
      return status{};
    });
    return st;
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

 private:
  static constexpr std::uint32_t no_block = std::numeric_limits<std::uint32_t>::max();
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
  using seq_table = sequence_table<MetaAlloc>;
  using block_list = typename seq_table::block_list;
  using seq_record = typename seq_table::record;
  struct block_meta {
    std::uint32_t refcount = 0;
    std::uint32_t generation = 0;
    std::uint32_t fill = 0;
    page_state state = page_state::free;
  };
  template <class T>
  using counted_vector = std::vector<T, counted_allocator<T, MetaAlloc>>;

  paged_storage(const options& opt, PageAlloc&& pa, MetaAlloc&& ma)
      : opt_(opt),
        layers_(opt.num_layers),
        page_alloc_(std::move(pa)),
        meta_alloc_(std::move(ma)) {}

  template <class T>
  counted_allocator<T, MetaAlloc> table_alloc() {
    return counted_allocator<T, MetaAlloc>(meta_alloc_, lines_.page_tables);
  }

  status init(std::uint64_t total_pages) {
    status st;
    detail::for_each_index<num_tiers>([&](auto I) {
      if (st)
        (void)(st = std::get<I>(pools_).init(page_alloc_, meta_alloc_, lines_.pool_bookkeeping,
                                             opt_.pages_per_tier[I], format_index(I)));
    });
    if (!st) return st;
    // A live block holds num_layers distinct live pages, so this many blocks can exist.
    block_capacity_ = std::uint32_t(total_pages / std::uint64_t(layers_));
    st = seqs_.init(meta_alloc_, lines_.page_tables, opt_.max_sequences);
    if (!st) return st;
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

  const seq_record* find(seq_id s) const { return seqs_.find(s); }
  seq_record* find(seq_id s) { return seqs_.find(s); }
  status bad_seq(seq_id s) const { return seqs_.bad(s); }

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

  status can_allocate_block_entries(std::size_t n) const {
    if (block_free_->size() < n)
      return status::make(errc::capacity_exhausted, "block table has ", block_free_->size(),
                          " free entries, ", n, " needed");
    return {};
  }
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

  page_id page_of(std::uint32_t b, int layer) const {
    return (*block_pages_)[std::size_t(b) * std::size_t(layers_) + std::size_t(layer)];
  }

  template <class F>
  status on_pool(page_id p, F&& f) const {
    if (p.format >= num_tiers)
      return status::out_of_range("page format (tier)", unsigned(p.format), num_tiers);
    status st;
    detail::with_index<num_tiers>(p.format, [&](auto I) { (void)(st = f(std::get<I>(pools_))); });
    return st;
  }
  template <class F>
  status on_pool(page_id p, F&& f) {
    if (p.format >= num_tiers)
      return status::out_of_range("page format (tier)", unsigned(p.format), num_tiers);
    status st;
    detail::with_index<num_tiers>(p.format, [&](auto I) { (void)(st = f(std::get<I>(pools_))); });
    return st;
  }

  status check_finite(std::span<const float> x, const char* what, std::int64_t n, const char* op,
                      int first_layer, const char* done) const {
    return check_finite_tokens(x, what, n, kv_heads, head_dim, op, first_layer, done);
  }

  static std::size_t pages_for(std::int64_t tokens) {
    return std::size_t((tokens + page_tokens - 1) / page_tokens);
  }
  static std::size_t committed_pages(const seq_record& r) { return pages_for(r.length); }
  static std::size_t pages_in(const seq_record& r, index_scope scope) {
    return pages_for(r.length + (scope == index_scope::readable ? r.reserved : 0));
  }

  // append's buffers hold n * num_layers * kv_heads * head_dim floats each (n bounded by
  // max_sequence_tokens, so the product does not overflow).
  status check_append_sizes(std::int64_t n, std::span<const float> keys,
                            std::span<const float> values) const {
    const std::size_t expect = std::size_t(n) * std::size_t(layers_) * kv_heads * head_dim;
    if (keys.size() != expect || values.size() != expect)
      return status::make(errc::invalid_argument, "append: ", n, " tokens need ", expect,
                          " floats for keys and for values ([layer][token][kv_head][dim]), got ",
                          keys.size(), " and ", values.size());
    return {};
  }
  static status reservation_outstanding(seq_id s, const seq_record& r, const char* op) {
    return status::make(errc::invalid_argument, op, ": ", s, " has a reservation of ", r.reserved,
                        " tokens outstanding; commit or cancel it first");
  }

  status check_mapping(const slot_mapping& out, std::int64_t n) const {
    const std::int64_t stride = out.layer_stride == 0 ? n : out.layer_stride;
    if (!out.slot.empty()) {
      if (stride < n)
        return status::make(errc::invalid_argument,
                            "slot_mapping: layer_stride = ", out.layer_stride, " is below the ", n,
                            " reserved tokens");
      const std::int64_t need = std::int64_t(layers_ - 1) * stride + n;
      if (std::int64_t(out.slot.size()) < need)
        return status::make(errc::invalid_argument, "slot_mapping: slot holds ", out.slot.size(),
                            " entries, ", need, " needed (", layers_, " layers, layer_stride ",
                            stride, ", ", n, " tokens)");
      if (pool<0>().capacity() > std::uint32_t(std::numeric_limits<std::int32_t>::max()))
        return status::exceeds(errc::invalid_argument, "slot_mapping: tier-0 pool slots",
                               pool<0>().capacity(), std::numeric_limits<std::int32_t>::max());
    }
    if (!out.offset.empty() && std::int64_t(out.offset.size()) < n)
      return status::make(errc::invalid_argument, "slot_mapping: offset holds ", out.offset.size(),
                          " entries, ", n, " needed");
    return {};
  }
  /// The reservation's slots and offsets; check_mapping passed.
  void fill_mapping(const seq_record& r, const slot_mapping& out) const {
    const std::int64_t n = r.reserved;
    const std::size_t stride = std::size_t(out.layer_stride == 0 ? n : out.layer_stride);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t pos = r.length + i;
      const std::uint32_t b = r.blocks[std::size_t(pos / page_tokens)];
      if (!out.offset.empty()) out.offset[std::size_t(i)] = std::int32_t(pos % page_tokens);
      if (!out.slot.empty())
        for (int l = 0; l < layers_; ++l)
          out.slot[std::size_t(l) * stride + std::size_t(i)] = std::int32_t(page_of(b, l).slot);
    }
  }

  /// The pages tokens [length, length + n) need, for append and reserve (no reservation is
  /// outstanding, n > 0 and the length limit were checked): block entries and the grown page
  /// list first (built aside, so a refusal gives its memory back exactly), then make_room,
  /// then the tier-0 pool; only then the new blocks. Nothing changes on refusal.
  template <class MakeRoom>
  status open_pages(seq_record& r, std::int64_t n, MakeRoom& make_room) {
    const std::size_t have = r.blocks.size();
    const std::size_t need = pages_for(r.length + n);
    const std::size_t fresh = need - have;
    if (auto st = can_allocate_block_entries(fresh); !st) return st;
    const bool grow = need > r.blocks.capacity();
    block_list grown(r.blocks.get_allocator());
    if (grow) {
      if (auto st = reserve_list(grown, need); !st) return st;
      grown.assign(r.blocks.begin(), r.blocks.end());
    }
    if (fresh > 0)
      if (auto st = make_room(std::uint32_t(fresh * std::size_t(layers_))); !st) return st;
    if (auto st = can_allocate_blocks(fresh); !st) return st;
    if (grow) r.blocks.swap(grown);
    for (std::size_t i = 0; i < fresh; ++i) r.blocks.push_back(new_block());
    return {};
  }

  /// Encodes layer l of tokens [start, start + n) (keys / values: [token][kv_head][dim]) into
  /// their open tier-0 pages; the pages exist (open_pages) and the input is finite.
  void encode_layer(seq_record& r, std::int64_t start, std::int64_t n, int l, const float* kl,
                    const float* vl) {
    encode_token_layer<layout<0>>(
        [&](std::int64_t pos) {
          return pool<0>().host_page(page_of(r.blocks[std::size_t(pos / page_tokens)], l));
        },
        start, n, l, kl, vl, opt_.codec_seed, opt_.head_base, &stats_);
  }

  /// Fill counts and sealing of the pages tokens [start, start + n) land in: a page that is
  /// full is immutable from now on (the controller and the prefix index see it sealed).
  void seal_filled(seq_record& r, std::int64_t start, std::int64_t n) {
    const std::int64_t end = start + n;
    for (std::size_t j = std::size_t(start / page_tokens), e = pages_for(end); j < e; ++j) {
      block_meta& m = (*block_meta_)[r.blocks[j]];
      const std::int64_t fill =
          std::min<std::int64_t>(end - std::int64_t(j) * page_tokens, page_tokens);
      m.fill = std::uint32_t(fill);
      if (fill == page_tokens && m.state == page_state::open) {
        m.state = page_state::sealed;
        for (int l = 0; l < layers_; ++l) (void)pool<0>().seal(page_of(r.blocks[j], l));
      }
    }
  }

  options opt_;
  int layers_ = 1;
  PageAlloc page_alloc_;
  MetaAlloc meta_alloc_;
  storage_lines lines_;
  typename detail::pool_tuple<Geometry, Tiers, PageAlloc, MetaAlloc>::type pools_;
  seq_table seqs_;
  std::optional<counted_vector<block_meta>> block_meta_;
  std::optional<counted_vector<page_id>> block_pages_;
  std::optional<counted_vector<std::uint32_t>> block_free_;
  std::uint32_t block_capacity_ = 0;
  std::uint32_t live_blocks_ = 0;
  std::uint64_t structure_epoch_ = 0;
  encode_stats stats_{};
};

}  // namespace tierkv
