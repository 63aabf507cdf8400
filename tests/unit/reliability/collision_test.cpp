// SPDX-License-Identifier: Apache-2.0
// Adversarial prefix hashing (issue 24's collisions_accepted): under a hash for which every
// page of every salt collides, the prefix index must still serve only prefixes whose token
// ids and salt match, because it compares them. Lookups of random near-miss documents (one id
// changed, another salt, a shared head) are checked against the true longest cached prefix.
#include <cstdint>
#include <map>
#include <vector>

#include "catch.hpp"
#include "colliding_hash.hpp"
#include "reliability_support.hpp"

using namespace reliability_test;

using tierkv_test::colliding_hash;

TEST_CASE("prefix index under an all-colliding hash accepts no collision",
          "[reliability][prefix]") {
  storage2::options so;
  so.num_layers = 1;
  so.max_sequences = 4;
  so.pages_per_tier = {256, 16};
  auto st = storage2::create(so).value();
  prefix_index<storage2, colliding_hash> px(*st);
  std::uint64_t rng = 9;
  const auto next = [&] { return rng = mix64(rng); };
  // 24 documents of 3 pages from a 4-id alphabet over two salts: many share heads.
  std::vector<std::pair<std::uint64_t, std::vector<std::int32_t>>> docs;
  for (int d = 0; d < 24; ++d) {
    std::vector<std::int32_t> ids(48);
    for (auto& x : ids) x = std::int32_t(next() % 4);
    const std::uint64_t salt = next() % 2;
    const seq_id s = st->create_sequence().value();
    std::vector<std::uint64_t> seeds;
    for (std::size_t i = 0; i < ids.size(); ++i) seeds.push_back(std::uint64_t(ids[i]) * 64 + i);
    REQUIRE(append_seeds(*st, s, seeds));
    REQUIRE(px.insert(s, salt, ids));
    REQUIRE(st->release(s));
    docs.push_back({salt, ids});
  }
  // The true longest cached prefix in whole pages: the longest page-aligned common head with a
  // document of the same salt.
  const auto truth = [&](std::uint64_t salt, const std::vector<std::int32_t>& q) {
    std::size_t best = 0;
    for (const auto& [s, ids] : docs) {
      if (s != salt) continue;
      std::size_t p = 0;
      while (p < 3 &&
             std::equal(q.begin() + std::ptrdiff_t(p * 16), q.begin() + std::ptrdiff_t(p * 16 + 16),
                        ids.begin() + std::ptrdiff_t(p * 16)))
        ++p;
      best = std::max(best, p);
    }
    return std::int64_t(best * 16);
  };
  std::uint64_t lookups = 0, accepted = 0, hits = 0;
  for (int i = 0; i < 20000; ++i) {
    auto [salt, q] = docs[next() % docs.size()];
    switch (next() % 4) {
      case 0:
        q[next() % q.size()] ^= 1;
        break;  // one id changed
      case 1:
        salt ^= 1;
        break;  // the other salt
      case 2:
        for (std::size_t j = 16 + next() % 32; j < q.size(); ++j) q[j] = std::int32_t(next() % 4);
        break;
      default:
        break;  // the document itself
    }
    const prefix_match m = px.lookup(salt, q);
    ++lookups;
    const std::int64_t want = truth(salt, q);
    if (m.tokens > want) ++accepted;
    CHECK(m.tokens == want);
    if (m.tokens > 0) ++hits;
  }
  REQUIRE(px.check_invariants());
  CHECK(hits > lookups / 2);  // the run exercised the matching path, not only misses
  CHECK(accepted == 0);
  print_metric("prefix_adversarial_lookups", double(lookups));
  print_metric("collisions_accepted", double(accepted));
}
