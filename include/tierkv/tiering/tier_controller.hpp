// SPDX-License-Identifier: Apache-2.0
// The tier controller: keeps a policy's per-page state (smoothed attention mass,
// hysteresis), plans conversions from the policy's choices, applies them through the
// conversion protocol (tiering/conversion.hpp), and makes room in tier 0 under memory
// pressure by demoting the pages the policy values least.
//
// Threading: one controller per storage, driven by one thread (the scheduler's), like
// the storage itself. Plans and stats are plain data.
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_policy.hpp"
#include "tierkv/tiering/tier_roles.hpp"

namespace tierkv {

/// One planned tier move of one physical page (a logical page's layer), for every holder.
struct conversion {
  block_ref block;    ///< the logical page
  int layer = 0;      ///< its layer
  int from = 0;       ///< tier index now
  int to = 0;         ///< tier index wanted
  float value = 0.f;  ///< the policy's keep value (orders the plan)
  /// Same move.
  friend bool operator==(const conversion&, const conversion&) = default;
};

/// What one retier step (or make_room) did; totals() sums them.
struct retier_stats {
  std::uint64_t planned = 0;            ///< conversions the plan asked for
  std::uint64_t converted = 0;          ///< published conversions (promotions + demotions + others)
  std::uint64_t promoted = 0;           ///< into tier 0
  std::uint64_t demoted = 0;            ///< out of tier 0
  std::uint64_t pressure_demoted = 0;   ///< demotions made by make_room
  std::uint64_t shadow_promotions = 0;  ///< promotions served losslessly from a kept tier-0 copy
  /// Held back for capacity, not faults (the old page stays published; a later step retries):
  std::uint64_t deferred = 0;       ///< promotions held back by the tier-0 reserve
  std::uint64_t deferred_full = 0;  ///< conversions whose target tier's pool had no free page
  std::uint64_t failed = 0;         ///< conversions that failed (old page kept)
  /// Pages whose conversion found non-finite data (a NaN-poisoned page): each stays published
  /// in its tier, is never planned or picked for pressure again until its block is freed, and
  /// is counted here once, by the step that found it (also counted in failed).
  std::uint64_t quarantined = 0;
  std::uint64_t injected_faults = 0;  ///< failures injected by the fault hook
  std::uint64_t shadows_made = 0;     ///< tier-0 copies kept at demotion (keep_shadows)
  std::uint64_t shadows_dropped = 0;  ///< tier-0 copies given back
  std::uint64_t saturated = 0;        ///< encoder saturations while converting
  status first_error;                 ///< the first failure, ok when none

  /// Adds o's counters (keeps the first error).
  void add(const retier_stats& o) {
    planned += o.planned;
    converted += o.converted;
    promoted += o.promoted;
    demoted += o.demoted;
    pressure_demoted += o.pressure_demoted;
    shadow_promotions += o.shadow_promotions;
    deferred += o.deferred;
    deferred_full += o.deferred_full;
    failed += o.failed;
    quarantined += o.quarantined;
    injected_faults += o.injected_faults;
    shadows_made += o.shadows_made;
    shadows_dropped += o.shadows_dropped;
    saturated += o.saturated;
    if (first_error.is_ok() && !o.first_error.is_ok()) first_error = o.first_error;
  }
};

/// The knobs of a tier_controller (tiered_cache_options::tiering).
struct tier_controller_options {
  /// Promotions into tier 0 leave at least this share of its pages free, so a promotion
  /// never forces the next append to demote (which would flap).
  int promotion_reserve_percent = 10;
  /// Keep a demoted page's tier-0 copy (a "shadow") while tier 0 has slack, so a quick
  /// promotion back is lossless and costs no encode. Shadows are dropped first, oldest
  /// first, whenever tier 0 keeps fewer than shadow_slack_percent of its pages free.
  bool keep_shadows = false;
  int shadow_slack_percent = 25;  ///< tier-0 free share below which shadows are dropped
  /// plan() re-evaluates only the pages whose inputs changed since the last plan (an observed
  /// mass, a block's position / age / holders / pin / seal, a tier change) plus the pages still
  /// waiting to move, instead of every (block, layer) page: the same plan (tested against the full
  /// scan), at O(changes) a step. A policy whose choose() reads steps_since_move declares
  /// `static constexpr bool choice_reads_time = true` and always gets the full scan.
  bool incremental_plan = true;
};

/// Keeps the policy's per-page state, plans conversions from its choices, applies them
/// through the conversion protocol and makes room in tier 0 under memory pressure
/// (docs/tiering.md).
template <class Storage, tier_policy Policy = policy::recency_anchor,
          class Roles = tier_roles<typename Storage::tier_list>>
class tier_controller {
  static_assert(check_tier_policy<Policy>());
  static_assert(std::is_same_v<typename Roles::tier_list, typename Storage::tier_list>,
                "tier_controller: Roles must map roles onto the storage's tier list");

