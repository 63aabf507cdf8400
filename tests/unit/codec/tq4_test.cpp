// SPDX-License-Identifier: Apache-2.0
// TQ4 against a float64 reference encoder/decoder; nibble packing; corrections; error
// against TQ3; bad input.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "rotated_reference.hpp"
#include "test_helpers.hpp"
#include "tierkv/codec/error_traits.hpp"
#include "tierkv/codec/tq4.hpp"

using namespace tierkv;

namespace {

constexpr double kStep = 0.3352;  // levels (c - 7.5) * step standard deviations

// the grid the tests check the codec against (codec_test::check_uniform_against_reference)
constexpr codec_test::uniform_grid kGrid{16, kStep, 91, 128};

template <class C>
void check_against_reference(double input_scale, std::uint64_t seed) {
  codec_test::check_uniform_against_reference<C>(kGrid, input_scale, seed);
}

}  // namespace

TEST_CASE("tq4: codes, alpha, decode and dot match a float64 reference", "[tq4][codec]") {
  check_against_reference<tq4_key::bind<32>>(1.0, 1);
  check_against_reference<tq4_key::bind<64>>(1.0, 2);
  check_against_reference<tq4_value::bind<64>>(3e-3, 3);
  check_against_reference<tq4_key::bind<128>>(250.0, 4);
  check_against_reference<tq4_value::bind<256>>(1e10, 5);
  check_against_reference<tq4_key::bind<512>>(1.0, 6);
}

TEST_CASE("tq4: accumulate + finalize equals the sum of p * decoded values", "[tq4][codec]") {
  codec_test::check_accumulate_finalize<tq4_value::bind<128>>(78, 4321, 16, 1e-5);
  codec_test::check_accumulate_finalize<tq4_key::bind<256>>(79, 17, 20, 1e-5);
}

TEST_CASE("tq4: nibble packing of docs/formats.md", "[tq4][codec]") {
  using C = tq4_key::bind<64>;
  REQUIRE(C::payload_bytes == 32);
  codec_test::gaussian_source rng(4);
  std::vector<std::uint8_t> codes(64), back(64), payload(C::payload_bytes);
  for (int rep = 0; rep < 50; ++rep) {
    for (auto& c : codes) c = std::uint8_t(std::uint64_t(std::fabs(rng.next()) * 1000) % 16);
    C::pack(codes.data(), payload.data());
    C::unpack(payload.data(), back.data());
    CHECK(back == codes);
    for (int w = 0; w < 8; ++w) {  // little-endian word w: coordinates 8w..8w+7 in nibbles 0..7
      const std::uint32_t word = detail::load_le32(payload.data() + 4 * w);
      for (int n = 0; n < 8; ++n) CHECK(((word >> (4 * n)) & 15u) == codes[std::size_t(8 * w + n)]);
    }
  }
}

TEST_CASE("tq4: scale invariance: x * 2^j gives the same codes and alpha * 2^j", "[tq4][codec]") {
  codec_test::check_scale_invariance<tq4_key::bind<128>>(12, 98, {-120, -60, -1, 1, 30, 100});
  codec_test::check_scale_invariance<tq4_value::bind<64>>(13, 5, {-7, 90});
}

TEST_CASE("tq4: zero vectors, NaN/Inf, huge and subnormal inputs", "[tq4][codec]") {
  // one-hot: every rotated coordinate has the same magnitude, all in the clip region's neighbours
  const auto zero =
      codec_test::check_tq_edge_inputs<tq4_key::bind<256>>(codec_context{6}, 9, 0.99, 0.05);
  CHECK(
      std::all_of(zero.begin(), zero.end(), [](std::uint8_t b) { return b == 0x88; }));  // codes 8
  codec_test::check_tq_edge_inputs<tq4_value::bind<64>>(codec_context{7}, 10, 0.99, 0.05);
  // The largest alpha times the largest level through a 512-point WHT stays finite.
  using C512 = tq4_key::bind<512>;
  std::vector<std::uint8_t> p(C512::payload_bytes, 0xFF);  // every code 15
  std::vector<float> out(512);
  C512::decode(p.data(), float_to_bf16(detail::tq_alpha_limit), out.data(), codec_context{6});
  CHECK(codec_test::all_finite(out));
}

TEST_CASE("tq4: error against TQ3 and the recorded traits", "[tq4][codec][traits]") {
  constexpr int n = 1500;
  const auto k4 = measure_inner_product_error<tq4_key::bind<128>>(n, 5);
  const auto k3 = measure_inner_product_error<tq3_key::bind<128>>(n, 5);
  CHECK(std::fabs(k4.bias) < 0.001);
  CHECK(k4.gain == Approx(1.0).margin(0.003));
  CHECK(k4.rms * std::sqrt(128.0) ==
        Approx(codec_error_traits<tq4_key>::ip_rms_sqrt_d).epsilon(0.1));
  CHECK(k4.rms * 1.6 < k3.rms);  // the point of the codec: 1.75x lower key error (docs/codecs.md)
  const auto v4 = measure_relative_mse<tq4_value::bind<128>>(n, 4);
  CHECK(v4.rel_mse == Approx(codec_error_traits<tq4_value>::rel_mse).epsilon(0.07));
  CHECK(v4.rel_mse < 0.0120);  // the uniform 16-level optimum for N(0,1) is 0.01154
}

TEST_CASE("tq4: sizes and bits per scalar", "[tq4][codec]") {
  CHECK(tq4_key::bind<64>::payload_bytes == 32);
  CHECK(tq4_key::bind<128>::payload_bytes == 64);
  CHECK(tq4_value::bind<512>::payload_bytes == 256);
  CHECK(bits_per_scalar<tq4_key::bind<64>> == 4.25);
  CHECK(bits_per_scalar<tq4_value::bind<128>> == 4.125);
  CHECK(std::string(tq4_key::bind<64>::name) == "tq4_key");
  CHECK(tq4_key::bind<64>::format == storage_format::tq4);
}
