// SPDX-License-Identifier: Apache-2.0
// An index of compacted documents: a new request whose token ids begin with a registered
// document starts from a fork of that document's compacted sequence (write_prefix's pages,
// shared by reference) instead of prefilling the document. prefix_index cannot hold these:
// it keys sealed pages by the token ids they hold, and a compacted sequence's t tokens are not
// the document's first t tokens. Here the key is the whole document (its n token ids under a
// salt, e.g. the model, and a variant, e.g. the budget and method), compared exactly (a hash
// picks candidates; the ids decide), and the match is all or nothing: a request matches a
// document only when it holds all n of its ids.
//
// Works over any cache with storage().length, fork and release (tiered_cache and
// cuda::tiered_cache). The index owns each registered sequence: it releases it when the entry
// is evicted, cleared or the index is destroyed (before the cache is). Forks keep their pages
// alive after that. The engine must not append to or release a registered sequence; a
// sequence whose length changed is refused at start_sequence. Driven by the thread that
// drives the cache (docs/threading.md); entries live on the engine's heap, not on the cache's
// report lines (a few hundred bytes each plus the document's token ids).
#pragma once

#include <algorithm>
#include <cstdint>
#include <new>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/prefix_index.hpp"

namespace tierkv::compaction {

/// Registered compacted documents over `Cache` (see the top of this header).
template <class Cache, class Hash = prefix_hash>
class document_index {
 public:
  /// The cache must outlive the index.
  explicit document_index(Cache& cache, Hash hash = {}) : cache_(&cache), hash_(hash) {}
  document_index(const document_index&) = delete;
  document_index& operator=(const document_index&) = delete;
  /// Releases every registered sequence (errors ignored: a destructor cannot report them; a
  /// status whose message cannot be allocated is dropped too).
  ~document_index() {
    for (const entry& e : entries_) {
      try {
        (void)cache_->release(e.seq);
      } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to report it to
      }
    }
  }

  /// A registered document matching a request.
  struct match {
    seq_id seq;                         ///< the registered (compacted) sequence
    std::int64_t document_tokens = 0;   ///< n: the request's next RoPE position after it
    std::int64_t compacted_tokens = 0;  ///< t: the tokens its sequence holds
  };
  /// A request started from a document.
  struct started {
    seq_id seq;                         ///< a new sequence: a fork of the registered one
    std::int64_t document_tokens = 0;   ///< n: tokens of the request it stands for
    std::int64_t compacted_tokens = 0;  ///< t: tokens it holds (the cache's length)
  };

  /// Registered documents.
  std::size_t size() const noexcept { return entries_.size(); }

  /// Registers seq, which holds a compaction of `document` (t <= n tokens, e.g. from
  /// write_prefix), under salt and variant; the index owns seq from now on. Refused (nothing
  /// changed, seq still the caller's): an empty document, a stale seq, one that holds no token or
  /// more tokens than the document, a document already registered under the same salt and
  /// variant (invalid_argument), no memory for the entry (capacity_exhausted).
  status insert(seq_id seq, std::uint64_t salt, std::span<const std::int32_t> document,
                std::uint64_t variant = 0) {
    if (document.empty())
      return status(errc::invalid_argument, "document_index insert: an empty document");
    auto len = cache_->storage().length(seq);
    if (!len) return len.error_status();
    if (*len < 1 || *len > std::int64_t(document.size()))
      return status::make(errc::invalid_argument, "document_index insert: ", seq, " holds ", *len,
                          " tokens; a compaction of a ", document.size(),
                          "-token document holds 1 to ", document.size());
    const std::uint64_t h = hash_(hash_.root(salt ^ variant), document);
    if (find_exact(salt, variant, h, document) != none)
      return status::make(errc::invalid_argument, "document_index insert: a ", document.size(),
                          "-token document with these ids is already registered under salt ", salt,
                          " and variant ", variant);
    try {
      entries_.push_back(entry{seq, salt, variant, h, *len,
                               std::vector<std::int32_t>(document.begin(), document.end()),
                               ++clock_});
    } catch (const std::bad_alloc&) {
      return status::make(errc::capacity_exhausted, "document_index insert: no memory for a ",
                          document.size(), "-token entry");
    }
    return {};
  }

