// SPDX-License-Identifier: Apache-2.0
// Error traits: the measuring functions reproduce the documented figures; tiers report both roles.
#include <cmath>

#include "catch.hpp"
#include "tierkv/codec/error_traits.hpp"
#include "tierkv/formats.hpp"

using namespace tierkv;

TEST_CASE("error traits: measured figures agree with the documented constants", "[traits]") {
  constexpr int n = 1500;
  SECTION("tq3_key: unbiased inner products") {
    const auto ip = measure_inner_product_error<tq3_key::bind<128>>(n, 1);
    CHECK(std::fabs(ip.bias) < 0.0015);
    CHECK(ip.gain == Approx(1.0).margin(0.005));
    CHECK(ip.rms * std::sqrt(128.0) ==
          Approx(codec_error_traits<tq3_key>::ip_rms_sqrt_d).epsilon(0.1));
  }
  SECTION("tq3_value: least-squares norm, lowest MSE, shrunk inner products") {
    const auto ms = measure_relative_mse<tq3_value::bind<128>>(n, 2);
    CHECK(ms.rel_mse == Approx(codec_error_traits<tq3_value>::rel_mse).epsilon(0.05));
    CHECK(ms.rel_mse < 0.0350);
    const auto ip = measure_inner_product_error<tq3_value::bind<128>>(n, 3);
    CHECK(ip.gain == Approx(0.966).margin(0.005));
    const auto plain = measure_relative_mse<tq3_plain::bind<128>>(n, 2);
    const auto key = measure_relative_mse<tq3_key::bind<128>>(n, 2);
    CHECK(ms.rel_mse < plain.rel_mse);  // same vectors: least squares is optimal
    CHECK(plain.rel_mse < key.rel_mse);
  }
  SECTION("fp8") {
    const auto e4 = measure_relative_mse<fp8_e4m3::bind<128>>(n, 4);
    CHECK(e4.rel_mse == Approx(codec_error_traits<fp8_e4m3>::rel_mse).epsilon(0.1));
    const auto e5 = measure_relative_mse<fp8_e5m2::bind<128>>(n, 4);
    CHECK(e5.rel_mse == Approx(codec_error_traits<fp8_e5m2>::rel_mse).epsilon(0.1));
    const auto ip = measure_inner_product_error<fp8_e4m3::bind<128>>(n, 5);
    CHECK(ip.rms * std::sqrt(128.0) ==
          Approx(codec_error_traits<fp8_e4m3>::ip_rms_sqrt_d).epsilon(0.15));
  }
  SECTION("int8_rotated: far below E4M3 at the same bits, unbiased") {
    const auto ms = measure_relative_mse<int8_rotated::bind<128>>(n, 4);
    CHECK(ms.rel_mse == Approx(codec_error_traits<int8_rotated>::rel_mse).epsilon(0.1));
    CHECK(ms.rel_mse * 10 < measure_relative_mse<fp8_e4m3::bind<128>>(n, 4).rel_mse);
    const auto ip = measure_inner_product_error<int8_rotated::bind<128>>(n, 5);
    CHECK(ip.rms * std::sqrt(128.0) ==
          Approx(codec_error_traits<int8_rotated>::ip_rms_sqrt_d).epsilon(0.15));
    CHECK(std::fabs(ip.bias) < 0.0005);
    CHECK(ip.gain == Approx(1.0).margin(0.001));
  }
  SECTION("dense controls") {
    CHECK(measure_relative_mse<dense_f32::bind<64>>(100, 6).rel_mse == 0.0);
    const auto b = measure_relative_mse<dense_bf16::bind<64>>(n, 6);
    CHECK(b.rel_mse == Approx(codec_error_traits<dense_bf16>::rel_mse).epsilon(0.15));
  }
}

TEST_CASE("error traits: a tier reports both roles and exact bits", "[traits]") {
  using stale = tier_error_traits<tier<tq3_key, tq3_value>, 128>;
  using recent = tier_error_traits<tier<fp8_e4m3, fp8_e4m3>, 64>;
  CHECK(stale::key_bits_per_scalar == 3.125);
  CHECK(stale::value_bits_per_scalar == 3.125);
  CHECK(recent::bits_per_scalar_kv == 8.25);
  CHECK(measure_for(kv_role::key) == error_measure::inner_product);
  CHECK(measure_for(kv_role::value) == error_measure::relative_mse);
  CHECK(stale::expected_value_rel_mse < 0.035);
  CHECK(stale::expected_key_ip_bias == 0.0);
  const auto k = stale::measure_keys(500, 9);
  const auto v = stale::measure_values(500, 9);
  CHECK(k.samples == 500);
  CHECK(v.samples == 500);
  CHECK(k.rms == Approx(stale::expected_key_ip_rms()).epsilon(0.15));
  CHECK(v.rel_mse == Approx(stale::expected_value_rel_mse).epsilon(0.07));
}
