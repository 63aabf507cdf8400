// SPDX-License-Identifier: Apache-2.0
// The query of an int8 key product (the tensor-core decode scores TQ3, TQ4 and int8_rotated
// keys with int8 x int8 mma, cuda/decode/tensor_core.cuh): per head, with 2^(e-1) <= max|q| <
// 2^e, Q = rint(q · 2^(bits - e)) has |Q| < 2^bits, bits = 7P - 1, and is written as P balanced
// base-128 digits, each an int8: Q = sum_p 128^p d_p exactly, d_p in [-64, 63] below the top
// digit, the top in [-64, 64]. Each digit multiplies the int8 key levels in its own int32
// accumulator (exact), and the score is the sum of 128^p times those.
#pragma once

#include "tierkv/core/config.hpp"

namespace tierkv {

/// Bits of the integer query written as P int8 digits (7P - 1).
template <int P>
inline constexpr int int8_query_bits = 7 * P - 1;

/// The digits of q (|q| < 2^int8_query_bits<P>), lowest first.
template <int P>
TIERKV_HD_INLINE void int8_query_digits(int q, int (&d)[P]) {
  static_assert(P >= 1 && P <= 4,
                "int8_query_digits: 1 to 4 digits (the digit sums stay in int32)");
  for (int p = 0; p < P; ++p) {  // P is a constant: unrolled
    d[p] = p + 1 < P ? ((q + 64) & 127) - 64 : q;
    q = (q - d[p]) >> 7;  // exact: q - d[p] is a multiple of 128
  }
}

}  // namespace tierkv
