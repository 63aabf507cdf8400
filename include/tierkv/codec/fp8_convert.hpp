// SPDX-License-Identifier: Apache-2.0
// Bit-exact float <-> FP8 (E4M3 "fn" and E5M2) conversions without cuda_fp8.h.
// float -> FP8 rounds to nearest even and saturates to the largest finite code, exactly
// like cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...): +-Inf -> +-max,
// NaN -> 0x7F (the canonical NaN cuda_fp8.h's conversion produces).
#pragma once

#include <cstdint>

#include "tierkv/codec/float_bits.hpp"
#include "tierkv/core/config.hpp"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace tierkv {

/// The two OCP FP8 formats.
enum class fp8_kind : std::uint8_t { e4m3, e5m2 };

/// Parameters of the two OCP FP8 formats as NVIDIA implements them.
template <fp8_kind K>
struct fp8_format;
/// E4M3: 4 exponent bits, 3 mantissa bits, max 448, no Inf.
template <>
struct fp8_format<fp8_kind::e4m3> {
  static constexpr int mantissa_bits = 3;                        ///< mantissa bits
  static constexpr int exponent_bias = 7;                        ///< exponent bias
  static constexpr std::uint8_t max_code = 0x7E;                 ///< 448; 0x7F is NaN, no Inf
  static constexpr float max_value = 448.0f;                     ///< largest finite value
  static constexpr std::uint32_t overflow_bits = 0x44000000u;    ///< 512: exponent beyond range
  static constexpr std::uint32_t min_normal_bits = 0x3C800000u;  ///< 2^-6
  static constexpr std::uint32_t underflow_bits =
      0x3A800000u;                               ///< 2^-10 = half the least subnormal
  static constexpr int subnormal_exponent = -9;  ///< subnormal = m * 2^-9
  static constexpr const char* name = "e4m3";    ///< the format's name
};
/// E5M2: 5 exponent bits, 2 mantissa bits, max 57344, with Inf.
template <>
struct fp8_format<fp8_kind::e5m2> {
  static constexpr int mantissa_bits = 2;                        ///< mantissa bits
  static constexpr int exponent_bias = 15;                       ///< exponent bias
  static constexpr std::uint8_t max_code = 0x7B;                 ///< 57344; 0x7C Inf, above NaN
  static constexpr float max_value = 57344.0f;                   ///< largest finite value
  static constexpr std::uint32_t overflow_bits = 0x47800000u;    ///< 65536
  static constexpr std::uint32_t min_normal_bits = 0x38800000u;  ///< 2^-14
  static constexpr std::uint32_t underflow_bits = 0x37000000u;   ///< 2^-17
  static constexpr int subnormal_exponent = -16;                 ///< subnormal = m * 2^-16
  static constexpr const char* name = "e5m2";                    ///< the format's name
};

namespace detail {

/// The portable conversion: float bits -> code, integer arithmetic only.
template <fp8_kind K>
TIERKV_HD constexpr std::uint8_t float_to_fp8_portable(float x) {
  using F = fp8_format<K>;
  constexpr int mb = F::mantissa_bits;
  const std::uint32_t u = float_bits(x);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  const std::uint8_t sign = std::uint8_t((u >> 24) & 0x80u);
  if (a > 0x7F800000u) return 0x7F;                                    // NaN (canonical, positive)
  if (a >= F::overflow_bits) return std::uint8_t(sign | F::max_code);  // includes Inf
  if (a <= F::underflow_bits) return sign;                             // rounds to (signed) zero
  if (a >= F::min_normal_bits) {
    const std::uint32_t e = (a >> 23) - 127u + std::uint32_t(F::exponent_bias);
    const std::uint32_t drop = 23u - std::uint32_t(mb);
    std::uint32_t r = (e << mb) | ((a >> drop) & ((1u << mb) - 1u));
    const std::uint32_t rem = a & ((1u << drop) - 1u);
    const std::uint32_t half = 1u << (drop - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;  // a carry moves into the exponent
    if (r > F::max_code) r = F::max_code;              // (max, next binade) -> max
    return std::uint8_t(sign | r);
  }
  // Subnormal target: value in units of 2^subnormal_exponent is sig * 2^(e - 150 - se).
  const std::uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = std::uint32_t(150 + F::subnormal_exponent) - (a >> 23);
  std::uint32_t r = sig >> shift;
  const std::uint32_t rem = sig & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;  // may become the least normal
  return std::uint8_t(sign | r);
}

}  // namespace detail

/// float -> FP8 code. On sm_89+ devices the hardware conversion is used (the CUDA test
/// proves it equals the portable one over all 2^32 inputs).
template <fp8_kind K>
TIERKV_HD_INLINE std::uint8_t float_to_fp8(float x) {
#if TIERKV_DEVICE_PASS && (__CUDA_ARCH__ >= 890)
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, K == fp8_kind::e4m3 ? __NV_E4M3 : __NV_E5M2);
#else
  return detail::float_to_fp8_portable<K>(x);
#endif
}

/// FP8 code -> float, exact. E4M3 0x7F/0xFF and E5M2 NaN codes give NaN; E5M2 Inf codes +-Inf.
template <fp8_kind K>
TIERKV_HD constexpr float fp8_to_float(std::uint8_t c) {
  using F = fp8_format<K>;
  constexpr int mb = F::mantissa_bits;
  const std::uint32_t sign = std::uint32_t(c & 0x80u) << 24;
  const std::uint32_t e = (c & 0x7Fu) >> mb;
  const std::uint32_t m = c & ((1u << mb) - 1u);
  if constexpr (K == fp8_kind::e4m3) {
    if ((c & 0x7Fu) == 0x7Fu) return detail::bits_float(0x7FC00000u);
  } else {
    if (e == 31u) return detail::bits_float(m == 0u ? (sign | 0x7F800000u) : 0x7FC00000u);
  }
  if (e == 0u) {
    // m * 2^subnormal_exponent, exact (m < 8 is exactly representable).
    const float v = float(m) * detail::exp2i(F::subnormal_exponent);
    return detail::bits_float(detail::float_bits(v) | sign);
  }
  return detail::bits_float(sign | ((e + 127u - std::uint32_t(F::exponent_bias)) << 23) |
                            (m << (23 - mb)));
}

/// The float value of every FP8 code of format K (host decode table).
template <fp8_kind K>
struct fp8_decode_table {
  float value[256];  ///< value[c] = fp8_to_float<K>(c)
  constexpr fp8_decode_table() : value{} {
    for (int c = 0; c < 256; ++c) value[c] = fp8_to_float<K>(std::uint8_t(c));
  }
};
/// Host-side lookup table (256 floats) for the CPU dot product and accumulate loops.
template <fp8_kind K>
inline constexpr fp8_decode_table<K> fp8_table{};

}  // namespace tierkv
