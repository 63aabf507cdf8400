// SPDX-License-Identifier: Apache-2.0
// allocate_bit_budget (tiering/bit_budget.hpp) against an exhaustive search over every
// assignment of small random instances: within the budget and the rooms, maximal, monotone in
// importance, and within one step's error of the optimum; the hull; edge cases and refusals.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tierkv/tiering/bit_budget.hpp"

using namespace tierkv;

namespace {

double total_error(const std::vector<budget_page>& pages, const std::vector<budget_tier>& tiers,
                   const std::vector<std::int16_t>& at) {
  double e = 0;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const double w = pages[i].importance > 0 ? double(pages[i].importance) : 0.0;
    e += w * tiers[std::size_t(at[i])].error;
  }
  return e;
}

double total_bytes(const std::vector<budget_tier>& tiers, const std::vector<std::int16_t>& at) {
  double b = 0;
  for (const std::int16_t t : at) b += tiers[std::size_t(t)].page_bytes;
  return b;
}

// Whether the budget may put page p in tier t: any tier without `now`, else one of no less error
// than its tier now, or the cheapest (every page may start there).
bool allowed(const budget_page& p, const std::vector<budget_tier>& tiers, int cheapest, int t) {
  return p.now < 0 || t == cheapest ||
         tiers[std::size_t(t)].error >= tiers[std::size_t(p.now)].error;
}

// The least total error over every allowed assignment within the budget and the rooms (float64).
double exhaustive_optimum(const std::vector<budget_page>& pages,
                          const std::vector<budget_tier>& tiers, double budget) {
  const int cheapest = detail::budget_hull(tiers).front();
  const std::size_t n = pages.size(), t = tiers.size();
  std::vector<std::int16_t> at(n, 0);
  double best = std::numeric_limits<double>::infinity();
  for (;;) {
    std::vector<std::uint64_t> used(t, 0);
    for (const std::int16_t x : at) ++used[std::size_t(x)];
    bool fits = total_bytes(tiers, at) <= budget;
    for (std::size_t i = 0; i < n; ++i) fits = fits && allowed(pages[i], tiers, cheapest, at[i]);
    for (std::size_t k = 0; k < t; ++k) fits = fits && used[k] <= tiers[k].room;
    if (fits) best = std::min(best, total_error(pages, tiers, at));
    std::size_t i = 0;
    while (i < n && ++at[i] == std::int16_t(t)) at[i++] = 0;
    if (i == n) break;
  }
  return best;
}

}  // namespace

TEST_CASE("bit budget: the hull keeps the tiers a budget can want", "[tiering][bit_budget]") {
  // int8-like, a dominated tier (more bytes, more error), TQ4/TQ3-like, a tier above the chord,
  // TQ3/TQ2-like
  const std::vector<budget_tier> tiers = {
      {8.25, 0.0001, 10}, {9.0, 0.01, 10}, {3.75, 0.039, 10}, {6.0, 0.037, 10}, {2.75, 0.15, 10}};
  const std::vector<int> hull = detail::budget_hull(tiers);
  CHECK(hull == std::vector<int>{4, 2, 0});
  CHECK(detail::budget_hull(std::vector<budget_tier>{{1, 1, 1}}) == std::vector<int>{0});
  // equal bytes: the lower error only
  CHECK(detail::budget_hull(std::vector<budget_tier>{{2, 0.5, 1}, {2, 0.2, 1}}) ==
        std::vector<int>{1});
}

