// SPDX-License-Identifier: Apache-2.0
// Seeded randomized Walsh–Hadamard rotation R = H·D (D: +-1 signs from a seed, H: the
// Walsh–Hadamard matrix), O(d log d), in place, float32, no tables: device code
// regenerates the signs from (seed, index) with one splitmix64 per 64 coordinates.
#pragma once

#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// Whether N is a power of two (the rotation's sizes).
template <int N>
inline constexpr bool is_power_of_two = N > 0 && (N & (N - 1)) == 0;

namespace detail {
template <int N>
inline constexpr int log2_of = N <= 1 ? 0 : 1 + log2_of<N / 2>;
}  // namespace detail

/// Signs of coordinates [64*block, 64*block + 64): bit i%64 set means D_ii = -1.
TIERKV_HD_INLINE constexpr std::uint64_t rotation_sign_word(std::uint64_t seed, int block) {
  return mix64(seed ^ (0xd1b54a32d192ed03ull * std::uint64_t(block + 1)));
}
/// Whether D_ii = -1 for seed.
TIERKV_HD_INLINE constexpr bool rotation_sign_negative(std::uint64_t seed, int i) {
  return ((rotation_sign_word(seed, i >> 6) >> (i & 63)) & 1u) != 0;
}

/// x <- D x: flips sign bits, exact.
template <int N>
TIERKV_HD_INLINE void apply_rotation_signs(float* x, std::uint64_t seed) {
  for (int b = 0; b < (N + 63) / 64; ++b) {
    const std::uint64_t w = rotation_sign_word(seed, b);
    const int end = (b + 1) * 64 < N ? (b + 1) * 64 : N;
    for (int i = b * 64; i < end; ++i)
      x[i] = detail::bits_float(detail::float_bits(x[i]) ^
                                (std::uint32_t((w >> (i & 63)) & 1u) << 31));
  }
}

/// x <- H_N x with the unnormalized +-1 Hadamard matrix (H_N^2 = N·I). Stages run with
/// stride 1, 2, 4, ..., N/2; in each butterfly the lower index gets a + b and the upper
/// a - b. Only additions, so no FMA contraction can change the result, and any device
/// mapping that keeps the stage order (in-register strides, then shuffles) is bit-exact.
template <int N>
TIERKV_HD_INLINE void walsh_hadamard_unnormalized(float* x) {
  static_assert(is_power_of_two<N>, "walsh_hadamard: the size must be a power of two");
  for (int h = 1; h < N; h <<= 1)
    for (int i = 0; i < N; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

/// The orthonormal rotation of the codecs, for callers that want it plain:
/// forward: x <- H D x / sqrt(N);   inverse: x <- D H x / sqrt(N)  (= R^T x).
template <int N>
struct randomized_hadamard {
  static_assert(is_power_of_two<N>, "randomized_hadamard: N must be a power of two");
  static constexpr int size = N;  ///< vector length

  /// x <- H D x / sqrt(N).
  TIERKV_HD static void forward(float* x, std::uint64_t seed) {
    apply_rotation_signs<N>(x, seed);
    walsh_hadamard_unnormalized<N>(x);
    scale(x);
  }
  /// x <- D H x / sqrt(N).
  TIERKV_HD static void inverse(float* x, std::uint64_t seed) {
    walsh_hadamard_unnormalized<N>(x);
    scale(x);
    apply_rotation_signs<N>(x, seed);
  }

 private:
  TIERKV_HD static void scale(float* x) {
    // 1/sqrt(N) = 2^(-log2 N / 2); exact for even log2 N, one rounding otherwise.
    int lg = 0;
    while ((1 << lg) < N) ++lg;
    const float s = (lg % 2 == 0) ? detail::exp2i(-lg / 2)
                                  : detail::exp2i(-(lg + 1) / 2) * 1.41421356237309505f;
    for (int i = 0; i < N; ++i) x[i] *= s;
  }
};

/// The attention domain of the rotated codecs (TQ3, int8_rotated), which store codes of
/// z = H_un D x (up to a per-vector scale): a query prepared as q'' = H_un D q / N gives
/// q . x_hat = scale * sum q''_i c_i, and an accumulator of p * scale * c maps back with
/// D H_un / N once per partial state (linear, so it commutes with merges of states of the same
/// codec and seed). 1/N is a power of two: exact.
template <int N>
struct rotated_domain {
  static_assert(is_power_of_two<N>, "rotated_domain: N must be a power of two");
  /// out <- H_un D q / N (out may be q).
  TIERKV_HD static void prepare_query(const float* q, float* out, std::uint64_t seed) {
    if (out != q)
      for (int i = 0; i < N; ++i) out[i] = q[i];
    apply_rotation_signs<N>(out, seed);
    walsh_hadamard_unnormalized<N>(out);
    scale_by_inverse_dim(out);
  }
  /// acc <- D H_un acc / N.
  TIERKV_HD static void finalize(float* acc, std::uint64_t seed) {
    walsh_hadamard_unnormalized<N>(acc);
    scale_by_inverse_dim(acc);
    apply_rotation_signs<N>(acc, seed);
  }

 private:
  TIERKV_HD static void scale_by_inverse_dim(float* x) {
    const float s = detail::exp2i(-detail::log2_of<N>);
    for (int i = 0; i < N; ++i) x[i] *= s;
  }
};

}  // namespace tierkv
