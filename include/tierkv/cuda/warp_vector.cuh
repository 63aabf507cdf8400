// SPDX-License-Identifier: Apache-2.0
// Token-vector codecs on lane groups: FP8 E4M3, TQ3, TQ4 and int8_rotated encode / decode of
// a vector held by G consecutive, aligned lanes of a warp. A helper's layout follows from its
// per-lane count N = d/G (G a power of two dividing 32): lane gl = lane % G of the group owns
// coordinates [gl*N, gl*N + N). G = 32 (N = d/32) is one warp per vector (decode's
// prepare_query / finalize, append's int8_rotated encode, codec_kernels.cuh's batch kernels);
// the retier kernel uses N = 64 (G = d/64 lanes, 32/G vectors per warp), which moves most
// butterfly stages and most of the Walsh-Hadamard from shuffles into registers
// (cuda/retier.cuh).
//
// Calling convention: all 32 lanes of a warp call a helper together (converged), each group
// with its own vector; groups of one lane (G = 1) may also diverge. Shuffles take the full-warp
// mask with xor offsets below G, so they stay inside a group; the helpers therefore never branch
// on one vector's data around a shuffle: a zero or non-finite vector runs the common path and
// has its results replaced by selects, and the rare cases that need another instruction
// sequence (a clipped input, a tiny or huge scale) switch the whole warp by a vote (warp_any).
//
// Bit-exact with the host codecs for every G. The host defines its sums in the canonical warp
// order (codec/turboquant.hpp: canonical lane l of 32 owns [l*d/32, (l+1)*d/32), fmaf in
// ascending order, then a xor butterfly over offsets 16, 8, 4, 2, 1). A lane of a G-group holds
// the R = 32/G canonical lanes gl*R .. gl*R + R-1: it forms their partial sums in the same fmaf
// order, then runs the butterfly's stages in the same order, offsets >= R across the group
// (shuffle xor offset/R) and offsets < R between its own partial sums (addition commutes, so
// which operand is a lane's own does not matter; the tree does). The Walsh-Hadamard keeps the
// stage order of walsh_hadamard_unnormalized (strides below N in registers, the rest across
// the group). Maxima are order-free. Decoding the rotated formats is exact until the final
// 1/d scaling (integer levels times one scale; see decode_levels), which the inverse rotation
// uses to fold the code scale into that one rounding.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/rotation.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

