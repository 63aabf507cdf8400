// SPDX-License-Identifier: Apache-2.0
// Shared by the reliability tests (fault sweep, soak, threading): a snapshot of everything
// observable about a cache down to page bytes, and the metric lines scripts/measure
// reliability collects from these tests' output.
#pragma once

#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>

#include "../tiering/tiering_test_support.hpp"

namespace reliability_test {

using namespace tiering_test;

// FNV-1a over every byte of every page a block names (the bytes an attend reads).
template <class Cache>
std::uint64_t page_bytes_digest(Cache& c) {
  std::uint64_t h = 1469598103934665603ull;
  auto& s = c.storage();
  s.for_each_block([&](block_ref b, int, std::uint32_t) {
    for (int l = 0; l < s.num_layers(); ++l) {
      auto bytes = s.page_bytes(s.block_page(b, l));
      if (!bytes) {
        h ^= 0xdead;
        continue;
      }
      for (std::uint8_t x : *bytes) h = (h ^ x) * 1099511628211ull;
    }
  });
  return h;
}

// cache_snapshot (report, page tables, refcounts, pool counts, controller totals) plus the
// page bytes: equal before and after a refused operation.
template <class Cache>
std::string full_snapshot(Cache& c) {
  std::ostringstream o;
  o << cache_snapshot(c) << "bytes " << page_bytes_digest(c) << '\n';
  return o.str();
}

// One "reliability-metric NAME VALUE" line on stdout, for scripts/measure.d/reliability.
inline void print_metric(const char* name, double value) {
  std::printf("reliability-metric %s %.17g\n", name, value);
  std::fflush(stdout);
}

}  // namespace reliability_test
