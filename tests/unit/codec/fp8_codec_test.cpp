// SPDX-License-Identifier: Apache-2.0
// FP8 and dense_bf16 codecs: scale rule, error bounds, attention operations against
// float64, and bad input.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "test_helpers.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"

using namespace tierkv;
using codec_test::gaussian;

namespace {

template <class C>
void check_fp8_codec_random(double scale_of_inputs) {
  constexpr int d = C::head_dim;
  codec_test::gaussian_source rng(0xF8 + d);
  const codec_context ctx{};
  for (int v = 0; v < 300; ++v) {
    auto x = gaussian(rng, d, scale_of_inputs);
    if (v % 7 == 0) x[std::size_t(v) % d] *= 100.0f;  // an outlier channel
    std::vector<std::uint8_t> payload(C::payload_bytes);
    bf16_bits meta = 0;
    encode_stats stats;
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::ok);
    CHECK(stats.saturated == 0);
    // The scale: the smallest bf16 with amax / scale <= fmt_max.
    float amax = 0;
    for (float e : x) amax = std::max(amax, std::fabs(e));
    const float s = bf16_to_float(meta);
    CHECK(double(amax) / double(s) <= double(C::format_t::max_value) * (1 + 0x1p-23));
    CHECK(double(amax) / double(bf16_to_float(bf16_bits(meta - 1))) >
          double(C::format_t::max_value));
    std::vector<float> y(d);
    C::decode(payload.data(), meta, y.data(), ctx);
    // Per element: half an FP8 ulp relative in the normal range, absolute below it.
    const double rel = C::format_t::mantissa_bits == 3 ? 0.0625 : 0.125;
    const double min_normal = double(detail::bits_float(C::format_t::min_normal_bits)) * s;
    for (int i = 0; i < d; ++i) {
      const double err = std::fabs(double(y[std::size_t(i)]) - double(x[std::size_t(i)]));
      if (std::fabs(x[std::size_t(i)]) >= min_normal)
        CHECK(err <= rel * std::fabs(double(x[std::size_t(i)])));
      else
        CHECK(err <= std::ldexp(double(s), C::format_t::subnormal_exponent - 1) * 1.0000001);
    }
    // dot and accumulate against float64 on the decoded vector.
    auto q = gaussian(rng, d);
    std::vector<float> qp(d);
    C::prepare_query(q.data(), qp.data(), ctx);
    const double want = codec_test::dot64(q.data(), y.data(), d);
    double sum_abs = 0;  // float summation error is bounded by ~d * eps * sum |q_i y_i|
    for (int i = 0; i < d; ++i) sum_abs += std::fabs(double(q[std::size_t(i)]) * y[std::size_t(i)]);
    CHECK(std::fabs(double(C::dot(qp.data(), payload.data(), meta)) - want) <=
          double(d) * 0x1p-23 * sum_abs);
    std::vector<float> acc(d, 0.5f);
    C::accumulate(0.25f, payload.data(), meta, acc.data());
    C::finalize(acc.data(), ctx);
    for (int i = 0; i < d; ++i)
      CHECK(double(acc[std::size_t(i)]) ==
            Approx(0.5 + 0.25 * double(y[std::size_t(i)])).epsilon(1e-6).margin(1e-30));
  }
}

template <class C>
void check_fp8_bad_input() {
  constexpr int d = C::head_dim;
  const codec_context ctx{};
  std::vector<std::uint8_t> payload(C::payload_bytes, 0xAB);
  bf16_bits meta = 0x1234;
  std::vector<float> y(d);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(d, 1.0f);
    x[d / 2] = bad;
    CHECK(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::non_finite_input);
    CHECK(meta == C::poison_meta);
    CHECK(std::all_of(payload.begin(), payload.end(), [](std::uint8_t b) { return b == 0; }));
    C::decode(payload.data(), meta, y.data(), ctx);
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
  }
  // Zero vector: scale 0, zero codes, exact zeros, never NaN.
  std::vector<float> z(d, 0.0f);
  z[1] = -0.0f;
  REQUIRE(C::encode(z.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
  CHECK(meta == 0);
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.0f; }));
  std::vector<float> q(d, 1.0f);
  CHECK(C::dot(q.data(), payload.data(), meta) == 0.0f);
  // Huge values: clipped at 2^127 and counted; decode stays finite.
  std::vector<float> h(d, 1.0f);
  h[0] = std::numeric_limits<float>::max();
  h[1] = -3e38f;
  h[2] = 1e38f;
  encode_stats stats;
  REQUIRE(C::encode(h.data(), payload.data(), meta, ctx, &stats) == errc::ok);
  CHECK(stats.saturated == 2);
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(codec_test::all_finite(y));
  CHECK(double(y[0]) == Approx(std::ldexp(1.0, 127)).epsilon(0.07));
  CHECK(double(y[2]) == Approx(1e38).epsilon(0.07));
  // A vector of subnormals: finite, no NaN, zeros stay zeros, max element kept well.
  std::vector<float> sub(d, 0.0f);
  for (int i = 0; i < d; i += 3)
    sub[std::size_t(i)] = float(i + 1) * std::numeric_limits<float>::denorm_min();
  REQUIRE(C::encode(sub.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
  CHECK(meta != 0);
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(codec_test::all_finite(y));
  // Documented: the scale cannot go below the least bf16 (2^-133), so an element keeps
  // FP8 precision only above 2^-133 * fmt_min_subnormal; below that it may round to 0.
  const double floor_abs =
      std::ldexp(double(bf16_to_float(meta)), C::format_t::subnormal_exponent - 1) * 1.0000001;
  for (int i = 0; i < d; ++i) {
    const double xi = double(sub[std::size_t(i)]), yi = double(y[std::size_t(i)]);
    const double rel = C::format_t::mantissa_bits == 3 ? 0.0625 : 0.125;
    CHECK(std::fabs(yi - xi) <= rel * std::fabs(xi) + floor_abs + 0x1p-149);
    if (xi == 0.0) CHECK(yi == 0.0);
  }
  // encode_with_scale: values beyond the range saturate and are counted.
  std::vector<float> w(d, 1.0f);
  w[3] = 1e6f;
  w[4] = -1e6f;
  encode_stats st2;
  C::encode_with_scale(w.data(), float_to_bf16(1.0f), payload.data(), &st2);
  CHECK(st2.saturated == 2);
  CHECK(payload[3] == C::format_t::max_code);
  CHECK(payload[4] == (0x80 | C::format_t::max_code));
}

}  // namespace

