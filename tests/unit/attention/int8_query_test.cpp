// SPDX-License-Identifier: Apache-2.0
// The int8 digits of an int8-key query (attention/int8_query.hpp): exact, in range, for every
// value the decode kernel can produce.
#include <cstdint>
#include <random>

#include "catch.hpp"
#include "tierkv/attention/int8_query.hpp"

using namespace tierkv;

namespace {

template <int P>
void check_digits(int q) {
  int d[P];
  int8_query_digits<P>(q, d);
  std::int64_t back = 0, scale = 1;
  for (int p = 0; p < P; ++p) {
    if (p + 1 < P) {
      CHECK(d[p] >= -64);
      CHECK(d[p] <= 63);
    } else {
      CHECK(d[p] >= -64);
      CHECK(d[p] <= 64);
    }
    back += scale * d[p];
    scale *= 128;
  }
  CHECK(back == q);
}

}  // namespace

TEST_CASE("int8 query digits: two digits cover every |Q| < 2^13 exactly", "[int8_query]") {
  STATIC_REQUIRE(int8_query_bits<2> == 13);
  const int lim = 1 << int8_query_bits<2>;
  for (int q = -lim + 1; q < lim; ++q) check_digits<2>(q);
}

TEST_CASE("int8 query digits: three digits, 20 bits: edges and random values", "[int8_query]") {
  STATIC_REQUIRE(int8_query_bits<3> == 20);
  const int lim = 1 << int8_query_bits<3>;
  for (int q :
       {0,    1,     -1,   63,    64,     -64,     -65,        127,      128,         -128,
        8191, -8191, 8192, 16383, -16384, lim - 1, -(lim - 1), lim - 64, -(lim - 64), lim - 65})
    check_digits<3>(q);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> u(-(lim - 1), lim - 1);
  for (int i = 0; i < 200000; ++i) check_digits<3>(u(rng));
}

TEST_CASE("int8 query digits: one digit is the value itself", "[int8_query]") {
  for (int q = -63; q <= 63; ++q) check_digits<1>(q);
}
