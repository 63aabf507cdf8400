// SPDX-License-Identifier: Apache-2.0
// Float64 references of the rotated codecs (TQ2, TQ3, TQ4, int8_rotated): the rotation H D x and
// the decode D H (alpha c) / N, written from the definitions (no fast transform).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "test_helpers.hpp"
#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/rotation.hpp"
#include "tierkv/codec/turboquant.hpp"

namespace codec_test {

// H D x in float64 (unnormalized H).
template <int N>
std::vector<double> hd64(const std::vector<double>& x, std::uint64_t seed) {
  std::vector<double> y(N, 0.0);
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      y[std::size_t(i)] += ((std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) *
                           (tierkv::rotation_sign_negative(seed, j) ? -1.0 : 1.0) *
                           x[std::size_t(j)];
  return y;
}

// D H (alpha c) / N in float64: the decoded vector from the scaled levels alpha * c_j.
template <int N>
std::vector<double> rotated_decode64(const std::vector<double>& scaled_levels, std::uint64_t seed) {
  std::vector<double> y(N, 0.0);
  for (int i = 0; i < N; ++i) {
    double s = 0;
    for (int j = 0; j < N; ++j)
      s += ((std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) * scaled_levels[std::size_t(j)];
    y[std::size_t(i)] = (tierkv::rotation_sign_negative(seed, i) ? -1.0 : 1.0) * s / double(N);
  }
  return y;
}

// encode(x * 2^j) gives the same codes and alpha * 2^j for every j (the power-of-two prescaling
// is exact); another rotation seed gives other codes.
template <class C>
void check_scale_invariance(std::uint64_t rng_seed, std::uint64_t ctx_seed,
                            std::initializer_list<int> js) {
  constexpr int N = C::head_dim;
  gaussian_source rng(rng_seed);
  const tierkv::codec_context ctx{ctx_seed};
  const auto x = gaussian(rng, N);
  std::vector<std::uint8_t> p0(C::payload_bytes), p1(C::payload_bytes);
  tierkv::bf16_bits m0 = 0, m1 = 0;
  REQUIRE(C::encode(x.data(), p0.data(), m0, ctx, nullptr) == tierkv::errc::ok);
  for (int j : js) {
    std::vector<float> xs(N);
    for (int i = 0; i < N; ++i) xs[std::size_t(i)] = std::ldexp(x[std::size_t(i)], j);
    REQUIRE(C::encode(xs.data(), p1.data(), m1, ctx, nullptr) == tierkv::errc::ok);
    INFO("j = " << j);
    CHECK(p1 == p0);
    CHECK(double(tierkv::bf16_to_float(m1)) == std::ldexp(double(tierkv::bf16_to_float(m0)), j));
  }
  REQUIRE(C::encode(x.data(), p1.data(), m1, tierkv::codec_context{ctx_seed + 1}, nullptr) ==
          tierkv::errc::ok);
  CHECK(p1 != p0);
}

// accumulate(p, ...) over `tokens` vectors then finalize equals sum p * decode (the rotated
// accumulator maps back once, linearly).
template <class C>
void check_accumulate_finalize(std::uint64_t rng_seed, std::uint64_t ctx_seed, int tokens,
                               double margin) {
  constexpr int N = C::head_dim;
  gaussian_source rng(rng_seed);
  const tierkv::codec_context ctx{ctx_seed};
  std::vector<float> acc(N, 0.0f);
  std::vector<double> want(N, 0.0);
  for (int t = 0; t < tokens; ++t) {
    const auto v = gaussian(rng, N);
    std::vector<std::uint8_t> payload(C::payload_bytes);
    typename C::meta_type meta{};
    REQUIRE(C::encode(v.data(), payload.data(), meta, ctx, nullptr) == tierkv::errc::ok);
    const float p = float(t + 1) / float(tokens * (tokens + 1) / 2);
    C::accumulate(p, payload.data(), meta, acc.data());
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    for (int i = 0; i < N; ++i) want[std::size_t(i)] += double(p) * y[std::size_t(i)];
  }
  C::finalize(acc.data(), ctx);
  for (int i = 0; i < N; ++i)
    CHECK(double(acc[std::size_t(i)]) == Approx(want[std::size_t(i)]).margin(margin));
}

// NaN or +-Inf at element `at`: errc::non_finite_input, zero codes and the poison alpha, so a
// slot read by mistake decodes to NaN.
template <class C>
void check_non_finite_poisons(const tierkv::codec_context& ctx, int at) {
  constexpr int N = C::head_dim;
  std::vector<std::uint8_t> payload(C::payload_bytes, 0xEE);
  tierkv::bf16_bits meta = 0x1111;
  std::vector<float> y(N);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(N, 0.5f);
    x[std::size_t(at)] = bad;
    CHECK(C::encode(x.data(), payload.data(), meta, ctx, nullptr) ==
          tierkv::errc::non_finite_input);
    CHECK(meta == C::poison_meta);
    CHECK(std::all_of(payload.begin(), payload.end(), [](std::uint8_t b) { return b == 0; }));
    C::decode(payload.data(), meta, y.data(), ctx);
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
  }
}

// TQ3 / TQ4 (tq_codec) on adversarial input: a zero vector (alpha 0, exact zeros); NaN and
// +-Inf (poison); every element near FLT_MAX (alpha clipped at tq_alpha_limit and counted,
// decode finite and in the right direction); subnormal elements (same direction, alpha > 0);
// one nonzero element (decode finite, that element close to it). Returns the zero vector's
// payload so a caller can check its codes.
template <class C>
std::vector<std::uint8_t> check_tq_edge_inputs(const tierkv::codec_context& ctx,
                                               std::uint64_t rng_seed, double min_cosine,
                                               double one_hot_rel) {
  constexpr int N = C::head_dim;
  std::vector<std::uint8_t> payload(C::payload_bytes, 0xEE), zero_payload;
  tierkv::bf16_bits meta = 0x1111;
  std::vector<float> y(N), q(N, 1.0f), z(N, 0.0f);
  z[std::size_t(N / 3)] = -0.0f;
  REQUIRE(C::encode(z.data(), payload.data(), meta, ctx, nullptr) == tierkv::errc::ok);
  CHECK(meta == 0);
  zero_payload = payload;
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.0f; }));
  CHECK(C::dot(q.data(), payload.data(), meta) == 0.0f);

  check_non_finite_poisons<C>(ctx, N - 5);

  gaussian_source rng(rng_seed);
  const auto g = gaussian(rng, N);
  auto cosine = [&](const std::vector<float>& a) {
    return dot64(a.data(), g.data(), N) /
           std::sqrt(dot64(a.data(), a.data(), N) * dot64(g.data(), g.data(), N));
  };
  std::vector<float> h(N), sub(N);
  for (int i = 0; i < N; ++i) {
    h[std::size_t(i)] = g[std::size_t(i)] * 1e38f;
    sub[std::size_t(i)] = g[std::size_t(i)] * 1e-40f;
  }
  tierkv::encode_stats st;
  REQUIRE(C::encode(h.data(), payload.data(), meta, ctx, &st) == tierkv::errc::ok);
  CHECK(st.saturated == 1);
  CHECK(tierkv::bf16_to_float(meta) == tierkv::detail::tq_alpha_limit);
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(all_finite(y));
  CHECK(cosine(y) > min_cosine);
  st = {};
  REQUIRE(C::encode(sub.data(), payload.data(), meta, ctx, &st) == tierkv::errc::ok);
  CHECK(st.saturated == 0);
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(all_finite(y));
  CHECK(tierkv::bf16_to_float(meta) > 0.0f);
  CHECK(cosine(y) > min_cosine);
  for (int i : {0, N / 2 - 28, N - 1}) {
    std::vector<float> e(N, 0.0f);
    e[std::size_t(i)] = -3.0f;
    REQUIRE(C::encode(e.data(), payload.data(), meta, ctx, nullptr) == tierkv::errc::ok);
    C::decode(payload.data(), meta, y.data(), ctx);
    CHECK(all_finite(y));
    CHECK(double(y[std::size_t(i)]) == Approx(-3.0).epsilon(one_hot_rel));
  }
  return zero_payload;
}