namespace tierkv::cuda::detail {

// Codecs that store a vector in the seeded rotation's domain (decode prepares queries and
// finalizes outputs there; retier flips or skips the rotation's signs for them).
template <class C>
inline constexpr bool rotated_format =
    C::format == storage_format::tq3 || C::format == storage_format::tq4 || C::format == storage_format::int8_rotated;

inline constexpr unsigned full_warp = 0xffffffffu;

// A vector of D coordinates held N per lane: G lanes, each holding R canonical lanes of P.
template <int D, int N>
struct lane_group {
  static constexpr int G = D / N;
  static constexpr int R = 32 / G;
  static constexpr int P = D / 32;
  static_assert(D % 32 == 0 && N * G == D && G >= 1 && G <= 32 && (G & (G - 1)) == 0,
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
__device__ __forceinline__ lane_vector<N, false, Signed, Runs> make_lane_vector(const float (&x)[N]) {
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
      for (int r = 0; r < R / 2; ++r)  // only r < o feeds the result (constant bound: fully unrolled)
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

// ---- payload access ------------------------------------------------------------------------

// Alignment of a lane's `lane_bytes` bytes at row + gl * lane_bytes in a payload row of
// `row_bytes`: page regions are 16-byte aligned and rows packed, so a row starts at a multiple
// of the largest power of two <= 16 dividing row_bytes.
constexpr int lane_alignment(std::size_t row_bytes, std::size_t lane_bytes) {
  int a = 16;
  while (a > 1 && (row_bytes % std::size_t(a) != 0 || lane_bytes % std::size_t(a) != 0)) a /= 2;
  return a;
}

// W 32-bit words at p (A-byte aligned, A >= 4) in the widest aligned accesses.
template <int A, int W>
__device__ __forceinline__ void load_words(const std::uint8_t* p, std::uint32_t (&w)[W]) {
  static_assert(A >= 4, "load_words: 4-byte alignment at least");
  if constexpr (A >= 16 && W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (A >= 8 && W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = reinterpret_cast<const std::uint32_t*>(p)[i];
  }
}
template <int A, int W>
__device__ __forceinline__ void store_words(std::uint8_t* p, const std::uint32_t (&w)[W]) {
  static_assert(A >= 4, "store_words: 4-byte alignment at least");
  if constexpr (A >= 16 && W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W / 4; ++i)
      reinterpret_cast<uint4*>(p)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  } else if constexpr (A >= 8 && W % 2 == 0) {
#pragma unroll
    for (int i = 0; i < W / 2; ++i) reinterpret_cast<uint2*>(p)[i] = make_uint2(w[2 * i], w[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) reinterpret_cast<std::uint32_t*>(p)[i] = w[i];
  }
}

// B bytes at p (A-byte aligned): whole words when B is a multiple of 4, else bytes.
template <int A, int B>
__device__ __forceinline__ void load_bytes(const std::uint8_t* p, std::uint8_t (&b)[B]) {
  if constexpr (A >= 4 && B % 4 == 0) {
    std::uint32_t w[B / 4];
    load_words<A>(p, w);
#pragma unroll
    for (int j = 0; j < B; ++j) b[j] = std::uint8_t(w[j / 4] >> (8 * (j % 4)));
  } else {
#pragma unroll
    for (int j = 0; j < B; ++j) b[j] = p[j];
  }
}
template <int A, int B>
__device__ __forceinline__ void store_bytes(std::uint8_t* p, const std::uint8_t (&b)[B]) {
  if constexpr (A >= 4 && B % 4 == 0) {
    std::uint32_t w[B / 4];
#pragma unroll
    for (int i = 0; i < B / 4; ++i)
      w[i] = std::uint32_t(b[4 * i]) | (std::uint32_t(b[4 * i + 1]) << 8) | (std::uint32_t(b[4 * i + 2]) << 16) |
             (std::uint32_t(b[4 * i + 3]) << 24);
    store_words<A>(p, w);
  } else {
#pragma unroll
    for (int j = 0; j < B; ++j) p[j] = b[j];
  }
}

// N one-byte codes held four to a word (code r in byte r % 4 of word r / 4), or N zero bytes
// where `keep` is false, at p (A-byte aligned).
template <int A, int N>
__device__ __forceinline__ void store_code_words(std::uint8_t* p, std::uint32_t (&w)[(N + 3) / 4], bool keep) {
#pragma unroll
  for (int i = 0; i < (N + 3) / 4; ++i) w[i] = keep ? w[i] : 0u;
  if constexpr (N % 4 == 0 && A >= 4) {
    store_words<A>(p, w);
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) p[r] = std::uint8_t(w[r / 4] >> (8 * (r % 4)));
  }
}

// ---- rotation ------------------------------------------------------------------------------

// This lane's N sign bits of the rotation's D (coordinates [gl*N, gl*N + N)), 32 per word:
// bit r of word q belongs to coordinate gl*N + 32q + r (set: negative). One splitmix64 sign word
// per 64 coordinates a lane holds, or per lane when N divides 64.
template <int N, int G>
__device__ __forceinline__ void lane_sign_bits(std::uint64_t seed, int lane, std::uint32_t (&bits)[(N + 31) / 32]) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "rotation signs: a power-of-two number of coordinates per lane");
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
  static_assert(32 % (G * G) == 0 && N % (8 * G) == 0, "lane_exchange: runs of whole canonical lanes and code words");
  static constexpr int S = N / G, run_chunks = S / 4, words = N / 8, run_words = S / 8;
  static constexpr int pitch = (N / 4 + G - 1) | 1;                         // float4s per row
  static constexpr int float4s = G == 1 ? 0 : 32 * pitch;  // per warp
  float4* area;  // this warp's float4s
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
      for (int c = 0; c < N / 4; ++c) row[chunk_at(c)] = make_float4(x[4 * c], x[4 * c + 1], x[4 * c + 2], x[4 * c + 3]);
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
  __device__ __forceinline__ void words_from_runs(const std::uint32_t (&q)[words], std::uint32_t (&w)[words],
                                                  int lane) const {
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
__device__ __forceinline__ void warp_inverse_rotation_of_levels(float (&x)[N], float w, float u, std::uint64_t seed,
                                                                int lane, const Exchange& ex = {}) {
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
__device__ __forceinline__ rotated_start rotated_input(const lane_vector<N, F, S>& v, float limit, float (&z)[N]) {
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
      return __uint_as_float((__float_as_uint(q1) & 0x7fffffffu) | (__float_as_uint(a) & 0x80000000u));
    }
  }
};

// ---- FP8 E4M3 ------------------------------------------------------------------------------

// Two FP8 codes in one conversion (lo in the low byte): the rounding of float_to_fp8.
__device__ __forceinline__ std::uint32_t float2_to_e4m3x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
#else
  return std::uint32_t(float_to_fp8<fp8_kind::e4m3>(lo)) | (std::uint32_t(float_to_fp8<fp8_kind::e4m3>(hi)) << 8);
#endif
}

// Bits 0..3 of `nib` to bits 7, 15, 23, 31 (the signs of four E4M3 codes in a word): one
// multiply by 2^7 + 2^14 + 2^21 + 2^28 moves bit b to b + 7 + 7c for c = 0..3, a target 8b' + 7
// only for c = b, and all these positions differ (no carries).
__device__ __forceinline__ std::uint32_t e4m3_sign_mask(std::uint32_t nib) {
  return ((nib & 0xFu) * 0x10204080u) & 0x80808080u;
}
// The rotation's D as xor masks on a lane's N E4M3 codes (word i holds coordinates gl*N + 4i ..
// gl*N + 4i + 3): the sign bits 7, 15, 23, 31. Flipping a code's sign bit is flipping the sign of
// its value, before decoding or after encoding (E4M3 rounding, clipping and the encoder's
// divisions are odd functions). A function of the seed and the lane alone: a caller converting
// many vectors of one seed (the retier kernel: a row of tokens) makes it once, in shared memory
// (a register copy is remade per vector under that kernel's register limit), lane-interleaved
// (word 4k + c of lane L in component c of uint4 32k + L: a warp's 16-byte accesses hit
// distinct bank quads). A lane reads only its own words: no synchronization. Runs: for a vector
// in lane_exchange's runs (word i: run i / (S/4), coordinates g N + gl S + 4 (i % (S/4)) ..).
template <int N, int G, bool Runs = false>
struct e4m3_sign_masks {
  static_assert(N % 16 == 0 && (!Runs || (N <= 64 && (N / G) % 4 == 0)),
                "e4m3_sign_masks: whole 16-byte groups of masks (runs: within one 64-bit sign word)");
  static constexpr int uint4s = 32 * N / 16;  // per warp
  uint4* area;                                // the warp's uint4s
  __device__ __forceinline__ void make(std::uint64_t seed, int lane) const {
    std::uint32_t m[N / 4];
    if constexpr (Runs) {
      constexpr int S = N / G;
#pragma unroll
      for (int g = 0; g < G; ++g) {  // a run's S <= 64 bits lie in one sign word
        const int first = g * N + (lane & (G - 1)) * S;
        const std::uint64_t bits = rotation_sign_word(seed, first >> 6) >> (first & 63);
#pragma unroll
        for (int i = 0; i < S / 4; ++i) m[g * (S / 4) + i] = e4m3_sign_mask(std::uint32_t(bits >> (4 * i)));
      }
    } else {
      std::uint32_t bits[(N + 31) / 32];
      lane_sign_bits<N, G>(seed, lane, bits);
#pragma unroll
      for (int i = 0; i < N / 4; ++i) m[i] = e4m3_sign_mask(bits[i / 8] >> (4 * (i % 8)));
    }
#pragma unroll
    for (int k = 0; k < N / 16; ++k) area[32 * k + lane] = make_uint4(m[4 * k], m[4 * k + 1], m[4 * k + 2], m[4 * k + 3]);
  }
  __device__ __forceinline__ void load(std::uint32_t (&w)[N / 4], int lane) const {
#pragma unroll
    for (int k = 0; k < N / 16; ++k) {
      const uint4 v = area[32 * k + lane];
      w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
    }
  }
};

// FP8 E4M3 encode of a vector held N per lane (exactly fp8_codec::encode); of D x for a Signed
// vector (the rotation's D as `signs`, flipped on the codes); a vector in runs stored run by run.
// Returns false (and writes the codec's poison) on non-finite input.
template <class Codec, int N, bool F, bool S, bool Runs>
__device__ __forceinline__ bool warp_encode_fp8(
    const lane_vector<N, F, S, Runs>& v, std::uint8_t* payload, typename Codec::meta_type* meta, int lane,
    const e4m3_sign_masks<N, lane_group<Codec::head_dim, N>::G, Runs>* signs = nullptr) {
  static_assert(!S || N % 16 == 0, "warp_encode_fp8: signs on whole groups of code words");
  using lg = lane_group<Codec::head_dim, N>;
  using meta_t = typename Codec::meta_type;
  float amax = __uint_as_float(group_max_bits<lg::G>(v.max_bits));
  if constexpr (F) amax *= fabsf(v.scale);
  const bool finite = (__float_as_uint(amax) & 0x7fffffffu) < inf_bits;
  const meta_t scale = finite ? Codec::scale_for(fminf(amax, Codec::input_limit)) : meta_t(0);
  const bool coded = scale != 0;  // else zero codes (a zero vector, or the poison)
  const narrow_divisor div = narrow_divisor::of(bf16_to_float(scale));
  // codes two by two into 32-bit words (a zero word where not coded)
  constexpr int W = (N + 3) / 4;
  std::uint32_t w[W];
  const auto encode = [&](auto plain) {
    constexpr bool fast = decltype(plain)::value;  // no clip, fast division
#pragma unroll
    for (int r = 0; r < N; r += 2) {
      float q[2] = {0.0f, 0.0f};
#pragma unroll
      for (int u = 0; u < 2 && r + u < N; ++u) {
        const float x = F ? v.x[r + u] * v.scale : v.x[r + u];
        q[u] = div.template divide<fast>(fast ? x : fmaxf(fminf(x, Codec::input_limit), -Codec::input_limit));
      }
      const std::uint32_t two = float2_to_e4m3x2(q[0], q[1]);
      w[r / 4] = r % 4 == 0 ? two : w[r / 4] | (two << 16);
    }
  };
  if (!warp_any<lg::G>(coded && (!div.fast || amax > Codec::input_limit)))
    encode(std::true_type{});
  else
    encode(std::false_type{});
  if constexpr (S) {  // D on the codes
    std::uint32_t m[N / 4];
    signs->load(m, lane);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) w[i] ^= m[i];
  }
  if constexpr (Runs) {
    constexpr int R = N / lg::G;  // run length
#pragma unroll
    for (int g = 0; g < lg::G; ++g) {
      std::uint32_t run[R / 4];
#pragma unroll
      for (int i = 0; i < R / 4; ++i) run[i] = w[g * (R / 4) + i];
      store_code_words<lane_alignment(Codec::payload_bytes, R), R>(payload + g * N + lg::index(lane) * R, run, coded);
    }
  } else {
    store_code_words<lane_alignment(Codec::payload_bytes, N), N>(payload + lg::index(lane) * N, w, coded);
  }
  if (lg::index(lane) == 0) *meta = finite ? scale : Codec::poison_meta;
  return finite;
}
template <class Codec, int N>
__device__ __forceinline__ bool warp_encode_fp8(const float (&x)[N], std::uint8_t* payload,
                                                typename Codec::meta_type* meta, int lane) {
  return warp_encode_fp8<Codec, N>(make_lane_vector(x), payload, meta, lane);
}

// Four E4M3 codes (a little-endian word) as two f16x2 (exact, like code_value): one
// cvt.f16x2.e4m3x2 per 16-bit half of the word.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
#if __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
#else
  const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = std::uint32_t(l.x) | (std::uint32_t(l.y) << 16);
  hi = std::uint32_t(h.x) | (std::uint32_t(h.y) << 16);
#endif
}
__device__ __forceinline__ float f16_bits_to_float(std::uint32_t bits16) {
  __half_raw r;
  r.x = static_cast<unsigned short>(bits16);
  return __half2float(__half(r));
}