 public:
  using storage_type = Storage;                         ///< the paged storage it drives
  using policy_type = Policy;                           ///< the tier policy
  using roles = Roles;                                  ///< role -> tier mapping
  using options = tier_controller_options;              ///< its knobs
  static constexpr int num_tiers = Storage::num_tiers;  ///< tiers of the storage
  static constexpr int append_tier = 0;                 ///< the tier new tokens are written in

  tier_controller(const tier_controller&) = delete;
  tier_controller& operator=(const tier_controller&) = delete;
  ~tier_controller() { drop_all_shadows(); }

  /// The storage must outlive the controller. Bookkeeping (per-page policy state, the
  /// plan buffer) is allocated once here from the storage's bookkeeping allocator and
  /// charged to its page_tables line; on failure nothing leaks.
  static result<std::unique_ptr<tier_controller>> create(Storage& storage, Policy policy = {},
                                                         options opt = {}) {
    if (auto st = validate(policy, opt); !st) return st;
    std::unique_ptr<tier_controller> c(new tier_controller(storage, std::move(policy), opt));
    try {
      const std::size_t blocks = storage.block_capacity();
      const std::size_t pages = blocks * std::size_t(storage.num_layers());
      c->blocks_.emplace(blocks, block_rec{}, c->template alloc<block_rec>());
      c->pages_.emplace(pages, page_rec{}, c->template alloc<page_rec>());
      c->plan_.emplace(c->template alloc<conversion>());
      c->plan_->reserve(pages);
      c->seen_.emplace(blocks, std::uint8_t(0), c->template alloc<std::uint8_t>());
      c->old_.emplace(blocks, old_facts{}, c->template alloc<old_facts>());
      c->seqs_seen_.emplace(storage.max_sequences(), seq_seen{}, c->template alloc<seq_seen>());
      c->dirty_.emplace(c->template alloc<std::uint32_t>());
      c->dirty_->reserve(pages);
      c->waiting_.emplace(c->template alloc<std::uint32_t>());
      c->waiting_->reserve(pages);
      c->staged_.emplace(c->template alloc<staged_conversion>());
      c->staged_->reserve(storage.template pool<append_tier>().capacity());
    } catch (const allocation_failure& e) {
      return e.get_status();
    }
    return result<std::unique_ptr<tier_controller>>(
        std::move(c));  // explicit: nvcc does not move implicitly here
  }

  /// The policy's knobs and the options against their limits, allocating nothing.
  static status validate(const Policy& policy, const options& opt) {
    if (auto st = policy.validate(); !st) return st;
    if (opt.promotion_reserve_percent < 0 || opt.promotion_reserve_percent > 100)
      return status::make(errc::invalid_argument,
                          "promotion_reserve_percent = ", opt.promotion_reserve_percent,
                          " must lie in [0, 100]");
    if (opt.shadow_slack_percent < 0 || opt.shadow_slack_percent > 100)
      return status::make(errc::invalid_argument,
                          "shadow_slack_percent = ", opt.shadow_slack_percent,
                          " must lie in [0, 100]");
    return {};
  }

  /// The storage it drives.
  Storage& storage() noexcept { return *storage_; }
  /// The policy.
  const Policy& policy() const noexcept { return policy_; }
  /// Its options.
  const options& config() const noexcept { return opt_; }
  /// Tier-0 shadow copies held now.
  std::uint32_t shadow_pages() const noexcept { return shadows_; }
  /// Every step's counters summed.
  const retier_stats& totals() const noexcept { return totals_; }

  /// Structural metadata from the engine: pinned logical pages are Anchor and never
  /// demoted under pressure (e.g. a system prompt). Unpinning returns them to the policy.
  status pin(seq_id s, std::int64_t first, std::int64_t count, bool pinned = true) {
    auto pages = storage_->logical_pages(s);
    if (!pages) return pages.error_status();
    if (first < 0 || count < 0 || first > *pages - count)
      return status::make(errc::out_of_range, "pin: logical pages [", first, ", ", first + count,
                          ") of ", s, " which has ", *pages, " pages");
    for (std::int64_t i = first; i < first + count; ++i) {
      const block_ref b = *storage_->block_of(s, i);
      sync(b).pinned = pinned;
      mark_block_dirty(b.index);
    }
    return {};
  }

