// SPDX-License-Identifier: Apache-2.0
// The seeded randomized Walsh–Hadamard rotation against an explicit float64 matrix.
#include <bit>
#include <cmath>
#include <vector>

#include "catch.hpp"
#include "test_helpers.hpp"
#include "tierkv/codec/rotation.hpp"

using namespace tierkv;

namespace {

template <int N>
void check_rotation(std::uint64_t seed) {
  codec_test::gaussian_source rng(seed);
  for (int v = 0; v < 20; ++v) {
    auto x = codec_test::gaussian(rng, N);
    // float64 reference: y = H D x / sqrt(N), H_ij = (-1)^popcount(i & j).
    std::vector<double> want(N, 0.0);
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) {
        const double dj = rotation_sign_negative(seed, j) ? -1.0 : 1.0;
        const double h = (std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0;
        want[std::size_t(i)] += h * dj * double(x[std::size_t(j)]);
      }
    auto y = x;
    randomized_hadamard<N>::forward(y.data(), seed);
    double nx = 0, ny = 0;
    for (int i = 0; i < N; ++i) {
      CHECK(double(y[std::size_t(i)]) ==
            Approx(want[std::size_t(i)] / std::sqrt(double(N))).margin(1e-5));
      nx += double(x[std::size_t(i)]) * x[std::size_t(i)];
      ny += double(y[std::size_t(i)]) * y[std::size_t(i)];
    }
    CHECK(ny == Approx(nx).epsilon(1e-5));  // orthogonal
    randomized_hadamard<N>::inverse(y.data(), seed);
    for (int i = 0; i < N; ++i)
      CHECK(double(y[std::size_t(i)]) == Approx(double(x[std::size_t(i)])).margin(1e-5));
  }
}

}  // namespace

TEST_CASE("rotation: forward equals the float64 matrix H D / sqrt(N); inverse undoes it",
          "[rotation]") {
  check_rotation<32>(1);
  check_rotation<64>(2);
  check_rotation<128>(0xDEADBEEFull);
  check_rotation<256>(4);
  check_rotation<512>(5);
}

TEST_CASE("rotation: signs are deterministic, seed-dependent and balanced", "[rotation]") {
  int negative = 0, differ = 0;
  for (int i = 0; i < 4096; ++i) {
    negative += rotation_sign_negative(42, i);
    differ += rotation_sign_negative(42, i) != rotation_sign_negative(43, i);
    CHECK(rotation_sign_negative(42, i) == rotation_sign_negative(42, i));
  }
  CHECK(negative > 1900);
  CHECK(negative < 2196);
  CHECK(differ > 1900);
  CHECK(differ < 2196);
  // The unnormalized transform applied twice is N times the identity (exact for small ints).
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[std::size_t(i)] = float(i % 7 - 3);
  auto y = x;
  walsh_hadamard_unnormalized<64>(y.data());
  walsh_hadamard_unnormalized<64>(y.data());
  for (int i = 0; i < 64; ++i) CHECK(y[std::size_t(i)] == 64.0f * x[std::size_t(i)]);
}