TEST_CASE("fp8 codecs: scale rule, error bound, dot and accumulate vs float64", "[fp8][codec]") {
  check_fp8_codec_random<fp8_e4m3::bind<64>>(1.0);
  check_fp8_codec_random<fp8_e4m3::bind<128>>(1e-3);
  check_fp8_codec_random<fp8_e4m3::bind<256>>(3e4);
  check_fp8_codec_random<fp8_e5m2::bind<128>>(1.0);
  check_fp8_codec_random<fp8_e5m2::bind<80>>(1e-20);
}

TEST_CASE("fp8 codecs: NaN/Inf, zeros, huge values, subnormals, saturation", "[fp8][codec]") {
  check_fp8_bad_input<fp8_e4m3::bind<64>>();
  check_fp8_bad_input<fp8_e4m3::bind<128>>();
  check_fp8_bad_input<fp8_e5m2::bind<128>>();
}

TEST_CASE("fp8 codecs: sizes and bits per scalar", "[fp8][codec]") {
  CHECK(fp8_e4m3::bind<128>::payload_bytes == 128);
  CHECK(fp8_e4m3::bind<128>::meta_bytes == 2);
  CHECK(bits_per_scalar<fp8_e4m3::bind<64>> == 8.25);
  CHECK(bits_per_scalar<fp8_e4m3::bind<128>> == 8.125);
  CHECK(bits_per_scalar<fp8_e5m2::bind<256>> == 8.0625);
  CHECK(fp8_e4m3::bind<128>::format == storage_format::fp8_e4m3);
  CHECK(fp8_e5m2::bind<128>::format == storage_format::fp8_e5m2);
}

TEST_CASE("dense_bf16: round to nearest even, saturation, bad input", "[bf16][codec]") {
  using C = dense_bf16::bind<128>;
  codec_test::gaussian_source rng(5);
  const codec_context ctx{};
  std::vector<std::uint8_t> payload(C::payload_bytes);
  no_meta m;
  std::vector<float> y(128);
  for (int v = 0; v < 50; ++v) {
    auto x = gaussian(rng, 128, std::ldexp(1.0, v - 25));
    REQUIRE(C::encode(x.data(), payload.data(), m, ctx, nullptr) == errc::ok);
    C::decode(payload.data(), m, y.data(), ctx);
    for (int i = 0; i < 128; ++i) {
      CHECK(y[std::size_t(i)] == bf16_to_float(float_to_bf16(x[std::size_t(i)])));
      CHECK(std::fabs(double(y[std::size_t(i)]) - x[std::size_t(i)]) <=
            std::ldexp(std::fabs(double(x[std::size_t(i)])), -8));
    }
    auto q = gaussian(rng, 128);
    const double want = codec_test::dot64(q.data(), y.data(), 128);
    CHECK(double(C::dot(q.data(), payload.data(), m)) ==
          Approx(want).epsilon(1e-5).margin(1e-5 * std::ldexp(1.0, v - 25) * 12));
  }
  std::vector<float> h(128, 1.0f);
  h[0] = std::numeric_limits<float>::max();
  encode_stats st;
  REQUIRE(C::encode(h.data(), payload.data(), m, ctx, &st) == errc::ok);
  CHECK(st.saturated == 1);
  C::decode(payload.data(), m, y.data(), ctx);
  CHECK(y[0] == bf16_to_float(bf16_max_finite));
  h[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK(C::encode(h.data(), payload.data(), m, ctx, nullptr) == errc::non_finite_input);
  C::decode(payload.data(), m, y.data(), ctx);
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
  CHECK(bits_per_scalar<C> == 16.0);
}
