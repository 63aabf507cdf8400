// SPDX-License-Identifier: Apache-2.0
// int8_rotated against a float64 reference (rotation, scale rule, codes, decode, dot); its
// error bound; accumulate + finalize; adversarial inputs; sizes.
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "rotated_reference.hpp"
#include "test_helpers.hpp"
#include "tierkv/codec/int8_rotated.hpp"

using namespace tierkv;

namespace {

// D H (alpha c) / N in float64: the decoded vector from codes and the stored alpha.
template <int N>
std::vector<double> reference_decode(const std::uint8_t* payload, double alpha,
                                     std::uint64_t seed) {
  std::vector<double> levels(N);
  for (int j = 0; j < N; ++j) levels[std::size_t(j)] = alpha * double(std::int8_t(payload[j]));
  return codec_test::rotated_decode64<N>(levels, seed);
}

template <int N>
void check_against_reference(double input_scale, std::uint64_t seed) {
  using C = int8_rotated_codec<N>;
  codec_test::gaussian_source rng(seed + N);
  int tie_mismatches = 0;
  for (int v = 0; v < 30; ++v) {
    const codec_context ctx{mix64(std::uint64_t(v) * 131 + N + seed)};
    auto x = codec_test::gaussian(rng, N, input_scale);
    if (v % 4 == 0) x[std::size_t(v) % N] += float(20 * input_scale);  // an outlier channel
    std::vector<std::uint8_t> payload(C::payload_bytes);
    bf16_bits meta = 0;
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
    const double alpha = double(bf16_to_float(meta));
    const auto z = codec_test::hd64<N>(std::vector<double>(x.begin(), x.end()), ctx.seed);
    double zmax = 0, xn2 = 0;
    for (int i = 0; i < N; ++i) zmax = std::max(zmax, std::fabs(z[std::size_t(i)]));
    for (float e : x) xn2 += double(e) * e;
    // Scale rule: alpha is zmax / 127 rounded up to bf16 (one bf16 step at most).
    CHECK(alpha >= zmax / 127.0 * (1 - 1e-6));
    CHECK(alpha <= zmax / 127.0 * (1 + 0x1p-7));
    // Codes: round(z / alpha), half away from zero; float rounding may flip exact ties only.
    for (int i = 0; i < N; ++i) {
      const double q = z[std::size_t(i)] / alpha;
      const int want = int(std::lround(q));
      const int got = std::int8_t(payload[std::size_t(i)]);
      CHECK(std::abs(got) <= 127);
      if (got == want) continue;
      CHECK(std::fabs(std::fabs(q - std::trunc(q)) - 0.5) < 1e-4);
      CHECK(std::abs(got - want) == 1);
      ++tie_mismatches;
    }
    // decode vs the float64 decode of the same codes and alpha.
    const auto yref = reference_decode<N>(payload.data(), alpha, ctx.seed);
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    double err2 = 0;
    for (int i = 0; i < N; ++i) {
      CHECK(double(y[std::size_t(i)]) ==
            Approx(yref[std::size_t(i)]).margin(2e-6 * std::sqrt(xn2 / N) + 1e-30));
      const double d = yref[std::size_t(i)] - double(x[std::size_t(i)]);
      err2 += d * d;
    }
    // Error bound: |x - x_hat|_2 = |z - alpha c|_2 / sqrt(N) <= alpha / 2 (orthonormal R).
    CHECK(std::sqrt(err2) <= alpha / 2 * (1 + 1e-6));
    // The attention path: q . x_hat through prepare_query + dot.
    auto q = codec_test::gaussian(rng, N);
    std::vector<float> qp(N);
    C::prepare_query(q.data(), qp.data(), ctx);
    double want_dot = 0, qn = 0;
    for (int i = 0; i < N; ++i) {
      want_dot += double(q[std::size_t(i)]) * yref[std::size_t(i)];
      qn += double(q[std::size_t(i)]) * q[std::size_t(i)];
    }
    CHECK(double(C::dot(qp.data(), payload.data(), meta)) ==
          Approx(want_dot).margin(2e-6 * std::sqrt(qn * xn2)));
  }
  CHECK(tie_mismatches <= 2);
}

}  // namespace

TEST_CASE("int8_rotated: scale, codes, decode and dot match a float64 reference",
          "[int8_rotated][codec]") {
  check_against_reference<8>(1.0, 1);
  check_against_reference<64>(1.0, 2);
  check_against_reference<64>(3e-3, 3);
  check_against_reference<128>(1.0, 4);
  check_against_reference<256>(50.0, 5);
  check_against_reference<512>(1.0, 6);
}

TEST_CASE("int8_rotated: accumulate + finalize equals the sum of p * decoded values",
          "[int8_rotated][codec]") {
  codec_test::check_accumulate_finalize<int8_rotated_codec<128>>(7, 12345, 20, 1e-4);
}

TEST_CASE("int8_rotated: scale invariance: x * 2^j gives the same codes and alpha * 2^j",
          "[int8_rotated][codec]") {
  codec_test::check_scale_invariance<int8_rotated_codec<64>>(9, 777, {-60, -7, 5, 90});
}