  /// The decode path's per-page attention mass of sequence s at one layer (host_decode's
  /// page_mass row: one entry per logical page, summing to 1), taken relative to a uniform
  /// share. A page only s holds (as of the last plan, no fork or release since) folds it into
  /// the policy's state at once: each call is one observation, and only a page whose role
  /// may have changed is re-evaluated by the next plan (with same_state_choice, the fold is
  /// the whole cost: at the torch_e2e scale the batch's pages are ~10^5-10^6 a step). A page
  /// shared by several sequences keeps the largest of their values until the next plan(),
  /// which folds it. scope = readable: the row covers the outstanding reservation's pages too
  /// (attention before commit, tiered_cache::prefill); they keep theirs until the next plan.
  status observe_mass(seq_id s, int layer, std::span<const float> mass,
                      index_scope scope = index_scope::committed) {
    const bool readable = scope == index_scope::readable;
    auto pages = storage_->logical_pages(s, scope);
    if (!pages) return pages.error_status();
    if (layer < 0 || layer >= storage_->num_layers())
      return status::out_of_range("layer", layer, storage_->num_layers());
    if (std::int64_t(mass.size()) < *pages)
      return status::make(errc::invalid_argument, "observe_mass: ", mass.size(), " masses for ", s,
                          " with ", *pages, readable ? " readable" : "", " logical pages");
    const float uniform = float(*pages);
    const bool holders_known = epoch_seen_ == storage_->structure_epoch();
    const auto fold = [&](std::int64_t i, block_ref b) {
      const float m = mass[std::size_t(i)] * uniform;
      if (!std::isfinite(m) || m < 0.0f) return;  // never let a broken signal move pages
      const block_rec& br = sync(b);
      page_rec& r = page(b.index, layer);
      if (holders_known && br.holders == 1 && r.pending < 0.0f) {
        const typename Policy::page_state before = r.state;
        policy_.observe(r.state, m);
        if (!same_state_choice(before, r.state)) mark_dirty(b.index, layer);
        return;
      }
      r.pending = r.pending < 0.0f ? m : std::max(r.pending, m);
      mark_dirty(b.index, layer);
    };
    storage_->for_each_logical_block(s, fold, scope);
    return {};
  }

  /// Folds the observed masses into the policy's state and returns the conversions the
  /// policy wants at `step` (a monotone scheduler step): deterministic, ordered with
  /// moves out of tier 0 first (lowest value first), then moves into tier 0 (highest
  /// value first), ties by block and layer. The span lives until the next plan().
  std::span<const conversion> plan(std::uint64_t step) {
    step_ = std::max(step_, step);
    refresh();
    plan_->clear();
    if (incremental())
      plan_changed();
    else
      plan_all();
    std::sort(plan_->begin(), plan_->end(), [](const conversion& a, const conversion& b) {
      const bool pa = a.to == append_tier, pb = b.to == append_tier;
      if (pa != pb) return pb;  // out of tier 0 (or between other tiers) first
      if (a.value != b.value) return pa ? a.value > b.value : a.value < b.value;
      if (a.block.index != b.block.index) return a.block.index < b.block.index;
      return a.layer < b.layer;
    });
    return {plan_->data(), plan_->size()};
  }

  /// The next plan() visits every page once (after the engine changed page tables behind the
  /// controller's back: replace_page outside it, say). The incremental plan needs it then.
  void rescan() noexcept { rescan_ = true; }

  /// Applies conversions (from plan(), or the engine's own) through the protocol. A
  /// failed conversion leaves its page published at its old id and tier; the rest go on.
  /// One held back for capacity (held_back) is counted as deferred, not as failed.
  template <conversion_fault_hook Faults = no_faults>
  retier_stats apply(std::span<const conversion> todo,
                     Faults&& faults = {}) requires Storage::page_allocator::host_accessible {
    retier_stats st;
    st.planned = todo.size();
    trim_shadows(st);
    const std::uint32_t reserve = percent_of_tier0(opt_.promotion_reserve_percent);
    for (const conversion& c : todo) {
      if (!storage_->check_block(c.block) || c.layer < 0 || c.layer >= storage_->num_layers()) {
        note_failure(st,
                     status::make(errc::stale_id, "apply: block ", c.block.index, "@",
                                  c.block.generation, " layer ", c.layer, " is no longer live"));
        continue;
      }
      if (int(storage_->block_page(c.block, c.layer).format) != c.from)
        continue;  // moved since planned
      page_rec& r = page(c.block.index, c.layer);
      if (c.to == append_tier && r.shadow.valid() &&
          r.shadow_of == storage_->block_page(c.block, c.layer)) {
        promote_from_shadow(c, r, st, faults);
        continue;
      }
      if (held_back(c, reserve, st)) continue;
      convert(c, r, st, faults);
    }
    totals_.add(st);
    return st;
  }

