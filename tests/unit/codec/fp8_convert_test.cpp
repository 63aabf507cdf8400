// SPDX-License-Identifier: Apache-2.0
// FP8 and bf16 conversions against float64 references: every code, every tie,
// subnormals, saturation, monotonicity.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/fp8_convert.hpp"

using namespace tierkv;

namespace {

template <fp8_kind K>
double reference_value(int c) {
  using F = fp8_format<K>;
  const int mb = F::mantissa_bits;
  const int e = (c & 0x7F) >> mb;
  const int m = c & ((1 << mb) - 1);
  const double s = (c & 0x80) ? -1.0 : 1.0;
  if (K == fp8_kind::e4m3 && (c & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
  if (K == fp8_kind::e5m2 && e == 31)
    return m == 0 ? s * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return s * std::ldexp(double(m), 1 - F::exponent_bias - mb);
  return s * std::ldexp(1.0 + double(m) / double(1 << mb), e - F::exponent_bias);
}

// Non-negative finite codes sorted by value (index = code for these formats).
template <fp8_kind K>
std::vector<double> positive_values() {
  std::vector<double> v;
  for (int c = 0; c <= fp8_format<K>::max_code; ++c) v.push_back(reference_value<K>(c));
  return v;
}

// Reference float -> code: nearest finite value in double, ties to the even code,
// saturating; NaN -> 0x7F.
template <fp8_kind K>
std::uint8_t reference_encode(float xf) {
  if (std::isnan(xf)) return 0x7F;
  static const std::vector<double> pos = positive_values<K>();
  const double x = std::fabs(double(xf));
  const std::uint8_t sign = std::signbit(xf) ? 0x80 : 0x00;
  const double maxv = pos.back();
  if (x >= maxv) return std::uint8_t(sign | fp8_format<K>::max_code);
  const auto it = std::upper_bound(pos.begin(), pos.end(), x);  // first > x
  const int hi = int(it - pos.begin());
  const int lo = hi - 1;
  const double dlo = x - pos[std::size_t(lo)], dhi = pos[std::size_t(hi)] - x;
  int c;
  if (dlo < dhi)
    c = lo;
  else if (dhi < dlo)
    c = hi;
  else
    c = (lo % 2 == 0) ? lo : hi;
  return std::uint8_t(sign | c);
}

template <fp8_kind K>
void check_all_codes_decode() {
  for (int c = 0; c < 256; ++c) {
    const double ref = reference_value<K>(c);
    const float got = fp8_to_float<K>(std::uint8_t(c));
    INFO("code " << c);
    if (std::isnan(ref)) {
      CHECK(std::isnan(got));
    } else {
      CHECK(double(got) == ref);
      CHECK(std::signbit(got) == bool(c & 0x80));
      CHECK(fp8_table<K>.value[c] == got);
    }
  }
}

template <fp8_kind K>
void check_round_trip_and_ties() {
  const auto pos = positive_values<K>();
  for (int c = 0; c < 256; ++c) {
    const float v = fp8_to_float<K>(std::uint8_t(c));
    if (std::isnan(v) || std::isinf(v)) continue;
    INFO("code " << c);
    CHECK(detail::float_to_fp8_portable<K>(v) == std::uint8_t(c));
  }
  // Every midpoint between neighbours (exact in float) and its float neighbours.
  int ties = 0;
  for (std::size_t i = 0; i + 1 < pos.size(); ++i) {
    const float mid = float((pos[i] + pos[i + 1]) / 2);
    REQUIRE(double(mid) == (pos[i] + pos[i + 1]) / 2);
    const std::uint8_t even = std::uint8_t(i % 2 == 0 ? i : i + 1);
    CHECK(detail::float_to_fp8_portable<K>(mid) == even);
    CHECK(detail::float_to_fp8_portable<K>(-mid) == std::uint8_t(0x80 | even));
    CHECK(detail::float_to_fp8_portable<K>(std::nextafter(mid, 0.0f)) == std::uint8_t(i));
    CHECK(detail::float_to_fp8_portable<K>(std::nextafter(mid, 1e30f)) == std::uint8_t(i + 1));
    ++ties;
  }
  CHECK(ties == int(pos.size()) - 1);
}

template <fp8_kind K>
void check_against_reference_sweep() {
  // A strided sweep of all 2^32 float bit patterns (both signs, every binade).
  std::uint64_t mismatches = 0, tested = 0;
  for (std::uint64_t b = 0; b < (1ull << 32); b += 65537) {
    const float x = detail::bits_float(std::uint32_t(b));
    const std::uint8_t got = detail::float_to_fp8_portable<K>(x);
    const std::uint8_t want = reference_encode<K>(x);
    mismatches += got != want;
    ++tested;
    if (got != want) {
      INFO("bits " << b << " got " << int(got) << " want " << int(want));
      CHECK(got == want);
      if (mismatches > 5) break;
    }
  }
  CHECK(mismatches == 0);
  CHECK(tested > 60000);
}

template <fp8_kind K>
void check_monotone() {
  // Non-decreasing decoded value over ascending positive floats, dense near the range.
  float prev = -1.0f;
  for (std::uint32_t b = 0; b < 0x7F800000u; b += 4093) {
    const float v = fp8_to_float<K>(detail::float_to_fp8_portable<K>(detail::bits_float(b)));
    CHECK_FALSE(v < prev);
    if (v < prev) break;
    prev = v;
  }
}

}  // namespace

TEST_CASE("fp8: every one of the 256 codes decodes to its float64 value", "[fp8]") {
  check_all_codes_decode<fp8_kind::e4m3>();
  check_all_codes_decode<fp8_kind::e5m2>();
}

TEST_CASE("fp8: round trip of every representable value and ties to even", "[fp8]") {
  check_round_trip_and_ties<fp8_kind::e4m3>();
  check_round_trip_and_ties<fp8_kind::e5m2>();
}

TEST_CASE("fp8: encoder equals a float64 nearest-even reference on a sweep of all floats",
          "[fp8]") {
  check_against_reference_sweep<fp8_kind::e4m3>();
  check_against_reference_sweep<fp8_kind::e5m2>();
}

TEST_CASE("fp8: encoding is monotone", "[fp8]") {
  check_monotone<fp8_kind::e4m3>();
  check_monotone<fp8_kind::e5m2>();
}

TEST_CASE("fp8: subnormals, underflow, saturation and specials", "[fp8]") {
  constexpr auto e4 = fp8_kind::e4m3;
  constexpr auto e5 = fp8_kind::e5m2;
  // E4M3 subnormals are m * 2^-9.
  CHECK(detail::float_to_fp8_portable<e4>(std::ldexp(1.0f, -9)) == 0x01);
  CHECK(detail::float_to_fp8_portable<e4>(std::ldexp(7.0f, -9)) == 0x07);
  CHECK(detail::float_to_fp8_portable<e4>(std::ldexp(1.0f, -10)) == 0x00);  // tie -> even 0
  CHECK(detail::float_to_fp8_portable<e4>(std::ldexp(3.0f, -11)) == 0x01);  // 0.75 units -> 1
  CHECK(detail::float_to_fp8_portable<e4>(std::ldexp(15.0f, -10)) ==
        0x08);  // 7.5 -> 8 = min normal
  CHECK(detail::float_to_fp8_portable<e4>(std::numeric_limits<float>::denorm_min()) == 0x00);
  CHECK(detail::float_to_fp8_portable<e4>(-std::numeric_limits<float>::denorm_min()) == 0x80);
  CHECK(detail::float_to_fp8_portable<e5>(std::ldexp(1.0f, -16)) == 0x01);
  CHECK(detail::float_to_fp8_portable<e5>(std::ldexp(1.0f, -17)) == 0x00);
  // Saturation to the max finite code (like __NV_SATFINITE).
  CHECK(detail::float_to_fp8_portable<e4>(448.0f) == 0x7E);
  CHECK(detail::float_to_fp8_portable<e4>(464.0f) == 0x7E);  // tie with "480" -> even 0x7E
  CHECK(detail::float_to_fp8_portable<e4>(479.0f) == 0x7E);
  CHECK(detail::float_to_fp8_portable<e4>(1e30f) == 0x7E);
  CHECK(detail::float_to_fp8_portable<e4>(-1e30f) == 0xFE);
  CHECK(detail::float_to_fp8_portable<e4>(std::numeric_limits<float>::infinity()) == 0x7E);
  CHECK(detail::float_to_fp8_portable<e4>(-std::numeric_limits<float>::infinity()) == 0xFE);
  CHECK(detail::float_to_fp8_portable<e5>(57344.0f) == 0x7B);
  CHECK(detail::float_to_fp8_portable<e5>(61440.0f) == 0x7B);
  CHECK(detail::float_to_fp8_portable<e5>(std::numeric_limits<float>::infinity()) == 0x7B);
  CHECK(detail::float_to_fp8_portable<e5>(-std::numeric_limits<float>::max()) == 0xFB);
  CHECK(detail::float_to_fp8_portable<e4>(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(detail::float_to_fp8_portable<e4>(-std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(detail::float_to_fp8_portable<e5>(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(detail::float_to_fp8_portable<e4>(-0.0f) == 0x80);
  CHECK(std::isinf(fp8_to_float<e5>(0x7C)));
  CHECK(std::isnan(fp8_to_float<e5>(0x7D)));
}

TEST_CASE("fp8: E4M3 relative error is at most 2^-4 in the normal range", "[fp8]") {
  double worst = 0;
  for (std::uint32_t b = 0x3C800000u; b <= 0x43E00000u; b += 97) {  // [2^-6, 448]
    const float x = detail::bits_float(b);
    const float y = fp8_to_float<fp8_kind::e4m3>(detail::float_to_fp8_portable<fp8_kind::e4m3>(x));
    worst = std::max(worst, std::fabs(double(y) - double(x)) / double(x));
  }
  CHECK(worst <= 0.0625);
  CHECK(worst > 0.0588);  // the sharp bound is 2^-4 / (1 + 2^-4) = 1/17, at x = 1.0625
}

TEST_CASE("bf16: nearest-even, round-up and saturating conversions", "[bf16]") {
  std::uint64_t bad = 0;
  for (std::uint64_t b = 0; b < (1ull << 32); b += 40961) {
    const float x = detail::bits_float(std::uint32_t(b));
    if (std::isnan(x)) {
      CHECK(std::isnan(bf16_to_float(float_to_bf16(x))));
      continue;
    }
    // Reference: the two bf16 neighbours by truncation, chosen in float64.
    const std::uint32_t u = std::uint32_t(b);
    const float lo = detail::bits_float(u & 0xFFFF0000u);
    const float hi = detail::bits_float((u & 0xFFFF0000u) + 0x10000u);
    const double dlo = std::fabs(double(x) - double(lo));
    const double hid = std::isinf(hi) ? std::copysign(std::ldexp(1.0, 128), double(x)) : double(hi);
    const double dhi = std::fabs(hid - double(x));
    const std::uint16_t tl = std::uint16_t(u >> 16);
    std::uint16_t want;
    if ((u & 0xFFFFu) == 0)
      want = tl;
    else if (dlo < dhi)
      want = tl;
    else if (dhi < dlo)
      want = std::uint16_t(tl + 1);
    else
      want = (tl & 1u) ? std::uint16_t(tl + 1) : tl;
    bad += float_to_bf16(x) != want;
    if (x >= 0.0f && !std::isinf(x)) {
      const float up = bf16_to_float(float_to_bf16_up(x));
      bad += !(up >= x) || (bf16_to_float(std::uint16_t(float_to_bf16_up(x) - 1)) >= x && x > 0);
    }
  }
  CHECK(bad == 0);
  bool sat = false;
  CHECK(float_to_bf16_satfinite(std::numeric_limits<float>::max(), &sat) == bf16_max_finite);
  CHECK(sat);
  sat = false;
  CHECK(float_to_bf16_satfinite(-std::numeric_limits<float>::max(), &sat) ==
        std::uint16_t(0x8000 | bf16_max_finite));
  CHECK(sat);
  sat = false;
  CHECK(float_to_bf16_satfinite(1.0f, &sat) == 0x3F80);
  CHECK_FALSE(sat);
}
