// SPDX-License-Identifier: Apache-2.0
// The plain types a tier_controller takes and returns: one planned conversion, the counters of
// a retier step, and the controller's options.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>

#include "tierkv/core/status.hpp"
#include "tierkv/paging/storage_types.hpp"

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
  /// A bit budget (issue 52; MosaicKV's global budget): > 0 makes every plan() place the pages
  /// it may move (all but the Recent window, open, pinned and dwelling pages) so that they store
  /// at most this many bits per key / value scalar, the bits going to the pages of highest keep
  /// value where they lower the tiers' expected error most (retier_planner::plan_budget,
  /// tiering/bit_budget.hpp). 0: off, the policy's choices as they are.
  double bits_per_scalar_target = 0;
  /// The weight of the key role's term in a tier's expected error under a bit budget
  /// (codec/error_traits.hpp tier_budget_key_error: the logit error at unit-variance logits).
  /// A model's logits span more than unit variance, which multiplies the key term: above ~8 a
  /// tier of TQ4 keys and TQ2 values joins the ladder between TQ3 / TQ2 and TQ4 / TQ3 (issue 52,
  /// docs/tiering.md). 1: the figures as measured.
  double budget_key_weight = 1;
};

}  // namespace tierkv
