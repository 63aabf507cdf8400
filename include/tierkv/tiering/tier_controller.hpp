// SPDX-License-Identifier: Apache-2.0
// The tier controller: keeps a policy's per-page state (smoothed attention mass,
// hysteresis), plans conversions from the policy's choices, applies them through the
// conversion protocol (tiering/conversion.hpp), and makes room in tier 0 under memory
// pressure by demoting the pages the policy values least.
//
// Threading: one controller per storage, driven by one thread (the scheduler's), like
// the storage itself. Plans and stats are plain data.
//
// Parts, one idea per header: controller_types.hpp (conversion, retier_stats, the options),
// page_records.hpp (what the controller knows of each block and page, kept in step with the
// storage; the shadows), retier_planner.hpp (the plan of the policy's choices, full or
// incremental, and the candidates of a pressure demotion); this header holds the controller's
// API and carries the moves out (apply, stage / commit, make_room).
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

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/tiering/controller_types.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/retier_planner.hpp"
#include "tierkv/tiering/tier_policy.hpp"
#include "tierkv/tiering/tier_roles.hpp"

namespace tierkv {

/// Keeps the policy's per-page state, plans conversions from its choices, applies them
/// through the conversion protocol and makes room in tier 0 under memory pressure
/// (docs/tiering.md).
template <class Storage, tier_policy Policy = policy::recency_anchor,
          class Roles = tier_roles<typename Storage::tier_list>>
class tier_controller : private detail::retier_planner<Storage, Policy, Roles> {
  static_assert(check_tier_policy<Policy>());
  static_assert(std::is_same_v<typename Roles::tier_list, typename Storage::tier_list>,
                "tier_controller: Roles must map roles onto the storage's tier list");
  using planner = detail::retier_planner<Storage, Policy, Roles>;

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
      if (opt.bits_per_scalar_target > 0) {
        c->budget_pages_.emplace(c->template alloc<budget_page>());
        c->budget_pages_->reserve(pages);
        c->budget_at_.emplace(c->template alloc<std::uint32_t>());
        c->budget_at_->reserve(pages);
        c->budget_to_.emplace(c->template alloc<std::int16_t>());
        c->budget_to_->reserve(pages);
      }
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
    if (!(opt.bits_per_scalar_target >= 0.0 && opt.bits_per_scalar_target <= 64.0))
      return status::make(errc::invalid_argument,
                          "bits_per_scalar_target = ", opt.bits_per_scalar_target,
                          " must lie in [0, 64] (0: no bit budget)");
    if (!(opt.budget_key_weight > 0.0 && opt.budget_key_weight <= 1e6))
      return status::make(errc::invalid_argument, "budget_key_weight = ", opt.budget_key_weight,
                          " must lie in (0, 1e6]");
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
  /// The last plan's bit budget (bits_per_scalar_target set): the bytes its placement gives the
  /// live pages and whether they fit; all zero before the first plan or without a budget.
  const budget_result& last_budget() const noexcept { return last_budget_; }

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
    if (opt_.bits_per_scalar_target > 0)
      last_budget_ = plan_budget(opt_.bits_per_scalar_target);
    else if (incremental())
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
  // The records and the planner this class uses (a dependent base's names are not found
  // unqualified).
  using planner::budget_at_;
  using planner::budget_pages_;
  using planner::budget_to_;
  using planner::demotion_room;
  using planner::drop_all_shadows;
  using planner::drop_oldest_shadow;
  using planner::epoch_seen_;
  using planner::incremental;
  using planner::mark_block_dirty;
  using planner::mark_dirty;
  using planner::opt_;
  using planner::page;
  using planner::pages_;
  using planner::percent_of_tier0;
  using planner::plan_;
  using planner::plan_all;
  using planner::plan_budget;
  using planner::plan_changed;
  using planner::policy_;
  using planner::pressure_candidates;
  using planner::refresh;
  using planner::release_shadow;
  using planner::rescan_;
  using planner::same_state_choice;
  using planner::shadows_;
  using planner::spill_target;
  using planner::step_;
  using planner::storage_;
  using planner::sync;
  using planner::trim_shadows;
  using typename planner::block_rec;
  using typename planner::old_facts;
  using typename planner::page_rec;
  using typename planner::seq_seen;
  template <class T>
  using counted_vector = typename planner::template counted_vector<T>;

  tier_controller(Storage& s, Policy p, options o) : planner(s, std::move(p), o) {}

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

  std::optional<counted_vector<staged_conversion>> staged_;  ///< make_room's demotions
  budget_result last_budget_{0, true, 0};
  retier_stats totals_;
};

}  // namespace tierkv
