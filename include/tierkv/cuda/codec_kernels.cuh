// SPDX-License-Identifier: Apache-2.0
// Batch encode / decode kernels for the codecs (used by tests, append and retier).
// One warp per vector for FP8 and TQ3 (bit-exact with the host encoders: the TQ3 warp
// path reproduces the canonical warp order of codec/tq3.hpp with warp/lane_group.cuh's 32-lane
// helpers), one thread per vector for any other codec. Launch helpers take a cudaStream_t,
// never synchronize, never allocate.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/core/config.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/warp/lane_group.cuh"
#include "tierkv/cuda/warp/rotation.cuh"

namespace tierkv::cuda {

/// n vectors: vector v reads x + v * x_stride (floats), writes its payload at
/// payload + v * payload_stride (bytes) and its meta at meta[v] (unused when the codec has
/// none). Its rotation seed is seeds[v], or `seed` when seeds is null. status[v] (if not
/// null) gets errc::ok or errc::non_finite_input; *saturated (if not null) is increased
/// by the encoder's saturation count.
template <class Codec>
struct encode_batch {
  const float* x = nullptr;                           ///< device input vectors (floats)
  std::size_t x_stride = Codec::head_dim;             ///< floats between vectors of x
  std::uint8_t* payload = nullptr;                    ///< device payloads out
  std::size_t payload_stride = Codec::payload_bytes;  ///< bytes between payloads
  /// Device metadata out, one per vector (unused when the codec has none)
  typename Codec::meta_type* meta = nullptr;
  const std::uint64_t* seeds = nullptr;     ///< optional device rotation seeds, one per vector
  std::uint64_t seed = 0;                   ///< rotation seed of every vector when seeds is null
  int n = 0;                                ///< number of vectors
  errc* status = nullptr;                   ///< optional device per-vector errc
  unsigned long long* saturated = nullptr;  ///< optional device saturation counter
};

/// n vectors: vector v decodes the payload at payload + v * payload_stride (bytes) and
/// meta[v] with rotation seed seeds[v] (or `seed` when seeds is null) into
/// out + v * out_stride (floats).
template <class Codec>
struct decode_batch {
  const std::uint8_t* payload = nullptr;              ///< device payloads in
  std::size_t payload_stride = Codec::payload_bytes;  ///< bytes between payloads
  /// Device metadata in, one per vector (unused when the codec has none)
  const typename Codec::meta_type* meta = nullptr;
  const std::uint64_t* seeds = nullptr;      ///< optional device rotation seeds, one per vector
  std::uint64_t seed = 0;                    ///< rotation seed of every vector when seeds is null
  int n = 0;                                 ///< number of vectors
  float* out = nullptr;                      ///< device decoded vectors out (floats)
  std::size_t out_stride = Codec::head_dim;  ///< floats between vectors of out
};

/// Warps per block of the warp-per-vector kernels (FP8, TQ3).
inline constexpr int codec_warps_per_block = 4;

namespace detail {

template <class Codec>
struct is_fp8 : std::false_type {};
template <int D, fp8_kind K>
struct is_fp8<fp8_codec<D, K>> : std::true_type {};
template <class Codec>
struct is_tq3 : std::false_type {};
template <int D, tq_norm N>
struct is_tq3<tq3_codec<D, N>> : std::true_type {};

__device__ inline void store_u32(std::uint8_t* p, std::uint32_t w) {
  if ((reinterpret_cast<std::uintptr_t>(p) & 3u) == 0u)
    *reinterpret_cast<std::uint32_t*>(p) = w;
  else
    tierkv::detail::store_le32(p, w);
}
__device__ inline std::uint32_t load_u32(const std::uint8_t* p) {
  if ((reinterpret_cast<std::uintptr_t>(p) & 3u) == 0u)
    return *reinterpret_cast<const std::uint32_t*>(p);
  return tierkv::detail::load_le32(p);
}

// One warp per vector: the canonical sums, maximum, signs and Walsh-Hadamard are
// warp/lane_group.cuh's with 32 lanes per vector.
__device__ inline float warp_sum_canonical(float s) {
  float part[1] = {s};
  return group_sum_canonical<32>(part);
}
__device__ inline float warp_max_nonnegative(float s) {  // s >= 0: bit order is value order
  return __uint_as_float(group_max_bits<32>(__float_as_uint(s)));
}

template <class Codec>
__device__ void fp8_encode_warp(const encode_batch<Codec>& b, int v, int lane) {
  constexpr int D = Codec::head_dim;
  const float* x = b.x + std::size_t(v) * b.x_stride;
  std::uint8_t* out = b.payload + std::size_t(v) * b.payload_stride;
  float amax = 0.0f;
  bool bad = false;
  unsigned long long clipped = 0;
  for (int i = lane; i < D; i += 32) {
    const float xi = x[i];
    bad |= !tierkv::detail::is_finite_bits(xi);
    float a = tierkv::detail::abs_bits(xi);
    if (a > Codec::input_limit) {
      a = Codec::input_limit;
      ++clipped;
    }
    amax = a > amax ? a : amax;
  }
  if (__any_sync(full_warp, bad)) {
    for (int i = lane; i < D; i += 32) out[i] = 0;
    if (lane == 0) {
      b.meta[v] = Codec::poison_meta;
      if (b.status) b.status[v] = errc::non_finite_input;
    }
    return;
  }
  amax = warp_max_nonnegative(amax);
  const bf16_bits scale = Codec::scale_for(amax);
  const float s = bf16_to_float(scale);
  for (int i = lane; i < D; i += 32) {
    if (scale == 0) {
      out[i] = 0;
      continue;
    }
    float xi = x[i];
    if (xi > Codec::input_limit) xi = Codec::input_limit;
    if (xi < -Codec::input_limit) xi = -Codec::input_limit;
    out[i] = float_to_fp8 < Codec::format_t::max_code == 0x7E ? fp8_kind::e4m3
                                                              : fp8_kind::e5m2 > (xi / s);
  }
  for (int o = 16; o >= 1; o >>= 1) clipped += __shfl_xor_sync(full_warp, clipped, o);
  if (lane == 0) {
    b.meta[v] = scale;
    if (b.status) b.status[v] = errc::ok;
    if (b.saturated && clipped) atomicAdd(b.saturated, clipped);
  }
}

template <class Codec>
__device__ void tq3_encode_warp(const encode_batch<Codec>& b, int v, int lane,
                                std::uint8_t* codes /* shared, D bytes for this warp */) {
  constexpr int D = Codec::head_dim;
  constexpr int Per = D / 32;
  const float* x = b.x + std::size_t(v) * b.x_stride + lane * Per;
  std::uint8_t* out = b.payload + std::size_t(v) * b.payload_stride;
  const std::uint64_t seed = b.seeds ? b.seeds[v] : b.seed;
  float z[Per];
  float amax = 0.0f;
  bool bad = false;
#pragma unroll
  for (int r = 0; r < Per; ++r) {
    z[r] = x[r];
    bad |= !tierkv::detail::is_finite_bits(z[r]);
    const float a = tierkv::detail::abs_bits(z[r]);
    amax = a > amax ? a : amax;
  }
  if (__any_sync(full_warp, bad)) {
    for (int i = lane; i < int(Codec::payload_bytes); i += 32) out[i] = 0;
    if (lane == 0) {
      b.meta[v] = Codec::poison_meta;
      if (b.status) b.status[v] = errc::non_finite_input;
    }
    return;
  }
  amax = warp_max_nonnegative(amax);
  bf16_bits meta = 0;
  bool saturated = false;
  if (amax == 0.0f) {
#pragma unroll
    for (int r = 0; r < Per; ++r) codes[lane * Per + r] = std::uint8_t(Codec::zero_code);
  } else {
    const int k = tierkv::detail::unit_exponent(amax);
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < Per; ++r) {
      z[r] = tierkv::detail::scale_pow2(z[r], k);
      part = fmaf(z[r], z[r], part);
    }
    const float sumsq = warp_sum_canonical(part);
    warp_signs<Per>(z, seed, lane);
    warp_wht<Per>(z, lane);
    const auto bounds = tierkv::detail::tq3_make_bounds(sqrtf(sumsq));
    float pzc = 0.0f, pcc = 0.0f;
#pragma unroll
    for (int r = 0; r < Per; ++r) {
      const int code = tierkv::detail::tq3_quantize(z[r], bounds);
      codes[lane * Per + r] = std::uint8_t(code);
      const float c = tierkv::detail::tq3_centroid(code);
      pzc = fmaf(z[r], c, pzc);
      pcc = fmaf(c, c, pcc);
    }
    const float s_zc = warp_sum_canonical(pzc);
    const float s_cc = warp_sum_canonical(pcc);
    meta = tierkv::detail::tq_alpha(Codec::norm, D, sumsq, s_zc, s_cc, k, Codec::grid::plain_scale,
                                    &saturated);
  }
  __syncwarp();
  if (lane < Codec::head_dim / 32) {
    std::uint32_t w[3];
    tierkv::detail::tq3_pack_group(codes + 32 * lane, w);
    for (int t = 0; t < 3; ++t) store_u32(out + 12 * lane + 4 * t, w[t]);
  }
  __syncwarp();  // codes[] is reused by the next vector of this warp
  if (lane == 0) {
    b.meta[v] = meta;
    if (b.status) b.status[v] = errc::ok;
    if (b.saturated && saturated) atomicAdd(b.saturated, 1ull);
  }
}

template <class Codec>
__device__ void tq3_decode_warp(const decode_batch<Codec>& b, int v, int lane) {
  constexpr int D = Codec::head_dim;
  constexpr int Per = D / 32;
  const std::uint8_t* in = b.payload + std::size_t(v) * b.payload_stride;
  const std::uint64_t seed = b.seeds ? b.seeds[v] : b.seed;
  const float alpha = bf16_to_float(b.meta[v]);
  // Lane's coordinates lie in one group of 32 (Per <= 16 divides 32).
  const int first = lane * Per;
  const int g = first >> 5;
  std::uint32_t w[3];
  for (int t = 0; t < 3; ++t) w[t] = load_u32(in + 12 * g + 4 * t);
  float y[Per];
#pragma unroll
  for (int r = 0; r < Per; ++r)
    // 0 + a*c, like the host's acc += w * c from a zero accumulator (with or without
    // contraction), so even the sign of a zero matches.
    y[r] = 0.0f +
           alpha * tierkv::detail::tq3_centroid(tierkv::detail::tq3_unpack(w, (first + r) & 31));
  warp_wht<Per>(y, lane);
  const float inv_d = tierkv::detail::exp2i(-tierkv::detail::log2_of<D>);
#pragma unroll
  for (int r = 0; r < Per; ++r) y[r] *= inv_d;
  warp_signs<Per>(y, seed, lane);
  float* out = b.out + std::size_t(v) * b.out_stride + first;
#pragma unroll
  for (int r = 0; r < Per; ++r) out[r] = y[r];
}

template <class Codec>
__global__ void __launch_bounds__(32 * codec_warps_per_block)
    encode_warp_kernel(encode_batch<Codec> b) {
  __shared__ std::uint8_t codes[codec_warps_per_block][is_tq3<Codec>::value ? Codec::head_dim : 1];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  for (int v = int(blockIdx.x) * codec_warps_per_block + warp; v < b.n;
       v += int(gridDim.x) * codec_warps_per_block) {
    if constexpr (is_tq3<Codec>::value)
      tq3_encode_warp(b, v, lane, codes[warp]);
    else
      fp8_encode_warp(b, v, lane);
  }
}

template <class Codec>
__global__ void __launch_bounds__(32 * codec_warps_per_block)
    decode_warp_kernel(decode_batch<Codec> b) {
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  for (int v = int(blockIdx.x) * codec_warps_per_block + warp; v < b.n;
       v += int(gridDim.x) * codec_warps_per_block) {
    if constexpr (is_tq3<Codec>::value) {
      tq3_decode_warp(b, v, lane);
    } else {
      const std::uint8_t* in = b.payload + std::size_t(v) * b.payload_stride;
      const float s = bf16_to_float(b.meta[v]);
      float* out = b.out + std::size_t(v) * b.out_stride;
      for (int i = lane; i < Codec::head_dim; i += 32) out[i] = Codec::code_value(in[i]) * s;
    }
  }
}

// Any codec: one thread per vector runs the host code path itself.
template <class Codec>
__global__ void encode_thread_kernel(encode_batch<Codec> b) {
  const int v = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (v >= b.n) return;
  typename Codec::meta_type meta{};
  encode_stats stats;
  const codec_context ctx{b.seeds ? b.seeds[v] : b.seed};
  const errc e = Codec::encode(b.x + std::size_t(v) * b.x_stride,
                               b.payload + std::size_t(v) * b.payload_stride, meta, ctx, &stats);
  if constexpr (Codec::meta_bytes > 0) b.meta[v] = meta;
  if (b.status) b.status[v] = e;
  if (b.saturated && stats.saturated) atomicAdd(b.saturated, (unsigned long long)stats.saturated);
}
template <class Codec>
__global__ void decode_thread_kernel(decode_batch<Codec> b) {
  const int v = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (v >= b.n) return;
  typename Codec::meta_type meta{};
  if constexpr (Codec::meta_bytes > 0) meta = b.meta[v];
  Codec::decode(b.payload + std::size_t(v) * b.payload_stride, meta,
                b.out + std::size_t(v) * b.out_stride,
                codec_context{b.seeds ? b.seeds[v] : b.seed});
}

inline int warp_grid(int n) {
  const long long blocks =
      (static_cast<long long>(n) + codec_warps_per_block - 1) / codec_warps_per_block;
  return static_cast<int>(blocks < 65535 * 16 ? blocks : 65535 * 16);  // grid-stride beyond
}

}  // namespace detail