  /// Two-phase apply for a fill the caller runs elsewhere (a GPU batch, cuda/retier/driver.cuh).
  /// stage() reserves the target page of each conversion of `todo` that apply() would run
  /// (live, unmoved, not held back for capacity) into `out` and returns how many;
  /// nothing is published and the old pages stay readable. commit() then publishes staged[i]
  /// where filled[i] is true and releases the other reserved pages, with apply()'s
  /// bookkeeping (dwell, counters). Shadows are neither made nor used on this path.
  template <conversion_fault_hook Faults = no_faults>
  std::size_t stage(std::span<const conversion> todo, std::span<staged_conversion> out,
                    retier_stats& st, Faults&& faults = {}) {
    st.planned += todo.size();
    const std::uint32_t reserve = percent_of_tier0(opt_.promotion_reserve_percent);
    std::size_t n = 0;
    for (const conversion& c : todo) {
      if (n == out.size()) break;
      if (!storage_->check_block(c.block) || c.layer < 0 || c.layer >= storage_->num_layers()) {
        note_failure(st,
                     status::make(errc::stale_id, "stage: block ", c.block.index, "@",
                                  c.block.generation, " layer ", c.layer, " is no longer live"));
        continue;
      }
      if (int(storage_->block_page(c.block, c.layer).format) != c.from)
        continue;  // moved since planned
      if (held_back(c, reserve, st)) continue;
      auto staged = reserve_conversion(*storage_, c.block, c.layer, c.to, faults);
      if (!staged) {
        note_failure(st, staged.error_status());
        continue;
      }
      out[n++] = *staged;
    }
    return n;
  }
  /// The second phase of stage() (see there).
  template <conversion_fault_hook Faults = no_faults>
  void commit(std::span<staged_conversion> staged, std::span<const bool> filled, retier_stats& st,
              Faults&& faults = {}) {
    for (std::size_t i = 0; i < staged.size(); ++i) {
      staged_conversion& sc = staged[i];
      if (!(i < filled.size() && filled[i])) {
        abort_conversion(*storage_, sc);
        note_failure(
            st, status::make(errc::non_finite_input, "commit: the fill of block ", sc.block.index,
                             " layer ", sc.layer, " failed; the old page stays published"));
        continue;
      }
      const int from = int(sc.from.format), to = int(sc.to.format);
      if (auto s = publish_conversion(*storage_, sc, faults); !s) {
        abort_conversion(*storage_, sc);
        note_failure(st, std::move(s));
        continue;
      }
      record_move(sc, from, to, st);
    }
    totals_.add(st);
  }
  /// commit() all or none (the GPU façade's make_room, so that a refused step changes nothing):
  /// when every staged[i] is filled and passes check_publish, all are published; otherwise
  /// every reserved page is given back and the first failure returned, with nothing changed,
  /// the totals included.
  template <conversion_fault_hook Faults = no_faults>
  status commit_all(std::span<staged_conversion> staged, std::span<const bool> filled,
                    retier_stats& st, Faults&& faults = {}) {
    for (std::size_t i = 0; i < staged.size(); ++i) {
      const staged_conversion& sc = staged[i];
      status s = i < filled.size() && filled[i]
                     ? check_publish(*storage_, sc, faults)
                     : status::make(errc::non_finite_input, "commit_all: the fill of block ",
                                    sc.block.index, " layer ", sc.layer, " failed");
      if (!s) {
        abandon(staged);
        return status::make(s.code(), s.message(), "; none of the ", staged.size(),
                            " conversions was published");
      }
    }
    for (staged_conversion& sc : staged) {
      const int from = int(sc.from.format), to = int(sc.to.format);
      publish_checked(*storage_, sc);
      record_move(sc, from, to, st);
    }
    totals_.add(st);
    return {};
  }
  /// Gives back the reserved target pages of staged conversions that will not be committed
  /// (no bookkeeping: as if stage() had not run).
  void abandon(std::span<staged_conversion> staged) {
    for (staged_conversion& sc : staged) abort_conversion(*storage_, sc);
  }
  /// Quarantines the page (block, layer) whose conversion found non-finite data (apply() does
  /// it itself; a caller running the fill elsewhere, cuda/retier/driver.cuh, calls this before
  /// commit): it stays published in its tier and is never planned or picked by make_room
  /// again, so a poisoned page cannot hold other pages' conversions back step after step.
  /// Counted once in st.quarantined; ends when the block is freed. A stale block is ignored.
  void quarantine(block_ref b, int layer, retier_stats& st) {
    if (!storage_->check_block(b) || layer < 0 || layer >= storage_->num_layers()) return;
    sync(b);
    page_rec& r = page(b.index, layer);
    if (r.quarantined) return;
    r.quarantined = true;
    r.want = -1;
    ++st.quarantined;
  }

  /// plan(step) + apply(): one retier step.
  template <conversion_fault_hook Faults = no_faults>
  retier_stats retier(std::uint64_t step,
                      Faults&& faults = {}) requires Storage::page_allocator::host_accessible {
    const auto todo = plan(step);
    return apply(todo, faults);
  }