// The uniform grids of the rotated scalar codec (TQ2, TQ4): 2^bits levels (c - (2^bits - 1) / 2)
// step standard deviations of the rotated coordinate.
struct uniform_grid {
  int levels;                 // 4 (TQ2), 16 (TQ4)
  double step;                // in standard deviations
  std::uint64_t context_mul;  // the test's codec-context seeds: mix64(v * context_mul + N + seed)
  int clip_checked_from_dim;  // from this head_dim on, some coordinate must clip
  constexpr int half() const { return levels / 2; }
  constexpr double center() const { return (levels - 1) / 2.0; }
};

struct uniform_reference {
  std::vector<int> codes;
  std::vector<double> t;  // sqrt(d) * y_i, in standard deviations
  double alpha_key = 0, alpha_value = 0;
};

// The definition: t_i = (H D x)_i / |x| ~ N(0, 1); code = clamp(floor(t / step) + levels / 2, 0,
// levels - 1); the alphas from <u, u_hat> = zc / N and |u_hat|^2 = cc / N with u_hat = D H c / N
// (t = sqrt(N) y, y = H_norm D u).
template <int N>
uniform_reference uniform_encode64(const std::vector<float>& x, std::uint64_t seed,
                                   const uniform_grid& g) {
  std::vector<double> xd(x.begin(), x.end());
  double n2 = 0;
  for (double v : xd) n2 += v * v;
  const double n = std::sqrt(n2);
  const auto z = hd64<N>(xd, seed);
  uniform_reference r;
  double zc = 0, cc = 0;
  for (int i = 0; i < N; ++i) {
    const double t = z[std::size_t(i)] / n;
    const int code = std::clamp(int(std::floor(t / g.step)) + g.half(), 0, g.levels - 1);
    const double c = code - g.center();
    r.codes.push_back(code);
    r.t.push_back(t);
    zc += t * c;
    cc += c * c;
  }
  const double uuh = zc / N, uh2 = cc / N;
  r.alpha_key = n / uuh;
  r.alpha_value = n * uuh / uh2;
  return r;
}

