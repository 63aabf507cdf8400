// SPDX-License-Identifier: Apache-2.0
// Append kernel: writes new tokens' keys and values (one decode token or a prefill chunk
// per sequence, one layer or all layers) into open pages of the append tier (a format whose
// device codec appends: FP8 E4M3, int8_rotated), computing per-token scales, at the slots the
// engine's slot mapping names.
// Codes and scales equal the host codec's encode() bit for bit (tests/cuda/append.cpp).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/codec/formats.cuh"

namespace tierkv::cuda {

/// Element type of the new keys and values: f32 or bf16 (converted to float on load).
enum class input_type : std::uint8_t { f32 = 0, bf16 = 1 };

/// New tokens of `layers` layers. Token n of layer l:
///   key   k[l * layer_stride + (n * kv_heads + h) * head_dim + i]   (same for v)
///   page  slot[l * slot_layer_stride + n] of `pool`, token offset offset[n] in that page.
/// A layer's pages hold one layer, so each layer has its own slots (slot_layer_stride);
/// offsets are the same for every layer (the sequence position decides them).
struct append_inputs {
  const void* k = nullptr;               ///< device keys of `type`, indexed as above
  const void* v = nullptr;               ///< device values, same layout as k
  input_type type = input_type::f32;     ///< element type of k and v
  std::int64_t layer_stride = 0;         ///< elements between layers of k and v
  const std::int32_t* slot = nullptr;    ///< [layers][slot_layer_stride]
  std::int64_t slot_layer_stride = 0;    ///< slots between layers in `slot`
  const std::int32_t* offset = nullptr;  ///< [tokens]
  int tokens = 0;                        ///< new tokens per layer
  int layers = 1;                        ///< layers written (k holds `layers` layers)
  pool_view pool;                        ///< the append tier's pool
  /// Rotated formats (int8_rotated): codec contexts are make_codec_context(cache_seed, layer,
  /// head_base + h, role), as in paged_storage. layer_base is the layer of k's layer 0.
  std::uint64_t cache_seed = 0;
  int head_base = 0;   ///< global index of KV head 0 (codec contexts use head_base + h)
  int layer_base = 0;  ///< the layer of k's layer 0 (codec contexts)
  /// Optional: first device error (errc as int; 0 = ok): out_of_range for a slot beyond the
  /// pool or an offset beyond page_tokens (nothing written for that token), non_finite_input
  /// for NaN/Inf (the codec's poison is written: zero codes, NaN scale).
  int* error = nullptr;
  /// Optional, with `error`: where the first error was, written by the warp that set it:
  /// {layer (layer_base + l), token n, kv head, role (0 key, 1 value)}.
  int* error_at = nullptr;
  /// Optional centring means (tierkv/centering.hpp), [layers][kv_heads][head_dim] floats from
  /// k's layer 0 on, mean_layer_stride apart: subtracted from each key (value) before it is
  /// encoded. A difference that overflows is non-finite and reported as such.
  const float* key_mean = nullptr;
  const float* value_mean = nullptr;   ///< the values' means, laid out as key_mean
  std::int64_t mean_layer_stride = 0;  ///< floats between layers of key_mean and value_mean
};

namespace detail {

__device__ __forceinline__ float load_input(const void* p, input_type t, std::int64_t i) {
  return t == input_type::bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
                               : static_cast<const float*>(p)[i];
}

// The token vector of this warp (blockIdx.y = layer; warps: token-major, then head, then
// role): its source in k / v and its payload and meta in the page. valid = false (and
// out_of_range reported) for a slot beyond the pool or an offset beyond page_tokens.
template <class Geometry, class Codec>
struct append_target {
  using layout = page_layout<Geometry, Codec, Codec>;
  bool valid = false;
  int role = 0, h = 0, layer = 0, token = 0;
  const void* src = nullptr;
  std::int64_t base = 0;        // first element of the vector in src
  const float* mean = nullptr;  // the vector's centring mean (head_dim floats), or none
  std::uint8_t* payload = nullptr;
  typename Codec::meta_type* meta = nullptr;