  /// Makes `pages` tier-0 pages free (before an append): drops shadows, then demotes the
  /// sealed tier-0 pages of lowest keep value to the Stale tier, or to the Cold tier once the
  /// Stale tier's pool is full (when Cold has a tier of its own). All or nothing, so a refused
  /// append or fork changes nothing: every demotion it needs is reserved, filled and checked
  /// for publishing first (a candidate failing there, say by an injected fault, is given back
  /// and the next one tried); only when all of them are staged are shadows dropped and the
  /// demotions published. Otherwise every staged page is given back and it refuses
  /// (capacity_exhausted, or the first failure) with nothing changed, the totals included.
  template <conversion_fault_hook Faults = no_faults>
  status make_room(std::uint32_t pages,
                   Faults&& faults = {}) requires Storage::page_allocator::host_accessible {
    if (storage_->free_pages(append_tier) >= pages) return {};
    auto todo = pressure_candidates(pages);
    if (!todo) return todo.error_status();
    const std::uint32_t deficit = pages - storage_->free_pages(append_tier);
    const std::size_t need = deficit - std::min(shadows_, deficit);
    retier_stats st;
    std::uint64_t saturated = 0;
    staged_->clear();  // capacity: every tier-0 page, reserved at create
    for (conversion c : *todo) {
      if (staged_->size() == need) break;
      if (held_elsewhere(c)) continue;
      // Stale while its pool has room (reserving a page takes it), then Cold.
      c.to = spill_target(storage_->free_pages(Roles::stale), storage_->free_pages(Roles::cold));
      ++st.planned;
      auto r = reserve_conversion(*storage_, c.block, c.layer, c.to, faults);
      if (!r) {
        note_failure(st, r.error_status());
        continue;
      }
      staged_conversion sc = *r;
      conversion_counters counters;
      status ok = fill_conversion_on_host(*storage_, sc, counters, faults);
      if (ok) ok = check_publish(*storage_, sc, faults);
      if (!ok) {
        abort_conversion(*storage_, sc);
        note_failure(st, std::move(ok));
        continue;
      }
      saturated += counters.saturated;
      staged_->push_back(sc);
    }
    if (const std::size_t got = staged_->size(); got < need) {
      for (staged_conversion& sc : *staged_) abort_conversion(*storage_, sc);
      staged_->clear();
      if (!st.first_error.is_ok()) return st.first_error;
      return status::make(errc::capacity_exhausted, "make_room: ", need, " demotions needed, only ",
                          got,
                          " tier-0 pages can be demoted (others are held); nothing was changed");
    }
    while (shadows_ > 0 && storage_->free_pages(append_tier) < pages) drop_oldest_shadow(st);
    for (staged_conversion& sc : *staged_) {
      publish_checked(*storage_, sc);
      page_rec& r = page(sc.block.index, sc.layer);
      if (r.shadow.valid()) release_shadow(r);  // a copy of an older page
      r.last_move = step_;
      r.moved = true;
      mark_dirty(sc.block.index, sc.layer);
      ++st.converted;
      ++st.demoted;
      ++st.pressure_demoted;
    }
    staged_->clear();
    st.saturated += saturated;
    totals_.add(st);
    if (storage_->free_pages(append_tier) >= pages) return {};
    return status::make(errc::capacity_exhausted, "make_room: tier 0 still has ",
                        storage_->free_pages(append_tier), " free pages of ", pages, " needed");
  }

  /// make_room for a caller that converts elsewhere (the GPU: cuda::tiered_cache stages these
  /// through its retier driver): drops the shadows make_room would drop, then returns the
  /// demotions it would run, in its order, exactly as many as tier 0 is still short (each
  /// frees one tier-0 page once published and its old page is released). Like make_room, it
  /// skips a page someone else still holds (retain_page: its demotion would free nothing), and
  /// refuses before changing anything. The span lives until the next plan or pressure call.
  result<std::span<const conversion>> pressure_plan(std::uint32_t pages) {
    if (storage_->free_pages(append_tier) >= pages) return std::span<const conversion>{};
    auto todo = pressure_candidates(pages);
    if (!todo) return todo.error_status();
    std::size_t n = 0;  // in place: todo views plan_
    std::uint32_t stale_left = storage_->free_pages(Roles::stale);
    std::uint32_t cold_left = storage_->free_pages(Roles::cold);
    for (const conversion& c : *todo)
      if (!held_elsewhere(c)) {
        conversion d = c;  // as make_room: Stale while its pool has room, then Cold
        d.to = spill_target(stale_left, cold_left);
        if (d.to == Roles::stale && stale_left > 0) --stale_left;
        if (d.to == Roles::cold && Roles::cold != Roles::stale && cold_left > 0) --cold_left;
        (*plan_)[n++] = d;
      }
    plan_->resize(n);
    const std::uint32_t short0 = pages - storage_->free_pages(append_tier);
    const std::uint64_t demotable = std::min<std::uint64_t>(n, demotion_room());
    if (std::uint64_t(shadows_) + demotable < short0)
      return status::make(errc::capacity_exhausted, "pressure_plan: tier 0 is ", short0,
                          " pages short; ", shadows_, " shadow copies and ", demotable,
                          " demotable pages (others are held) cannot free them; nothing was "
                          "changed");
    todo = std::span<const conversion>(plan_->data(), n);
    retier_stats st;
    while (shadows_ > 0 && storage_->free_pages(append_tier) < pages) drop_oldest_shadow(st);
    totals_.add(st);
    const std::uint32_t free0 = storage_->free_pages(append_tier);
    const std::size_t need = free0 >= pages ? 0 : std::size_t(pages - free0);
    return todo->first(std::min(need, todo->size()));
  }

