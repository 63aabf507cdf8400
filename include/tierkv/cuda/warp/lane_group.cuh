// SPDX-License-Identifier: Apache-2.0
// Vectors held by groups of lanes of a warp (lane_group, lane_vector), warp-uniform votes and
// the reductions whose order is the host codecs' canonical warp order (bit-exact with them).
// Calling convention and the canonical order: see warp/README in docs/gpu.md ("Warp layer").
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>
#include <cstring>

#include "tierkv/codec/float_bits.hpp"
#include "tierkv/cuda/arch/math.cuh"
namespace tierkv::cuda::detail {

inline constexpr unsigned full_warp = 0xffffffffu;

// A vector of D coordinates held N per lane: G lanes, each holding R canonical lanes of P.
template <int D, int N>
struct lane_group {
  static constexpr int G = D / N;
  static constexpr int R = 32 / G;
  static constexpr int P = D / 32;
  static_assert(
      D % 32 == 0 && N * G == D && G >= 1 && G <= 32 && (G & (G - 1)) == 0,
      "lane groups: head_dim a multiple of 32, held by a power-of-two number of lanes <= 32");
  __device__ static int index(int lane) { return lane & (G - 1); }
};

// ---- warp-uniform choices ------------------------------------------------------------------

// Whether any vector of the warp needs a general instruction sequence: a vote, so the whole warp
// takes it. Groups of one lane decide alone (no shuffles to keep together; they may diverge).
template <int G>
__device__ __forceinline__ bool warp_any(bool p) {
  if constexpr (G == 1) {
    return p;
  } else {
    return __any_sync(full_warp, p);
  }
}

// ---- group reductions ----------------------------------------------------------------------

// max over the group of unsigned values (order-free).
template <int G>
__device__ __forceinline__ std::uint32_t group_max_bits(std::uint32_t m) {
#pragma unroll
  for (int o = G / 2; o >= 1; o >>= 1) {
    const std::uint32_t other = __shfl_xor_sync(full_warp, m, o);
    m = other > m ? other : m;
  }
  return m;
}

// sum over the group of integers (order-free).
template <int G>
__device__ __forceinline__ int group_sum_int(int s) {
#pragma unroll
  for (int o = G / 2; o >= 1; o >>= 1) s += __shfl_xor_sync(full_warp, s, o);
  return s;
}

// Bit pattern of this lane's max |x_i|: for non-negative floats the unsigned order of the bit
// patterns is the order of the values, and Inf and NaN patterns lie above every finite one, so
// one integer maximum gives both the largest magnitude and the finiteness of the vector.
template <int N>
__device__ __forceinline__ std::uint32_t lane_max_abs_bits(const float (&x)[N]) {
  std::uint32_t m = 0u;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const std::uint32_t a = __float_as_uint(x[r]) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m;
}
inline constexpr std::uint32_t inf_bits = 0x7f800000u;

// A decoded vector held N per lane, as a decoder hands it to an encoder: the values x_r * scale
// and the bit pattern of this lane's largest |x_r| (lane_max_abs_bits). Factored: FP8 code
// values apart from their bf16 scale (every product exact, so a rotated encoder folds the scale
// into its own power-of-two multiply); else scale 1 and x the values themselves. Signed: the
// vector is D x, the rotation's sign flips applied once more (by the FP8 decoder on the codes; a
// rotated decoder leaves out its last D, D D = I), for a rotated encoder of the same seed to
// skip its D (flipping signs commutes with the encoder's scaling, clipping and maxima) or the
// FP8 encoder to flip its codes' signs. Runs: held in lane_exchange's runs layout (a rotated
// decoder's output for the FP8 encoder, which stores run by run).
template <int N, bool Factored = false, bool Signed = false, bool Runs = false>
struct lane_vector {
  static constexpr bool factored = Factored, rotation_signed = Signed, runs = Runs;
  float x[N];
  float scale;
  std::uint32_t max_bits;
};
template <bool Signed = false, bool Runs = false, int N>
__device__ __forceinline__ lane_vector<N, false, Signed, Runs> make_lane_vector(
    const float (&x)[N]) {
  lane_vector<N, false, Signed, Runs> v;
#pragma unroll
  for (int r = 0; r < N; ++r) v.x[r] = x[r];
  v.scale = 1.0f;
  v.max_bits = lane_max_abs_bits(x);
  return v;
}

// The canonical butterfly over a vector's 32 canonical partial sums, this lane holding the R =
// 32/G of canonical lanes gl*R + r in part[r]: stages 16, 8, 4, 2, 1, across the group while the
// offset is >= R, then in registers. Every lane of the group returns the sum.
template <int G>
__device__ __forceinline__ float group_sum_canonical(float (&part)[32 / G]) {
  constexpr int R = 32 / G;
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    if (o >= R) {
#pragma unroll
      for (int r = 0; r < R; ++r) part[r] = part[r] + __shfl_xor_sync(full_warp, part[r], o / R);
    } else {
#pragma unroll
      for (int r = 0; r < R / 2;
           ++r)  // only r < o feeds the result (constant bound: fully unrolled)
        if (r < o) part[r] = part[r] + part[r + o];
    }
  }
  return part[0];
}

// sum_i a_i b_i in the canonical order (detail::canonical_dot) of a vector held N per lane.
template <int D, int N>
__device__ __forceinline__ float group_dot_canonical(const float (&a)[N], const float (&b)[N]) {
  using lg = lane_group<D, N>;
  float part[lg::R];
#pragma unroll
  for (int r = 0; r < lg::R; ++r) {
    float s = 0.0f;
#pragma unroll
    for (int j = r * lg::P; j < (r + 1) * lg::P; ++j) s = fmaf(a[j], b[j], s);
    part[r] = s;
  }
  return group_sum_canonical<lg::G>(part);
}

// (NaN-propagating: arch/math.cuh's fmax_nan)
__device__ __forceinline__ float quad_col_max(float x) {
  x = fmax_nan(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmax_nan(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmax_nan(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float quad_col_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

}  // namespace tierkv::cuda::detail
