// SPDX-License-Identifier: Apache-2.0
// Paged KV storage: one page pool per tier, sequences as ordered lists of logical
// pages, per-layer physical pages, refcounted sharing (fork, prefix reuse), and the
// replace hook the tiering engine converts pages through.
//
// Parts, one idea per header: storage_types.hpp (options, block_ref, room hook, slot_mapping,
// tier loops), block_store.hpp (the pools and the block table, with the operations on single
// pages and blocks), sequence_store.hpp (the sequences over the blocks: create, fork, release,
// prefix sequences, lookups, iteration, invariants; it derives from block_store),
// sequence_table.hpp (sequence slots, ids, page lists), token_writer.hpp (host encode / decode of
// token vectors); this header derives from sequence_store and writes and reads the tokens
// (append, reserve / write_layer / commit, read_token / read_layer).
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
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/page_pool.hpp"
#include "tierkv/paging/sequence_store.hpp"
#include "tierkv/paging/sequence_table.hpp"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/paging/token_writer.hpp"

namespace tierkv {

/// Sequences, per-layer page tables and one page pool per tier, with refcounted sharing of
/// sealed pages (fork, prefix reuse) and page replacement for conversions (see the file
/// comment and docs/paging.md). One thread at a time (docs/threading.md).
template <class Geometry, class Tiers, allocator_policy PageAlloc = host_allocator,
          host_allocator_policy MetaAlloc = host_allocator>
class paged_storage : public sequence_store<Geometry, Tiers, PageAlloc, MetaAlloc> {
  using base = sequence_store<Geometry, Tiers, PageAlloc, MetaAlloc>;

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
                MakeRoom&& make_room = {}) requires(PageAlloc::host_accessible) {
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
                     std::span<const float> values) requires(PageAlloc::host_accessible) {
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
  /// Appends one logical page to s made of the caller's fresh pages, one per layer
  /// (allocate_page's, written already), holding `fill` tokens: any tier for a full page,
  /// tier 0 for a partial one (an open page is what appends write). s must have no
  /// reservation and end on a page boundary. The pages become s's (published; sealed when
  /// full). Refusals (naming the value) change nothing and leave the pages the caller's.
  /// How an import or the GPU host tier's restore builds a sequence: no tier-0 page is opened
  /// for a page that arrives in another tier.
  status append_pages(seq_id s, std::int64_t fill, std::span<const page_id> pages) {
    seq_record* r = find(s);
    if (r == nullptr) return bad_seq(s);
    if (r->reserved != 0) return reservation_outstanding(s, *r, "append_pages");
    if (r->length % page_tokens != 0)
      return status::make(errc::invalid_argument, "append_pages: ", s, " has ", r->length,
                          " tokens, not a whole number of pages of ", page_tokens);
    if (fill < 1 || fill > page_tokens)
      return status::make(errc::invalid_argument, "append_pages: fill = ", fill,
                          " must lie in [1, ", page_tokens, "]");
    if (fill > max_sequence_tokens - r->length)
      return status::exceeds(errc::out_of_range, "append_pages: sequence length", r->length + fill,
                             max_sequence_tokens);
    if (pages.size() != std::size_t(layers_))
      return status::make(errc::invalid_argument, "append_pages: ", pages.size(), " pages for ",
                          layers_, " layers");
    for (std::size_t l = 0; l < pages.size(); ++l) {
      if (auto st = this->check_fresh_page(pages[l], "append_pages"); !st) return st;
      if (fill < page_tokens && pages[l].format != 0)
        return status::make(errc::invalid_argument, "append_pages: layer ", l, "'s page ", pages[l],
                            " of a partial page (fill ", fill,
                            ") is not in tier 0; only full pages arrive converted");
      for (std::size_t m = 0; m < l; ++m)
        if (pages[m] == pages[l])
          return status::make(errc::invalid_argument, "append_pages: ", pages[l],
                              " given for layers ", m, " and ", l);
    }
    if (auto st = can_allocate_block_entries(1); !st) return st;
    if (r->blocks.size() == r->blocks.capacity()) {  // grown aside: a refusal frees it exactly
      block_list grown(r->blocks.get_allocator());
      if (auto st = reserve_list(grown, std::max<std::size_t>(2 * r->blocks.size(), 4)); !st)
        return st;
      grown.assign(r->blocks.begin(), r->blocks.end());
      r->blocks.swap(grown);
    }
    r->blocks.push_back(this->adopt_block(pages, std::uint32_t(fill)));
    r->length += fill;
    return {};
  }

  /// commit(s, 0): gives back the whole reservation.
  status cancel(seq_id s) { return commit(s, 0); }

  /// Decodes (layer, token, kv head) of a sequence through its page's tier codecs.
  status read_token(seq_id s, int layer, std::int64_t token, int head, float* key,
                    float* value) const requires(PageAlloc::host_accessible) {
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
                    std::span<float> values) const requires(PageAlloc::host_accessible) {
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

  // ---- counters ----------------------------------------------------------------------------
  /// Scalars clipped by encoders so far (encode_stats).
  std::uint64_t saturations() const noexcept { return stats_.saturated; }

 private:
  // The members of the store and the sequences the token operations use (a dependent base's
  // names are not found unqualified).
  using base::bad_seq;
  using base::block_meta_;
  using base::can_allocate_block_entries;
  using base::can_allocate_blocks;
  using base::drop_block;
  using base::find;
  using base::init_blocks;
  using base::init_pools;
  using base::layers_;
  using base::lines_;
  using base::meta_alloc_;
  using base::new_block;
  using base::opt_;
  using base::page_of;
  using base::pages_for;
  using base::pools_;
  using base::reserve_list;
  using base::seqs_;
  using typename base::block_list;
  using typename base::block_meta;
  using typename base::seq_record;

  paged_storage(const options& opt, PageAlloc&& pa, MetaAlloc&& ma)
      : base(opt, std::move(pa), std::move(ma)) {}

  status init(std::uint64_t total_pages) {
    if (auto st = init_pools(opt_.pages_per_tier); !st) return st;
    if (auto st = seqs_.init(meta_alloc_, lines_.page_tables, opt_.max_sequences); !st) return st;
    return init_blocks(total_pages);
  }

  status check_finite(std::span<const float> x, const char* what, std::int64_t n, const char* op,
                      int first_layer, const char* done) const {
    return check_finite_tokens(x, what, n, kv_heads, head_dim, op, first_layer, done);
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
      if (std::get<0>(pools_).capacity() > std::uint32_t(std::numeric_limits<std::int32_t>::max()))
        return status::exceeds(errc::invalid_argument, "slot_mapping: tier-0 pool slots",
                               std::get<0>(pools_).capacity(),
                               std::numeric_limits<std::int32_t>::max());
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
          return std::get<0>(pools_).host_page(
              page_of(r.blocks[std::size_t(pos / page_tokens)], l));
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
        for (int l = 0; l < layers_; ++l) (void)std::get<0>(pools_).seal(page_of(r.blocks[j], l));
      }
    }
  }

  encode_stats stats_{};
};

}  // namespace tierkv