TEST_CASE("bit budget: random instances against an exhaustive search", "[tiering][bit_budget]") {
  std::mt19937_64 rng(20261207);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int checked = 0, optimal = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t n = 1 + std::size_t(rng() % 6), t = 2 + std::size_t(rng() % 3);
    std::vector<budget_tier> tiers(t);
    for (auto& x : tiers) x = {1.0 + 9.0 * u(rng), 0.2 * u(rng), n};  // rooms never bind
    std::vector<budget_page> pages(n);
    for (std::size_t i = 0; i < n; ++i)
      pages[i] = {trial % 5 == 0 ? float(rng() % 3) : float(8.0 * u(rng)), rng() % 4};
    const std::vector<int> hull = detail::budget_hull(tiers);
    if (trial % 3 == 1)  // some pages already in a hull tier: none of less error for them
      for (auto& p : pages)
        p.now = rng() % 2 ? std::int16_t(-1) : std::int16_t(hull[rng() % hull.size()]);
    double cheapest = std::numeric_limits<double>::infinity(), dearest = 0;
    for (const auto& x : tiers)
      cheapest = std::min(cheapest, x.page_bytes), dearest = std::max(dearest, x.page_bytes);
    const double budget = double(n) * (cheapest + (dearest - cheapest) * u(rng));
    std::vector<std::int16_t> at(n, -1);
    const auto r = allocate_bit_budget(pages, tiers, budget, at);
    REQUIRE(r.has_value());
    REQUIRE(r->within);
    INFO("trial " << trial << ", " << n << " pages, " << t << " tiers, budget " << budget);
    // within the budget, and the result's bytes are the pages' bytes
    CHECK(r->bytes == Approx(total_bytes(tiers, at)));
    CHECK(total_bytes(tiers, at) <= budget + 1e-9);
    // allowed, and maximal: no page can take its next hull step within the budget
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(allowed(pages[i], tiers, hull.front(), at[i]));
      const auto j = std::size_t(std::find(hull.begin(), hull.end(), at[i]) - hull.begin());
      REQUIRE(j < hull.size());  // every page on the hull
      if (j + 1 < hull.size() && allowed(pages[i], tiers, hull.front(), hull[j + 1]))
        CHECK(r->bytes + tiers[hull[j + 1]].page_bytes - tiers[hull[j]].page_bytes > budget);
    }
    // monotone: a more important page is never in a cheaper tier (pages free to go anywhere)
    for (std::size_t a = 0; a < n; ++a)
      for (std::size_t b = 0; b < n; ++b)
        if (pages[a].importance > pages[b].importance && pages[a].now < 0 && pages[b].now < 0)
          CHECK(tiers[at[a]].page_bytes >= tiers[at[b]].page_bytes);
    // within one step's error of the optimum (the LP relaxation's bound), never below it
    const double opt = exhaustive_optimum(pages, tiers, budget);
    double step = 0;
    for (std::size_t j = 0; j + 1 < hull.size(); ++j)
      step = std::max(step, tiers[hull[j]].error - tiers[hull[j + 1]].error);
    const double greedy = total_error(pages, tiers, at);
    float wmax = 0;
    for (const auto& p : pages) wmax = std::max(wmax, p.importance);
    CHECK(greedy >= opt - 1e-12);
    CHECK(greedy <= opt + double(wmax) * step + 1e-12);
    ++checked;
    optimal += greedy <= opt + 1e-12;
  }
  CHECK(checked == 400);
  CHECK(optimal > 300);  // the greedy is usually the optimum itself
}

TEST_CASE("bit budget: rooms bind, importance leads, ties by order", "[tiering][bit_budget]") {
  // tiers: 0 = 8-bit (error 0), 1 = 4-bit, 2 = 3-bit; 6 pages
  std::vector<budget_tier> tiers = {{8, 0.0, 6}, {4, 0.04, 6}, {3, 0.15, 6}};
  std::vector<budget_page> pages = {{5, 0}, {1, 1}, {0, 2}, {0, 3}, {9, 4}, {0, 5}};
  std::vector<std::int16_t> at(6, -1);
  // a budget of all-3-bit plus 1 byte: one 3 -> 4 step, the most important page's
  auto r = allocate_bit_budget(pages, tiers, 6 * 3 + 1, at);
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{2, 2, 2, 2, 1, 2});
  CHECK(r->bytes == 19);
  CHECK(r->steps == 1);
  // generous: error saved per byte is 0.11 x importance for 3 -> 4 and 0.01 x importance for
  // 4 -> 8, so pages 4 (9) and 0 (5) reach 8-bit before the pages of importance 0 leave 3-bit,
  // and the last 4 -> 8 step (page 1) does not fit
  r = allocate_bit_budget(pages, tiers, 8 + 8 + 4 * 4, at);
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{0, 1, 1, 1, 0, 1});
  CHECK(r->bytes == 32);
  // ties of importance: the lower order first
  r = allocate_bit_budget(pages, tiers, 6 * 3 + 3, at);  // three 3 -> 4 steps
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{1, 1, 2, 2, 1, 2});
  pages[3].order = 0;  // among the pages of importance 0, page 3 now comes first (0 < 5 < 7)
  pages[2].order = 7;
  r = allocate_bit_budget(pages, tiers, 6 * 3 + 4, at);
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{1, 1, 2, 1, 1, 2});
  // a room binds: tier 0 holds one page, so page 0 stays 4-bit with bytes to spare
  tiers[0].room = 1;
  r = allocate_bit_budget(pages, tiers, 1000, at);
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{1, 1, 1, 1, 0, 1});
  // the cheapest tier's room short: the most important pages start one tier up
  tiers = {{8, 0.0, 6}, {4, 0.04, 6}, {3, 0.15, 4}};
  r = allocate_bit_budget(pages, tiers, 0, at);
  REQUIRE(r.has_value());
  CHECK_FALSE(r->within);
  CHECK(at == std::vector<std::int16_t>{1, 2, 2, 2, 1, 2});
}

