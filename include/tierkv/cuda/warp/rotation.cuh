// SPDX-License-Identifier: Apache-2.0
// The seeded randomized Walsh-Hadamard rotation on vectors held by lane groups: sign bits,
// the transform in the stage order of the host's walsh_hadamard_unnormalized (bit-identical),
// layout exchanges between a lane's own coordinates and runs, and the inverse rotation.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/codec/rotation.hpp"
#include "tierkv/cuda/warp/lane_group.cuh"
namespace tierkv::cuda::detail {

// ---- rotation ------------------------------------------------------------------------------

// This lane's N sign bits of the rotation's D (coordinates [gl*N, gl*N + N)), 32 per word:
// bit r of word q belongs to coordinate gl*N + 32q + r (set: negative). One splitmix64 sign word
// per 64 coordinates a lane holds, or per lane when N divides 64.
template <int N, int G>
__device__ __forceinline__ void lane_sign_bits(std::uint64_t seed, int lane,
                                               std::uint32_t (&bits)[(N + 31) / 32]) {
  static_assert(N > 0 && (N & (N - 1)) == 0,
                "rotation signs: a power-of-two number of coordinates per lane");
  const int first = (lane & (G - 1)) * N;
  if constexpr (N >= 64) {
#pragma unroll
    for (int b = 0; b < N / 64; ++b) {
      const std::uint64_t w = rotation_sign_word(seed, (first >> 6) + b);
      bits[2 * b] = std::uint32_t(w);
      bits[2 * b + 1] = std::uint32_t(w >> 32);
    }
  } else {
    bits[0] = std::uint32_t(rotation_sign_word(seed, first >> 6) >> (first & 63));
  }
}

// x <- D x on this lane's coordinates: a sign-bit flip, exact; bit r of a word moves to the
// sign by one left shift.
template <int N, int G = 32>
__device__ __forceinline__ void warp_signs(float (&x)[N], std::uint64_t seed, int lane) {
  std::uint32_t bits[(N + 31) / 32];
  lane_sign_bits<N, G>(seed, lane, bits);
#pragma unroll
  for (int r = 0; r < N; ++r)
    x[r] = __uint_as_float(__float_as_uint(x[r]) ^ ((bits[r / 32] << (31 - r % 32)) & 0x80000000u));
}

// The stages of the unnormalized Walsh-Hadamard with strides below N, on a lane's N consecutive
// coordinates (walsh_hadamard_unnormalized's order: lower index a + b, upper a - b).
template <int N>
__device__ __forceinline__ void lane_wht(float (&x)[N]) {
#pragma unroll
  for (int h = 1; h < N; h <<= 1)
#pragma unroll
    for (int p = 0; p < N / 2; ++p) {  // the stage's butterflies, one flat loop (fully unrolled)
      const int j = p / h * 2 * h + p % h;
      const float a = x[j], b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
}

// Unnormalized Walsh-Hadamard of a vector held N per lane by G lanes, in the stage order of
// walsh_hadamard_unnormalized: strides below N inside the lane, the rest across the group
// (lower index a + b, upper a - b; as fmaf(+-1, own, other), one rounding of the same sum).
template <int N, int G = 32>
__device__ __forceinline__ void warp_wht(float (&x)[N], int lane) {
  lane_wht<N>(x);
#pragma unroll
  for (int lm = 1; lm < G; lm <<= 1) {
    const float own_sign = (lane & lm) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = fmaf(own_sign, x[r], __shfl_xor_sync(full_warp, x[r], lm));
  }
}

// A warp's shared-memory scratch that moves vectors held N coordinates per lane by G lanes
// between two layouts: A, lane gl holding [gl N, gl N + N) (every other helper's), and runs,
// lane gl holding the G runs [g N + gl S, g N + gl S + S) (S = N/G, g < G) in y[g S ..], where
// the Walsh-Hadamard's strides N .. D/2 lie inside the lane (runs_wht: no shuffles; used by the
// TQ3 encoder and the rotated decoders for an FP8 destination) and a canonical lane's P = D/32
// coordinates still lie in one run (S a multiple of P: G^2 divides 32). Row L of the
// scratch holds lane L's layout-A floats as 16-byte chunks with a gap after each run's chunks,
// at an odd pitch: at N = 64 (G = 2, 4) the row writes and the run reads of a quarter-warp then
// hit eight different bank quads. Code words return to layout A through the rows' first
// chunks. G = 1: the layouts coincide (copies, no shared memory).
struct no_exchange {
  static constexpr bool runs = false;
  static constexpr int float4s = 0;
};
template <int N, int G>
struct lane_exchange {
  static constexpr bool runs = true;
  static_assert(32 % (G * G) == 0 && N % (8 * G) == 0,
                "lane_exchange: runs of whole canonical lanes and code words");
  static constexpr int S = N / G, run_chunks = S / 4, words = N / 8, run_words = S / 8;
  static constexpr int pitch = (N / 4 + G - 1) | 1;        // float4s per row
  static constexpr int float4s = G == 1 ? 0 : 32 * pitch;  // per warp
  float4* area;                                            // this warp's float4s
  static constexpr int chunk_at(int c) { return c + c / run_chunks; }

  // y (runs) from x (layout A), once every lane is done with the scratch's previous contents.
  __device__ __forceinline__ void to_runs(const float (&x)[N], float (&y)[N], int lane) const {
    if constexpr (G == 1) {
#pragma unroll
      for (int r = 0; r < N; ++r) y[r] = x[r];
    } else {
      float4* row = area + lane * pitch;
      __syncwarp();
#pragma unroll
      for (int c = 0; c < N / 4; ++c)
        row[chunk_at(c)] = make_float4(x[4 * c], x[4 * c + 1], x[4 * c + 2], x[4 * c + 3]);
      __syncwarp();
      const int gl = lane & (G - 1);
      const float4* runs = area + (lane - gl) * pitch + chunk_at(run_chunks * gl);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int c = 0; c < run_chunks; ++c) {
          const float4 v = runs[g * pitch + c];
          float* o = y + g * S + 4 * c;
          o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
        }
    }
  }
  // The lane's layout-A code words (eight codes each, coordinate order) from its runs' words
  // (run g's in q[g S/8 ..]), through the rows' first chunks once every lane has read its runs.
  __device__ __forceinline__ void words_from_runs(const std::uint32_t (&q)[words],
                                                  std::uint32_t (&w)[words], int lane) const {
    if constexpr (G == 1) {
#pragma unroll
      for (int i = 0; i < words; ++i) w[i] = q[i];
    } else {
      std::uint8_t* rows = reinterpret_cast<std::uint8_t*>(area);
      constexpr int row_bytes = 16 * pitch;
      const int gl = lane & (G - 1);
      __syncwarp();
#pragma unroll
      for (int g = 0; g < G; ++g) {
        std::uint32_t part[run_words];
#pragma unroll
        for (int k = 0; k < run_words; ++k) part[k] = q[g * run_words + k];
        store_words<4 * run_words>(rows + (lane - gl + g) * row_bytes + 4 * gl * run_words, part);
      }
      __syncwarp();
      load_words<16>(rows + lane * row_bytes, w);
    }
  }
};

// The Walsh-Hadamard stages of strides N .. D/2 on a vector in runs (after lane_wht and
// lane_exchange::to_runs): run g with run g + hg, in walsh_hadamard_unnormalized's order.
template <int N, int G>
__device__ __forceinline__ void runs_wht(float (&y)[N]) {
  constexpr int S = N / G;
#pragma unroll
  for (int hg = 1; hg < G; hg <<= 1)
#pragma unroll
    for (int g = 0; g < G; ++g)
      if ((g & hg) == 0)
#pragma unroll
        for (int j = 0; j < S; ++j) {
          const float a = y[g * S + j], b = y[(g + hg) * S + j];
          y[g * S + j] = a + b;
          y[(g + hg) * S + j] = a - b;
        }
}

// x <- D H_un x / D on a vector held N per lane (decode's finalize; the stage order of
// rotated_domain::finalize, so bit-identical to it).
template <int D, int N>
__device__ __forceinline__ void warp_inverse_rotation(float (&x)[N], std::uint64_t seed, int lane) {
  constexpr int G = lane_group<D, N>::G;
  warp_wht<N, G>(x, lane);
  const float s = tierkv::detail::exp2i(-tierkv::detail::log2_of<D>);
#pragma unroll
  for (int r = 0; r < N; ++r) x[r] *= s;
  warp_signs<N, G>(x, seed, lane);
}

// The rotated codecs' decode D H_un (w c) / D, for c = u L with integer levels L, |L| <= 128
// (TQ3: L / 64, TQ4: code - 7.5 with u = 1, int8_rotated: the code), given x = L. While
// w u d 128 < 2^127 every product w c and every Walsh-Hadamard sum of them is an integer
// multiple of (w's last bit) u below 2^24 of it and below 2^127: exact, so the host's result
// is one rounding of w u H_un(L) / D. Then this runs the exact H_un(L) on the levels and that
// one rounding as fmaf(H_un(L), w u / D, +0) (w u / D exact: a bf16 scaled by a power of two,
// its last bit at least 2^-148; the +0 gives the host's +0 where w = 0). A larger (or NaN) w,
// where the host's sums may overflow, switches the warp to the host's order: x = w u L first,
// the same Walsh-Hadamard, then times 1/D. Then D, the signs (unless the caller wants D x).
// With a lane_exchange x comes out in runs (D x only: the signs are the caller's).
template <int D, int N, bool Signs = true, class Exchange = no_exchange>
__device__ __forceinline__ void warp_inverse_rotation_of_levels(float (&x)[N], float w, float u,
                                                                std::uint64_t seed, int lane,
                                                                const Exchange& ex = {}) {
  static_assert(!(Signs && Exchange::runs), "warp_inverse_rotation_of_levels: runs come as D x");
  constexpr int G = lane_group<D, N>::G;
  constexpr float exact_limit = 0x1p127f / float(128 * D);  // w u below it: exact sums
  const float inv_d = tierkv::detail::exp2i(-tierkv::detail::log2_of<D>);
  const float wu = w * u;
  float scale = wu * inv_d;
  if (warp_any<G>(!(fabsf(wu) < exact_limit))) {
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = fmaf(x[r], wu, 0.0f);  // 0 + w c, as the host accumulates
    scale = inv_d;
  }
  if constexpr (Exchange::runs) {
    lane_wht<N>(x);
    float y[N];
    ex.to_runs(x, y, lane);
    runs_wht<N, G>(y);
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = fmaf(y[r], scale, 0.0f);
  } else {
    warp_wht<N, G>(x, lane);
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = fmaf(x[r], scale, 0.0f);
    if constexpr (Signs) warp_signs<N, G>(x, seed, lane);
  }
}

}  // namespace tierkv::cuda::detail
