// SPDX-License-Identifier: Apache-2.0
// Prefix reuse: full logical pages indexed by a chained hash of their token ids and a
// caller salt (LoRA adapter, tenant). Entries keep the token ids, so a hash collision
// is rejected by comparison, never served. The index holds one reference per cached
// logical page; eviction (explicit, LRU) drops only pages no sequence still uses.
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "tierkv/codec/codec.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/paging/paged_storage.hpp"

namespace tierkv {

/// Chained page hash: h_i = H(h_{i-1}, tokens of page i), h_{-1} = root(salt).
struct prefix_hash {
  /// The hash before the first page, per salt (e.g. model or LoRA adapter).
  std::uint64_t root(std::uint64_t salt) const noexcept {
    return mix64(salt ^ 0x7072656669785f31ull);
  }
  /// The hash of a page of tokens following a prefix whose hash is parent.
  std::uint64_t operator()(std::uint64_t parent,
                           std::span<const std::int32_t> tokens) const noexcept {
    std::uint64_t h = mix64(parent ^ std::uint64_t(tokens.size()));
    for (std::int32_t t : tokens) h = mix64(h ^ std::uint64_t(std::uint32_t(t)));
    return h;
  }
};

/// The longest cached prefix: whole pages, each with its pages for every layer and their
/// current tiers (page_id::format), pages[i * num_layers + layer].
struct prefix_match {
  std::int64_t tokens = 0;        ///< matched tokens (a multiple of page_tokens)
  std::vector<block_ref> blocks;  ///< the matched logical pages, in order
  std::vector<page_id> pages;     ///< their physical pages, [block][layer]
};

/// Caches sealed pages of token-id prefixes over a paged_storage so a new request can
/// start from a cached prefix instead of recomputing it (start_sequence). Each entry holds
/// a reference to its page; evict() drops entries no sequence uses.
template <class Storage, class Hash = prefix_hash>
class prefix_index {
  using meta_allocator = typename Storage::meta_allocator;
  template <class T>
  using counted_vector = std::vector<T, counted_allocator<T, meta_allocator>>;
  static constexpr std::uint32_t none = std::numeric_limits<std::uint32_t>::max();
  static constexpr int page_tokens = Storage::page_tokens;

 public:
  /// The storage must outlive the index; its bookkeeping allocator pays for the
  /// entries, charged to storage.lines().prefix_index.
  explicit prefix_index(Storage& storage, Hash hash = {})
      : storage_(&storage),
        hash_(hash),
        entries_(alloc<entry>()),
        tokens_(alloc<std::int32_t>()),
        free_(alloc<std::uint32_t>()),
        buckets_(alloc<std::uint32_t>()) {}
  prefix_index(const prefix_index&) = delete;
  prefix_index& operator=(const prefix_index&) = delete;
  // NOLINTNEXTLINE(bugprone-exception-escape): see release_entries
  ~prefix_index() { release_entries(); }

  /// Cached pages (entries).
  std::size_t size() const noexcept { return live_; }

  /// Caches the full pages of seq covered by tokens (its first tokens.size() token ids).
  /// Returns the number of new entries; pages already cached are kept (and touched).
  result<std::size_t> insert(seq_id seq, std::uint64_t salt, std::span<const std::int32_t> tokens) {
    auto len = storage_->length(seq);
    if (!len) return len.error_status();
    if (std::int64_t(tokens.size()) > *len)
      return status::make(errc::invalid_argument, "prefix insert: ", tokens.size(),
                          " token ids for ", seq, " which holds ", *len, " tokens");
    const std::size_t full = tokens.size() / page_tokens;
    std::uint32_t parent = none;
    std::uint64_t h = hash_.root(salt);
    std::size_t i = 0;
    std::vector<std::uint32_t> cached;  // touched only once the insert cannot be refused
    for (; i < full; ++i) {
      const auto page = tokens.subspan(i * page_tokens, page_tokens);
      h = hash_(h, page);
      const std::uint32_t e = find(h, parent, salt, page);
      if (e == none) break;
      cached.push_back(e);
      parent = e;
    }
    const std::size_t fresh = full - i;
    if (fresh == 0) {
      touch(cached);
      return std::size_t(0);
    }
    std::vector<block_ref> blocks;  // checked before anything changes
    for (std::size_t j = i; j < full; ++j) {
      auto b = storage_->block_of(seq, std::int64_t(j));
      if (!b) return b.error_status();
      if (!storage_->block_sealed(*b))
        return status::make(errc::not_writable, "prefix insert: page ", j, " of ", seq,
                            " is not sealed");
      blocks.push_back(*b);
    }
    if (auto st = reserve(live_ + fresh); !st) return st;
    touch(cached);
    std::uint64_t hh = h;
    // h is the hash of page i already (the loop broke after computing it).
    for (std::size_t j = i; j < full; ++j) {
      const auto page = tokens.subspan(j * page_tokens, page_tokens);
      if (j != i) hh = hash_(hh, page);
      (void)storage_->retain_block(blocks[j - i]);
      parent = add(hh, parent, salt, page, blocks[j - i]);
    }
    return fresh;
  }

