// SPDX-License-Identifier: Apache-2.0
// The default tier policy: Recent = the newest pages of a sequence, Anchor = attention
// sinks, pinned pages, sensitive layers and pages whose smoothed attention mass stays
// high, Cold (off by default) = old pages whose smoothed attention mass stays low, Stale =
// everything else.
#pragma once

#include "tierkv/core/config.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

#include "tierkv/core/status.hpp"
#include "tierkv/tiering/tier_policy.hpp"

namespace tierkv::policy {

/// The knobs of policy::recency_anchor.
struct recency_anchor_options {
  int recent_pages = 4;  ///< R: the newest R logical pages of a sequence are Recent
  int sink_pages = 1;    ///< A: the first A logical pages (attention sinks) are Anchor
  /// Attention mass is taken relative to a uniform share (mass x pages of the sequence),
  /// smoothed by an EMA with weight ema_alpha for the newest step. A page becomes an
  /// anchor when the EMA rises above enter_mass and stops being one when it falls below
  /// leave_mass (hysteresis: a page hovering between the two keeps its role).
  float ema_alpha = 0.25f;
  float enter_mass = 4.0f;            ///< EMA above which a page becomes an anchor
  float leave_mass = 2.0f;            ///< EMA below which an anchor stops being one
  std::uint64_t min_dwell_steps = 8;  ///< steps between two tier moves of one page
  /// Layer sensitivity: the first and last layers of a model carry more error through
  /// the network (public TurboQuant deployments kept them in FP8): their pages are Anchor.
  int keep_first_layers = 1;
  int keep_last_layers = 1;  ///< the last layers whose pages are Anchor
  /// The Cold role (issue 52; off by default: cold_enter_mass = 0, which no EMA is below). A
  /// page that would be Stale is Cold when its EMA fell below cold_enter_mass (and has not
  /// risen above cold_leave_mass since: hysteresis, as for anchors) and it is at least
  /// cold_after_pages pages old. A page never observed stays Stale: no mass, no evidence.
  float cold_enter_mass = 0.0f;
  float cold_leave_mass = 0.0f;  ///< EMA above which a Cold page is Stale again
  int cold_after_pages = 0;      ///< the newest cold_after_pages pages are never Cold
  /// Per-layer budgets (CompressKV's per-layer allocation, issue 52): bit l set = every page of
  /// layer l that would be Stale is Cold, whatever its mass (after cold_after_pages). An offline
  /// profile of each layer's error chooses the bits (bench/research/layer_profile.py); 0 = none.
  /// Layers 0-63; from Python, whose knobs are doubles, layers 0-52.
  std::uint64_t cold_layers = 0;
};

/// The default tier policy: Recent = the newest pages of a sequence, Anchor = sinks, pinned
/// pages, sensitive layers and pages of persistently high attention mass, Stale = the rest.
class recency_anchor {
 public:
  using options = recency_anchor_options;                     ///< its knobs
  static constexpr std::string_view name = "recency_anchor";  ///< its run-time name (policies.hpp)
  /// f(name, field) for every knob of o (o const or not): the names Python's policy_options and
  /// the C ABI's knob names use.
  template <class Options, class F>
  static void knobs(Options& o, F&& f) {
    f("recent_pages", o.recent_pages);
    f("sink_pages", o.sink_pages);
    f("ema_alpha", o.ema_alpha);
    f("enter_mass", o.enter_mass);
    f("leave_mass", o.leave_mass);
    f("min_dwell_steps", o.min_dwell_steps);
    f("keep_first_layers", o.keep_first_layers);
    f("keep_last_layers", o.keep_last_layers);
    f("cold_enter_mass", o.cold_enter_mass);
    f("cold_leave_mass", o.cold_leave_mass);
    f("cold_after_pages", o.cold_after_pages);
    f("cold_layers", o.cold_layers);
  }
  /// What it remembers per page.
  struct page_state {
    float ema = 0.0f;       ///< smoothed relative attention mass
    bool anchored = false;  ///< above enter_mass, not yet below leave_mass
    bool cold = false;      ///< below cold_enter_mass, not yet above cold_leave_mass
    bool observed = false;  ///< at least one mass observation
  };

  recency_anchor() = default;
  /// A policy with knobs o (validate() checks them).
  explicit recency_anchor(const options& o) : opt_(o) {}
  /// Its knobs.
  const options& knobs() const noexcept { return opt_; }

  /// invalid_argument naming the first inconsistent knob.
  status validate() const {
    if (opt_.recent_pages < 0)
      return status::make(errc::invalid_argument, "recent_pages = ", opt_.recent_pages, " < 0");
    if (opt_.sink_pages < 0)
      return status::make(errc::invalid_argument, "sink_pages = ", opt_.sink_pages, " < 0");
    if (!(opt_.ema_alpha > 0.0f && opt_.ema_alpha <= 1.0f))
      return status::make(errc::invalid_argument, "ema_alpha = ", opt_.ema_alpha,
                          " must lie in (0, 1]");
    if (!std::isfinite(opt_.enter_mass) || !std::isfinite(opt_.leave_mass) ||
        !(opt_.leave_mass >= 0.0f) || !(opt_.enter_mass >= opt_.leave_mass))
      return status::make(errc::invalid_argument, "enter_mass = ", opt_.enter_mass,
                          ", leave_mass = ", opt_.leave_mass,
                          ": need finite 0 <= leave_mass <= enter_mass (hysteresis)");
    if (opt_.keep_first_layers < 0 || opt_.keep_last_layers < 0)
      return status::make(errc::invalid_argument, "keep_first_layers = ", opt_.keep_first_layers,
                          ", keep_last_layers = ", opt_.keep_last_layers, ": must be >= 0");
    if (!std::isfinite(opt_.cold_enter_mass) || !std::isfinite(opt_.cold_leave_mass) ||
        !(opt_.cold_enter_mass >= 0.0f) || !(opt_.cold_leave_mass >= opt_.cold_enter_mass) ||
        !(opt_.cold_leave_mass <= opt_.leave_mass))
      return status::make(errc::invalid_argument, "cold_enter_mass = ", opt_.cold_enter_mass,
                          ", cold_leave_mass = ", opt_.cold_leave_mass,
                          ", leave_mass = ", opt_.leave_mass,
                          ": need finite 0 <= cold_enter_mass <= cold_leave_mass <= leave_mass "
                          "(a Cold page is never an anchor)");
    if (opt_.cold_after_pages < 0)
      return status::make(errc::invalid_argument, "cold_after_pages = ", opt_.cold_after_pages,
                          " < 0");
    return {};
  }

