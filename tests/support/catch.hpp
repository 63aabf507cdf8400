// SPDX-License-Identifier: Apache-2.0
// The one place tests include Catch2 from: works with Catch2 2.13 (Debian 12)
// and Catch2 3.x (Ubuntu 24.04).
#pragma once

// Catch2 v3's assertion macros stall nvcc's front end (cudafe++, issue 29): a GPU test's
// TEST_CASEs live in a .cpp, its kernels in a Catch2-free *_kernels.cu.
#if defined(__CUDACC__)
#error "Catch2 is not compiled by nvcc: put the TEST_CASEs in a .cpp (tests/CMakeLists.txt)"
#endif

#if defined(TIERKV_CATCH3)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/generators/catch_generators_range.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif

#include <string>

namespace tierkv_test {
// A message matcher for CHECK_THROWS_WITH under both Catch2 majors (v3 renamed Contains).
inline auto contains(const std::string& text) {
#if defined(TIERKV_CATCH3)
  return Catch::Matchers::ContainsSubstring(text);
#else
  return Catch::Matchers::Contains(text);
#endif
}
}  // namespace tierkv_test