  /// The longest registered document (under salt and variant) that tokens begin with, changing
  /// nothing; nullopt when none does.
  std::optional<match> find(std::uint64_t salt, std::span<const std::int32_t> tokens,
                            std::uint64_t variant = 0) const {
    const std::size_t e = best(salt, variant, tokens);
    if (e == none) return std::nullopt;
    const entry& en = entries_[e];
    return match{en.seq, std::int64_t(en.tokens.size()), en.length};
  }

  /// A new sequence for a request whose token ids are `tokens`: a fork of the longest
  /// registered document they begin with (nullopt when none does; nothing changed). The engine
  /// then appends tokens[document_tokens..) with RoPE positions from document_tokens on. A
  /// refused fork (no sequence slot, memory) or a registered sequence whose length changed is
  /// returned as an error with nothing changed.
  result<std::optional<started>> start_sequence(std::uint64_t salt,
                                                std::span<const std::int32_t> tokens,
                                                std::uint64_t variant = 0) {
    const std::size_t e = best(salt, variant, tokens);
    if (e == none) return std::optional<started>{};
    entry& en = entries_[e];
    auto len = cache_->storage().length(en.seq);
    if (!len) return len.error_status();
    if (*len != en.length)
      return status::make(errc::invalid_argument, "document_index: registered ", en.seq, " holds ",
                          *len, " tokens, ", en.length,
                          " when registered (appended to or replaced by the engine)");
    auto f = cache_->fork(en.seq);
    if (!f) return f.error_status();
    en.last_used = ++clock_;
    return std::optional<started>(started{*f, std::int64_t(en.tokens.size()), en.length});
  }

  /// Evicts up to max_entries least recently used documents, releasing their sequences (pages a
  /// fork shares stay until the fork is released). Returns how many; a release the cache
  /// refuses (e.g. cuda::tiered_cache mid-step) stops there with that entry kept.
  result<std::size_t> evict(std::size_t max_entries) {
    std::size_t done = 0;
    while (done < max_entries && !entries_.empty()) {
      const auto lru = std::min_element(
          entries_.begin(), entries_.end(),
          [](const entry& a, const entry& b) { return a.last_used < b.last_used; });
      if (auto st = cache_->release(lru->seq); !st) return st;
      entries_.erase(lru);
      ++done;
    }
    return done;
  }

  /// Evicts every document.
  status clear() {
    auto n = evict(entries_.size());
    return n ? status{} : n.error_status();
  }

 private:
  static constexpr std::size_t none = std::size_t(-1);
  struct entry {
    seq_id seq;
    std::uint64_t salt = 0, variant = 0, hash = 0;
    std::int64_t length = 0;           // t when registered
    std::vector<std::int32_t> tokens;  // the document's n ids
    std::uint64_t last_used = 0;
  };

  std::size_t find_exact(std::uint64_t salt, std::uint64_t variant, std::uint64_t h,
                         std::span<const std::int32_t> doc) const {
    for (std::size_t e = 0; e < entries_.size(); ++e) {
      const entry& en = entries_[e];
      if (en.salt == salt && en.variant == variant && en.hash == h &&
          std::ranges::equal(en.tokens, doc))
        return e;
    }
    return none;
  }
  // The entry of the longest document tokens begin with: a hash of each distinct candidate
  // length, then the ids themselves.
  std::size_t best(std::uint64_t salt, std::uint64_t variant,
                   std::span<const std::int32_t> tokens) const {
    std::size_t found = none;
    const std::uint64_t root = hash_.root(salt ^ variant);
    for (std::size_t e = 0; e < entries_.size(); ++e) {
      const entry& en = entries_[e];
      const std::size_t n = en.tokens.size();
      if (en.salt != salt || en.variant != variant || n > tokens.size()) continue;
      if (found != none && n <= entries_[found].tokens.size()) continue;
      const auto head = tokens.first(n);
      if (hash_(root, head) == en.hash && std::ranges::equal(en.tokens, head)) found = e;
    }
    return found;
  }

  Cache* cache_;
  Hash hash_;
  std::vector<entry> entries_;
  std::uint64_t clock_ = 0;
};

}  // namespace tierkv::compaction
