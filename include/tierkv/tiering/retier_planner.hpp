// SPDX-License-Identifier: Apache-2.0
// Which pages a tier_controller should move, and where. The plan of the policy's choices, over
// every page (plan_all) or over only the pages whose inputs changed and those still waiting to
// move (plan_changed, the incremental plan), with the dwell that holds a page that has just
// moved; and the candidates of a demotion under memory pressure (sealed tier-0 pages, lowest
// keep value first) with where each goes (the Stale tier, then Cold once Stale is full).
// tier_controller derives from it and carries the moves out.
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "tierkv/codec/error_traits.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/tiering/bit_budget.hpp"
#include "tierkv/tiering/controller_types.hpp"
#include "tierkv/tiering/page_records.hpp"
#include "tierkv/tiering/tier_policy.hpp"

namespace tierkv {
namespace detail {

/// The planning half of a tier_controller (see the file comment), over its page_records.
template <class Storage, class Policy, class Roles>
class retier_planner : public page_records<Storage, Policy> {
  using records = page_records<Storage, Policy>;

 protected:
  using records::records;
  // The records this class reads and writes (a dependent base's names are not found
  // unqualified).
  using records::append_tier;
  using records::blocks_;
  using records::dirty_;
  using records::facts;
  using records::mark_block_dirty;
  using records::opt_;
  using records::page;
  using records::pages_;
  using records::percent_of_tier0;
  using records::policy_;
  using records::refresh;
  using records::shadows_;
  using records::storage_;
  using typename records::block_rec;
  using typename records::page_rec;
  template <class T>
  using counted_vector = typename records::template counted_vector<T>;

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
        fold_mass(r);
        if (!sealed || r.quarantined) continue;
        const page_facts f = facts(bi, l, storage_->block_page(ref, l));
        const int to = Roles::tier_of(policy_.choose(r.state, f));
        if (to == f.tier || dwelling(r, f)) continue;
        plan_->push_back(conversion{ref, l, f.tier, to, policy_.keep_value(r.state, f)});
      }
    }
    drop_incremental_lists();
  }

  /// This step's observed mass into the policy's state (once: pending is reset).
  void fold_mass(page_rec& r) {
    if (r.pending >= 0.0f) policy_.observe(r.state, r.pending);
    r.pending = -1.0f;
  }

  /// After a full scan: the incremental plan's lists are dropped, so its next plan visits all.
  void drop_incremental_lists() {
    for (const std::uint32_t i : *dirty_) (*pages_)[i].dirty = false;
    dirty_->clear();
    for (const std::uint32_t i : *waiting_) (*pages_)[i].waiting = false;
    waiting_->clear();
    rescan_ = true;
  }

  /// plan() under a bit budget (tier_controller_options::bits_per_scalar_target, MosaicKV's
  /// global budget). Open and pinned pages and the policy's Recent pages stay where they are and
  /// are not charged: a sequence's first chunks, mostly Recent, would otherwise push every older
  /// page to the cheapest tier for good (a page never regains a lossy tier's error); they add
  /// their own rate over the Recent window, a few pages a sequence (docs/tiering.md). Every other
  /// page is charged target bits per stored scalar: those the dwell holds (and quarantined ones)
  /// where they are, so that what they spend under the target goes to the rest, the movable
  /// pages, which go where allocate_bit_budget puts them (tiering/bit_budget.hpp), weighted by
  /// the policy's keep value (newer pages first among equals), never to a tier of less expected
  /// error than their own (a lossy page regains nothing), over every tier with room (tier 0
  /// keeps promotion_reserve_percent free, as apply() does). A tier's error is budget_key_weight
  /// x key ip rms^2 x head_dim + value relative MSE (codec/error_traits.hpp). A
  /// full scan every plan: the budget is global. Returns what the allocation did, bytes over
  /// every live page (the memory report's), within = whether the charged pages fit (false: they
  /// exceed the target even with the movable ones in the cheapest tier).
  budget_result plan_budget(double target_bits) {
    constexpr int T = Storage::num_tiers;
    const int layers = storage_->num_layers();
    std::array<budget_tier, T> tiers{};
    const auto views = storage_->views();
    detail::for_each_index<T>([&](auto I) {
      tiers[I].page_bytes = double(views[I].page_bytes);
      using tier = tier_at_t<typename Storage::tier_list, I>;
      tiers[I].error = opt_.budget_key_weight * tier_budget_key_error<tier, Storage::head_dim>() +
                       tier_budget_value_error<tier, Storage::head_dim>();
      tiers[I].room = storage_->free_pages(I);
    });
    const std::uint64_t reserve = percent_of_tier0(opt_.promotion_reserve_percent);
    tiers[append_tier].room =
        tiers[append_tier].room > reserve ? tiers[append_tier].room - reserve : 0;
    budget_pages_->clear();
    budget_at_->clear();
    // fixed: every fixed page's bytes; held: the bytes of the charged fixed pages (dwelling or
    // quarantined); scalars: the charged pages' scalars (held and movable)
    double fixed = 0, held = 0, scalars = 0;
    const double scalars_per_token_layer = 2.0 * Storage::kv_heads * Storage::head_dim;
    storage_->for_each_block([&](block_ref ref, int fill, std::uint32_t) {
      const bool sealed = storage_->block_sealed(ref);
      for (int l = 0; l < layers; ++l) {
        page_rec& r = page(ref.index, l);
        fold_mass(r);
        const page_id p = storage_->block_page(ref, l);
        const page_facts f = facts(ref.index, l, p);
        if (!sealed || f.pinned || budget_exempt(policy_, r.state, f)) {
          fixed += tiers[f.tier].page_bytes;  // not charged
          continue;
        }
        scalars += double(fill) * scalars_per_token_layer;
        if (r.quarantined || dwelling(r, f)) {  // charged where they are
          fixed += tiers[f.tier].page_bytes;
          held += tiers[f.tier].page_bytes;
          continue;
        }
        ++tiers[f.tier].room;
        const std::uint64_t age = std::uint64_t(std::clamp<std::int64_t>(f.age, 0, 1LL << 40));
        budget_pages_->push_back({policy_.keep_value(r.state, f),
                                  age * std::uint64_t(layers) + std::uint64_t(l),
                                  std::int16_t(f.tier)});
        budget_at_->push_back(ref.index * std::uint32_t(layers) + std::uint32_t(l));
      }
    });
    budget_to_->assign(budget_pages_->size(), std::int16_t(-1));
    const double budget = target_bits / 8.0 * scalars - held;
    auto placed = allocate_bit_budget(*budget_pages_, tiers, budget, *budget_to_);
    drop_incremental_lists();
    if (!placed) return budget_result{fixed, false, 0};
    for (std::size_t k = 0; k < budget_at_->size(); ++k) {
      const std::uint32_t i = (*budget_at_)[k];
      const std::uint32_t bi = i / std::uint32_t(layers);
      const int l = int(i % std::uint32_t(layers));
      const block_ref ref{bi, (*blocks_)[bi].generation};
      const int from = int(storage_->block_page(ref, l).format);
      const int to = (*budget_to_)[k];
      if (to != from)
        plan_->push_back(conversion{ref, l, from, to, (*budget_pages_)[k].importance});
    }
    placed->bytes += fixed;
    return *placed;
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
      fold_mass(r);
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

  std::optional<counted_vector<conversion>> plan_;        ///< plan()'s conversions, or pressure's
  std::optional<counted_vector<std::uint32_t>> waiting_;  ///< pages wanting another tier
  // plan_budget's scratch (allocated by create when a bit budget is set): the movable pages, the
  // page index of each, the tier the budget gives each
  std::optional<counted_vector<budget_page>> budget_pages_;
  std::optional<counted_vector<std::uint32_t>> budget_at_;
  std::optional<counted_vector<std::int16_t>> budget_to_;
  bool rescan_ = true;  ///< the next incremental plan visits every page
};

}  // namespace detail
}  // namespace tierkv
