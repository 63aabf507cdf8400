// SPDX-License-Identifier: Apache-2.0
// A prefix hash under which every chain and every document hashes alike: indexes tested with it
// must tell entries apart by their token ids, never by the hash.
#pragma once

#include <cstdint>
#include <span>

namespace tierkv_test {

struct colliding_hash {
  std::uint64_t root(std::uint64_t) const noexcept { return 42; }
  std::uint64_t operator()(std::uint64_t, std::span<const std::int32_t>) const noexcept {
    return 42;
  }
};

}  // namespace tierkv_test