  /// The longest cached prefix of tokens under salt; marks its entries recently used.
  prefix_match lookup(std::uint64_t salt, std::span<const std::int32_t> tokens) {
    std::vector<std::uint32_t> entries;
    prefix_match m = match(salt, tokens, entries);
    touch(entries);
    return m;
  }

  /// A new sequence starting from the longest cached prefix of tokens; the caller
  /// appends the remaining tokens' keys and values. Returns the sequence and the
  /// number of tokens it already holds.
  struct started {
    seq_id seq;                      ///< the new sequence
    std::int64_t cached_tokens = 0;  ///< tokens it already holds
  };
  /// A refusal (no sequence slot) leaves the LRU order as it was.
  result<started> start_sequence(std::uint64_t salt, std::span<const std::int32_t> tokens) {
    std::vector<std::uint32_t> entries;
    prefix_match m = match(salt, tokens, entries);
    auto s = storage_->create_sequence_from_blocks(m.blocks);
    if (!s) return s.error_status();
    touch(entries);
    return started{*s, m.tokens};
  }

  /// Evicts up to max_entries least recently used entries that no sequence uses (the
  /// index holds the only reference) and that no longer entry extends. Returns how many.
  std::size_t evict(std::size_t max_entries) {
    std::size_t done = 0;
    while (done < max_entries) {
      std::uint32_t victim = none;
      for (std::uint32_t e = 0; e < entries_->size(); ++e) {
        const entry& en = (*entries_)[e];
        if (!en.live || en.children != 0 || storage_->block_refcount(en.block) != 1) continue;
        if (victim == none || en.last_used < (*entries_)[victim].last_used) victim = e;
      }
      if (victim == none) break;
      remove(victim);
      ++done;
    }
    return done;
  }
  /// Evicts until the tier's pool has `pages` free pages or nothing evictable is left.
  std::size_t evict_until_free(int tier, std::uint32_t pages) {
    std::size_t n = 0;
    while (storage_->free_pages(tier) < pages && evict(1) == 1) ++n;
    return n;
  }
  /// Entries evict() could drop now (unused by any sequence, extended by no entry).
  std::size_t evictable() const {
    std::size_t n = 0;
    for (const entry& en : *entries_)
      if (en.live && en.children == 0 && storage_->block_refcount(en.block) == 1) ++n;
    return n;
  }
  /// Drops every entry and its page references.
  void clear() {
    release_entries();
    entries_.reset();
    tokens_.reset();
    free_.reset();
    buckets_.reset();
    live_ = 0;
    entries_.emplace(alloc<entry>());
    tokens_.emplace(alloc<std::int32_t>());
    free_.emplace(alloc<std::uint32_t>());
    buckets_.emplace(alloc<std::uint32_t>());
  }

