// SPDX-License-Identifier: Apache-2.0
// range_allocator (the host tier's carving of its pinned slab) against a byte map: random
// allocations and frees never overlap, stay inside the capacity and aligned, account every
// byte, and coalesce back to one run; refusals change nothing and name the request.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "tierkv/memory/range_allocator.hpp"

using namespace tierkv;

TEST_CASE("range_allocator: first fit, alignment, coalescing, refusals", "[memory][range]") {
  range_allocator a(4096 + 100, 256);  // capacity rounds down to 4096
  CHECK(a.capacity() == 4096);
  CHECK(a.largest_free() == 4096);
  const auto r0 = a.allocate(1).value();  // one aligned unit
  const auto r1 = a.allocate(300).value();
  const auto r2 = a.allocate(256).value();
  CHECK(r0 == 0);
  CHECK(r1 == 256);
  CHECK(r2 == 256 + 512);
  CHECK(a.used() == 256 + 512 + 256);
  CHECK(a.ranges() == 3);

  // a hole in the middle is reused first fit; the run after it stays
  REQUIRE(a.free(r1).is_ok());
  CHECK(a.allocate(512).value() == 256);
  REQUIRE(a.free(256).is_ok());

  SECTION("refusals name the request and change nothing") {
    const auto used = a.used();
    auto big = a.allocate(4000);
    REQUIRE_FALSE(big.has_value());
    CHECK(big.code() == errc::capacity_exhausted);
    const std::string m = big.error_status().message();
    CHECK(m.find("4000 bytes requested") != std::string::npos);
    CHECK(m.find("largest free run is 3072") != std::string::npos);
    CHECK(a.used() == used);
    CHECK(a.allocate(1 << 20).code() == errc::capacity_exhausted);
    CHECK(a.allocate(0).code() == errc::invalid_argument);
    CHECK(a.free(100).code() == errc::invalid_argument);  // not a range's start
    CHECK(a.free(256).code() == errc::invalid_argument);  // already freed
    CHECK(a.used() == used);
  }
  SECTION("freeing everything coalesces into one run") {
    REQUIRE(a.free(r2).is_ok());
    REQUIRE(a.free(r0).is_ok());
    CHECK(a.used() == 0);
    CHECK(a.ranges() == 0);
    CHECK(a.largest_free() == 4096);
    CHECK(a.allocate(4096).value() == 0);
  }
  SECTION("an empty allocator refuses everything") {
    range_allocator none;
    CHECK(none.capacity() == 0);
    CHECK(none.allocate(1).code() == errc::capacity_exhausted);
  }
}

TEST_CASE("range_allocator: random allocations against a byte map", "[memory][range]") {
  constexpr std::uint64_t cap = 1 << 16, align = 64;
  range_allocator a(cap, align);
  std::vector<int> owner(cap, -1);  // which live range holds each byte
  struct live {
    std::uint64_t at, bytes;
  };
  std::vector<live> held;
  std::mt19937_64 rng(20261207);
  std::uniform_int_distribution<std::uint64_t> size(1, 5000);
  for (int step = 0; step < 20000; ++step) {
    if (held.empty() || rng() % 3 != 0) {
      const std::uint64_t want = size(rng);
      const std::uint64_t largest = a.largest_free(), used = a.used();
      auto r = a.allocate(want);
      if (!r) {  // refused only when no free run fits; then nothing changed
        CHECK(largest < a.round_up(want));
        CHECK(a.used() == used);
        continue;
      }
      const std::uint64_t at = *r, bytes = a.round_up(want);
      REQUIRE(at % align == 0);
      REQUIRE(at + bytes <= cap);
      for (std::uint64_t i = at; i < at + bytes; ++i) {
        REQUIRE(owner[i] == -1);
        owner[i] = int(held.size());
      }
      held.push_back({at, bytes});
    } else {
      const std::size_t k = rng() % held.size();
      REQUIRE(a.free(held[k].at).is_ok());
      for (std::uint64_t i = held[k].at; i < held[k].at + held[k].bytes; ++i) owner[i] = -1;
      held[k] = held.back();
      held.pop_back();
      for (std::size_t j = 0; j < held.size(); ++j)  // renumber the moved range
        for (std::uint64_t i = held[j].at; i < held[j].at + held[j].bytes; ++i) owner[i] = int(j);
    }
    std::uint64_t in_use = 0;
    for (const live& l : held) in_use += l.bytes;
    REQUIRE(a.used() == in_use);
    REQUIRE(a.ranges() == held.size());
  }
  for (const live& l : held) REQUIRE(a.free(l.at).is_ok());
  CHECK(a.used() == 0);
  CHECK(a.largest_free() == cap);
}
