// SPDX-License-Identifier: Apache-2.0
// The rotated encoders' power-of-two scaling start and a correctly rounded division by one
// narrow divisor (FP8 scales, int8_rotated steps).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/codec/float_bits.hpp"
#include "tierkv/cuda/warp/lane_group.cuh"
namespace tierkv::cuda::detail {

// ---- scaling and division ------------------------------------------------------------------

// The rotated encoders' start (tq_codec / int8_rotated_codec::encode): the vector's largest
// magnitude amax (clipped at `limit`: the host's clipped amax), finiteness, k with amax 2^k in
// [1, 2), and z_r = scale_pow2(x_r scale clipped to +-limit, k). Commonly one multiply per
// element: by 2^k, or for a factored vector by S = scale 2^k (exact and normal, as FP8 code
// values h_r in [2^-9, 448] give S in (2^-9, 2^10], and h_r S is the host's one rounding of
// h_r scale 2^k). A vector that clips, or an unfactored one whose k lies outside the normal
// exponent range (two multiplies), switches the warp to the host's sequence (warp-uniform). A
// zero or non-finite vector (not coded) runs on substitute numbers.
struct rotated_start {
  bool finite, coded;
  int k;
};
template <int G, int N, bool F, bool S>
__device__ __forceinline__ rotated_start rotated_input(const lane_vector<N, F, S>& v, float limit,
                                                       float (&z)[N]) {
  const std::uint32_t mbits = group_max_bits<G>(v.max_bits);
  float amax = __uint_as_float(mbits);
  if constexpr (F) amax *= fabsf(v.scale);  // max |x_r scale|: exact products, monotone
  const bool finite = mbits < inf_bits && (__float_as_uint(amax) & 0x7fffffffu) < inf_bits;
  const bool coded = finite && amax != 0.0f;
  const int k = tierkv::detail::unit_exponent(coded ? fminf(amax, limit) : 1.0f);
  const int k1 = k > 127 ? 127 : (k < -126 ? -126 : k);
  const float e1 = tierkv::detail::exp2i(k1), e2 = tierkv::detail::exp2i(k - k1);
  const float xs = F ? tierkv::detail::scale_pow2(v.scale, k) : e1;
  if (warp_any<G>(coded && (amax > limit || (!F && k != k1)))) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      const float x = F ? v.x[r] * v.scale : v.x[r];
      z[r] = fmaxf(fminf(x, limit), -limit) * e1 * e2;  // e2 = 1 where k is in range: exact
    }
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) z[r] = v.x[r] * xs;
  }
  return {finite, coded, k};
}

// a / b correctly rounded, for one divisor b > 0 with an 8-bit significand (a bf16 value times
// a power of two: FP8 scales, int8_rotated steps) and many a: q = a*y with y = RN(1/b), one
// exact fmaf remainder, q + r*y, and the sign of a (so -0 stays -0). Equal to a / b for all
// 2^23 x 2^7 significand pairs (checked exhaustively on the host); scale-invariant, so exact
// while no step under- or overflows: b in [2^-100, 2^125] and |a| <= 2^127 (where |a / b| <
// 2^-11 the quotient may differ in its last bits, which both callers round to a zero code of
// a's sign). Other divisors take the IEEE division.
struct narrow_divisor {
  float b, y;
  bool fast;
  __device__ static narrow_divisor of(float divisor) {
    return {divisor, __frcp_rn(divisor), divisor >= 0x1p-100f && divisor <= 0x1p125f};
  }
  template <bool Fast>
  __device__ __forceinline__ float divide(float a) const {
    if constexpr (!Fast) {
      return __fdiv_rn(a, b);
    } else {
      const float q = __fmul_rn(a, y);
      const float q1 = fmaf(fmaf(-b, q, a), y, q);
      return __uint_as_float((__float_as_uint(q1) & 0x7fffffffu) |
                             (__float_as_uint(a) & 0x80000000u));
    }
  }
};

}  // namespace tierkv::cuda::detail
