// SPDX-License-Identifier: Apache-2.0
// A user format on the GPU (tests/unit/user_format/int8_twin.hpp, registered through
// TIERKV_USER_FORMATS by user_format.cmake): retier encodes into it and decode reads it through
// the device codec its header declares, bit for bit as int8_rotated, and exports carry its tag.
#include <algorithm>

#include "catch.hpp"
#include "tierkv/formats.hpp"
#include "user_format_kernels.hpp"

TEST_CASE("cuda: a user format's tier is demoted into and decoded, as int8_rotated bit for bit",
          "[cuda][user]") {
  STATIC_REQUIRE(tierkv::find_format("int8_twin") == tierkv::builtin_formats::size);
  auto twin = cuda_test::run_user_format(true);
  INFO((twin ? "" : twin.error_status().message()));
  REQUIRE(twin);
  auto base = cuda_test::run_user_format(false);
  REQUIRE(base);
  CHECK(twin->converted > 0);  // pages went into the user tier on the GPU
  CHECK(twin->converted == base->converted);
  CHECK(twin->stale_used > 0);
  CHECK(twin->stale_used == base->stale_used);
  REQUIRE(twin->outputs.size() == base->outputs.size());
  REQUIRE(!twin->outputs.empty());
  CHECK(std::equal(twin->outputs.begin(), twin->outputs.end(), base->outputs.begin()));
  // the exports differ exactly in the Stale tier's format tags (and nothing else of the pages)
  REQUIRE(twin->export_blob.size() == base->export_blob.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < twin->export_blob.size(); ++i)
    differ += twin->export_blob[i] != base->export_blob[i];
  CHECK(differ > 0);
  CHECK(std::count(twin->export_blob.begin(), twin->export_blob.end(), std::uint8_t(200)) >=
        std::count(base->export_blob.begin(), base->export_blob.end(), std::uint8_t(200)) + 2);
}