/// Encodes b.n vectors on `stream` (asynchronous). Returns the launch error, if any.
template <vector_codec Codec>
cudaError_t launch_encode(const encode_batch<Codec>& b, cudaStream_t stream = nullptr) {
  if (b.n <= 0) return cudaSuccess;
  if constexpr (detail::is_fp8<Codec>::value || detail::is_tq3<Codec>::value)
    detail::encode_warp_kernel<Codec>
        <<<detail::warp_grid(b.n), 32 * codec_warps_per_block, 0, stream>>>(b);
  else
    detail::encode_thread_kernel<Codec><<<(b.n + 127) / 128, 128, 0, stream>>>(b);
  return cudaGetLastError();
}

/// Decodes b.n vectors to float on `stream` (asynchronous).
template <vector_codec Codec>
cudaError_t launch_decode(const decode_batch<Codec>& b, cudaStream_t stream = nullptr) {
  if (b.n <= 0) return cudaSuccess;
  if constexpr (detail::is_fp8<Codec>::value || detail::is_tq3<Codec>::value)
    detail::decode_warp_kernel<Codec>
        <<<detail::warp_grid(b.n), 32 * codec_warps_per_block, 0, stream>>>(b);
  else
    detail::decode_thread_kernel<Codec><<<(b.n + 127) / 128, 128, 0, stream>>>(b);
  return cudaGetLastError();
}

/// The reference path: one thread per vector running the host encoder's own code (slow;
/// for tests that check the warp kernels).
template <vector_codec Codec>
cudaError_t launch_encode_reference(const encode_batch<Codec>& b, cudaStream_t stream = nullptr) {
  if (b.n <= 0) return cudaSuccess;
  detail::encode_thread_kernel<Codec><<<(b.n + 127) / 128, 128, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace tierkv::cuda