// FP8 E4M3 decode (exactly fp8_codec::decode), factored: the code values (each exactly
// code_value(c), by one cvt.f16x2.e4m3x2 per two codes), the scale apart (x_r * scale is the
// host's product), and the largest |code value| from f16 maxima (NaN codes propagate). Signed:
// D x for a rotated encoder, by flipping the codes' sign bits with `signs` (that seed's masks).
template <class Codec, int N, bool Signed = false>
__device__ __forceinline__ lane_vector<N, true, Signed> warp_decode_fp8(
    const std::uint8_t* payload, typename Codec::meta_type meta, int lane,
    const e4m3_sign_masks<N, lane_group<Codec::head_dim, N>::G>* signs = nullptr) {
  static_assert(Codec::format == storage_format::fp8_e4m3, "warp_decode_fp8: an E4M3 codec");
  static_assert(!Signed || N % 16 == 0, "warp_decode_fp8: signs on whole groups of code words");
  using lg = lane_group<Codec::head_dim, N>;
  lane_vector<N, true, Signed> v;
  v.scale = bf16_to_float(meta);
  const std::uint8_t* p = payload + lg::index(lane) * N;
  if constexpr (N % 4 == 0) {
    std::uint32_t w[N / 4];
    load_words<lane_alignment(Codec::payload_bytes, N)>(p, w);
    if constexpr (Signed) {  // D on the codes
      std::uint32_t m[N / 4];
      signs->load(m, lane);
#pragma unroll
      for (int i = 0; i < N / 4; ++i) w[i] ^= m[i];
    }
    __half2 m = __float2half2_rn(0.0f);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      std::uint32_t h[2];
      e4m3x4_to_f16x2x2(w[i], h[0], h[1]);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        __half2 pair;
        std::memcpy(&pair, &h[t], sizeof pair);
        m = __hmax2_nan(m, __habs2(pair));
        v.x[4 * i + 2 * t] = f16_bits_to_float(h[t]);
        v.x[4 * i + 2 * t + 1] = f16_bits_to_float(h[t] >> 16);
      }
    }
    const std::uint32_t lo = __float_as_uint(__low2float(m)), hi = __float_as_uint(__high2float(m));
    v.max_bits = (lo > hi ? lo : hi) & 0x7fffffffu;
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) v.x[r] = Codec::code_value(p[r]);
    v.max_bits = lane_max_abs_bits(v.x);
  }
  return v;
}

