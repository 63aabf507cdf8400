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

struct reference_result {
  std::vector<int> codes;
  std::vector<double> t;  // sqrt(d) * y_i, in standard deviations
  double alpha_key = 0, alpha_value = 0;
};

// The definition: t_i = (H D x)_i / |x| ~ N(0, 1); code = clamp(floor(t / step) + 8, 0, 15);
// the alphas from <u, u_hat> and |u_hat|^2 with u_hat = D H c / N (any scale of c).
template <int N>
reference_result reference_encode(const std::vector<float>& x, std::uint64_t seed) {
  std::vector<double> xd(x.begin(), x.end());
  double n2 = 0;
  for (double v : xd) n2 += v * v;
  const double n = std::sqrt(n2);
  const auto z = codec_test::hd64<N>(xd, seed);
  reference_result r;
  double zc = 0, cc = 0;
  for (int i = 0; i < N; ++i) {
    const double t = z[std::size_t(i)] / n;
    const int code = std::clamp(int(std::floor(t / kStep)) + 8, 0, 15);
    const double c = code - 7.5;
    r.codes.push_back(code);
    r.t.push_back(t);
    zc += t * c;
    cc += c * c;
  }
  // <u, u_hat> = zc / (N |u_hat|'s scale ...): with u_hat = D H c / N, <u, u_hat> = zc / N
  // and |u_hat|^2 = cc / N (t = sqrt(N) y, y = H_norm D u).
  const double uuh = zc / N, uh2 = cc / N;
  r.alpha_key = n / uuh;
  r.alpha_value = n * uuh / uh2;
  return r;
}

template <int N>
std::vector<double> reference_decode(const std::vector<std::uint8_t>& codes, double alpha,
                                     std::uint64_t seed) {
  std::vector<double> levels(N);
  for (int j = 0; j < N; ++j) levels[std::size_t(j)] = alpha * (codes[std::size_t(j)] - 7.5);
  return codec_test::rotated_decode64<N>(levels, seed);
}

template <class C>
void check_against_reference(double input_scale, std::uint64_t seed) {
  constexpr int N = C::head_dim;
  codec_test::gaussian_source rng(seed + N);
  int boundary_mismatches = 0, far_mismatches = 0, clipped = 0;
  for (int v = 0; v < 40; ++v) {
    const codec_context ctx{mix64(std::uint64_t(v) * 91 + N + seed)};
    auto x = codec_test::gaussian(rng, N, input_scale);
    if (v % 5 == 0) x[std::size_t(v) % N] += float(8 * input_scale);  // an offset channel
    std::vector<std::uint8_t> payload(C::payload_bytes);
    bf16_bits meta = 0;
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
    std::vector<std::uint8_t> codes(N);
    C::unpack(payload.data(), codes.data());
    const auto ref = reference_encode<N>(x, ctx.seed);
    for (int i = 0; i < N; ++i) {
      const double q = ref.t[std::size_t(i)] / kStep;
      clipped += q < -8 || q >= 8;
      if (codes[std::size_t(i)] == ref.codes[std::size_t(i)]) continue;
      // float rounding may only move a coordinate across a decision boundary it touches
      const bool at_boundary = std::fabs(q - std::round(q)) < 1e-4;
      (at_boundary ? boundary_mismatches : far_mismatches) += 1;
    }
    const double want_alpha =
        C::norm == tq_norm::unbiased_inner_product ? ref.alpha_key : ref.alpha_value;
    CHECK(double(bf16_to_float(meta)) == Approx(want_alpha).epsilon(0x1p-8));
    const auto yref = reference_decode<N>(codes, double(bf16_to_float(meta)), ctx.seed);
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    const double xn = std::sqrt(codec_test::dot64(x.data(), x.data(), N));
    for (int i = 0; i < N; ++i)
      CHECK(double(y[std::size_t(i)]) ==
            Approx(yref[std::size_t(i)]).margin(1e-5 * xn / std::sqrt(double(N))));
    // The attention path: q·k_hat through prepare_query + dot.
    auto q = codec_test::gaussian(rng, N);
    std::vector<float> qp(N);
    C::prepare_query(q.data(), qp.data(), ctx);
    double want_dot = 0;
    for (int i = 0; i < N; ++i) want_dot += double(q[std::size_t(i)]) * yref[std::size_t(i)];
    const double qn = std::sqrt(codec_test::dot64(q.data(), q.data(), N));
    CHECK(double(C::dot(qp.data(), payload.data(), meta)) ==
          Approx(want_dot).margin(2e-6 * qn * xn));
  }
  CHECK(far_mismatches == 0);
  CHECK(boundary_mismatches <= 2);
  if (N >= 128) CHECK(clipped > 0);  // the clip region is exercised (2 * 0.4% of coordinates)
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
