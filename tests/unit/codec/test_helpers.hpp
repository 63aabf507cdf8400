// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the codec tests: deterministic random vectors and float64 references.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "tierkv/codec/error_traits.hpp"
#include "tierkv/formats.hpp"

namespace codec_test {

using tierkv::detail::gaussian_source;

inline std::vector<float> gaussian(gaussian_source& rng, int n, double scale = 1.0) {
  std::vector<float> x(std::size_t(n), 0.0f);
  for (auto& v : x) v = float(rng.next() * scale);
  return x;
}

inline double dot64(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return s;
}

inline bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

}  // namespace codec_test
