// SPDX-License-Identifier: Apache-2.0
// bfloat16 as raw bits (std::uint16_t): the storage type of FP8 scales, TQ3 norms
// and the dense_bf16 payload (docs/formats.md). Integer-only conversions, so host
// and device produce the same bits without cuda_bf16.h.
#pragma once

#include <cstdint>

#include "tierkv/codec/float_bits.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// The bits of a bfloat16 value (the metadata scalars of FP8, TQ3, TQ4, int8_rotated).
using bf16_bits = std::uint16_t;

inline constexpr bf16_bits bf16_max_finite = 0x7F7F;  ///< 3.3895e38
inline constexpr bf16_bits bf16_quiet_nan = 0x7FC0;   ///< a quiet NaN (poisoned metadata)
inline constexpr bf16_bits bf16_one = 0x3F80;         ///< 1.0

/// The float value of bf16 bits (exact).
TIERKV_HD_INLINE float bf16_to_float(bf16_bits b) {
  return detail::bits_float(std::uint32_t(b) << 16);
}

/// Round to nearest, ties to even (NaN stays a quiet NaN; overflow gives +-Inf).
TIERKV_HD_INLINE bf16_bits float_to_bf16(float x) {
  const std::uint32_t u = detail::float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_bits((u >> 16) | 0x0040u);
  return bf16_bits((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// Round to nearest even, but a finite input never becomes Inf: it saturates to the
/// largest finite bf16 (and *saturated is set). Input must not be NaN.
TIERKV_HD_INLINE bf16_bits float_to_bf16_satfinite(float x, bool* saturated) {
  bf16_bits b = float_to_bf16(x);
  if ((b & 0x7FFFu) == 0x7F80u && detail::is_finite_bits(x)) {
    b = bf16_bits((b & 0x8000u) | bf16_max_finite);
    if (saturated) *saturated = true;
  }
  return b;
}

/// Smallest bf16 >= x, for finite x >= 0 (FP8 scales are rounded up so that
/// max|x| / scale never exceeds the format's maximum).
TIERKV_HD_INLINE bf16_bits float_to_bf16_up(float x) {
  const std::uint32_t u = detail::float_bits(x);
  const std::uint32_t hi = u >> 16;
  return bf16_bits((u & 0xFFFFu) != 0u ? hi + 1u : hi);
}

}  // namespace tierkv
