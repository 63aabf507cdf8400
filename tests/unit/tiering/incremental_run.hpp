// SPDX-License-Identifier: Apache-2.0
// The controller tests' random run: the incremental plan against the full scan, for any
// storage, policy and roles (controller_test.cpp, cold_test.cpp).
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "tiering_test_support.hpp"

namespace tiering_test {

// Drives two identical storages through the same random run (appends, forks, releases, pins,
// masses, pressure and part of every plan applied), c1 planning incrementally, c2 with the full
// scan (or any two controllers that must agree, e.g. one policy chosen at compile time and the
// same chosen by name): every plan must be the same list in the same order. Returns the
// conversions planned.
template <class Storage, class Controller1, class Controller2>
std::uint64_t incremental_equals_full_run(Storage& s1, Storage& s2, Controller1& c1,
                                          Controller2& c2, std::uint64_t rng_seed) {
  std::mt19937_64 rng(rng_seed);
  const int layers = s1.num_layers();
  std::vector<std::pair<seq_id, seq_id>> live;
  std::uint64_t seed = 1, planned = 0;
  for (std::uint64_t step = 1; step <= 400; ++step) {
    if (live.size() < 2 || (live.size() < 6 && rng() % 9 == 0))
      live.push_back({s1.create_sequence().value(), s2.create_sequence().value()});
    if (live.size() > 2 && rng() % 17 == 0) {
      const std::size_t i = rng() % live.size();
      REQUIRE(s1.release(live[i].first));
      REQUIRE(s2.release(live[i].second));
      live.erase(live.begin() + std::ptrdiff_t(i));
    }
    if (live.size() < 6 && rng() % 13 == 0) {
      const auto& p = live[rng() % live.size()];
      auto f1 = s1.fork(p.first, [&](std::uint32_t n) { return c1.make_room(n); });
      auto f2 = s2.fork(p.second, [&](std::uint32_t n) { return c2.make_room(n); });
      REQUIRE(f1.has_value() == f2.has_value());
      if (f1) live.push_back({*f1, *f2});
    }
    for (auto& [a, b] : live) {
      const std::int64_t len = *s1.length(a);
      const int n = len > 400 ? 0 : int(rng() % 3 == 0 ? 1 + rng() % 20 : 1);
      if (n == 0) continue;
      const auto seeds = seeds_from(seed, n);
      seed += std::uint64_t(n);
      std::vector<float> k, v;
      make_kv<Storage>(layers, seeds, k, v);
      const status r1 = s1.append(a, n, k, v, [&](std::uint32_t m) { return c1.make_room(m); });
      const status r2 = s2.append(b, n, k, v, [&](std::uint32_t m) { return c2.make_room(m); });
      REQUIRE(r1.code() == r2.code());
      const std::int64_t pages = *s1.logical_pages(a);
      if (pages > 3 && rng() % 23 == 0) {
        const std::int64_t first = std::int64_t(rng() % std::uint64_t(pages - 1));
        const bool pin = rng() % 2 == 0;
        REQUIRE(c1.pin(a, first, 1, pin));
        REQUIRE(c2.pin(b, first, 1, pin));
      }
      for (int l = 0; l < layers; ++l) {
        if (rng() % 2) continue;  // a sampled layer
        std::vector<float> mass(static_cast<std::size_t>(pages));
        float sum = 0;
        for (auto& m : mass) sum += (m = float(rng() % 100) * (rng() % 7 == 0 ? 8.f : 1.f));
        for (auto& m : mass) m = sum > 0 ? m / sum : 0.f;
        REQUIRE(c1.observe_mass(a, l, mass));
        REQUIRE(c2.observe_mass(b, l, mass));
      }
    }
    const auto p1 = c1.plan(step);
    const auto p2 = c2.plan(step);
    INFO("step " << step);
    REQUIRE(p1.size() == p2.size());
    for (std::size_t i = 0; i < p1.size(); ++i) {
      CHECK(p1[i].block.index == p2[i].block.index);
      CHECK(p1[i].layer == p2[i].layer);
      CHECK(p1[i].from == p2[i].from);
      CHECK(p1[i].to == p2[i].to);
      CHECK(p1[i].value == p2[i].value);
    }
    planned += p1.size();
    // Apply only part of it (as a GPU batch of bounded size would): the rest must be planned again.
    const std::size_t n = std::min<std::size_t>(p1.size(), 1 + rng() % 8);
    const std::vector<conversion> todo1(p1.begin(), p1.begin() + std::ptrdiff_t(n));
    const std::vector<conversion> todo2(p2.begin(), p2.begin() + std::ptrdiff_t(n));
    const auto a1 = c1.apply(todo1);
    const auto a2 = c2.apply(todo2);
    REQUIRE(a1.converted == a2.converted);
    REQUIRE(a1.deferred + a1.deferred_full == a2.deferred + a2.deferred_full);
  }
  REQUIRE(c1.check_invariants());
  REQUIRE(c2.check_invariants());
  return planned;
}

}  // namespace tiering_test