  /// Folds one step's relative attention mass into the EMA (non-finite or negative mass is
  /// ignored).
  void observe(page_state& s, float mass) const {
    if (!std::isfinite(mass) || mass < 0.0f) return;  // a broken signal never moves a page
    s.ema = s.observed ? s.ema + opt_.ema_alpha * (mass - s.ema) : mass;
    s.observed = true;
    if (!s.anchored && s.ema > opt_.enter_mass)
      s.anchored = true;
    else if (s.anchored && s.ema < opt_.leave_mass)
      s.anchored = false;
    if (!s.cold && s.ema < opt_.cold_enter_mass)
      s.cold = true;
    else if (s.cold && s.ema > opt_.cold_leave_mass)
      s.cold = false;
  }

  /// Whether the knobs can make a page Cold (cold_enter_mass > 0, or a Cold layer).
  bool cold_enabled() const noexcept {
    return opt_.cold_enter_mass > 0.0f || opt_.cold_layers != 0;
  }

  /// Whether layer's would-be Stale pages are all Cold (options::cold_layers).
  bool cold_layer(int layer) const noexcept {
    return layer >= 0 && layer < 64 && (opt_.cold_layers >> layer & 1u) != 0;
  }

  /// Whether layer is one of the first keep_first_layers or last keep_last_layers.
  bool sensitive_layer(int layer, int num_layers) const {
    return layer < opt_.keep_first_layers || layer >= num_layers - opt_.keep_last_layers;
  }

  /// Recent if among the newest recent_pages; else Anchor if pinned, in a sensitive layer,
  /// a sink or anchored by mass; else Cold if its mass stays low or its layer is a Cold layer,
  /// and it is old enough; else Stale.
  tier_role choose(const page_state& s, const page_facts& f) const {
    if (f.age < opt_.recent_pages) return tier_role::recent;
    if (f.pinned || sensitive_layer(f.layer, f.num_layers)) return tier_role::anchor;
    if (f.position < opt_.sink_pages) return tier_role::anchor;
    if (s.anchored) return tier_role::anchor;
    return (s.cold || cold_layer(f.layer)) && f.age >= opt_.cold_after_pages ? tier_role::cold
                                                                             : tier_role::stale;
  }

  /// options::min_dwell_steps
  std::uint64_t min_dwell_steps() const { return opt_.min_dwell_steps; }

  /// Whether choose() gives the same role for two sets of block facts (the controller's
  /// incremental plan skips the pages whose facts moved only in ways choose() does not read).
  bool same_choice(const page_facts& a, const page_facts& b) const {
    return (a.age < opt_.recent_pages) == (b.age < opt_.recent_pages) &&
           (a.position < opt_.sink_pages) == (b.position < opt_.sink_pages) &&
           (a.age < opt_.cold_after_pages) == (b.age < opt_.cold_after_pages) &&
           a.pinned == b.pinned;
  }

  /// Whether choose() gives the same role for two states (only `anchored` and `cold` are read):
  /// the controller re-evaluates an observed page only when one of them flipped.
  bool same_state_choice(const page_state& a, const page_state& b) const {
    return a.anchored == b.anchored && a.cold == b.cold;
  }

  /// Under a bit budget, Recent pages and sinks stay where they are, uncharged: a sink costs one
  /// page a layer and sequence, and a budget that cannot be met (or one that sensitive layers
  /// fill first) would otherwise code the sinks at its cheapest tier, which costs Gemma 3 270M
  /// +18% perplexity at 2.57 bits against +13% with 8-bit sinks
  /// (bench/results/cold/gemma-ppl-32k-2026-12-07.json).
  bool budget_exempt(const page_state&, const page_facts& f) const {
    return f.age < opt_.recent_pages || f.position < opt_.sink_pages;
  }

  /// Demotion order under pressure: plain pages by smoothed mass, then anchors by mass,
  /// then sinks, then Recent pages (oldest first), then sensitive layers; pinned never.
  float keep_value(const page_state& s, const page_facts& f) const {
    if (f.pinned) return std::numeric_limits<float>::infinity();
    const float mass = s.ema < 1.0e3f ? s.ema : 1.0e3f;
    float v = mass + (s.anchored ? 1.0e3f : 0.0f);
    if (f.position < opt_.sink_pages) v += 1.0e4f;
    if (f.age < opt_.recent_pages) v += 1.0e5f + float(opt_.recent_pages - f.age);
    if (sensitive_layer(f.layer, f.num_layers)) v += 1.0e6f;
    return v;
  }

 private:
  options opt_{};
};

static_assert(check_tier_policy<recency_anchor>());

}  // namespace tierkv::policy
