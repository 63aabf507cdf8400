// SPDX-License-Identifier: Apache-2.0
// Round-trips one vector through the FP8 E4M3 and TQ3 codecs of the packaged headers and checks
// the reconstruction error; non-zero exit on any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tierkv/codec/codec.hpp>
#include <tierkv/codec/fp8.hpp>
#include <tierkv/codec/tq3.hpp>
#include <tierkv/core/status.hpp>
#include <vector>

namespace {

constexpr int kDim = 128;

// Relative squared error |y - x|^2 / |x|^2 of one encode + decode, or -1 when encode refuses.
template <class C>
double round_trip(const std::vector<float>& x) {
  std::vector<std::uint8_t> payload(C::payload_bytes);
  typename C::meta_type meta{};
  const tierkv::codec_context ctx = tierkv::make_codec_context(7, 0, 0, tierkv::kv_role::value);
  if (C::encode(x.data(), payload.data(), meta, ctx, nullptr) != tierkv::errc::ok) return -1;
  std::vector<float> y(kDim);
  C::decode(payload.data(), meta, y.data(), ctx);
  double err = 0, norm = 0;
  for (int i = 0; i < kDim; ++i) {
    const double d = double(y[std::size_t(i)]) - double(x[std::size_t(i)]);
    err += d * d;
    norm += double(x[std::size_t(i)]) * double(x[std::size_t(i)]);
  }
  return err / norm;
}

}  // namespace

int main() {
  std::mt19937 rng(26);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(kDim);
  for (float& v : x) v = normal(rng);

  using fp8 = tierkv::codec_for<tierkv::fp8_e4m3, kDim>;
  using tq3 = tierkv::codec_for<tierkv::tq3_value, kDim>;
  static_assert(fp8::payload_bytes == kDim && tq3::payload_bytes == kDim * 3 / 8);
  const double e_fp8 = round_trip<fp8>(x);
  const double e_tq3 = round_trip<tq3>(x);
  // FP8 E4M3: 3 mantissa bits, relative MSE about 1e-3 on a Gaussian vector; TQ3: about 0.034
  // (README). The bounds leave room without letting a broken codec pass.
  const bool ok = e_fp8 >= 0 && e_fp8 < 5e-3 && e_tq3 >= 0 && e_tq3 < 0.06;
  std::printf("tierkv test_package: relative MSE fp8_e4m3 %.5f, tq3 %.4f: %s\n", e_fp8, e_tq3,
              ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
