// SPDX-License-Identifier: Apache-2.0
// Bit-level float helpers shared by the codecs: bit casts, finiteness, exact
// powers of two. Integer-only where possible, so host and device agree bit for bit.
#pragma once

#include <bit>
#include <cstdint>

#include "tierkv/core/config.hpp"

namespace tierkv::detail {

TIERKV_HD_INLINE constexpr std::uint32_t float_bits(float x) {
  return __builtin_bit_cast(std::uint32_t, x);  // std::bit_cast is host-only under nvcc
}

TIERKV_HD_INLINE constexpr float bits_float(std::uint32_t u) {
  return __builtin_bit_cast(float, u);
}

/// Not NaN and not +-Inf, by the exponent field (immune to -ffast-math folding).
TIERKV_HD_INLINE bool is_finite_bits(float x) {
  return (float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

TIERKV_HD_INLINE float abs_bits(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

/// The largest |x_i| of x[0, n) with each |x_i| clipped at `limit` (clipped counts the
/// elements beyond it); false, with amax unspecified, when x holds NaN or Inf.
TIERKV_HD_INLINE bool clipped_amax(const float* x, int n, float limit, float& amax,
                                   std::uint64_t& clipped) {
  amax = 0.0f;
  clipped = 0;
  for (int i = 0; i < n; ++i) {
    if (!is_finite_bits(x[i])) return false;
    float a = abs_bits(x[i]);
    if (a > limit) {
      a = limit;
      ++clipped;
    }
    amax = a > amax ? a : amax;
  }
  return true;
}

/// 2^k as a float for k in [-126, 127] (normal range), built from its bits.
TIERKV_HD_INLINE constexpr float exp2i(int k) { return bits_float(std::uint32_t(k + 127) << 23); }

/// x * 2^k for k in [-252, 254], in at most two exact-power multiplies; each step is
/// exact unless the result leaves the normal range (then IEEE rounding, same on host
/// and device as long as denormals are not flushed).
TIERKV_HD_INLINE float scale_pow2(float x, int k) {
  const int k1 = k > 127 ? 127 : (k < -126 ? -126 : k);
  const int k2 = k - k1;
  float y = x * exp2i(k1);
  if (k2 != 0) y = y * exp2i(k2);
  return y;
}

/// The k with a * 2^k in [1, 2), for finite a > 0 (subnormals included): k in [-127, 149].
TIERKV_HD_INLINE int unit_exponent(float a) {
  const std::uint32_t u = float_bits(a) & 0x7FFFFFFFu;
  const int biased = int(u >> 23);
  if (biased != 0) return 127 - biased;
  // Subnormal: a = m * 2^-149 with m < 2^23; the leading bit of m sits at 31 - clz(m).
  const std::uint32_t m = u & 0x7FFFFFu;
  int top = 0;
  for (std::uint32_t t = m; t > 1; t >>= 1) ++top;
  return 149 - top;
}

}  // namespace tierkv::detail
