// SPDX-License-Identifier: Apache-2.0
// The tier policy concept: what the controller asks a policy about each physical page
// (one logical page, one layer) and what it tells the policy in return.
#pragma once

#include "tierkv/core/config.hpp"

#include <concepts>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "tierkv/core/status.hpp"
#include "tierkv/tiering/tier_roles.hpp"

namespace tierkv {

/// What the controller knows about one physical page at a retier step. A logical page
/// shared by several sequences (fork, prefix reuse) is one page: its facts combine the
/// holders (youngest age, smallest position).
struct page_facts {
  static constexpr std::int64_t no_holder =
      std::numeric_limits<std::int64_t>::max();  ///< position and age of a page no sequence holds

  int layer = 0;                       ///< the page's layer
  int num_layers = 1;                  ///< layers of the cache
  int tier = 0;                        ///< tier index it is stored in now
  std::int64_t position = no_holder;   ///< smallest logical page index among its sequences
  std::int64_t age = no_holder;        ///< pages after it in its youngest holder (0 = newest page)
  std::uint32_t holders = 0;           ///< sequences holding it (0: only the prefix index)
  bool pinned = false;                 ///< structural metadata from the engine (e.g. system prompt)
  std::uint64_t steps_since_move = 0;  ///< retier steps since it last changed tier (or was created)
};

/// A tier policy P provides:
///   typename P::page_state                 per-page state the controller stores for P
///                                          (trivially copyable, default = a new page)
///   p.observe(state, mass)                 one step's attention mass of the page, relative
///                                          to a uniform share (1 = average page)
///   p.choose(state, facts) -> tier_role    the role the page should have now
///   p.min_dwell_steps() -> uint64          steps a page stays in a tier before it may move
///                                          again (pressure demotions excepted)
///   p.keep_value(state, facts) -> float    under memory pressure, pages with the lowest
///                                          value are demoted first; +inf = never demote
///   p.validate() -> status                 its knobs are consistent
/// and may provide, for the controller's incremental plan (tier_controller_options):
///   p.same_choice(facts_a, facts_b) -> bool  choose() cannot tell the two apart (position,
///                                          age, holders, pinned); without it, any change
///                                          of a block's facts re-evaluates its pages
///   p.same_state_choice(state_a, state_b) -> bool  choose() cannot tell the two states
///                                          apart: an observation that keeps it so does not
///                                          re-evaluate the page
///   P::choice_reads_time = true            choose() reads steps_since_move: plan() then
///                                          visits every page each step
/// and, for a bit budget (tier_controller_options::bits_per_scalar_target):
///   p.budget_exempt(state, facts) -> bool  the budget leaves the page where it is, uncharged;
///                                          without it, the pages choose() calls Recent
namespace detail {
template <class P>
concept has_page_state = requires {
  typename P::page_state;
  requires std::is_trivially_copyable_v<typename P::page_state>;
  requires std::default_initializable<typename P::page_state>;
};
template <class P>
concept has_observe = has_page_state<P> &&
    requires(const P& p, typename P::page_state& s, float m) {
  { p.observe(s, m) } -> std::same_as<void>;
};
template <class P>
concept has_choose = has_page_state<P> &&
    requires(const P& p, const typename P::page_state& s, const page_facts& f) {
  { p.choose(s, f) } -> std::same_as<tier_role>;
};
template <class P>
concept has_min_dwell = requires(const P& p) {
  { p.min_dwell_steps() } -> std::convertible_to<std::uint64_t>;
};
template <class P>
concept has_keep_value = has_page_state<P> &&
    requires(const P& p, const typename P::page_state& s, const page_facts& f) {
  { p.keep_value(s, f) } -> std::convertible_to<float>;
};
template <class P>
concept has_validate = requires(const P& p) {
  { p.validate() } -> std::same_as<status>;
};
}  // namespace detail

template <class P>
concept tier_policy = std::copy_constructible<P> && detail::has_page_state<P> &&
    detail::has_observe<P> && detail::has_choose<P> && detail::has_min_dwell<P> &&
    detail::has_keep_value<P> && detail::has_validate<P>;

/// Whether a bit budget leaves the page where it is, uncharged: P's budget_exempt, or the pages
/// its choose() calls Recent where P has none (the one default, for the planner and any_policy).
template <class P>
bool budget_exempt(const P& p, const typename P::page_state& s, const page_facts& f) {
  if constexpr (requires { p.budget_exempt(s, f); })
    return bool(p.budget_exempt(s, f));
  else
    return p.choose(s, f) == tier_role::recent;
}

/// static_assert(check_tier_policy<P>()) names the first missing member.
template <class P>
constexpr bool check_tier_policy() {
  static_assert(std::copy_constructible<P>,
                "tier policy: must be copy constructible (a value type of knobs)");
  static_assert(
      detail::has_page_state<P>,
      "tier policy: missing `struct page_state` (trivially copyable, default constructible)");
  static_assert(detail::has_observe<P>,
                "tier policy: missing `void observe(page_state&, float mass) const`");
  static_assert(
      detail::has_choose<P>,
      "tier policy: missing `tier_role choose(const page_state&, const page_facts&) const`");
  static_assert(detail::has_min_dwell<P>,
                "tier policy: missing `std::uint64_t min_dwell_steps() const`");
  static_assert(
      detail::has_keep_value<P>,
      "tier policy: missing `float keep_value(const page_state&, const page_facts&) const`");
  static_assert(detail::has_validate<P>, "tier policy: missing `status validate() const`");
  return tier_policy<P>;
}

}  // namespace tierkv