template <int N>
std::vector<double> uniform_decode64(const std::vector<std::uint8_t>& codes, double alpha,
                                     const uniform_grid& g, std::uint64_t seed) {
  std::vector<double> levels(N);
  for (int j = 0; j < N; ++j) levels[std::size_t(j)] = alpha * (codes[std::size_t(j)] - g.center());
  return rotated_decode64<N>(levels, seed);
}

// Codec C (a uniform-grid TQ codec) against the float64 reference: codes (only coordinates on a
// decision boundary may differ), alpha, decode and the attention path's q·k_hat.
template <class C>
void check_uniform_against_reference(const uniform_grid& g, double input_scale,
                                     std::uint64_t seed) {
  using namespace tierkv;
  constexpr int N = C::head_dim;
  gaussian_source rng(seed + N);
  int boundary_mismatches = 0, far_mismatches = 0, clipped = 0;
  for (int v = 0; v < 40; ++v) {
    const codec_context ctx{mix64(std::uint64_t(v) * g.context_mul + N + seed)};
    auto x = gaussian(rng, N, input_scale);
    if (v % 5 == 0) x[std::size_t(v) % N] += float(8 * input_scale);  // an offset channel
    std::vector<std::uint8_t> payload(C::payload_bytes);
    bf16_bits meta = 0;
    REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
    std::vector<std::uint8_t> codes(N);
    C::unpack(payload.data(), codes.data());
    const auto ref = uniform_encode64<N>(x, ctx.seed, g);
    for (int i = 0; i < N; ++i) {
      const double q = ref.t[std::size_t(i)] / g.step;
      clipped += q < -g.half() || q >= g.half();
      if (codes[std::size_t(i)] == ref.codes[std::size_t(i)]) continue;
      // float rounding may only move a coordinate across a decision boundary it touches
      const bool at_boundary = std::fabs(q - std::round(q)) < 1e-4;
      (at_boundary ? boundary_mismatches : far_mismatches) += 1;
    }
    const double want_alpha =
        C::norm == tq_norm::unbiased_inner_product ? ref.alpha_key : ref.alpha_value;
    CHECK(double(bf16_to_float(meta)) == Approx(want_alpha).epsilon(0x1p-8));
    const auto yref = uniform_decode64<N>(codes, double(bf16_to_float(meta)), g, ctx.seed);
    std::vector<float> y(N);
    C::decode(payload.data(), meta, y.data(), ctx);
    const double xn = std::sqrt(dot64(x.data(), x.data(), N));
    for (int i = 0; i < N; ++i)
      CHECK(double(y[std::size_t(i)]) ==
            Approx(yref[std::size_t(i)]).margin(1e-5 * xn / std::sqrt(double(N))));
    // The attention path: q·k_hat through prepare_query + dot.
    auto q = gaussian(rng, N);
    std::vector<float> qp(N);
    C::prepare_query(q.data(), qp.data(), ctx);
    double want_dot = 0;
    for (int i = 0; i < N; ++i) want_dot += double(q[std::size_t(i)]) * yref[std::size_t(i)];
    const double qn = std::sqrt(dot64(q.data(), q.data(), N));
    CHECK(double(C::dot(qp.data(), payload.data(), meta)) ==
          Approx(want_dot).margin(2e-6 * qn * xn));
  }
  CHECK(far_mismatches == 0);
  CHECK(boundary_mismatches <= 2);
  if (N >= g.clip_checked_from_dim) CHECK(clipped > 0);  // the clip region is exercised
}

}  // namespace codec_test
