// SPDX-License-Identifier: Apache-2.0
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tierkv/codec/dense.hpp"

using namespace tierkv;

TEST_CASE("dense_f32 round-trips exactly and rejects non-finite input", "[codec][dense]") {
  using C = codec_for<dense_f32, 64>;
  static_assert(bits_per_scalar<C> == 32.0);
  std::mt19937 rng(1);
  std::normal_distribution<float> n;
  std::vector<float> x(64), y(64), acc(64, 0.f);
  for (auto& v : x) v = n(rng);
  std::vector<std::uint8_t> payload(C::payload_bytes);
  no_meta meta;
  const codec_context ctx = make_codec_context(7, 0, 0, kv_role::key);
  REQUIRE(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::ok);
  C::decode(payload.data(), meta, y.data(), ctx);
  CHECK(x == y);

  double ref = 0;
  for (int i = 0; i < 64; ++i) ref += double(x[size_t(i)]) * x[size_t(i)];
  CHECK(C::dot(x.data(), payload.data(), meta) == Approx(ref).epsilon(1e-5));

  C::accumulate(0.5f, payload.data(), meta, acc.data());
  for (int i = 0; i < 64; ++i) CHECK(acc[size_t(i)] == 0.5f * x[size_t(i)]);

  x[17] = std::numeric_limits<float>::quiet_NaN();
  CHECK(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::non_finite_input);
  x[17] = std::numeric_limits<float>::infinity();
  CHECK(C::encode(x.data(), payload.data(), meta, ctx, nullptr) == errc::non_finite_input);
}

TEST_CASE("codec contexts differ per layer, head and role", "[codec][context]") {
  const auto a = make_codec_context(1, 0, 0, kv_role::key);
  CHECK(a.seed == make_codec_context(1, 0, 0, kv_role::key).seed);
  CHECK(a.seed != make_codec_context(1, 1, 0, kv_role::key).seed);
  CHECK(a.seed != make_codec_context(1, 0, 1, kv_role::key).seed);
  CHECK(a.seed != make_codec_context(1, 0, 0, kv_role::value).seed);
  CHECK(a.seed != make_codec_context(2, 0, 0, kv_role::key).seed);
}