// ---- TQ3 / TQ4 -----------------------------------------------------------------------------

// A lane's N TQ3 / TQ4 codes (coordinates [gl*N, gl*N + N)) packed into payload words as they
// are produced (docs/formats.md), by integer multiply-adds where a lane packs whole words (the
// FMA pipe; codes are added, never overlapping, into place). TQ3: 3 words per 32-coordinate
// group, codes j < 24 in nibble j % 8 of word j / 8, the three bits of codes 24..31 in bit
// 4(j - 24) + 3 of words 0, 1, 2. Codes arrive as the bits of the float 2^23 + code (bias
// 0x4B000000, see quantize_level): code j < 24 adds at nibble j % 8 of its word, code j >= 24
// at nibble j - 24 of a spare word whose bits store() spreads; each word starts at minus the
// biases its eight codes bring. With N >= 32 the lane's coordinates are whole groups, stored
// by the lane alone; with N < 32 each lane ORs its codes into the three words of its group, the
// 32 / N lanes of the group OR-reduce by shuffles and lanes store whole words. TQ4: nibbles,
// coordinate 2b in the low nibble of byte b, plain codes in [0, 15].
inline constexpr std::uint32_t tq_packer_bias = 0x4B000000u;
template <class Codec, int N>
struct tq_packer {
  static constexpr int D = Codec::head_dim;
  static constexpr bool tq3 = Codec::format == storage_format::tq3;
  static_assert(tq3 || Codec::format == storage_format::tq4, "tq_packer: a TQ3 or TQ4 codec");
  static_assert(!tq3 || N % 32 == 0 || 32 % N == 0, "tq_packer: a lane's coordinates are whole TQ3 groups or lie in one");
  static_assert(tq3 || N % 2 == 0, "tq_packer: TQ4 needs whole bytes per lane (head_dim >= 64)");
  static constexpr std::uint32_t bias = tq3 ? tq_packer_bias : 0u;  // the bits of 2^23
  // minus the biases of eight codes added at nibbles 0..7 (bias << 4k vanishes from k = 2 on)
  static constexpr std::uint32_t word_start = 0u - (bias + (bias << 4));
  static constexpr bool whole = !tq3 || N >= 32;  // words of this lane only
  static constexpr int groups = N >= 32 ? N / 32 : 1;
  static constexpr int words = tq3 ? 3 * groups : (N + 7) / 8;
  std::uint32_t w[words];
  std::uint32_t high[tq3 && whole ? groups : 1];  // TQ3: codes 24..31 of each group, as nibbles

