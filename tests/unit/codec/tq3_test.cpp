// SPDX-License-Identifier: Apache-2.0
// TQ3 against a float64 reference encoder/decoder; packing layout; corrections; bad input.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "rotated_reference.hpp"
#include "test_helpers.hpp"
#include "tierkv/codec/tq3.hpp"

using namespace tierkv;

namespace {

// The int8-grid levels L / 64 and their unit-variance decision thresholds (codec/tq3.hpp).
const double kCentroid[8] = {-127 / 64., -79 / 64., -44 / 64., -14 / 64.,
                             14 / 64.,   44 / 64.,  79 / 64.,  127 / 64.};
const double kThreshold[3] = {0.49223481171792629, 1.04387727312594713, 1.74828226230849682};

struct reference_result {
  std::vector<int> codes;
  std::vector<double> t;  // sqrt(d) * y_i
  double alpha_key = 0, alpha_value = 0, norm = 0;
};

template <int N>
reference_result reference_encode(const std::vector<float>& x, std::uint64_t seed) {
  std::vector<double> xd(x.begin(), x.end());
  double n2 = 0;
  for (double v : xd) n2 += v * v;
  const double n = std::sqrt(n2);
  const auto z = codec_test::hd64<N>(xd, seed);  // = sqrt(N) * H_norm D x
  reference_result r;
  r.norm = n;
  double uuh = 0, uh2 = 0;
  for (int i = 0; i < N; ++i) {
    const double t = z[std::size_t(i)] / n;  // sqrt(N) * y_i
    const double a = std::fabs(t);
    const int m = (a > kThreshold[0]) + (a > kThreshold[1]) + (a > kThreshold[2]);
    const int code = t < 0 ? 3 - m : 4 + m;
    r.codes.push_back(code);
    r.t.push_back(t);
    uuh += (t / std::sqrt(double(N))) * (kCentroid[code] / std::sqrt(double(N)));
    uh2 += kCentroid[code] * kCentroid[code] / double(N);
  }
  r.alpha_key = n / uuh;
  r.alpha_value = n * uuh / uh2;
  return r;
}

// D H (alpha c) / N in float64 from the codes and the stored alpha.
template <int N>
std::vector<double> reference_decode(const std::vector<std::uint8_t>& codes, double alpha,
                                     std::uint64_t seed) {
  std::vector<double> levels(N);
  for (int j = 0; j < N; ++j) levels[std::size_t(j)] = alpha * kCentroid[codes[std::size_t(j)]];
  return codec_test::rotated_decode64<N>(levels, seed);
}

template <class C>
void check_against_reference(double input_scale) {
  constexpr int N = C::head_dim;
  codec_test::gaussian_source rng(1000 + N);
  int near_threshold_mismatches = 0, far_mismatches = 0;
  for (int v = 0; v < 40; ++v) {
    const codec_context ctx{mix64(std::uint64_t(v) * 77 + N)};
    auto x = codec_test::gaussian(rng, N, input_scale);
    if (v % 5 == 0) x[std::size_t(v) % N] += float(8 * input_scale);  // an offset channel
    std::vector<std::uint8_t> payload(C::payload_bytes);
    bf16_bits meta = 0;
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
    std::vector<std::uint8_t> codes(N);
    C::unpack(payload.data(), codes.data());
    const auto ref = reference_encode<N>(x, ctx.seed);
    for (int i = 0; i < N; ++i) {
      if (codes[std::size_t(i)] == ref.codes[std::size_t(i)]) continue;
      double gap = 1e9;
      for (double th : {0.0, kThreshold[0], kThreshold[1], kThreshold[2]})
        gap = std::min(gap, std::fabs(std::fabs(ref.t[std::size_t(i)]) - th));
      (gap < 1e-5 ? near_threshold_mismatches : far_mismatches) += 1;
    }
    // alpha: float64 formula from the float64 reference, within bf16 rounding.
    const double want_alpha = C::norm == tq_norm::unbiased_inner_product ? ref.alpha_key
                              : C::norm == tq_norm::least_squares
                                  ? ref.alpha_value
                                  : ref.norm * tq3_grid::plain_scale;
    CHECK(double(bf16_to_float(meta)) == Approx(want_alpha).epsilon(0x1p-8));
    // decode vs float64 decode of the same codes and alpha.
    const auto yref = reference_decode<N>(codes, double(bf16_to_float(meta)), ctx.seed);
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    for (int i = 0; i < N; ++i)
      CHECK(double(y[std::size_t(i)]) ==
            Approx(yref[std::size_t(i)]).margin(1e-5 * ref.norm / std::sqrt(double(N))));
    // The attention path: q·k_hat through prepare_query + dot.
    auto q = codec_test::gaussian(rng, N);
    std::vector<float> qp(N);
    C::prepare_query(q.data(), qp.data(), ctx);
    double want_dot = 0, qn = 0;
    for (int i = 0; i < N; ++i) {
      want_dot += double(q[std::size_t(i)]) * yref[std::size_t(i)];
      qn += double(q[std::size_t(i)]) * q[std::size_t(i)];
    }
    CHECK(double(C::dot(qp.data(), payload.data(), meta)) ==
          Approx(want_dot).margin(2e-6 * std::sqrt(qn) * ref.norm));
  }
  CHECK(far_mismatches == 0);
  CHECK(near_threshold_mismatches <= 2);
}

}  // namespace

