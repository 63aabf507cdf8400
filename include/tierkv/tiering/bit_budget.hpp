// SPDX-License-Identifier: Apache-2.0
// A bit budget over pages (MosaicKV's global budget, issue 52): which tier each movable page
// takes so that the pages' bytes stay within a budget and the bits go where they lower the
// expected error most, each page's error weighted by its importance (its attention mass: the
// policy's keep value). A multiple-choice knapsack, solved by the greedy over each page's steps
// along the lower convex hull of the tiers' (bytes, error) points, taken in decreasing order of
// importance x error saved per byte: the same order for every page (importance scales the
// slopes), so one sort of the pages serves every step. The result never exceeds the budget or a
// tier's room; where no room binds, no page could take its next step within the budget
// (maximal) and a more important page is never in a cheaper tier than a less important one
// (tests/unit/tiering/bit_budget_test.cpp checks these against an exhaustive search, and that
// the total error is within one step's of the optimum). The tier controller runs it when
// tier_controller_options::bits_per_scalar_target is set (retier_planner.hpp).
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "tierkv/core/status.hpp"

namespace tierkv {

/// One tier as the budget sees it.
struct budget_tier {
  double page_bytes = 0;  ///< bytes of one page in it
  double error = 0;  ///< expected error of a page in it (the planner: key ip rms^2 d + value MSE)
  std::uint64_t room = 0;  ///< pages of it the movable pages may take (free + theirs now)
};

/// One page the budget may move.
struct budget_page {
  float importance = 0;     ///< weight of its error (NaN and negatives count as 0)
  std::uint64_t order = 0;  ///< ties of importance: the lower order is served first
  /// The tier it is in now, or -1. A page keeps the error of every lossy tier it passed through,
  /// so a tier of less error than this one's gains it nothing: the budget gives it none.
  std::int16_t now = -1;
};

/// What allocate_bit_budget did.
struct budget_result {
  double bytes = 0;         ///< bytes of the pages in their chosen tiers
  bool within = true;       ///< bytes <= the budget (false: the cheapest start did not fit)
  std::uint64_t steps = 0;  ///< hull steps taken above each page's start
};

namespace detail {

// The lower convex hull of the tiers' (page_bytes, error) points with error falling as bytes
// rise: the tiers a budget ever chooses, cheapest first.
inline std::vector<int> budget_hull(std::span<const budget_tier> tiers) {
  std::vector<int> byb(tiers.size());
  std::iota(byb.begin(), byb.end(), 0);
  std::stable_sort(byb.begin(), byb.end(), [&](int a, int b) {
    return tiers[a].page_bytes < tiers[b].page_bytes ||
           (tiers[a].page_bytes == tiers[b].page_bytes && tiers[a].error < tiers[b].error);
  });
  std::vector<int> hull;
  for (const int t : byb) {
    // a tier no cheaper-or-equal tier beats; then pop the points above the chord (convexity)
    if (!hull.empty() && tiers[t].error >= tiers[hull.back()].error) continue;
    if (!hull.empty() && tiers[t].page_bytes == tiers[hull.back()].page_bytes) continue;
    while (hull.size() >= 2) {
      const budget_tier& a = tiers[hull[hull.size() - 2]];
      const budget_tier& b = tiers[hull.back()];
      const budget_tier& c = tiers[t];
      // b is on or above the chord a-c: slope(a, b) <= slope(a, c) in error saved per byte
      const double ab = (a.error - b.error) / (b.page_bytes - a.page_bytes);
      const double ac = (a.error - c.error) / (c.page_bytes - a.page_bytes);
      if (ab > ac) break;
      hull.pop_back();
    }
    hull.push_back(t);
  }
  return hull;
}

}  // namespace detail

/// Chooses the tier of each page (out[i], indices into tiers) within byte_budget: see the file
/// comment. Every page starts in the cheapest hull tier (the most important pages one tier up
/// where its room is short); steps that do not fit, or would pass the error of the page's tier
/// now, close their page. Refuses (changing nothing) sizes that differ, no tier, non-finite or
/// negative bytes or errors, a page's `now` outside the tiers, and rooms that cannot hold every
/// page. Allocates O(pages) scratch.
inline result<budget_result> allocate_bit_budget(std::span<const budget_page> pages,
                                                 std::span<const budget_tier> tiers,
                                                 double byte_budget, std::span<std::int16_t> out) {
  if (out.size() != pages.size())
    return status::make(errc::invalid_argument, "allocate_bit_budget: ", out.size(),
                        " outputs for ", pages.size(), " pages");
  if (tiers.empty() || tiers.size() > 32767)
    return status::make(errc::invalid_argument, "allocate_bit_budget: ", tiers.size(),
                        " tiers (1 to 32767)");
  std::uint64_t room = 0;
  for (const budget_page& p : pages)
    if (p.now < -1 || p.now >= std::int16_t(tiers.size()))
      return status::make(errc::invalid_argument, "allocate_bit_budget: a page's tier now is ",
                          p.now, " (-1 or a tier of ", tiers.size(), ")");
  for (std::size_t t = 0; t < tiers.size(); ++t) {
    const budget_tier& x = tiers[t];
    if (!(std::isfinite(x.page_bytes) && x.page_bytes >= 0 && std::isfinite(x.error) &&
          x.error >= 0))
      return status::make(errc::invalid_argument, "allocate_bit_budget: tier ", t,
                          " has page_bytes = ", x.page_bytes, ", error = ", x.error,
                          " (finite, >= 0)");
    room += std::min<std::uint64_t>(x.room, pages.size());
  }
  if (room < pages.size())
    return status::make(errc::capacity_exhausted, "allocate_bit_budget: the tiers have room for ",
                        room, " of ", pages.size(), " pages");
  if (std::isnan(byte_budget))
    return status::make(errc::invalid_argument, "allocate_bit_budget: byte_budget is NaN");

  const std::vector<int> hull = detail::budget_hull(tiers);
  const auto weight = [&](std::size_t i) {
    const float w = pages[i].importance;
    return w > 0.0f ? double(w) : 0.0;  // NaN and negatives: 0
  };
  std::vector<std::uint32_t> rank(pages.size());  // most important first
  std::iota(rank.begin(), rank.end(), 0u);
  std::sort(rank.begin(), rank.end(), [&](std::uint32_t a, std::uint32_t b) {
    const double wa = weight(a), wb = weight(b);
    return wa > wb || (wa == wb && (pages[a].order < pages[b].order ||
                                    (pages[a].order == pages[b].order && a < b)));
  });

  // Start: hull tier 0 for the least important pages its room holds, the rest one hull tier up
  // (and so on); tiers off the hull take the pages the hull's rooms leave.
  const std::size_t h = hull.size();
  std::vector<std::uint64_t> left(tiers.size());
  for (std::size_t t = 0; t < tiers.size(); ++t) left[t] = tiers[t].room;
  std::vector<std::int16_t> level(pages.size(), 0);  // hull index, or -1 - tier off the hull
  budget_result res;
  {
    std::size_t next = pages.size();  // pages rank[next..] placed, least important last
    for (std::size_t j = 0; j < h && next > 0; ++j) {
      const std::uint64_t take = std::min<std::uint64_t>(left[hull[j]], next);
      for (std::uint64_t k = 0; k < take; ++k) level[rank[--next]] = std::int16_t(j);
      left[hull[j]] -= take;
    }
    for (std::size_t t = 0; t < tiers.size() && next > 0; ++t) {
      const std::uint64_t take = std::min<std::uint64_t>(left[t], next);
      for (std::uint64_t k = 0; k < take; ++k) level[rank[--next]] = std::int16_t(-1 - int(t));
      left[t] -= take;
    }
  }
  const auto tier_of = [&](std::int16_t lv) { return lv >= 0 ? hull[std::size_t(lv)] : -1 - lv; };
  for (std::size_t i = 0; i < pages.size(); ++i) res.bytes += tiers[tier_of(level[i])].page_bytes;
  res.within = res.bytes <= byte_budget;

  // Steps j -> j + 1 in decreasing importance x slope_j: a merge of the h - 1 step lists, each in
  // rank order; ties go to the lower step, so a page's steps come in order.
  if (res.within && h >= 2) {
    std::vector<double> slope(h - 1);
    for (std::size_t j = 0; j + 1 < h; ++j) {
      const budget_tier& a = tiers[hull[j]];
      const budget_tier& b = tiers[hull[j + 1]];
      slope[j] = (a.error - b.error) / (b.page_bytes - a.page_bytes);
    }
    std::vector<std::size_t> at(h - 1, 0);
    std::vector<bool> closed(pages.size(), false);
    // the highest hull index a page may reach: none of less error than its tier now
    const auto cap = [&](std::size_t i) {
      if (pages[i].now < 0) return h - 1;
      const double floor_error = tiers[std::size_t(pages[i].now)].error;
      std::size_t c = 0;
      while (c + 1 < h && tiers[hull[c + 1]].error >= floor_error) ++c;
      return c;
    };
    for (;;) {
      int best = -1;
      double best_gain = 0;
      for (std::size_t j = 0; j + 1 < h; ++j) {
        if (at[j] == rank.size()) continue;
        const double g = weight(rank[at[j]]) * slope[j];
        if (best < 0 || g > best_gain) best = int(j), best_gain = g;
      }
      if (best < 0) break;
      const std::size_t j = std::size_t(best);
      const std::uint32_t i = rank[at[j]++];
      if (closed[i] || level[i] != std::int16_t(j)) continue;
      if (j + 1 > cap(i)) {
        closed[i] = true;
        continue;
      }
      const int to = hull[j + 1];
      const double more = tiers[to].page_bytes - tiers[hull[j]].page_bytes;
      if (left[to] == 0 || res.bytes + more > byte_budget) {
        closed[i] = true;  // bytes only grow: this step never fits later
        continue;
      }
      --left[to];
      ++left[hull[j]];
      res.bytes += more;
      level[i] = std::int16_t(j + 1);
      ++res.steps;
    }
  }
  for (std::size_t i = 0; i < pages.size(); ++i) out[i] = std::int16_t(tier_of(level[i]));
  return res;
}

}  // namespace tierkv