  /// Storage invariants with the controller's own pages (shadows) and `held_elsewhere` pages
  /// the caller holds (a GPU retier driver's batch in flight and replaced pages) accounted for,
  /// and the shadows' own consistency.
  status check_invariants(std::uint32_t held_elsewhere = 0) const {
    std::uint32_t n = 0;
    for (const page_rec& r : *pages_) {
      if (!r.shadow.valid()) continue;
      ++n;
      if (auto st = storage_->check_page(r.shadow); !st) return st;
      if (r.shadow.format != append_tier || storage_->page_published(r.shadow))
        return status::make(errc::corrupt_data, "shadow ", r.shadow,
                            " is not a caller-owned tier-0 page");
    }
    if (n != shadows_)
      return status::make(errc::corrupt_data, "shadow count ", shadows_, " != ", n);
    return storage_->check_invariants(shadows_ + held_elsewhere);
  }

  /// The policy state of (block, layer) (tests, reports).
  const typename Policy::page_state& page_state_of(block_ref b, int layer) const {
    return (*pages_)[std::size_t(b.index) * std::size_t(storage_->num_layers()) +
                     std::size_t(layer)]
        .state;
  }

 private:
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

  tier_controller(Storage& s, Policy p, options o) : storage_(&s), policy_(std::move(p)), opt_(o) {}

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

  /// plan() over every page: folds the observed masses, asks the policy for every sealed page.
  void plan_all() {
    const int layers = storage_->num_layers();
    for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi) {
      block_rec& b = (*blocks_)[bi];
      if (!b.live) continue;
      const block_ref ref{bi, b.generation};
      const bool sealed = storage_->block_sealed(ref);
      for (int l = 0; l < layers; ++l) {
        page_rec& r = page(bi, l);
        if (r.pending >= 0.0f) policy_.observe(r.state, r.pending);
        r.pending = -1.0f;
        if (!sealed || r.quarantined) continue;
        const page_facts f = facts(bi, l, storage_->block_page(ref, l));
        const int to = Roles::tier_of(policy_.choose(r.state, f));
        if (to == f.tier || dwelling(r, f)) continue;
        plan_->push_back(conversion{ref, l, f.tier, to, policy_.keep_value(r.state, f)});
      }
    }
    for (const std::uint32_t i : *dirty_) (*pages_)[i].dirty = false;
    dirty_->clear();
    for (const std::uint32_t i : *waiting_) (*pages_)[i].waiting = false;
    waiting_->clear();
    rescan_ = true;  // the incremental plan's lists were dropped: its next plan visits all
  }