TEST_CASE("tq3: codes, alpha, decode and dot match a float64 reference", "[tq3]") {
  check_against_reference<tq3_key::bind<32>>(1.0);
  check_against_reference<tq3_key::bind<64>>(1.0);
  check_against_reference<tq3_value::bind<128>>(1e-3);
  check_against_reference<tq3_key::bind<128>>(250.0);
  check_against_reference<tq3_plain::bind<128>>(1.0);
  check_against_reference<tq3_value::bind<256>>(1e10);
}

TEST_CASE("tq3: levels are int8 L / 64, and the GPU lookup tables hold exactly them", "[tq3]") {
  // The GPU decode reads levels from byte tables (one byte-permute per 4 codes): int8 L for
  // the key product, the f16 bits of L / 64 (low and high bytes) for the value product.
  auto table_byte = [](std::uint32_t w0, std::uint32_t w1, int code) {
    return (code < 4 ? w0 >> (8 * code) : w1 >> (8 * (code - 4))) & 0xffu;
  };
  auto f16_value = [](std::uint32_t h) {  // normal f16 only (the levels are)
    const double mant = 1.0 + double(h & 0x3ffu) / 1024.0;
    const int e = int((h >> 10) & 0x1fu) - 15;
    REQUIRE(((h >> 10) & 0x1fu) != 0u);
    return ((h & 0x8000u) ? -1.0 : 1.0) * std::ldexp(mant, e);
  };
  for (int code = 0; code < 8; ++code) {
    const int L = detail::tq3_level_int(code);
    CHECK(double(tq3_grid::level(code)) == double(L) / 64.0);
    CHECK(double(tq3_grid::level(code)) == kCentroid[code]);
    CHECK(std::int8_t(table_byte(detail::tq3_s8_0, detail::tq3_s8_1, code)) == L);
    const std::uint32_t h = table_byte(detail::tq3_f16_lo0, detail::tq3_f16_lo1, code) |
                            (table_byte(detail::tq3_f16_hi0, detail::tq3_f16_hi1, code) << 8);
    CHECK(f16_value(h) == double(L) / 64.0);
    // The value path's biased byte u = L + 128 as an f16 subnormal (u 2^-24: mantissa u < 1024),
    // times 2^14 minus 2^-3 in one fma: L / 1024; or, biased (phased steps), as is, the bias
    // 128 2^-24 (value_bias_pair, the subnormal 0x0080) subtracted from the accumulator
    // (docs/gpu.md, tq3_widen in cuda/codec/tq3.cuh).
    const std::uint32_t u = table_byte(detail::tq3_u8_0, detail::tq3_u8_1, code);
    CHECK(int(u) == L + 128);
    CHECK(u < 1024u);
    CHECK(std::ldexp(double(u), -24) * 16384.0 - 0.125 == double(L) / 1024.0);
    CHECK(std::ldexp(double(u), -24) - std::ldexp(128.0, -24) == std::ldexp(double(L), -24));
    if (code > 0) CHECK(detail::tq3_level_int(code - 1) < L);  // ascending
    CHECK(detail::tq3_level_int(7 - code) == -L);              // symmetric
  }
  // Thresholds: the midpoints of adjacent levels at the unit scale 0.0169736 (Gaussian MSE
  // optimum).
  const double a = 0.016973614197169872;
  CHECK(double(detail::tq3_threshold1) == Approx(a * (14 + 44) / 2).epsilon(1e-7));
  CHECK(double(detail::tq3_threshold2) == Approx(a * (44 + 79) / 2).epsilon(1e-7));
  CHECK(double(detail::tq3_threshold3) == Approx(a * (79 + 127) / 2).epsilon(1e-7));
  CHECK(double(tq3_grid::plain_scale) == Approx(64 * a).epsilon(1e-7));
}