TEST_CASE("int8_rotated: zero vectors, NaN/Inf, huge and subnormal inputs",
          "[int8_rotated][codec]") {
  constexpr int N = 64;
  using C = int8_rotated_codec<N>;
  const codec_context ctx{99};
  std::vector<std::uint8_t> payload(N, 0xAB);
  bf16_bits meta = 0x1234;
  encode_stats stats;
  SECTION("zeros: alpha 0, codes 0, decode and dot 0") {
    std::vector<float> x(N, 0.f), y(N, 1.f), q(N, 1.f);
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::ok);
    CHECK(meta == 0);
    for (auto b : payload) CHECK(b == 0);
    C::decode(payload.data(), meta, y.data(), ctx);
    for (float v : y) CHECK(v == 0.f);
    CHECK(C::dot(q.data(), payload.data(), meta) == 0.f);
  }
  SECTION("NaN or Inf: non_finite_input, zero codes and a NaN alpha (loud if read)") {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()}) {
      std::vector<float> x(N, 1.f);
      x[17] = bad;
      CHECK(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::non_finite_input);
      CHECK(meta == C::poison_meta);
      for (auto b : payload) CHECK(b == 0);
      std::vector<float> y(N);
      C::decode(payload.data(), meta, y.data(), ctx);
      CHECK(std::isnan(y[0]));
    }
  }
  SECTION("huge magnitudes: clipped at 2^112 and counted; alpha and decode stay finite") {
    std::vector<float> x(N, 1.f);
    x[3] = 3e38f;
    x[9] = -3e38f;
    x[10] = 1e33f;  // below the limit: not counted
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::ok);
    CHECK(stats.saturated == 2);
    CHECK(std::isfinite(bf16_to_float(meta)));
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    CHECK(codec_test::all_finite(y));
    CHECK(y[3] == Approx(double(C::input_limit)).epsilon(0.02));
    CHECK(y[9] == Approx(-double(C::input_limit)).epsilon(0.02));
  }
  SECTION("all at FLT_MAX with one sign: alpha finite, decode within the bound") {
    std::vector<float> x(N, std::numeric_limits<float>::max());
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::ok);
    CHECK(stats.saturated == std::uint64_t(N));
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    for (float v : y) CHECK(v == Approx(double(C::input_limit)).epsilon(0.02));
  }
  SECTION(
      "tiny and subnormal inputs: scaled before rotating; the bound holds with the stored alpha") {
    // 1e-36: alpha stays a normal bf16, so the relative error is that of normal inputs.
    // 1e-41 (subnormal): alpha rounds up to bf16's least subnormals, so precision is coarse
    // (as for FP8's bf16 scale), but the error stays within alpha / 2 and nothing is lost.
    for (double scale : {1e-36, 1e-41}) {
      codec_test::gaussian_source rng(3);
      auto x = codec_test::gaussian(rng, N, scale);
      REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::ok);
      const double alpha = double(bf16_to_float(meta));
      CHECK(alpha > 0);
      std::vector<float> y(N);
      C::decode(payload.data(), meta, y.data(), ctx);
      CHECK(codec_test::all_finite(y));
      double e2 = 0, n2 = 0;
      for (int i = 0; i < N; ++i) {
        const double d = double(y[std::size_t(i)]) - double(x[std::size_t(i)]);
        e2 += d * d;
        n2 += double(x[std::size_t(i)]) * x[std::size_t(i)];
      }
      // Plus the subnormal output grid (2^-149 per element) at 1e-41.
      CHECK(std::sqrt(e2) <= alpha / 2 * (1 + 1e-5) + std::sqrt(double(N)) * 0x1p-149);
      if (scale > 1e-38) CHECK(e2 / n2 < 1e-4);
    }
  }
}

TEST_CASE("int8_rotated: sizes and bits per scalar", "[int8_rotated][codec]") {
  static_assert(int8_rotated_codec<64>::payload_bytes == 64);
  static_assert(int8_rotated_codec<64>::meta_bytes == 2);
  CHECK(bits_per_scalar<int8_rotated_codec<64>> == 8.25);
  CHECK(bits_per_scalar<int8_rotated_codec<128>> == 8.125);
  CHECK(std::string(int8_rotated_codec<128>::name) == "int8_rotated");
}

TEMPLATE_TEST_CASE_SIG("int8_rotated: clipped inputs decode finite at every head_dim up to 512",
                       "[int8_rotated][codec]", ((int N), N), 64, 128, 256, 512) {
  // Found by tests/fuzz/codec_fuzz.cpp: at the old 2^120 limit, head_dim 256 with two
  // coordinates at -FLT_MAX decoded to -Inf (the inverse rotation's sum overflowed before /d).
  using C = int8_rotated_codec<N>;
  const codec_context ctx{0x5eed};
  for (const float big : {std::numeric_limits<float>::max(), 3e38f, 1e34f}) {
    for (int spread = 1; spread <= N; spread *= 4) {  // 1, 4, 16, ... coordinates at -big
      std::vector<float> x(N, 1e-30f);
      for (int i = 0; i < spread; ++i) x[std::size_t(i * (N / spread))] = i % 2 ? big : -big;
      std::vector<std::uint8_t> payload(C::payload_bytes);
      bf16_bits meta = 0;
      encode_stats stats;
      REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, &stats) == errc::ok);
      std::vector<float> y(N);
      C::decode(payload.data(), meta, y.data(), ctx);
      INFO("big " << big << ", " << spread << " coordinates");
      CHECK(codec_test::all_finite(y));
      CHECK(std::fabs(y[0]) == Approx(double(C::input_limit)).epsilon(0.25));
    }
  }
}
