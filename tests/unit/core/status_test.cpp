// SPDX-License-Identifier: Apache-2.0
#include <string>

#include "catch.hpp"
#include "tierkv/core/status.hpp"

using namespace tierkv;

TEST_CASE("status messages name the offending value and the limit", "[core][status]") {
  const status s = status::out_of_range("layer", 31, 30);
  CHECK_FALSE(s.is_ok());
  CHECK(s.code() == errc::out_of_range);
  CHECK(s.message() == "layer = 31 is out of range [0, 30)");

  const status e = status::exceeds(errc::capacity_exhausted, "pages requested", 9, 8);
  CHECK(e.message() == "pages requested = 9 exceeds the limit 8");
}

TEST_CASE("ok status is cheap and truthy", "[core][status]") {
  const status s = status::ok();
  CHECK(s.is_ok());
  CHECK(static_cast<bool>(s));
  CHECK(s.message().empty());
  CHECK_NOTHROW(s.throw_if_error());
}

TEST_CASE("throw_if_error raises tierkv::error with the code and message", "[core][status]") {
  const status s = status::make(errc::stale_id, "page#0:3@1 was freed");
  try {
    s.throw_if_error();
    FAIL("expected tierkv::error");
  } catch (const error& ex) {
    CHECK(ex.code() == errc::stale_id);
    CHECK(std::string(ex.what()) == "stale_id: page#0:3@1 was freed");
  }
}

TEST_CASE("result holds a value or a failing status", "[core][status]") {
  result<int> good = 7;
  REQUIRE(good.has_value());
  CHECK(*good == 7);
  CHECK(good.code() == errc::ok);

  result<int> bad = status::out_of_range("slot", 5, 4);
  CHECK_FALSE(bad.has_value());
  CHECK(bad.code() == errc::out_of_range);
  CHECK_THROWS_AS(bad.value(), error);

  // An ok status is not a value: it becomes an invalid_argument failure, never a silent default.
  result<int> confused = status::ok();
  CHECK_FALSE(confused.has_value());
  CHECK(confused.code() == errc::invalid_argument);
}

TEST_CASE("every errc has a distinct name", "[core][status]") {
  CHECK(to_string(errc::ok) == "ok");
  CHECK(to_string(errc::capacity_exhausted) == "capacity_exhausted");
  CHECK(to_string(errc::non_finite_input) == "non_finite_input");
  CHECK(to_string(errc::injected_fault) == "injected_fault");
}