TEST_CASE("bit budget: edges and adversarial values", "[tiering][bit_budget]") {
  const std::vector<budget_tier> tiers = {{8, 0.0, 4}, {3, 0.15, 4}};
  std::vector<std::int16_t> at(4, -1);
  // NaN, -inf and negative importance count as 0; +inf comes first
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<budget_page> pages = {{nan, 0}, {-inf, 1}, {inf, 2}, {-3, 3}};
  auto r = allocate_bit_budget(pages, tiers, 4 * 3 + 5, at);
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{1, 1, 0, 1});
  // an infinite budget: every page in the best tier
  r = allocate_bit_budget(pages, tiers, std::numeric_limits<double>::infinity(), at);
  REQUIRE(r.has_value());
  CHECK(at == std::vector<std::int16_t>{0, 0, 0, 0});
  // no pages
  r = allocate_bit_budget({}, tiers, 0, {});
  REQUIRE(r.has_value());
  CHECK(r->bytes == 0);
  CHECK(r->within);
  // a page already lossy gains nothing from a better tier: the bytes go to the next page
  const std::vector<budget_tier> three = {{8, 0.0, 3}, {4, 0.04, 3}, {3, 0.15, 3}};
  std::vector<std::int16_t> capped(3, -1);
  r = allocate_bit_budget(std::vector<budget_page>{{9, 0, 1}, {5, 1, -1}, {1, 2, 2}}, three,
                          3 * 3 + 6, capped);
  REQUIRE(r.has_value());
  // without its cap page 0 (9) would take tier 0 before page 1 (5): 9 x 0.01 > 5 x 0.01
  CHECK(capped == std::vector<std::int16_t>{1, 0, 2});  // page 0 stops at its own tier 1
  // one tier
  std::vector<std::int16_t> one(2, -1);
  r = allocate_bit_budget(std::vector<budget_page>{{1, 0}, {2, 1}},
                          std::vector<budget_tier>{{5, 0.1, 2}}, 10, one);
  REQUIRE(r.has_value());
  CHECK(one == std::vector<std::int16_t>{0, 0});
}

TEST_CASE("bit budget: refusals change nothing", "[tiering][bit_budget]") {
  const std::vector<budget_page> pages = {{1, 0}, {2, 1}};
  std::vector<std::int16_t> at = {-5, -5};
  const auto unchanged = [&] { return at == std::vector<std::int16_t>{-5, -5}; };
  std::vector<std::int16_t> short_out(1, -5);
  auto r = allocate_bit_budget(pages, std::vector<budget_tier>{{1, 0, 2}}, 1, short_out);
  CHECK(r.code() == errc::invalid_argument);
  CHECK(short_out[0] == -5);
  r = allocate_bit_budget(pages, {}, 1, at);
  CHECK(r.code() == errc::invalid_argument);
  CHECK(unchanged());
  r = allocate_bit_budget(pages, std::vector<budget_tier>{{-1, 0, 2}}, 1, at);
  CHECK(r.code() == errc::invalid_argument);
  CHECK(r.error_status().message().find("page_bytes = -1") != std::string::npos);
  CHECK(unchanged());
  r = allocate_bit_budget(pages, std::vector<budget_tier>{{1, std::nan(""), 2}}, 1, at);
  CHECK(r.code() == errc::invalid_argument);
  CHECK(unchanged());
  r = allocate_bit_budget(pages, std::vector<budget_tier>{{1, 0, 2}}, std::nan(""), at);
  CHECK(r.code() == errc::invalid_argument);
  CHECK(unchanged());
  const std::vector<budget_page> far = {{1, 0, 1}, {2, 1, -2}};
  r = allocate_bit_budget(far, std::vector<budget_tier>{{1, 0, 2}}, 1, at);
  CHECK(r.code() == errc::invalid_argument);
  CHECK(r.error_status().message().find("tier now is 1") != std::string::npos);
  CHECK(unchanged());
  r = allocate_bit_budget(pages, std::vector<budget_tier>{{1, 0, 1}}, 1, at);
  CHECK(r.code() == errc::capacity_exhausted);
  CHECK(r.error_status().message().find("room for 1 of 2 pages") != std::string::npos);
  CHECK(unchanged());
}