  /// Chains, children counts, references: ok or what is broken.
  status check_invariants() const {
    std::vector<std::uint32_t> children(entries_->size(), 0);
    std::size_t live = 0;
    for (std::uint32_t e = 0; e < entries_->size(); ++e) {
      const entry& en = (*entries_)[e];
      if (!en.live) continue;
      ++live;
      if (auto st = storage_->check_block(en.block); !st) return st;
      if (!storage_->block_sealed(en.block))
        return status::make(errc::corrupt_data, "prefix entry ", e, " names an open page");
      if (en.parent != none) {
        if (!(*entries_)[en.parent].live)
          return status::make(errc::corrupt_data, "prefix entry ", e, " has a dead parent");
        ++children[en.parent];
      }
    }
    if (live != live_)
      return status::make(errc::corrupt_data, "prefix index counts ", live_, " entries, holds ",
                          live);
    std::size_t chained = 0;
    for (std::uint32_t head : *buckets_)
      for (std::uint32_t e = head; e != none; e = (*entries_)[e].next) {
        if (!(*entries_)[e].live)
          return status::make(errc::corrupt_data, "bucket chain holds dead entry ", e);
        if (++chained > live_)
          return status(errc::corrupt_data, "bucket chains hold more entries than live");
      }
    if (chained != live_)
      return status::make(errc::corrupt_data, "bucket chains hold ", chained, " of ", live_,
                          " entries");
    for (std::uint32_t e = 0; e < entries_->size(); ++e)
      if ((*entries_)[e].live && (*entries_)[e].children != children[e])
        return status::make(errc::corrupt_data, "prefix entry ", e, " children ",
                            (*entries_)[e].children, " != ", children[e]);
    return {};
  }

 private:
  // Every live entry's block reference back to the storage (the entries stay as they are).
  // release_block builds a message (and may allocate) only for an invalid reference; a live
  // entry's reference is valid, so nothing here throws.
  // NOLINTNEXTLINE(bugprone-exception-escape)
  void release_entries() noexcept {
    for (std::uint32_t e = 0; e < entries_->size(); ++e)
      if ((*entries_)[e].live) (void)storage_->release_block((*entries_)[e].block);
  }
  struct entry {
    std::uint64_t hash = 0;
    std::uint64_t salt = 0;
    std::uint64_t last_used = 0;
    block_ref block;
    std::uint32_t parent = none;
    std::uint32_t next = none;  ///< bucket chain
    std::uint32_t children = 0;
    bool live = false;
  };

  template <class T>
  counted_allocator<T, meta_allocator> alloc() {
    return counted_allocator<T, meta_allocator>(storage_->meta_alloc(),
                                                storage_->lines().prefix_index);
  }

  std::uint32_t find(std::uint64_t h, std::uint32_t parent, std::uint64_t salt,
                     std::span<const std::int32_t> page) const {
    if (buckets_->empty()) return none;
    for (std::uint32_t e = (*buckets_)[h & (buckets_->size() - 1)]; e != none;
         e = (*entries_)[e].next) {
      const entry& en = (*entries_)[e];
      if (en.hash != h || en.parent != parent || (parent == none && en.salt != salt)) continue;
      const std::int32_t* t = tokens_->data() + std::size_t(e) * page_tokens;
      bool same = true;
      for (int k = 0; k < page_tokens && same; ++k) same = t[k] == page[std::size_t(k)];
      if (same) return e;  // a hash collision with other tokens falls through
    }
    return none;
  }

  /// The longest cached prefix and its entries, changing nothing.
  prefix_match match(std::uint64_t salt, std::span<const std::int32_t> tokens,
                     std::vector<std::uint32_t>& entries) const {
    prefix_match m;
    std::uint32_t parent = none;
    std::uint64_t h = hash_.root(salt);
    const int layers = storage_->num_layers();
    for (std::size_t i = 0; i < tokens.size() / page_tokens; ++i) {
      const auto page = tokens.subspan(i * page_tokens, page_tokens);
      h = hash_(h, page);
      const std::uint32_t e = find(h, parent, salt, page);
      if (e == none) break;
      const entry& en = (*entries_)[e];
      entries.push_back(e);
      m.blocks.push_back(en.block);
      for (int l = 0; l < layers; ++l) m.pages.push_back(storage_->block_page(en.block, l));
      m.tokens += page_tokens;
      parent = e;
    }
    return m;
  }
  /// Marks entries recently used, in chain order.
  void touch(std::span<const std::uint32_t> entries) {
    for (std::uint32_t e : entries) (*entries_)[e].last_used = ++tick_;
  }

