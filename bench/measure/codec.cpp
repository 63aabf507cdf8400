// SPDX-License-Identifier: Apache-2.0
// scripts/measure codec: codec fidelity on N(0,1) vectors (EVALUATION.md §1).
//   TQ3 relative MSE (>= 10^5 vectors) at d = 64/128/256 for each norm correction;
//   inner-product bias / rms / gain of (q·k_hat − q·k)/(|q||k|) with q = k + g;
//   FP8 E4M3 / E5M2 max relative error over every float in the normal range;
//   bits per scalar of each codec at each head_dim.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "measure_common.hpp"
#include "tierkv/codec/error_traits.hpp"
#include "tierkv/formats.hpp"

using namespace tierkv;

namespace {

constexpr int kMseVectors = 100000;
constexpr int kIpVectors = 100000;

template <fp8_kind K>
double fp8_max_rel_err() {
  using F = fp8_format<K>;
  double worst = 0;
  const std::uint32_t hi = detail::float_bits(F::max_value);
  for (std::uint32_t b = F::min_normal_bits; b <= hi; ++b) {
    const float x = detail::bits_float(b);
    const float y = fp8_to_float<K>(float_to_fp8<K>(x));
    const double e = std::fabs(double(y) - double(x)) / double(x);
    worst = e > worst ? e : worst;
  }
  return worst;
}

template <class Family, int D>
void tq3_row(measure::report& rep, const char* fam) {
  using C = codec_for<Family, D>;
  const auto ms = measure_relative_mse<C>(kMseVectors, 1000 + D);
  const auto ip = measure_inner_product_error<C>(kIpVectors, 2000 + D);
  std::printf("%-10s %4d %10.5f %10.4f %+11.5f %9.5f %8.5f %8.4f\n", fam, D, ms.rel_mse,
              ms.max_rel_mse, ip.bias, ip.rms, ip.gain, bits_per_scalar<C>);
  const std::string sfx = std::string(fam) + "_d" + std::to_string(D);
  rep.metric(sfx + "_rel_mse", ms.rel_mse);
  rep.metric(sfx + "_ip_bias", ip.bias);
  rep.metric(sfx + "_ip_rms", ip.rms);
  rep.metric(sfx + "_ip_gain", ip.gain);
}

template <class Family, int D>
void small_row(measure::report& rep, const char* fam) {
  using C = codec_for<Family, D>;
  const auto ms = measure_relative_mse<C>(20000, 3000 + D);
  const auto ip = measure_inner_product_error<C>(20000, 4000 + D);
  std::printf("%-10s %4d %10.6f %10.4f %+11.5f %9.5f %8.5f %8.4f\n", fam, D, ms.rel_mse,
              ms.max_rel_mse, ip.bias, ip.rms, ip.gain, bits_per_scalar<C>);
  const std::string sfx = std::string(fam) + "_d" + std::to_string(D);
  rep.metric(sfx + "_rel_mse", ms.rel_mse);
  rep.metric(sfx + "_ip_rms", ip.rms);
  rep.metric(sfx + "_bits_per_scalar", bits_per_scalar<C>);
}

}  // namespace