  __device__ tq_packer() {
#pragma unroll
    for (int t = 0; t < words; ++t) w[t] = tq3 && whole ? word_start : 0u;
#pragma unroll
    for (int g = 0; g < (tq3 && whole ? groups : 1); ++g) high[g] = word_start;
  }
  // The code of the lane's coordinate r (TQ3: biased; gl: the lane's index in its group).
  __device__ __forceinline__ void add(int r, std::uint32_t code, int gl) {
    if constexpr (!tq3) {
      w[r / 8] += code << (4 * (r % 8));
    } else if constexpr (whole) {
      const int j = r % 32;
      std::uint32_t& t = j < 24 ? w[3 * (r / 32) + j / 8] : high[r / 32];
      t += code << (4 * (j % 8));
    } else {
      const int j = (gl * N + r) % 32;
      const std::uint32_t c = code & 7u;
      if (j < 24) {
        const std::uint32_t v = c << (4 * (j & 7));
#pragma unroll
        for (int t = 0; t < 3; ++t) w[t] |= (j >> 3) == t ? v : 0u;
      } else {
        const int sh = 4 * (j - 24) + 3;
#pragma unroll
        for (int t = 0; t < 3; ++t) w[t] |= ((c >> t) & 1u) << sh;
      }
    }
  }
  // TQ3 with whole words: the lane's codes from nibble words in coordinate order (eight codes
  // each; per group codes 0-23 in words 0-2 and 24-31 in the fourth).
  __device__ __forceinline__ void set_words(const std::uint32_t (&q)[4 * groups]) {
    static_assert(tq3 && whole, "set_words: TQ3 codes in whole words");
#pragma unroll
    for (int g = 0; g < groups; ++g) {
#pragma unroll
      for (int t = 0; t < 3; ++t) w[3 * g + t] = q[4 * g + t];
      high[g] = q[4 * g + 3];
    }
  }
  // Where `take` holds, the codes of `other` instead.
  __device__ __forceinline__ void replace_if(bool take, const tq_packer& other) {
#pragma unroll
    for (int t = 0; t < words; ++t) w[t] = take ? other.w[t] : w[t];
#pragma unroll
    for (int g = 0; g < (tq3 && whole ? groups : 1); ++g) high[g] = take ? other.high[g] : high[g];
  }
  __device__ __forceinline__ void store(std::uint8_t* payload, int lane) {
    const int gl = lane_group<D, N>::index(lane);
    if constexpr (!tq3) {
      constexpr int A = lane_alignment(Codec::payload_bytes, N / 2);
      if constexpr (N % 8 == 0) {
        store_words<A>(payload + gl * (N / 2), w);
      } else {
        std::uint8_t b[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; ++i) b[i] = std::uint8_t(w[i / 4] >> (8 * (i % 4)));
        store_bytes<A>(payload + gl * (N / 2), b);
      }
    } else if constexpr (whole) {
#pragma unroll
      for (int g = 0; g < groups; ++g)  // bit t of code 24 + n to bit 4n + 3 of word t
#pragma unroll
        for (int t = 0; t < 3; ++t) w[3 * g + t] |= (high[g] & (0x11111111u << t)) << (3 - t);
      store_words<lane_alignment(Codec::payload_bytes, 12 * groups)>(payload + 12 * groups * gl, w);
    } else {
      constexpr int lanes_per_group = 32 / N;
#pragma unroll
      for (int o = 1; o < lanes_per_group; o <<= 1)
#pragma unroll
        for (int t = 0; t < 3; ++t) w[t] |= __shfl_xor_sync(full_warp, w[t], o);
      std::uint32_t* out = reinterpret_cast<std::uint32_t*>(payload) + 3 * ((gl * N) >> 5);
      const int li = gl % lanes_per_group;
      if constexpr (lanes_per_group >= 3) {
        if (li < 3) out[li] = li == 0 ? w[0] : li == 1 ? w[1] : w[2];
      } else if (li == 0) {
#pragma unroll
        for (int t = 0; t < 3; ++t) out[t] = w[t];
      }
    }
  }
};

// 1.0f where a > b, else 0.0f, in the FMA pipe: fma.sat(a, K, -b K) with K = 2^32 saturates the
// once-rounded K(a - b) into [0, 1]; a > b >= 2^-9 means a - b >= ulp(b) >= 2^-32, so K(a - b)
// >= 1, and a <= b gives <= 0. b2_32 = b K (exact). TQ3's bounds are at least 0.49.
__device__ __forceinline__ float greater_step(float a, float b2_32) {
  float r;
  asm("fma.rn.sat.f32 %0, %1, 0f4F800000, %2;" : "=f"(r) : "f"(a), "f"(-b2_32));
  return r;
}
// TQ3 level magnitudes by rank m (codes 4 + m): mag(0) plus the steps to mag(1..3).
constexpr float tq3_magnitude(int m) { return float(tierkv::detail::tq3_level_int(4 + m)) * tierkv::detail::tq3_level_scale; }
// The code from the level L: floor(4 + L * 64/36) is 4 + m for L = +mag(m) and 3 - m for L =
// -mag(m), since 64 mag(m) / 36 (14, 44, 79, 127 over 36: 0.39, 1.22, 2.19, 3.53) lies in
// (m, m + 1) with a margin of 0.19 or more.
inline constexpr float tq3_code_slope = 64.0f / 36.0f;
static_assert(tq3_magnitude(0) * 64 / 36 > 0.1f && tq3_magnitude(0) * 64 / 36 < 0.9f &&
                  tq3_magnitude(1) * 64 / 36 > 1.1f && tq3_magnitude(1) * 64 / 36 < 1.9f &&
                  tq3_magnitude(2) * 64 / 36 > 2.1f && tq3_magnitude(2) * 64 / 36 < 2.9f &&
                  tq3_magnitude(3) * 64 / 36 > 3.1f && tq3_magnitude(3) * 64 / 36 < 3.9f,
              "tq3: the code slope separates the magnitudes");

// The code of one rotated coordinate and its level c: grid::quantize and grid::level. For TQ3
// in floating point (the FMA pipe; comparisons would become predicates and integer selects):
// the bounds increase (thresholds t1 < t2 < t3 times n >= 1), so with f_i = [|z| > b_i] in
// {0, 1} the magnitude rank is m = f1 + f2 + f3 and the magnitude is mag(0) + f1 (mag(1) -
// mag(0)) + ... (multiples of 1/64: exact); level = +-magnitude with z's sign bit (-0 counts as
// negative), and the code 4 + m or 3 - m comes back as the bits of the float 2^23 + code,
// rounded down from 2^23 + 4 + level * 64/36 (tq3_code_slope). TQ4: the grid's own functions.
template <class Grid>
__device__ __forceinline__ std::uint32_t quantize_level(float z, const typename Grid::bounds& b2_32, float& level) {
  if constexpr (Grid::format == storage_format::tq3) {
    const float a = fabsf(z);
    const float f1 = greater_step(a, b2_32.b1), f2 = greater_step(a, b2_32.b2), f3 = greater_step(a, b2_32.b3);
    const float magnitude =
        fmaf(f3, tq3_magnitude(3) - tq3_magnitude(2),
             fmaf(f2, tq3_magnitude(2) - tq3_magnitude(1), fmaf(f1, tq3_magnitude(1) - tq3_magnitude(0), tq3_magnitude(0))));
    level = __uint_as_float(__float_as_uint(magnitude) | (__float_as_uint(z) & 0x80000000u));
    return __float_as_uint(__fmaf_rd(level, tq3_code_slope, 8388612.0f));
  } else {
    const int code = Grid::quantize(z, b2_32);
    level = Grid::level(code);
    return std::uint32_t(code);
  }
}
// The bounds quantize_level takes: TQ3's thresholds times 2^32 (exact), TQ4's as they are.
template <class Grid>
__device__ __forceinline__ typename Grid::bounds quantize_bounds(float n) {
  typename Grid::bounds b = Grid::make_bounds(n);
  if constexpr (Grid::format == storage_format::tq3) {
    b.b1 *= 0x1p32f;
    b.b2 *= 0x1p32f;
    b.b3 *= 0x1p32f;
  }
  return b;
}
// A code as quantize_level returns it (TQ3: biased), for the packer.
template <class Grid>
constexpr std::uint32_t packer_code(int code) {
  return Grid::format == storage_format::tq3 ? tq_packer_bias + std::uint32_t(code) : std::uint32_t(code);
}

