// SPDX-License-Identifier: Apache-2.0
// What a tier_controller knows of each block and page of its storage, kept in step with the
// storage between steps: per block its holders, youngest age, smallest position, pin and
// sealing; per page the policy's state, its last move, the mass observed this step, its shadow
// (a tier-0 copy kept after a demotion) and its place in the incremental plan's lists.
// refresh() brings the block facts up to date, facts() is what the policy's choose() sees,
// mark_dirty() queues a page for the next incremental plan. tier_controller derives from it
// (through retier_planner.hpp).
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/tiering/controller_types.hpp"
#include "tierkv/tiering/tier_policy.hpp"

namespace tierkv {
namespace detail {

/// The per-block and per-page records of a tier_controller over Storage (see the file comment).
template <class Storage, class Policy>
class page_records {
 protected:
  static constexpr int append_tier = 0;  // tier_controller::append_tier

  struct block_rec {
    std::uint32_t generation = 0;
    bool live = false;
    bool pinned = false;
    std::uint32_t holders = 0;
    std::int64_t position = page_facts::no_holder;
    std::int64_t age = page_facts::no_holder;
    bool sealed = false;  ///< as of the last refresh
  };
  struct old_facts {  // a block's facts at the previous refresh
    std::uint32_t holders = 0;
    std::int64_t position = 0, age = 0;
  };
  struct seq_seen {  // a sequence slot as the last refresh saw it
    std::uint32_t id = seq_id::invalid_value;
    std::int64_t length = 0;
  };
  struct page_rec {
    typename Policy::page_state state{};
    std::uint64_t last_move = 0;  ///< the step the page last moved, or was first seen
    bool moved = false;           ///< moved at least once: the dwell holds only later moves
    float pending = -1.0f;        ///< this step's relative mass; < 0: none observed
    page_id shadow;               ///< tier-0 copy kept after a demotion
    page_id shadow_of;  ///< the page it was demoted into (the shadow is valid while published)
    std::uint64_t shadow_step = 0;
    /// The incremental plan: the tier the policy chose at the last evaluation (-1: none, the
    /// block is open), the tier the page had then, and list memberships.
    std::int16_t want = -1;  // 16-bit: compared with page formats' unsigned 8-bit tiers
    std::int16_t want_from = -1;
    bool dirty = false;        ///< in dirty_: inputs changed since the last plan
    bool quarantined = false;  ///< its conversion found non-finite data: never planned again
    bool waiting = false;      ///< in waiting_: wants another tier
  };
  template <class T>
  using counted_vector = std::vector<T, counted_allocator<T, typename Storage::meta_allocator>>;
  template <class T>
  counted_allocator<T, typename Storage::meta_allocator> alloc() {
    return counted_allocator<T, typename Storage::meta_allocator>(storage_->meta_alloc(),
                                                                  storage_->lines().page_tables);
  }

  page_records(Storage& s, Policy p, tier_controller_options o)
      : storage_(&s), policy_(std::move(p)), opt_(o) {}

  page_rec& page(std::uint32_t block, int layer) {
    return (*pages_)[std::size_t(block) * std::size_t(storage_->num_layers()) + std::size_t(layer)];
  }

  /// The record of a live block, reset when the block slot holds a new logical page.
  block_rec& sync(block_ref b) {
    block_rec& r = (*blocks_)[b.index];
    if (!r.live || r.generation != b.generation) {
      forget(b.index);
      r = block_rec{};
      r.generation = b.generation;
      r.live = true;
      for (int l = 0; l < storage_->num_layers(); ++l) {
        page_rec& p = page(b.index, l);
        const bool dirty = p.dirty, waiting = p.waiting;  // list memberships stay true
        p = page_rec{};
        p.last_move = step_;
        p.dirty = dirty;
        p.waiting = waiting;
      }
      mark_block_dirty(b.index);
    }
    return r;
  }
  /// Gives back what the controller holds for a block slot whose page is gone.
  void forget(std::uint32_t bi) {
    for (int l = 0; l < storage_->num_layers(); ++l) {
      page_rec& p = page(bi, l);
      if (p.shadow.valid()) release_shadow(p);
    }
    (*blocks_)[bi].live = false;
  }

  /// Brings holders, youngest age, smallest position and sealing of the blocks up to date.
  /// With the incremental plan, between two equal structure epochs (nothing freed, forked,
  /// released or started from shared blocks) only the sequences whose length changed are
  /// visited: their new blocks, their newly sealed tail, and (when they grew by a page) the
  /// ages of their blocks. Anything else, or a grown sequence holding a shared block (whose
  /// age is a minimum over holders), takes the full pass over every block, as before: at the
  /// torch_e2e scale (46 sequences x 8208 pages x 16 layers) that pass cost ~10 ms of a
  /// decode step's host time (bench/results/model-gpu/).
  void refresh() {
    if (incremental() && seqs_seen_ && epoch_seen_ == storage_->structure_epoch() &&
        refresh_grown())
      return;
    refresh_all();
    epoch_seen_ = storage_->structure_epoch();
    storage_->for_each_sequence_slot([&](std::uint32_t slot, seq_id s, std::int64_t len) {
      (*seqs_seen_)[slot] = {s.value, len};
    });
  }

