// SPDX-License-Identifier: Apache-2.0
// The default tier policy: Recent = the newest pages of a sequence, Anchor = attention
// sinks, pinned pages, sensitive layers and pages whose smoothed attention mass stays
// high, Stale = everything else.
#pragma once

#include "tierkv/core/config.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

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
};

/// The default tier policy: Recent = the newest pages of a sequence, Anchor = sinks, pinned
/// pages, sensitive layers and pages of persistently high attention mass, Stale = the rest.
class recency_anchor {
 public:
  using options = recency_anchor_options;  ///< its knobs
  /// What it remembers per page.
  struct page_state {
    float ema = 0.0f;       ///< smoothed relative attention mass
    bool anchored = false;  ///< above enter_mass, not yet below leave_mass
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
  }

  /// Whether layer is one of the first keep_first_layers or last keep_last_layers.
  bool sensitive_layer(int layer, int num_layers) const {
    return layer < opt_.keep_first_layers || layer >= num_layers - opt_.keep_last_layers;
  }

  /// Recent if among the newest recent_pages; else Anchor if pinned, in a sensitive layer,
  /// a sink or anchored by mass; else Stale.
  tier_role choose(const page_state& s, const page_facts& f) const {
    if (f.age < opt_.recent_pages) return tier_role::recent;
    if (f.pinned || sensitive_layer(f.layer, f.num_layers)) return tier_role::anchor;
    if (f.position < opt_.sink_pages) return tier_role::anchor;
    return s.anchored ? tier_role::anchor : tier_role::stale;
  }

  /// options::min_dwell_steps
  std::uint64_t min_dwell_steps() const { return opt_.min_dwell_steps; }

  /// Whether choose() gives the same role for two sets of block facts (the controller's
  /// incremental plan skips the pages whose facts moved only in ways choose() does not read).
  bool same_choice(const page_facts& a, const page_facts& b) const {
    return (a.age < opt_.recent_pages) == (b.age < opt_.recent_pages) &&
           (a.position < opt_.sink_pages) == (b.position < opt_.sink_pages) && a.pinned == b.pinned;
  }

  /// Whether choose() gives the same role for two states (only `anchored` is read): the
  /// controller re-evaluates an observed page only when its anchoring flipped.
  bool same_state_choice(const page_state& a, const page_state& b) const {
    return a.anchored == b.anchored;
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
