// SPDX-License-Identifier: Apache-2.0
// The warpgroup MMA primitives (cuda/arch/wgmma.cuh) against float64: S = Q K^T on f16 operands
// from shared memory and O = P V with P in bf16 registers, over the no-swizzle K-major layout (and
// the MN-major one for V) and descriptors, on random and adversarial values (zeros, the formats'
// largest finite values and subnormals, signs alternating). On a mismatch the test also runs the
// descriptors with the two byte offsets exchanged and says whether that reading matched.
#include "catch.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <cuda_fp16.h>

#include "cuda_test.hpp"
#include "tierkv/codec/bf16.hpp"
#include "wgmma_kernels.hpp"

namespace {

using cuda_test::device_buffer;

constexpr int M = 64, N = 32, D = 256;

std::uint16_t half_bits(float x) {
  const __half h = __float2half_rn(x);
  return *reinterpret_cast<const std::uint16_t*>(&h);
}
double half_value(std::uint16_t b) { return double(__half2float(*reinterpret_cast<__half*>(&b))); }

// Values for element i: mostly N(0, 1) scaled, with zeros, huge and tiny magnitudes mixed in.
float draw(std::mt19937_64& rng, int i, float huge, float tiny) {
  std::normal_distribution<float> nd(0.f, 1.f);
  switch (i % 37) {
    case 0:
      return 0.f;
    case 1:
      return huge;
    case 2:
      return -huge;
    case 3:
      return tiny;
    default:
      return nd(rng);
  }
}

// max |got - want| / (sum over the product's terms of |a| |b|): f32 accumulation of exact
// products leaves about 2^-23 x K of that bound
template <class Ref>
double worst_relative(const std::vector<float>& got, int rows, int cols, Ref ref) {
  double worst = 0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      double want = 0, scale = 0;
      ref(r, c, want, scale);
      const double g = got[std::size_t(r) * cols + c];
      const double err = std::isfinite(g) ? std::abs(g - want) / (scale > 0 ? scale : 1.0) : 1e30;
      worst = std::max(worst, err);
    }
  return worst;
}

// Runs the product into a fresh buffer and checks it against ref (about 2^-23 x K relative to
// the terms' magnitudes, so 1e-5 for K <= 256); on a mismatch the run with the descriptors'
// byte offsets exchanged says whether the layout was read the other way round.
template <class Run, class Ref>
void check_product(Run run, Ref ref, int rows, int cols, std::uint64_t seed) {
  device_buffer<float> out(std::size_t(rows) * cols);
  run(out.p, false);
  const double err = worst_relative(out.get(), rows, cols, ref);
  double exchanged = -1;  // the diagnostic, run on a mismatch only
  if (err > 1e-5) {
    run(out.p, true);
    exchanged = worst_relative(out.get(), rows, cols, ref);
  }
  INFO("seed " << seed << ": with the byte offsets exchanged " << exchanged << " (-1: not run)");
  CHECK(err <= 1e-5);
}

}  // namespace

TEST_CASE("wgmma: S = Q K^T (m64n32k16 f16, shared-memory descriptors) equals float64",
          "[cuda][wgmma]") {
  if (cuda_test::compute_capability() != 90) {  // sm_90a code runs on sm_90 alone
    WARN("not run: wgmma needs an sm_90 GPU");
    return;
  }
  REQUIRE(cuda_test::wgmma_built());
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    std::vector<std::uint16_t> q(M * D), k(N * D);
    // f16's largest finite value is 65504; huge x huge would overflow f32 only past 1.8e19
    for (int i = 0; i < M * D; ++i) q[std::size_t(i)] = half_bits(draw(rng, i, 6e4f, 6e-8f));
    for (int i = 0; i < N * D; ++i) k[std::size_t(i)] = half_bits(draw(rng, i + 5, 6e4f, 6e-8f));
    device_buffer<std::uint16_t> dq(q), dk(k);
    auto ref = [&](int r, int c, double& want, double& scale) {
      for (int i = 0; i < D; ++i) {
        const double a = half_value(q[std::size_t(r) * D + i]);
        const double b = half_value(k[std::size_t(c) * D + i]);
        want += a * b;
        scale += std::abs(a * b);
      }
    };
    check_product(
        [&](float* s, bool exchanged) { cuda_test::wgmma_scores(dq.p, dk.p, s, exchanged); }, ref,
        M, N, seed);
  }
}

TEST_CASE("wgmma: O = P V (m64n256k16 bf16, P in registers) equals float64", "[cuda][wgmma]") {
  if (cuda_test::compute_capability() != 90) {  // sm_90a code runs on sm_90 alone
    WARN("not run: wgmma needs an sm_90 GPU");
    return;
  }
  REQUIRE(cuda_test::wgmma_built());
  const bool mn_major = GENERATE(false, true);  // V transposed (K-major) or as token rows
  INFO("V " << (mn_major ? "MN-major (transpose flag)" : "K-major"));
  for (std::uint64_t seed : {4u, 5u, 6u}) {
    std::mt19937_64 rng(seed);
    std::vector<std::uint16_t> p(M * N), v(N * D);
    for (int i = 0; i < M * N; ++i)
      p[std::size_t(i)] = tierkv::float_to_bf16(std::abs(draw(rng, i, 1e18f, 1e-38f)));
    for (int i = 0; i < N * D; ++i)
      v[std::size_t(i)] = tierkv::float_to_bf16(draw(rng, i + 3, 1e18f, 1e-38f));
    device_buffer<std::uint16_t> dp(p), dv(v);
    auto ref = [&](int r, int c, double& want, double& scale) {
      for (int i = 0; i < N; ++i) {
        const double a = tierkv::bf16_to_float(p[std::size_t(r) * N + i]);
        const double b = tierkv::bf16_to_float(v[std::size_t(i) * D + c]);
        want += a * b;
        scale += std::abs(a * b);
      }
    };
    check_product(
        [&](float* o, bool exchanged) {
          cuda_test::wgmma_values(dp.p, dv.p, o, exchanged, mn_major);
        },
        ref, M, D, seed);
  }
}