  /// The incremental refresh: false (nothing changed yet) when a grown sequence holds a shared
  /// block, and the caller runs the full pass.
  bool refresh_grown() {
    constexpr std::int64_t T = Storage::page_tokens;
    auto& seen = *seqs_seen_;
    bool shared = false;
    storage_->for_each_sequence_slot([&](std::uint32_t slot, seq_id s, std::int64_t len) {
      const seq_seen& old = seen[slot];
      if (old.id == s.value && old.length == len) return;
      const std::int64_t before = old.id == s.value ? old.length : 0;
      if ((len + T - 1) / T == (before + T - 1) / T || shared) return;
      // ages move by a page: a block held by several sequences has its age as a minimum
      storage_->for_each_logical_block(s, [&](std::int64_t, block_ref b) {
        const block_rec& r = (*blocks_)[b.index];
        if (r.live && r.generation == b.generation && r.holders > 1) shared = true;
      });
    });
    if (shared) return false;
    storage_->for_each_sequence_slot([&](std::uint32_t slot, seq_id s, std::int64_t len) {
      seq_seen& old = seen[slot];
      if (old.id == s.value && old.length == len) return;
      const std::int64_t before = old.id == s.value ? old.length : 0;
      const std::int64_t n = (len + T - 1) / T;
      // a sequence that kept its page count moves only its tail (new tokens, sealing)
      const std::int64_t first = n == (before + T - 1) / T ? std::max<std::int64_t>(0, n - 1) : 0;
      storage_->for_each_logical_block(s, [&](std::int64_t logical, block_ref b) {
        if (logical < first) return;
        block_rec& r = sync(b);
        const old_facts o{r.holders, r.position, r.age};
        r.holders = 1;
        r.position = logical;
        r.age = n - 1 - logical;
        const bool sealed = storage_->block_sealed(b);
        if (sealed != r.sealed || !same_choice_facts(o, r)) mark_block_dirty(b.index);
        r.sealed = sealed;
      });
      old = {s.value, len};
    });
    return true;
  }