  /// plan() over what changed: the dirty pages are folded and re-evaluated; the waiting pages
  /// (wanting another tier: held by the dwell, deferred, or not yet run) are planned again. The
  /// same conversions as plan_all() for a policy whose choose() does not read steps_since_move.
  void plan_changed() {
    const int layers = storage_->num_layers();
    if (rescan_) {
      rescan_ = false;
      for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi)
        if ((*blocks_)[bi].live) mark_block_dirty(bi);
    }
    for (const std::uint32_t i : *dirty_) {
      page_rec& r = (*pages_)[i];
      r.dirty = false;
      if (r.pending >= 0.0f) policy_.observe(r.state, r.pending);
      r.pending = -1.0f;
      const std::uint32_t bi = i / std::uint32_t(layers);
      const int l = int(i % std::uint32_t(layers));
      r.want = -1;
      const block_rec& b = (*blocks_)[bi];
      if (!b.live || !b.sealed || r.quarantined) continue;
      evaluate(r, bi, l, storage_->block_page(block_ref{bi, b.generation}, l));
    }
    dirty_->clear();
    std::size_t kept = 0;
    for (const std::uint32_t i : *waiting_) {
      page_rec& r = (*pages_)[i];
      const std::uint32_t bi = i / std::uint32_t(layers);
      const int l = int(i % std::uint32_t(layers));
      const block_rec& b = (*blocks_)[bi];
      const block_ref ref{bi, b.generation};
      const page_id p = b.live && b.sealed ? storage_->block_page(ref, l) : page_id{};
      if (r.quarantined) r.want = -1;
      if (p.valid() && r.want >= 0 && int(p.format) != r.want_from) evaluate(r, bi, l, p);
      if (!p.valid() || r.want < 0 || int(p.format) == r.want) {
        r.waiting = false;
        continue;
      }
      (*waiting_)[kept++] = i;
      const page_facts f = facts(bi, l, p);
      if (dwelling(r, f)) continue;
      plan_->push_back(conversion{ref, l, f.tier, r.want, policy_.keep_value(r.state, f)});
    }
    waiting_->resize(kept);
  }

  /// The dwell holds a page that moved fewer than min_dwell_steps ago (no flapping between
  /// tiers); a page's first move, out of the tier it was written in, is not held: a chunked
  /// prefill's step is a whole chunk, and the dwell must not widen the policy's Recent window.
  bool dwelling(const page_rec& r, const page_facts& f) const {
    return r.moved && f.steps_since_move < policy_.min_dwell_steps();
  }

  void evaluate(page_rec& r, std::uint32_t bi, int layer, page_id p) {
    const page_facts f = facts(bi, layer, p);
    r.want = std::int16_t(Roles::tier_of(policy_.choose(r.state, f)));
    r.want_from = std::int16_t(f.tier);
    if (r.want != f.tier && !r.waiting) {
      r.waiting = true;
      waiting_->push_back(bi * std::uint32_t(storage_->num_layers()) + std::uint32_t(layer));
    }
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

  /// Where a pressure demotion goes: the Stale tier while it has free pages (stale_free > 0),
  /// else the Cold tier when Cold has a tier of its own (neither tier 0 nor Stale's) with free
  /// pages; else Stale (its reservation then fails: capacity, counted as such).
  static constexpr bool cold_spill = Roles::cold != Roles::stale && Roles::cold != append_tier;
  static int spill_target(std::uint32_t stale_free, std::uint32_t cold_free) {
    if constexpr (Roles::stale == append_tier) {
      return cold_spill ? Roles::cold : Roles::stale;
    } else {
      if (cold_spill && stale_free == 0 && cold_free > 0) return Roles::cold;
      return Roles::stale;
    }
  }
  /// Free pages pressure demotions can go to: the Stale tier's, and the Cold tier's when it has
  /// one of its own; none in tier 0.
  std::uint64_t demotion_room() const {
    std::uint64_t n = Roles::stale == append_tier ? 0 : storage_->free_pages(Roles::stale);
    if constexpr (cold_spill) n += storage_->free_pages(Roles::cold);
    return n;
  }

  /// make_room's candidates (sealed tier-0 pages the policy lets go, lowest keep value first;
  /// `to` is the Stale tier, make_room and pressure_plan move it to Cold once Stale is full), or
  /// capacity_exhausted when shadows and every possible demotion cannot free `pages`.
  result<std::span<const conversion>> pressure_candidates(std::uint32_t pages) {
    refresh();
    const std::uint32_t free0 = storage_->free_pages(append_tier);
    const std::uint32_t deficit = pages - free0;
    constexpr int stale = Roles::stale;
    if (stale == append_tier && !cold_spill)
      return status::make(errc::capacity_exhausted, "tier 0 has ", free0, " free pages, ", pages,
                          " needed, and the Stale and Cold roles map to tier 0 too");
    plan_->clear();
    const int layers = storage_->num_layers();
    for (std::uint32_t bi = 0; bi < storage_->block_capacity(); ++bi) {
      block_rec& b = (*blocks_)[bi];
      if (!b.live) continue;
      const block_ref ref{bi, b.generation};
      if (!storage_->block_sealed(ref)) continue;
      for (int l = 0; l < layers; ++l) {
        const page_id p = storage_->block_page(ref, l);
        if (p.format != append_tier || page(bi, l).quarantined) continue;
        const page_facts f = facts(bi, l, p);
        const float v = policy_.keep_value(page(bi, l).state, f);
        if (std::isinf(v)) continue;
        plan_->push_back(conversion{ref, l, append_tier, stale, v});
      }
    }
    const std::uint64_t demotable = std::min<std::uint64_t>(plan_->size(), demotion_room());
    if (std::uint64_t(shadows_) + demotable < deficit)
      return status::make(errc::capacity_exhausted, "tier 0 has ", free0, " free pages and ", pages,
                          " are needed; dropping ", shadows_, " shadow copies and demoting ",
                          demotable, " pages (of ", plan_->size(), " demotable, ", demotion_room(),
                          " free in the Stale", cold_spill ? " and Cold" : "",
                          " tiers) cannot free ", deficit, "; nothing was changed");
    std::sort(plan_->begin(), plan_->end(), [](const conversion& a, const conversion& b) {
      if (a.value != b.value) return a.value < b.value;
      if (a.block.index != b.block.index) return a.block.index < b.block.index;
      return a.layer < b.layer;
    });
    return std::span<const conversion>(plan_->data(), plan_->size());
  }

  std::uint32_t percent_of_tier0(int percent) const {
    return std::uint32_t(std::uint64_t(storage_->template pool<append_tier>().capacity()) *
                         std::uint64_t(percent) / 100);
  }

  /// A page someone else still holds (retain_page): demoting it would free no tier-0 page.
  bool held_elsewhere(const conversion& c) const {
    return storage_->page_refcount(storage_->block_page(c.block, c.layer)) != 1;
  }

  /// Capacity, not a fault: a promotion that would eat into the tier-0 reserve, or any
  /// conversion whose target pool is full (the Stale pool, typically). Counted, not tried.
  bool held_back(const conversion& c, std::uint32_t reserve, retier_stats& st) const {
    if (c.to < 0 || c.to >= num_tiers) return false;  // reserve_conversion reports it
    if (c.to == append_tier && storage_->free_pages(append_tier) <= reserve) {
      ++st.deferred;
      return true;
    }
    if (storage_->free_pages(c.to) == 0) {
      ++st.deferred_full;
      return true;
    }
    return false;
  }

  // The bookkeeping of a published conversion from tier `from` to `to`.
  void record_move(const staged_conversion& sc, int from, int to, retier_stats& st) {
    page_rec& r = page(sc.block.index, sc.layer);
    if (r.shadow.valid()) release_shadow(r);  // a copy of an older page
    r.last_move = step_;
    r.moved = true;
    mark_dirty(sc.block.index, sc.layer);
    ++st.converted;
    if (to == append_tier) ++st.promoted;
    if (from == append_tier && to != append_tier) ++st.demoted;
  }

  void note_failure(retier_stats& st, status s) {
    ++st.failed;
    if (s.code() == errc::injected_fault) ++st.injected_faults;
    if (st.first_error.is_ok()) st.first_error = std::move(s);
  }

  template <class Faults>
  void convert(const conversion& c, page_rec& r, retier_stats& st, Faults& faults) {
    auto staged = reserve_conversion(*storage_, c.block, c.layer, c.to, faults);
    if (!staged) return note_failure(st, staged.error_status());
    staged_conversion sc = *staged;
    conversion_counters counters;
    if (auto s = fill_conversion_on_host(*storage_, sc, counters, faults); !s) {
      abort_conversion(*storage_, sc);
      if (s.code() == errc::non_finite_input) quarantine(c.block, c.layer, st);
      return note_failure(st, std::move(s));
    }
    st.saturated += counters.saturated;
    // A shadow: a byte copy of the tier-0 page being demoted, made only with slack.
    page_id shadow;
    const bool demotion = c.from == append_tier && c.to != append_tier;
    if (demotion && opt_.keep_shadows &&
        storage_->free_pages(append_tier) > percent_of_tier0(opt_.shadow_slack_percent)) {
      if (auto p = storage_->allocate_page(append_tier)) {
        auto dst = storage_->page_bytes(*p);
        auto src = storage_->page_bytes(sc.from);
        if (dst && src && storage_->page_alloc().copy(dst->data(), src->data(), src->size()))
          shadow = *p;
        else
          (void)storage_->release_page(*p);
      }
    }
    const page_id published = sc.to;
    if (auto s = publish_conversion(*storage_, sc, faults); !s) {
      abort_conversion(*storage_, sc);
      if (shadow.valid()) (void)storage_->release_page(shadow);
      return note_failure(st, std::move(s));
    }
    if (r.shadow.valid()) release_shadow(r);  // a copy of an older page
    if (shadow.valid()) {
      r.shadow = shadow;
      r.shadow_of = published;
      r.shadow_step = step_;
      ++shadows_;
      ++st.shadows_made;
    }
    r.last_move = step_;
    r.moved = true;
    mark_dirty(c.block.index, c.layer);
    ++st.converted;
    if (c.to == append_tier) ++st.promoted;
    if (demotion) ++st.demoted;
  }

  template <class Faults>
  void promote_from_shadow(const conversion& c, page_rec& r, retier_stats& st, Faults& faults) {
    staged_conversion sc{c.block, c.layer, r.shadow_of, r.shadow};
    if (auto s = publish_conversion(*storage_, sc, faults); !s)
      return note_failure(st, std::move(s));
    r.shadow = page_id{};  // published: the block owns it
    r.shadow_of = page_id{};
    --shadows_;
    r.last_move = step_;
    r.moved = true;
    mark_dirty(c.block.index, c.layer);
    ++st.converted;
    ++st.promoted;
    ++st.shadow_promotions;
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
  options opt_;
  std::optional<counted_vector<block_rec>> blocks_;
  std::optional<counted_vector<page_rec>> pages_;
  std::optional<counted_vector<conversion>> plan_;
  std::optional<counted_vector<std::uint8_t>> seen_;
  std::optional<counted_vector<old_facts>> old_;       ///< refresh's previous facts per block
  std::optional<counted_vector<seq_seen>> seqs_seen_;  ///< per sequence slot, at the last refresh
  std::uint64_t epoch_seen_ = ~std::uint64_t(0);  ///< the storage's structure epoch then (none yet)
  std::optional<counted_vector<std::uint32_t>> dirty_;       ///< pages to re-evaluate (page index)
  std::optional<counted_vector<std::uint32_t>> waiting_;     ///< pages wanting another tier
  std::optional<counted_vector<staged_conversion>> staged_;  ///< make_room's demotions
  bool rescan_ = true;
  std::uint64_t step_ = 0;
  std::uint32_t shadows_ = 0;
  retier_stats totals_;
};

}  // namespace tierkv
