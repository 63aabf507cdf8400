// SPDX-License-Identifier: Apache-2.0
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <locale>
#include <sstream>
#include <string>
#include <string_view>

#include "catch.hpp"
#include "tierkv/core/ids.hpp"
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

namespace {
template <class... Parts>
std::string streamed(const Parts&... parts) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  (out << ... << parts);
  return out.str();
}
}  // namespace

TEST_CASE("status::format writes numbers as the classic stream does, under any global locale",
          "[core][status]") {
  // Numbers go through std::to_chars, not a stream's num_put (a Python build crashed there:
  // bench/results/tests/gpu-knob-segfault-2026-12-07.txt); the text must stay what it was.
  using lim_d = std::numeric_limits<double>;
  const auto check_all = [] {
    CHECK(status::format("x = ", 2.5, ", n = ", -1, ", e = ", 1e12, ", f = ", 0.25f) ==
          streamed("x = ", 2.5, ", n = ", -1, ", e = ", 1e12, ", f = ", 0.25f));
    CHECK(status::format(1.0 / 3, ' ', 2.0f, ' ', 1e-300, ' ', 123456789.0, ' ', 0.1f, ' ', 3.4e38f,
                         ' ', -0.0, ' ', 1e-5, ' ', 100000.0, ' ', 1000000.0) ==
          streamed(1.0 / 3, ' ', 2.0f, ' ', 1e-300, ' ', 123456789.0, ' ', 0.1f, ' ', 3.4e38f, ' ',
                   -0.0, ' ', 1e-5, ' ', 100000.0, ' ', 1000000.0));
    CHECK(status::format(std::nan(""), ' ', lim_d::infinity(), ' ', -lim_d::infinity()) ==
          streamed(std::nan(""), ' ', lim_d::infinity(), ' ', -lim_d::infinity()));
    CHECK(status::format(std::numeric_limits<long long>::min(), ' ',
                         std::numeric_limits<std::uint64_t>::max(), ' ', short(-3), ' ',
                         std::size_t(123), ' ', std::uint32_t(7)) ==
          streamed(std::numeric_limits<long long>::min(), ' ',
                   std::numeric_limits<std::uint64_t>::max(), ' ', short(-3), ' ', std::size_t(123),
                   ' ', std::uint32_t(7)));
    CHECK(status::format(true, ' ', 'c', ' ', std::string("s"), ' ', std::string_view("v"), ' ',
                         errc::invalid_argument) == "1 c s v invalid_argument");
  };
  check_all();
  CHECK(status::format("0x", hex{0xdeadbeefULL}, " 0x", hex{0}, " ", 255) == "0xdeadbeef 0x0 255");
  // A global locale with a decimal comma and digit grouping, where the system has one: the
  // messages do not change.
  for (const char* name : {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8"}) {
    try {
      const std::locale old = std::locale::global(std::locale(name));
      check_all();
      CHECK(status::format(1234567.5) == "1.23457e+06");
      std::locale::global(old);
      break;
    } catch (const std::runtime_error&) {  // not installed here
    }
  }
}

TEST_CASE("fixed and the ids write what a fixed-precision stream wrote", "[core][status]") {
  // The memory report writes its ratios as fixed{v, 3} (it streamed std::fixed with 3 digits).
  const auto fixed3 = [](double v) {
    std::ostringstream out;
    out.imbue(std::locale::classic());
    out << std::fixed << std::setprecision(3) << v;
    return out.str();
  };
  for (const double v : {0.0, -0.0, 1.0 / 3, 2.0005, 4.4999, 123456789.125, -7.25, 1e-9, 1e300,
                         std::numeric_limits<double>::max(),
                         std::numeric_limits<double>::infinity(), std::nan("")}) {
    CAPTURE(v);
    CHECK(concat(fixed{v, 3}) == fixed3(v));
  }
  CHECK(concat(fixed{2.5, 0}, ' ', fixed{2.5, 1}, ' ', fixed{1.0, -4}) == "2 2.5 1");
  int x = 0;
  const void* p = &x;
  const void* null = nullptr;
  CHECK(concat(p, ' ', null, ' ', nullptr) == streamed(p, ' ', null, " 0"));
  const char* no_text = nullptr;
  CHECK(concat("name ", no_text, '.') == "name (null).");
  CHECK(to_string(seq_id(3)) == "seq#3");
  CHECK(to_string(seq_id()) == "seq#<invalid>");
  CHECK(to_string(layer_id(0)) == "layer#0");
  CHECK(to_string(page_id{5, 2, 1}) == "page#1:5@2");
  CHECK(to_string(page_id{}) == "page#<invalid>");
  CHECK(status::format("read ", page_id{5, 2, 1}, " of ", seq_id(9)) == "read page#1:5@2 of seq#9");
  std::ostringstream out;
  out << page_id{5, 2, 1} << ' ' << head_id(4);
  CHECK(out.str() == "page#1:5@2 head#4");
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