// The canonical butterfly (group_sum_canonical) over partial sums held in runs: part[g][i] is
// canonical lane g 32/G + gl 32/G^2 + i. Stages 16 .. 32/G over g in registers, then across the
// group, then over i in registers.
template <int G>
__device__ __forceinline__ float runs_sum_canonical(float (&part)[G][32 / (G * G)]) {
  constexpr int I = 32 / (G * G);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    if (o >= 32 / G) {
#pragma unroll
      for (int g = 0; g < G / 2; ++g)  // only g < o G/32 feeds the result
#pragma unroll
        for (int i = 0; i < I; ++i)
          if (g < o * G / 32) part[g][i] = part[g][i] + part[g + o * G / 32][i];
    } else if (o >= I) {
#pragma unroll
      for (int i = 0; i < I; ++i) part[0][i] = part[0][i] + __shfl_xor_sync(full_warp, part[0][i], o / I);
    } else {
#pragma unroll
      for (int i = 0; i < I / 2; ++i)
        if (i < o) part[0][i] = part[0][i] + part[0][i + o];
    }
  }
  return part[0][0];
}

// sum L^2 over TQ3 codes held eight to a word in 3-bit nibbles (level = L / 64): one byte
// permute per four codes to their int8 levels (the nibbles' top bits are clear) and a 4-way
// byte dot product.
template <int W>
__device__ __forceinline__ int tq3_level_square_sum(const std::uint32_t (&q)[W]) {
  int s = 0;
#pragma unroll
  for (int i = 0; i < W; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int l = int(__byte_perm(tierkv::detail::tq3_s8_0, tierkv::detail::tq3_s8_1, q[i] >> (16 * h)));
      s = __dp4a(l, l, s);
    }
  return s;
}

// TQ3 encode's rotation and quantization in runs (lane_exchange): the in-lane Walsh-Hadamard
// stages, the exchange, the remaining stages in registers, then per coordinate the code (into
// nibble words) and the canonical partial sums of z.c. c.c comes from the codes: every c_i^2 =
// L_i^2 / 4096 and every partial sum of them is a multiple of 2^-12 below 2^11 (d 127^2 <
// 2^23), exact in any order, so the host's canonical sum is the integer sum L_i^2 / 4096.
// The codes go back to layout A into `pk`.
template <class Codec, int N, int G>
__device__ __forceinline__ void tq3_quantize_runs(float (&z)[N], float sumsq, const lane_exchange<N, G>& ex, int lane,
                                                  tq_packer<Codec, N>& pk, float& s_zc, float& s_cc) {
  using grid = typename Codec::grid;
  using X = lane_exchange<N, G>;
  constexpr int P = Codec::head_dim / 32;
  static_assert(grid::format == storage_format::tq3 && X::S % P == 0, "tq3_quantize_runs: TQ3, whole canonical lanes per run");
  lane_wht<N>(z);
  float y[N];
  ex.to_runs(z, y, lane);
  runs_wht<N, G>(y);
  const typename grid::bounds bounds = quantize_bounds<grid>(sqrtf(sumsq));
  float p_zc[G][32 / (G * G)];
  std::uint32_t q[X::words];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < 32 / (G * G); ++i) p_zc[g][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < X::words; ++i) q[i] = tq_packer<Codec, N>::word_start;
#pragma unroll
  for (int r = 0; r < N; ++r) {  // y[r]: run r / S, coordinate r % S of it
    float c;
    const std::uint32_t code = quantize_level<grid>(y[r], bounds, c);
    float& part = p_zc[r / X::S][r % X::S / P];
    part = fmaf(y[r], c, part);
    q[r / 8] += code << (4 * (r % 8));
  }
  s_zc = runs_sum_canonical<G>(p_zc);
  s_cc = float(group_sum_int<G>(tq3_level_square_sum(q))) *
         (tierkv::detail::tq3_level_scale * tierkv::detail::tq3_level_scale);
  std::uint32_t w[X::words];
  ex.words_from_runs(q, w, lane);
  pk.set_words(w);
}

