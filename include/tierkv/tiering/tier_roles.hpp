// SPDX-License-Identifier: Apache-2.0
// Tier roles: Recent, Anchor, Stale and Cold are roles a page plays, each mapped to one tier
// of the cache's compile-time tier list (tier<KeyCodec, ValueCodec>, codec/tier.hpp).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <ostream>
#include <string_view>

#include "tierkv/codec/tier.hpp"

namespace tierkv {

/// The role a page plays; a policy chooses it, tier_roles maps it to a tier.
enum class tier_role : std::uint8_t {
  recent = 0,  ///< the newest pages of a sequence: read by every step, written last
  anchor = 1,  ///< attention sinks, pinned pages, pages whose attention mass stays high
  stale = 2,   ///< everything else: compressed
  cold = 3,    ///< Stale pages that receive little attention mass: compressed further
};

/// The role's name ("recent", "anchor", "stale", "cold").
constexpr std::string_view to_string(tier_role r) noexcept {
  switch (r) {
    case tier_role::recent:
      return "recent";
    case tier_role::anchor:
      return "anchor";
    case tier_role::stale:
      return "stale";
    case tier_role::cold:
      return "cold";
  }
  return "unknown";
}
/// Writes the role's name.
inline std::ostream& operator<<(std::ostream& out, tier_role r) { return out << to_string(r); }

/// Which tier index of TierList each role lives in. The default puts Recent and Anchor
/// in tier 0 (the tier pages are appended in, FP8 in the usual list) and Stale in the
/// last tier (TQ3); Cold shares Stale's tier unless given its own (then a policy that never
/// chooses tier_role::cold, or recency_anchor with its cold knobs off, leaves it empty).
/// Roles may share a tier; the cost is one pool and one attention inner loop per distinct
/// tier, not per role.
template <class TierList, int Recent = 0, int Anchor = 0, int Stale = TierList::size - 1,
          int Cold = Stale>
struct tier_roles {
  static_assert(Recent >= 0 && Recent < TierList::size,
                "tier_roles: Recent is not an index of the tier list");
  static_assert(Anchor >= 0 && Anchor < TierList::size,
                "tier_roles: Anchor is not an index of the tier list");
  static_assert(Stale >= 0 && Stale < TierList::size,
                "tier_roles: Stale is not an index of the tier list");
  static_assert(Cold >= 0 && Cold < TierList::size,
                "tier_roles: Cold is not an index of the tier list");
  static_assert(Recent == 0,
                "tier_roles: Recent must be tier 0, the tier new tokens are appended in (pages are "
                "written while open, and only sealed pages are converted)");
  using tier_list = TierList;            ///< the cache's tier list
  static constexpr int recent = Recent;  ///< tier of Recent pages (0)
  static constexpr int anchor = Anchor;  ///< tier of Anchor pages
  static constexpr int stale = Stale;    ///< tier of Stale pages
  static constexpr int cold = Cold;      ///< tier of Cold pages (Stale's unless given)

  /// The tier index role r lives in.
  static constexpr int tier_of(tier_role r) noexcept {
    // a table, not a switch: roles sharing a tier would be identical branches
    constexpr int tiers[] = {Recent, Anchor, Stale, Cold};
    const auto i = static_cast<std::size_t>(r);
    if (i < std::size(tiers)) return tiers[i];
    return Stale;  // not a tier_role value: the compressed tier, as before Cold existed
  }
};

}  // namespace tierkv