TEST_CASE("tq3: accumulate + finalize equals sum of p * decoded values", "[tq3]") {
  codec_test::check_accumulate_finalize<tq3_value::bind<128>>(77, 12345, 16, 1e-5);
}

TEST_CASE("tq3: packing layout of docs/formats.md", "[tq3]") {
  using C = tq3_key::bind<64>;
  codec_test::gaussian_source rng(3);
  std::vector<std::uint8_t> codes(64), back(64), payload(C::payload_bytes);
  REQUIRE(C::payload_bytes == 24);  // 3 * 64 / 8
  for (int rep = 0; rep < 50; ++rep) {
    for (auto& c : codes) c = std::uint8_t(std::uint64_t(std::fabs(rng.next()) * 1000) % 8);
    C::pack(codes.data(), payload.data());
    C::unpack(payload.data(), back.data());
    CHECK(back == codes);
    for (int g = 0; g < 2; ++g) {
      std::uint32_t w[3];
      for (int t = 0; t < 3; ++t)  // little-endian words
        w[t] = std::uint32_t(payload[std::size_t(12 * g + 4 * t)]) |
               std::uint32_t(payload[std::size_t(12 * g + 4 * t + 1)]) << 8 |
               std::uint32_t(payload[std::size_t(12 * g + 4 * t + 2)]) << 16 |
               std::uint32_t(payload[std::size_t(12 * g + 4 * t + 3)]) << 24;
      // j < 24: W & 0x77777777 are nibble selectors of codes 0..23.
      for (int j = 0; j < 24; ++j)
        CHECK(((w[j / 8] & 0x77777777u) >> (4 * (j % 8)) & 0xFu) == codes[std::size_t(32 * g + j)]);
      // j >= 24: the documented 3-op gather gives codes 24..31 as nibbles.
      const std::uint32_t hi =
          ((w[0] >> 3) & 0x11111111u) | ((w[1] >> 2) & 0x22222222u) | ((w[2] >> 1) & 0x44444444u);
      for (int n = 0; n < 8; ++n)
        CHECK(((hi >> (4 * n)) & 0xFu) == codes[std::size_t(32 * g + 24 + n)]);
    }
  }
}

TEST_CASE("tq3: scale invariance: x * 2^j gives the same codes and alpha * 2^j", "[tq3]") {
  codec_test::check_scale_invariance<tq3_key::bind<128>>(11, 99, {-120, -60, -1, 1, 30, 100});
}

TEST_CASE("tq3: zero vectors, NaN/Inf, huge and subnormal inputs", "[tq3]") {
  using C = tq3_value::bind<256>;
  const auto zero = codec_test::check_tq_edge_inputs<C>(codec_context{5}, 8, 0.97, 0.67);
  std::vector<std::uint8_t> codes(256);
  C::unpack(zero.data(), codes.data());
  CHECK(std::all_of(codes.begin(), codes.end(), [](std::uint8_t c) { return c == C::zero_code; }));
  codec_test::check_tq_edge_inputs<tq3_key::bind<64>>(codec_context{3}, 11, 0.97, 0.67);
}

TEST_CASE("tq3: sizes and bits per scalar", "[tq3]") {
  CHECK(tq3_key::bind<64>::payload_bytes == 24);
  CHECK(tq3_key::bind<128>::payload_bytes == 48);
  CHECK(tq3_value::bind<512>::payload_bytes == 192);
  CHECK(bits_per_scalar<tq3_key::bind<64>> == 3.25);
  CHECK(bits_per_scalar<tq3_value::bind<128>> == 3.125);
  CHECK(bits_per_scalar<tq3_key::bind<256>> == 3.0625);
}