// TQ3 / TQ4 encode (exactly tq_codec::encode), codes packed in registers; `norm` the alpha
// correction (the codec's, or its sibling family's: key and value codecs differ only there). A
// zero or non-finite vector runs the common path on substitute numbers, then takes zero_code
// codes and alpha 0, or zero codes and the poison (returning false). With a lane_exchange (TQ3)
// the rotation's cross-lane half and the quantization run in runs (tq3_quantize_runs).
template <class Codec, int N, bool F, bool S, class Exchange = no_exchange>
__device__ __forceinline__ bool warp_encode_tq(const lane_vector<N, F, S>& v, std::uint8_t* payload,
                                               typename Codec::meta_type* meta, std::uint64_t seed, int lane,
                                               tq_norm norm = Codec::norm, const Exchange& ex = {}) {
  constexpr int D = Codec::head_dim;
  using grid = typename Codec::grid;
  using lg = lane_group<D, N>;
  const int gl = lg::index(lane);
  float z[N];
  const auto [finite, coded, k] = rotated_input<lg::G>(v, __FLT_MAX__, z);
  const float sumsq = group_dot_canonical<D, N>(z, z);
  if constexpr (!lane_vector<N, F, S>::rotation_signed) warp_signs<N, lg::G>(z, seed, lane);
  tq_packer<Codec, N> pk;
  float s_zc, s_cc;
  if constexpr (Exchange::runs) {
    tq3_quantize_runs<Codec, N>(z, sumsq, ex, lane, pk, s_zc, s_cc);
  } else {
    warp_wht<N, lg::G>(z, lane);
    const typename grid::bounds bounds = quantize_bounds<grid>(sqrtf(sumsq));
    // Quantize, pack and form the canonical partial sums of z.c and c.c in one pass (the
    // fmaf order of group_dot_canonical), so codes and levels need no registers of their own.
    float p_zc[lg::R], p_cc[lg::R];
#pragma unroll
    for (int q = 0; q < lg::R; ++q) p_zc[q] = p_cc[q] = 0.0f;
#pragma unroll
    for (int r = 0; r < N; ++r) {
      float c;
      const std::uint32_t code = quantize_level<grid>(z[r], bounds, c);
      p_zc[r / lg::P] = fmaf(z[r], c, p_zc[r / lg::P]);
      p_cc[r / lg::P] = fmaf(c, c, p_cc[r / lg::P]);
      pk.add(r, code, gl);
    }
    s_zc = group_sum_canonical<lg::G>(p_zc);
    s_cc = group_sum_canonical<lg::G>(p_cc);
  }
  tq_packer<Codec, N> special;  // zero_code codes (zero vector) or zeros (poison)
#pragma unroll
  for (int r = 0; r < N; ++r) special.add(r, finite ? packer_code<grid>(Codec::zero_code) : packer_code<grid>(0), gl);
  pk.replace_if(!coded, special);
  pk.store(payload, lane);
  if (gl == 0) {
    bool saturated = false;
    *meta = coded    ? tierkv::detail::tq_alpha(norm, D, sumsq, s_zc, s_cc, k, grid::plain_scale, &saturated)
            : finite ? typename Codec::meta_type(0)
                     : Codec::poison_meta;
  }
  return finite;
}
template <class Codec, int N>
__device__ __forceinline__ bool warp_encode_tq(const float (&x)[N], std::uint8_t* payload,
                                               typename Codec::meta_type* meta, std::uint64_t seed, int lane) {
  return warp_encode_tq<Codec, N>(make_lane_vector(x), payload, meta, seed, lane);
}

// x = float(b - 128) for byte k of `bytes` (exact): 2^23 + b built by one byte permute, minus
// 2^23 + 128. Bytes hold a level or code L as L ^ 0x80 (two's complement, biased by 128).
__device__ __forceinline__ float biased_byte_value(std::uint32_t bytes, int k) {
  return __uint_as_float(__byte_perm(bytes, 0x4B000000u, 0x7440u + unsigned(k))) - 8388736.0f;
}
// The TQ3 levels L (level = L / 64) of codes 0..7 as biased bytes, for one byte permute per four
// codes: word 0 holds codes 0-3, word 1 codes 4-7.
inline constexpr std::uint32_t tq3_biased_levels_0 = tierkv::detail::tq3_s8_0 ^ 0x80808080u;
inline constexpr std::uint32_t tq3_biased_levels_1 = tierkv::detail::tq3_s8_1 ^ 0x80808080u;

// The lane's N TQ3 codes in coordinate order, 8 per word in 3-bit nibbles (the top bit of each
// nibble clear, as a byte-permute selector needs): per 32-coordinate group the nibbles of its
// three words (codes 0-23) and the fourth word gathered from their top bits (codes 24-31).
template <class Codec, int N>
__device__ __forceinline__ void tq3_lane_nibbles(const std::uint8_t* payload, int lane,
                                                 std::uint32_t (&nib)[(N + 7) / 8]) {
  static_assert(N % 32 == 0 || 32 % N == 0, "TQ3: a lane's coordinates are whole groups or lie in one");
  constexpr int groups = N >= 32 ? N / 32 : 1;
  const int first = lane_group<Codec::head_dim, N>::index(lane) * N;
  std::uint32_t words[3 * groups];
  load_words<lane_alignment(Codec::payload_bytes, 12 * groups)>(payload + 12 * (first / 32), words);
#pragma unroll
  for (int g = 0; g < groups; ++g) {
    const std::uint32_t w0 = words[3 * g], w1 = words[3 * g + 1], w2 = words[3 * g + 2];
    const std::uint32_t q[4] = {w0 & 0x77777777u, w1 & 0x77777777u, w2 & 0x77777777u,
                                ((w0 >> 3) & 0x11111111u) | ((w1 >> 2) & 0x22222222u) | ((w2 >> 1) & 0x44444444u)};
    if constexpr (N >= 32) {
#pragma unroll
      for (int t = 0; t < 4; ++t) nib[4 * g + t] = q[t];
    } else {  // the lane's N consecutive codes from (first % 32)
      const int j = first % 32;
#pragma unroll
      for (int t = 0; t < (N + 7) / 8; ++t) {
        const int s = j / 8 + t;
        const std::uint32_t v = s == 0 ? q[0] : s == 1 ? q[1] : s == 2 ? q[2] : q[3];
        nib[t] = N >= 8 ? v : v >> (4 * (j % 8));
      }
    }
  }
}