int main() {
  const auto t0 = std::chrono::steady_clock::now();
  measure::report rep("codec");
  std::printf("codec fidelity on N(0,1) vectors; inner products with q = k + g (g ~ N(0,1))\n");
  std::printf("TQ3: %d vectors for MSE, %d for inner products; FP8/bf16: 20000\n", kMseVectors,
              kIpVectors);
  std::printf("%-10s %4s %10s %10s %11s %9s %8s %8s\n", "codec", "d", "rel_mse", "max_vec",
              "ip_bias", "ip_rms", "ip_gain", "bits");
  tq3_row<tq3_value, 64>(rep, "tq3_value");
  tq3_row<tq3_value, 128>(rep, "tq3_value");
  tq3_row<tq3_value, 256>(rep, "tq3_value");
  tq3_row<tq3_key, 64>(rep, "tq3_key");
  tq3_row<tq3_key, 128>(rep, "tq3_key");
  tq3_row<tq3_key, 256>(rep, "tq3_key");
  tq3_row<tq3_plain, 64>(rep, "tq3_plain");
  tq3_row<tq3_plain, 128>(rep, "tq3_plain");
  tq3_row<tq3_plain, 256>(rep, "tq3_plain");
  small_row<fp8_e4m3, 64>(rep, "fp8_e4m3");
  small_row<fp8_e4m3, 128>(rep, "fp8_e4m3");
  small_row<fp8_e4m3, 256>(rep, "fp8_e4m3");
  small_row<fp8_e5m2, 128>(rep, "fp8_e5m2");
  small_row<dense_bf16, 128>(rep, "dense_bf16");
  small_row<int8_rotated, 128>(rep, "int8_rotated");
  small_row<tq4_key, 64>(rep, "tq4_key");
  small_row<tq4_key, 128>(rep, "tq4_key");
  small_row<tq4_key, 256>(rep, "tq4_key");
  small_row<tq4_value, 128>(rep, "tq4_value");
  small_row<tq2_key, 64>(rep, "tq2_key");
  small_row<tq2_key, 128>(rep, "tq2_key");
  small_row<tq2_key, 256>(rep, "tq2_key");
  small_row<tq2_value, 64>(rep, "tq2_value");
  small_row<tq2_value, 128>(rep, "tq2_value");
  small_row<tq2_value, 256>(rep, "tq2_value");

  const double e4 = fp8_max_rel_err<fp8_kind::e4m3>();
  const double e5 = fp8_max_rel_err<fp8_kind::e5m2>();
  std::printf(
      "\nFP8 max relative error over every float in the normal range: E4M3 %.6f "
      "(bound 2^-4 = 0.0625), E5M2 %.6f (bound 2^-3)\n",
      e4, e5);

  std::printf("\nbits per scalar (payload + meta):\n%-12s %8s %8s %8s %8s\n", "codec", "d=64",
              "d=128", "d=256", "d=512");
  std::printf("%-12s %8.4f %8.4f %8.4f %8.4f\n", "tq3", bits_per_scalar<tq3_key::bind<64>>,
              bits_per_scalar<tq3_key::bind<128>>, bits_per_scalar<tq3_key::bind<256>>,
              bits_per_scalar<tq3_key::bind<512>>);
  std::printf("%-12s %8.4f %8.4f %8.4f %8.4f\n", "fp8", bits_per_scalar<fp8_e4m3::bind<64>>,
              bits_per_scalar<fp8_e4m3::bind<128>>, bits_per_scalar<fp8_e4m3::bind<256>>,
              bits_per_scalar<fp8_e4m3::bind<512>>);
  std::printf("%-12s %8.4f %8.4f %8.4f %8.4f\n", "dense_bf16",
              bits_per_scalar<dense_bf16::bind<64>>, bits_per_scalar<dense_bf16::bind<128>>,
              bits_per_scalar<dense_bf16::bind<256>>, bits_per_scalar<dense_bf16::bind<512>>);

  // The headline metrics (EVALUATION.md §1): TQ3 MSE is the value codec's (tq3_value),
  // the inner-product bias the key codec's (tq3_key).
  double mse64 = 0, mse128 = 0, mse256 = 0, bias128 = 0;
  {
    mse64 = measure_relative_mse<tq3_value::bind<64>>(kMseVectors, 1000 + 64).rel_mse;
    mse128 = measure_relative_mse<tq3_value::bind<128>>(kMseVectors, 1000 + 128).rel_mse;
    mse256 = measure_relative_mse<tq3_value::bind<256>>(kMseVectors, 1000 + 256).rel_mse;
    bias128 = measure_inner_product_error<tq3_key::bind<128>>(kIpVectors, 2000 + 128).bias;
  }
  rep.metric("tq3_rel_mse_d64", mse64);
  rep.metric("tq3_rel_mse_d128", mse128);
  rep.metric("tq3_rel_mse_d256", mse256);
  rep.metric("tq3_ip_bias_d128", bias128);
  rep.metric("fp8_e4m3_max_rel_err", e4);
  rep.metric("fp8_e5m2_max_rel_err", e5);
  rep.metric("tq3_bits_per_scalar_d64", bits_per_scalar<tq3_key::bind<64>>);
  rep.metric("tq3_bits_per_scalar_d128", bits_per_scalar<tq3_key::bind<128>>);
  rep.metric("tq3_bits_per_scalar_d256", bits_per_scalar<tq3_key::bind<256>>);
  rep.metric("fp8_bits_per_scalar_d64", bits_per_scalar<fp8_e4m3::bind<64>>);
  rep.metric("fp8_bits_per_scalar_d128", bits_per_scalar<fp8_e4m3::bind<128>>);
  rep.metric("fp8_bits_per_scalar_d256", bits_per_scalar<fp8_e4m3::bind<256>>);
  rep.metric("dense_bf16_bits_per_scalar_d128", bits_per_scalar<dense_bf16::bind<128>>);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "\ntarget: tq3_rel_mse <= 0.0350 at every d; |tq3_ip_bias| ~ 0; fp8_e4m3_max_rel_err <= "
      "0.0625  (%.1f s)\n",
      secs);
  rep.emit();
  return 0;
}