  /// Makes room for `live` entries without changing any entry (strong guarantee). The grown
  /// arrays are built aside and swapped in only once every one of them is allocated, so a
  /// failed allocation gives back what the others took: a refusal changes no byte count either.
  status reserve(std::size_t live) {
    if (live > std::size_t(none) - 1)
      return status::exceeds(errc::capacity_exhausted, "prefix entries", live, none - 1);
    const std::size_t fresh = live > live_ ? live - live_ : 0;
    const std::size_t grow = fresh > free_->size() ? fresh - free_->size() : 0;
    const std::size_t want = entries_->size() + grow;
    std::size_t nb = buckets_->empty() ? 16 : buckets_->size();
    while (nb < 2 * live) nb *= 2;
    std::optional<counted_vector<entry>> entries;
    std::optional<counted_vector<std::int32_t>> tokens;
    std::optional<counted_vector<std::uint32_t>> free, heads;
    try {
      if (want > entries_->capacity()) grown(entries, *entries_, want);
      if (want * page_tokens > tokens_->capacity()) grown(tokens, *tokens_, want * page_tokens);
      if (want > free_->capacity()) grown(free, *free_, want);
      if (nb != buckets_->size()) heads.emplace(nb, none, alloc<std::uint32_t>());
    } catch (const allocation_failure& e) {
      return status::make(errc::capacity_exhausted, "prefix index growth to ", live,
                          " entries failed; nothing changed (", e.get_status(), ")");
    }
    if (entries) entries_->swap(*entries);
    if (tokens) tokens_->swap(*tokens);
    if (free) free_->swap(*free);
    if (heads) {
      for (std::uint32_t e = 0; e < entries_->size(); ++e) {
        entry& en = (*entries_)[e];
        if (!en.live) continue;
        en.next = (*heads)[en.hash & (nb - 1)];
        (*heads)[en.hash & (nb - 1)] = e;
      }
      buckets_->swap(*heads);
    }
    return {};
  }
  /// A copy of v with capacity n, from the same allocator line (throws allocation_failure).
  template <class T>
  void grown(std::optional<counted_vector<T>>& out, const counted_vector<T>& v, std::size_t n) {
    out.emplace(alloc<T>());
    out->reserve(n);
    out->assign(v.begin(), v.end());
  }

  /// Caller reserved room: nothing here allocates.
  std::uint32_t add(std::uint64_t h, std::uint32_t parent, std::uint64_t salt,
                    std::span<const std::int32_t> page, block_ref block) {
    std::uint32_t e;
    if (!free_->empty()) {
      e = free_->back();
      free_->pop_back();
    } else {
      e = std::uint32_t(entries_->size());
      entries_->push_back(entry{});
      tokens_->resize(tokens_->size() + page_tokens);
    }
    entry& en = (*entries_)[e];
    en = entry{h, salt, ++tick_, block, parent, none, 0, true};
    std::copy(page.begin(), page.end(),
              tokens_->begin() + std::ptrdiff_t(std::size_t(e) * page_tokens));
    std::uint32_t& head = (*buckets_)[h & (buckets_->size() - 1)];
    en.next = head;
    head = e;
    if (parent != none) ++(*entries_)[parent].children;
    ++live_;
    return e;
  }

  void remove(std::uint32_t e) {
    entry& en = (*entries_)[e];
    std::uint32_t* link = &(*buckets_)[en.hash & (buckets_->size() - 1)];
    while (*link != e) link = &(*entries_)[*link].next;
    *link = en.next;
    if (en.parent != none) --(*entries_)[en.parent].children;
    (void)storage_->release_block(en.block);
    en.live = false;
    free_->push_back(e);  // capacity reserved with the entries
    --live_;
  }

  Storage* storage_;
  Hash hash_;
  std::optional<counted_vector<entry>> entries_;
  std::optional<counted_vector<std::int32_t>> tokens_;  ///< page_tokens ids per entry
  std::optional<counted_vector<std::uint32_t>> free_;
  std::optional<counted_vector<std::uint32_t>> buckets_;  ///< power of two, heads of chains
  std::size_t live_ = 0;
  std::uint64_t tick_ = 0;
};

}  // namespace tierkv