// The integer levels L_r of the lane's TQ3 / TQ4 codes as floats (TQ3: level = L / 64; TQ4:
// level = L = code - 7.5), and the level unit u (1/64 or 1): exact.
template <class Codec, int N>
__device__ __forceinline__ float decode_levels(const std::uint8_t* payload, float (&x)[N], int lane) {
  if constexpr (Codec::format == storage_format::tq3) {
    std::uint32_t nib[(N + 7) / 8];
    tq3_lane_nibbles<Codec, N>(payload, lane, nib);
#pragma unroll
    for (int r = 0; r < N; r += 4) {
      const std::uint32_t sel = nib[r / 8] >> (16 * ((r / 4) % 2));
      const std::uint32_t bytes = __byte_perm(tq3_biased_levels_0, tq3_biased_levels_1, sel & 0xffffu);
#pragma unroll
      for (int u = 0; u < 4 && r + u < N; ++u) x[r + u] = biased_byte_value(bytes, u);
    }
    return tierkv::detail::tq3_level_scale;
  } else {
    static_assert(Codec::format == storage_format::tq4, "decode_levels: a TQ3 or TQ4 codec");
    static_assert(N % 2 == 0, "TQ4 needs whole bytes per lane (head_dim >= 64)");
    std::uint8_t b[N / 2];
    load_bytes<lane_alignment(Codec::payload_bytes, N / 2)>(
        payload + lane_group<Codec::head_dim, N>::index(lane) * (N / 2), b);
#pragma unroll
    for (int r = 0; r < N; ++r) {
      // 2^21 + code (the float at 2^21 steps by 1/4), minus 2^21 + 7.5: code - 7.5, exact
      const std::uint32_t code = (b[r / 2] >> (4 * (r % 2))) & 15u;
      x[r] = __uint_as_float(0x4A000000u | (code << 2)) - (2097152.0f + tq4_grid::offset);
    }
    return 1.0f;
  }
}

// TQ3 / TQ4 decode (exactly tq_codec::decode: 0 + alpha*c, inverse rotation D H_un / d; Signed:
// D x, i.e. without the last D; with a lane_exchange in runs).
template <class Codec, int N, bool Signed = false, class Exchange = no_exchange>
__device__ __forceinline__ void warp_decode_tq(const std::uint8_t* payload, typename Codec::meta_type meta,
                                               std::uint64_t seed, float (&x)[N], int lane, const Exchange& ex = {}) {
  constexpr int D = Codec::head_dim;
  const float unit = decode_levels<Codec, N>(payload, x, lane);
  warp_inverse_rotation_of_levels<D, N, !Signed>(x, bf16_to_float(meta), unit, seed, lane, ex);
}

// ---- int8_rotated --------------------------------------------------------------------------

// int8_rotated encode (exactly int8_rotated_codec::encode): the same power-of-two scaling
// and rotation as TQ3, a group maximum, then the codec's alpha_for and per-element rounding.
template <class Codec, int N, bool F, bool S>
__device__ __forceinline__ bool warp_encode_int8r(const lane_vector<N, F, S>& v, std::uint8_t* payload,
                                                  typename Codec::meta_type* meta, std::uint64_t seed,
                                                  int lane) {
  using lg = lane_group<Codec::head_dim, N>;
  using meta_t = typename Codec::meta_type;
  float z[N];
  const auto [finite, coded, k] = rotated_input<lg::G>(v, Codec::input_limit, z);
  if constexpr (!lane_vector<N, F, S>::rotation_signed) warp_signs<N, lg::G>(z, seed, lane);
  warp_wht<N, lg::G>(z, lane);
  const float zmax = __uint_as_float(group_max_bits<lg::G>(lane_max_abs_bits(z)));
  const meta_t alpha = coded ? Codec::alpha_for(zmax, k) : meta_t(0);
  const narrow_divisor div = narrow_divisor::of(tierkv::detail::scale_pow2(bf16_to_float(alpha), k));
  std::uint32_t w[(N + 3) / 4];  // codes four to a word as they are produced
  const auto encode = [&](auto fast) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      const float q = div.template divide<decltype(fast)::value>(z[r]);
      int c = int(q + (q >= 0.0f ? 0.5f : -0.5f));
      c = c > Codec::max_code ? Codec::max_code : (c < -Codec::max_code ? -Codec::max_code : c);
      const std::uint32_t b = std::uint32_t(c) & 0xffu;
      w[r / 4] = r % 4 == 0 ? b : w[r / 4] | (b << (8 * (r % 4)));
    }
  };
  if (!warp_any<lg::G>(coded && !div.fast))
    encode(std::true_type{});
  else
    encode(std::false_type{});
  store_code_words<lane_alignment(Codec::payload_bytes, N), N>(payload + lg::index(lane) * N, w, coded);
  if (lg::index(lane) == 0) *meta = finite ? alpha : Codec::poison_meta;
  return finite;
}
template <class Codec, int N>
__device__ __forceinline__ bool warp_encode_int8r(const float (&x)[N], std::uint8_t* payload,
                                                  typename Codec::meta_type* meta, std::uint64_t seed,
                                                  int lane) {
  return warp_encode_int8r<Codec, N>(make_lane_vector(x), payload, meta, seed, lane);
}

// int8_rotated decode (exactly int8_rotated_codec::decode: 0 + alpha*c, D H_un / d; Signed: D x;
// with a lane_exchange in runs).
template <class Codec, int N, bool Signed = false, class Exchange = no_exchange>
__device__ __forceinline__ void warp_decode_int8r(const std::uint8_t* payload, typename Codec::meta_type meta,
                                                  std::uint64_t seed, float (&x)[N], int lane, const Exchange& ex = {}) {
  constexpr int D = Codec::head_dim;
  const std::uint8_t* p = payload + lane_group<D, N>::index(lane) * N;
  if constexpr (N % 4 == 0) {  // a word of four codes at a time, biased by one xor
    std::uint32_t w[N / 4];
    load_words<lane_alignment(Codec::payload_bytes, N)>(p, w);
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = biased_byte_value(w[r / 4] ^ 0x80808080u, r % 4);
  } else {
#pragma unroll
    for (int r = 0; r < N; ++r) x[r] = biased_byte_value(p[r] ^ 0x80u, 0);
  }
  warp_inverse_rotation_of_levels<D, N, !Signed>(x, bf16_to_float(meta), 1.0f, seed, lane, ex);
}

}  // namespace tierkv::cuda::detail