  /// Recomputes holders, youngest age and smallest position of every live block.
  void refresh_all() {
    for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi) {
      block_rec& r = (*blocks_)[bi];
      (*old_)[bi] = {r.holders, r.position, r.age};
      r.holders = 0;
      r.position = r.age = page_facts::no_holder;
    }
    auto& seen = *seen_;
    std::fill(seen.begin(), seen.end(), std::uint8_t(0));
    storage_->for_each_block([&](block_ref b, int, std::uint32_t) {
      sync(b);
      seen[b.index] = 1;
    });
    for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi)
      if ((*blocks_)[bi].live && !seen[bi]) forget(bi);
    storage_->for_each_sequence([&](seq_id s, std::int64_t len) {
      const std::int64_t n = (len + Storage::page_tokens - 1) / Storage::page_tokens;
      storage_->for_each_logical_block(s, [&](std::int64_t i, block_ref b) {
        block_rec& r = (*blocks_)[b.index];
        ++r.holders;
        r.position = std::min(r.position, i);
        r.age = std::min(r.age, n - 1 - i);
      });
    });
    // The incremental plan re-evaluates the pages of every block whose facts changed.
    for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi) {
      block_rec& r = (*blocks_)[bi];
      if (!r.live) continue;
      const bool sealed = storage_->block_sealed(block_ref{bi, r.generation});
      const old_facts& o = (*old_)[bi];
      if (sealed != r.sealed || !same_choice_facts(o, r)) mark_block_dirty(bi);
      r.sealed = sealed;
    }
  }

  /// Whether a block's facts moved in a way choose() can see. A policy may say which changes
  /// it reads (same_choice(a, b): recency_anchor reads only "is Recent" and "is a sink", so a
  /// sequence growing by a page re-evaluates the few pages that cross those lines rather than
  /// every page of the sequence); otherwise any change counts.
  bool same_choice_facts(const old_facts& o, const block_rec& r) const {
    if (o.holders == r.holders && o.position == r.position && o.age == r.age) return true;
    if constexpr (requires(const page_facts& f) {
                    { policy_.same_choice(f, f) } -> std::convertible_to<bool>;
                  }) {
      page_facts a, b;
      a.holders = o.holders;
      a.position = o.position;
      a.age = o.age;
      a.pinned = b.pinned = r.pinned;
      b.holders = r.holders;
      b.position = r.position;
      b.age = r.age;
      return policy_.same_choice(a, b);
    } else {
      return false;
    }
  }

  /// Whether choose() gives the same role for two policy states (policy::same_state_choice);
  /// without it, every observation re-evaluates its page.
  bool same_state_choice(const typename Policy::page_state& a,
                         const typename Policy::page_state& b) const {
    if constexpr (requires {
                    { policy_.same_state_choice(a, b) } -> std::convertible_to<bool>;
                  })
      return policy_.same_state_choice(a, b);
    else
      return false;
  }

  static constexpr bool choice_reads_time() {
    if constexpr (requires { Policy::choice_reads_time; })
      return bool(Policy::choice_reads_time);
    else
      return false;
  }
  bool incremental() const { return opt_.incremental_plan && !choice_reads_time(); }

  void mark_dirty(std::uint32_t bi, int layer) {
    if (!incremental()) return;  // the full scan visits every page anyway
    page_rec& r = page(bi, layer);
    if (r.dirty) return;
    r.dirty = true;
    dirty_->push_back(bi * std::uint32_t(storage_->num_layers()) + std::uint32_t(layer));
  }
  void mark_block_dirty(std::uint32_t bi) {
    for (int l = 0; l < storage_->num_layers(); ++l) mark_dirty(bi, l);
  }

  page_facts facts(std::uint32_t bi, int layer, page_id p) const {
    const block_rec& b = (*blocks_)[bi];
    page_facts f;
    f.layer = layer;
    f.num_layers = storage_->num_layers();
    f.tier = int(p.format);
    f.position = b.position;
    f.age = b.age;
    f.holders = b.holders;
    f.pinned = b.pinned;
    const std::uint64_t last =
        (*pages_)[std::size_t(bi) * std::size_t(f.num_layers) + std::size_t(layer)].last_move;
    f.steps_since_move = step_ - std::min(step_, last);
    return f;
  }

  std::uint32_t percent_of_tier0(int percent) const {
    return std::uint32_t(std::uint64_t(storage_->template pool<append_tier>().capacity()) *
                         std::uint64_t(percent) / 100);
  }

  void release_shadow(page_rec& r) {
    (void)storage_->release_page(r.shadow);
    r.shadow = page_id{};
    r.shadow_of = page_id{};
    --shadows_;
  }
  void drop_oldest_shadow(retier_stats& st) {
    page_rec* oldest = nullptr;
    for (page_rec& r : *pages_)
      if (r.shadow.valid() && (oldest == nullptr || r.shadow_step < oldest->shadow_step))
        oldest = &r;
    if (oldest == nullptr) return;
    release_shadow(*oldest);
    ++st.shadows_dropped;
  }
  /// Drops shadows that are stale (their page moved on) or that eat into tier 0's slack.
  void trim_shadows(retier_stats& st) {
    if (shadows_ == 0) return;
    const int layers = storage_->num_layers();
    for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi) {
      const block_rec& b = (*blocks_)[bi];
      for (int l = 0; l < layers; ++l) {
        page_rec& r = page(bi, l);
        if (!r.shadow.valid()) continue;
        if (!b.live || !(storage_->block_page(block_ref{bi, b.generation}, l) == r.shadow_of)) {
          release_shadow(r);
          ++st.shadows_dropped;
        }
      }
    }
    const std::uint32_t slack = percent_of_tier0(opt_.shadow_slack_percent);
    while (shadows_ > 0 && storage_->free_pages(append_tier) < slack) drop_oldest_shadow(st);
  }
  void drop_all_shadows() {
    if (!pages_ || shadows_ == 0) return;
    for (page_rec& r : *pages_)
      if (r.shadow.valid()) release_shadow(r);
  }

  Storage* storage_;
  Policy policy_;
  tier_controller_options opt_;
  std::optional<counted_vector<block_rec>> blocks_;
  std::optional<counted_vector<page_rec>> pages_;
  std::optional<counted_vector<std::uint8_t>> seen_;
  std::optional<counted_vector<old_facts>> old_;       ///< refresh's previous facts per block
  std::optional<counted_vector<seq_seen>> seqs_seen_;  ///< per sequence slot, at the last refresh
  std::uint64_t epoch_seen_ = ~std::uint64_t(0);  ///< the storage's structure epoch then (none yet)
  std::optional<counted_vector<std::uint32_t>> dirty_;  ///< pages to re-evaluate (page index)
  std::uint64_t step_ = 0;
  std::uint32_t shadows_ = 0;
};

}  // namespace detail
}  // namespace tierkv