  __device__ append_target(const append_inputs& in, int warp, int lane) {
    constexpr int D = Geometry::head_dim, H = Geometry::kv_heads;
    layer = int(blockIdx.y);
    role = warp % 2;
    h = (warp / 2) % H;
    const int n = warp / (2 * H);
    token = n;
    const std::int32_t slot = in.slot[std::int64_t(layer) * in.slot_layer_stride + n];
    const std::int32_t off = in.offset[n];
    if (slot < 0 || std::uint32_t(slot) >= in.pool.capacity || off < 0 ||
        off >= Geometry::page_tokens) {
      if (lane == 0) report(in, errc::out_of_range);
      return;
    }
    valid = true;
    src = role == 0 ? in.k : in.v;
    base = std::int64_t(layer) * in.layer_stride + (std::int64_t(n) * H + h) * D;
    if (const float* m = role == 0 ? in.key_mean : in.value_mean)
      mean = m + std::int64_t(layer) * in.mean_layer_stride + std::int64_t(h) * D;
    std::uint8_t* page = in.pool.page(std::uint32_t(slot));
    payload = page + (role == 0 ? layout::key_payload(h, off) : layout::value_payload(h, off));
    meta = reinterpret_cast<typename Codec::meta_type*>(
        page + (role == 0 ? layout::key_meta(h, off) : layout::value_meta(h, off)));
  }
  // The first error of the launch, and where it was (append_inputs::error_at).
  __device__ void report(const append_inputs& in, errc e) const {
    if (in.error == nullptr || atomicCAS(in.error, 0, int(e)) != 0 || in.error_at == nullptr)
      return;
    in.error_at[0] = in.layer_base + layer;
    in.error_at[1] = token;
    in.error_at[2] = h;
    in.error_at[3] = role;
  }
};

// One warp encodes one token vector: lane l loads coordinates N l .. N l + N - 1 (minus their
// centring means), the append tier's device codec encodes them (append_encode, in its
// cuda/codec/ file: false on non-finite input, its poison written), and a failure is reported
// with where it was.
template <class Geometry, class Codec>
__global__ void __launch_bounds__(256) append_kernel(append_inputs in) {
  constexpr int D = Geometry::head_dim, H = Geometry::kv_heads, N = (D + 31) / 32;
  const int warp = int(blockIdx.x) * (blockDim.x / 32) + int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  if (warp >= in.tokens * H * 2) return;
  const append_target<Geometry, Codec> at(in, warp, lane);
  if (!at.valid) return;
  float x[N];
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int i = lane * N + j;
    x[j] = D % 32 == 0 || i < D
               ? load_input(at.src, in.type, at.base + i) - (at.mean ? at.mean[i] : 0.f)
               : 0.f;
  }
  const std::uint64_t seed =
      make_codec_context(in.cache_seed, in.layer_base + at.layer, in.head_base + at.h,
                         at.role == 0 ? kv_role::key : kv_role::value)
          .seed;
  if (!device_codec<Codec>::template append_encode<N>(x, at.payload, at.meta, seed, lane) &&
      lane == 0)
    at.report(in, errc::non_finite_input);
}

// grid (ceil(kv_heads * head_dim / 128), 2): thread i of role blockIdx.y is channel i; its mean
// over the tokens in token order, summed in float64 as channel_means::estimate does (the same
// float result). A non-finite mean (NaN / Inf input, which the append then reports) is 0:
// that channel is not centred, which is still exact.
template <class Geometry>
__global__ void __launch_bounds__(128)
    estimate_means_kernel(append_inputs in, float* key_mean, float* value_mean) {
  constexpr int C = Geometry::kv_heads * Geometry::head_dim;
  const int i = int(blockIdx.x) * 128 + int(threadIdx.x);
  if (i >= C) return;
  const bool value = blockIdx.y == 1;
  const void* src = value ? in.v : in.k;
  double sum = 0;
  for (int t = 0; t < in.tokens; ++t)
    sum += double(load_input(src, in.type, std::int64_t(t) * C + i));
  const float m = float(sum / double(in.tokens));
  (value ? value_mean : key_mean)[i] = tierkv::detail::is_finite_bits(m) ? m : 0.f;
}

}  // namespace detail

/// Enqueues the estimate of one layer's centring means (channel_means::estimate's, bit for
/// bit) from the tokens of `in` (its layer 0): key_mean and value_mean get kv_heads x head_dim
/// floats each. No synchronization, no allocation.
template <class Geometry>
status estimate_means(const append_inputs& in, float* key_mean, float* value_mean,
                      cudaStream_t stream) {
  if (in.tokens < 1 || !in.k || !in.v || !key_mean || !value_mean)
    return status::make(errc::invalid_argument, "estimate_means: tokens = ", in.tokens,
                        " (>= 1) and k, v, key_mean, value_mean must be set");
  constexpr int C = Geometry::kv_heads * Geometry::head_dim;
  detail::estimate_means_kernel<Geometry>
      <<<dim3(unsigned((C + 127) / 128), 2), 128, 0, stream>>>(in, key_mean, value_mean);
  return check_launch("estimate_means_kernel");
}

/// Enqueues the append on `stream`. Tier must store keys and values in one format, FP8 E4M3
/// or int8_rotated (the tier new tokens go to). No synchronization, no allocation.
template <class Geometry, class Tier>
status append(const append_inputs& in, cudaStream_t stream) {
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  static_assert(std::is_same_v<K, V> && detail::device_codec<K>::appends,
                "cuda::append: the append tier must store keys and values in one format whose "
                "device codec appends (fp8_e4m3, int8_rotated: `appends` and append_encode in its "
                "cuda/codec/ file)");
  using layout = page_layout<Geometry, K, V>;
  if (in.tokens < 0 || in.layers < 1 || in.layers > 65535)
    return status::make(errc::invalid_argument, "append: tokens = ", in.tokens,
                        ", layers = ", in.layers, " (tokens >= 0, layers in [1, 65535])");
  if (in.tokens == 0) return status::ok();
  if (!in.k || !in.v || !in.slot || !in.offset || !in.pool.base)
    return status::make(errc::invalid_argument,
                        "append: k, v, slot, offset and pool.base must be set");
  if (in.pool.page_bytes != layout::page_bytes)
    return status::make(errc::geometry_mismatch, "append: pool.page_bytes = ", in.pool.page_bytes,
                        " but the append tier's page layout needs ", layout::page_bytes);
  if (in.layers > 1 &&
      (in.layer_stride < std::int64_t(in.tokens) * Geometry::kv_heads * Geometry::head_dim ||
       in.slot_layer_stride < in.tokens))
    return status::make(errc::invalid_argument, "append: layer_stride = ", in.layer_stride,
                        " and slot_layer_stride = ", in.slot_layer_stride,
                        " must cover one layer's tokens");
  const std::int64_t warps = std::int64_t(in.tokens) * Geometry::kv_heads * 2;
  const std::int64_t blocks = (warps + 7) / 8;
  if (blocks > 0x7fffffff)
    return status::exceeds(errc::invalid_argument, "append: blocks", blocks, 0x7fffffff);
  detail::append_kernel<Geometry, K>
      <<<dim3(unsigned(blocks), unsigned(in.layers)), 256, 0, stream>>>(in);
  return check_launch("append_kernel");
}

}  // namespace tierkv::cuda
