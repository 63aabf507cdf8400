// SPDX-License-Identifier: Apache-2.0
// The one place tests include Catch2 from: works with Catch2 2.13 (Debian 12)
// and Catch2 3.x (Ubuntu 24.04).
#pragma once

#if defined(TIERKV_CATCH3)
#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/generators/catch_generators_range.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
using Catch::Approx;
#else
#include <catch2/catch.hpp>
#endif
