// SPDX-License-Identifier: Apache-2.0
// Float64 references of the rotated codecs (TQ3, TQ4, int8_rotated): the rotation H D x and
// the decode D H (alpha c) / N, written from the definitions (no fast transform).
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

#include "tierkv/codec/rotation.hpp"

namespace codec_test {

// H D x in float64 (unnormalized H).
template <int N> std::vector<double> hd64(const std::vector<double>& x, std::uint64_t seed) {
  std::vector<double> y(N, 0.0);
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      y[std::size_t(i)] += ((std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) *
                           (tierkv::rotation_sign_negative(seed, j) ? -1.0 : 1.0) * x[std::size_t(j)];
  return y;
}

// D H (alpha c) / N in float64: the decoded vector from the scaled levels alpha * c_j.
template <int N> std::vector<double> rotated_decode64(const std::vector<double>& scaled_levels, std::uint64_t seed) {
  std::vector<double> y(N, 0.0);
  for (int i = 0; i < N; ++i) {
    double s = 0;
    for (int j = 0; j < N; ++j)
      s += ((std::popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) * scaled_levels[std::size_t(j)];
    y[std::size_t(i)] = (tierkv::rotation_sign_negative(seed, i) ? -1.0 : 1.0) * s / double(N);
  }
  return y;
}

}  // namespace codec_test
