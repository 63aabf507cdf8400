// SPDX-License-Identifier: Apache-2.0
// Retier kernels: convert whole pages between two tiers (FP8 -> TQ3 demotion, TQ3 -> FP8
// promotion, or any pair of supported formats) over a list of (source, destination) page
// slots, one warp per token vector (warps loop over the vectors), on the caller's stream. Codes equal the host codecs'
// decode-then-encode bit for bit (tests/cuda/retier.cu).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstdint>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/warp_vector.cuh"
#include "tierkv/memory/page_layout.hpp"

namespace tierkv::cuda {

// Page i of the list: src.page(src_slot[i]) (tier From) -> dst.page(dst_slot[i]) (tier To),
// layer layer_of[i] (or `layer` for all when layer_of is null; codec contexts depend on it).
// All page_tokens slots are converted: retier seals pages, so they are full. A NaN-poisoned
// or non-finite source vector gives the destination codec's poison and errc::non_finite_input.
struct retier_inputs {
  pool_view src;
  pool_view dst;
  const std::int32_t* src_slot = nullptr;
  const std::int32_t* dst_slot = nullptr;
  const std::int32_t* layer_of = nullptr;
  int layer = 0;
  int pages = 0;
  std::uint64_t cache_seed = 0;
  int head_base = 0;  // global index of KV head 0: contexts use head_base + head (tensor parallel)
  int* error = nullptr;  // optional: first device errc (0 = ok)
};

namespace detail {

template <class C, int P>
__device__ __forceinline__ void warp_decode_any(const std::uint8_t* payload, typename C::meta_type meta,
                                                std::uint64_t seed, float (&x)[P], int lane) {
  if constexpr (C::format == storage_format::fp8_e4m3) {
    warp_decode_fp8<C, P>(payload, meta, x, lane);
  } else if constexpr (C::format == storage_format::tq3 || C::format == storage_format::tq4) {
    warp_decode_tq<C, P>(payload, meta, seed, x, lane);
  } else if constexpr (C::format == storage_format::int8_rotated) {
    warp_decode_int8r<C, P>(payload, meta, seed, x, lane);
  } else {
    static_assert(tierkv::detail::dependent_false<C>, "retier: source codec must be fp8_e4m3, tq3, tq4 or int8_rotated");
  }
}
template <class C, int P>
__device__ __forceinline__ bool warp_encode_any(const float (&x)[P], std::uint8_t* payload,
                                                typename C::meta_type* meta, std::uint64_t seed, int lane) {
  if constexpr (C::format == storage_format::fp8_e4m3) {
    return warp_encode_fp8<C, P>(x, payload, meta, lane);
  } else if constexpr (C::format == storage_format::tq3 || C::format == storage_format::tq4) {
    return warp_encode_tq<C, P>(x, payload, meta, seed, lane);
  } else if constexpr (C::format == storage_format::int8_rotated) {
    return warp_encode_int8r<C, P>(x, payload, meta, seed, lane);
  } else {
    static_assert(tierkv::detail::dependent_false<C>, "retier: destination codec must be fp8_e4m3, tq3, tq4 or int8_rotated");
    return false;
  }
}

inline constexpr int retier_warps = 8;
// Blocks of a launch: enough to fill an H200 several times over; warps then loop over the
// vectors (grid stride), so a large batch does not pay a block launch per 8 vectors.
inline constexpr std::int64_t retier_max_blocks = 132 * 16;

// One (page, role, head, token) vector per warp iteration; consecutive warps take
// consecutive tokens.
template <class Geometry, class From, class To>
__device__ __forceinline__ void retier_vector(const retier_inputs& in, std::int64_t w, int lane) {
  constexpr int D = Geometry::head_dim, H = Geometry::kv_heads, T = Geometry::page_tokens;
  constexpr int P = D / 32;
  constexpr int per_page = H * T * 2;
  const int i = int(w / per_page);
  const int r = int(w - std::int64_t(i) * per_page);
  const int t = r % T, h = (r / T) % H, role = r / (T * H);
  const std::int32_t s = in.src_slot[i], d = in.dst_slot[i];
  if (s < 0 || std::uint32_t(s) >= in.src.capacity || d < 0 || std::uint32_t(d) >= in.dst.capacity) {
    if (lane == 0 && in.error) atomicCAS(in.error, 0, int(errc::out_of_range));
    return;
  }
  const int layer = in.layer_of ? in.layer_of[i] : in.layer;
  const kv_role kr = role == 0 ? kv_role::key : kv_role::value;
  const std::uint64_t seed = make_codec_context(in.cache_seed, layer, in.head_base + h, kr).seed;
  const std::uint8_t* sp = in.src.page(std::uint32_t(s));
  std::uint8_t* dp = in.dst.page(std::uint32_t(d));
  float x[P];
  bool ok;
  if (role == 0) {
    using SK = typename From::template key_codec<D>;
    using DK = typename To::template key_codec<D>;
    using SL = page_layout<Geometry, SK, typename From::template value_codec<D>>;
    using DL = page_layout<Geometry, DK, typename To::template value_codec<D>>;
    const auto meta = *reinterpret_cast<const typename SK::meta_type*>(sp + SL::key_meta(h, t));
    warp_decode_any<SK, P>(sp + SL::key_payload(h, t), meta, seed, x, lane);
    ok = warp_encode_any<DK, P>(x, dp + DL::key_payload(h, t),
                                reinterpret_cast<typename DK::meta_type*>(dp + DL::key_meta(h, t)), seed, lane);
  } else {
    using SV = typename From::template value_codec<D>;
    using DV = typename To::template value_codec<D>;
    using SL = page_layout<Geometry, typename From::template key_codec<D>, SV>;
    using DL = page_layout<Geometry, typename To::template key_codec<D>, DV>;
    const auto meta = *reinterpret_cast<const typename SV::meta_type*>(sp + SL::value_meta(h, t));
    warp_decode_any<SV, P>(sp + SL::value_payload(h, t), meta, seed, x, lane);
    ok = warp_encode_any<DV, P>(x, dp + DL::value_payload(h, t),
                                reinterpret_cast<typename DV::meta_type*>(dp + DL::value_meta(h, t)), seed, lane);
  }
  if (!ok && lane == 0 && in.error) atomicCAS(in.error, 0, int(errc::non_finite_input));
}

template <class Geometry, class From, class To>
__global__ void __launch_bounds__(retier_warps * 32) retier_kernel(retier_inputs in) {
  const int wib = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const std::int64_t total = std::int64_t(in.pages) * Geometry::kv_heads * Geometry::page_tokens * 2;
  const std::int64_t stride = std::int64_t(gridDim.x) * retier_warps;
  for (std::int64_t w = std::int64_t(blockIdx.x) * retier_warps + wib; w < total; w += stride)
    retier_vector<Geometry, From, To>(in, w, lane);
}

}  // namespace detail

// Enqueues the conversion of in.pages pages from tier From to tier To on `stream`.
// Source and destination pages must not overlap (distinct pools or slots).
template <class Geometry, class From, class To>
status retier(const retier_inputs& in, cudaStream_t stream) {
  constexpr int D = Geometry::head_dim;
  static_assert(D % 32 == 0, "cuda::retier: head_dim must be a multiple of 32 (one warp per vector)");
  using src_layout = page_layout<Geometry, typename From::template key_codec<D>, typename From::template value_codec<D>>;
  using dst_layout = page_layout<Geometry, typename To::template key_codec<D>, typename To::template value_codec<D>>;
  if (in.pages < 0) return status::make(errc::invalid_argument, "retier: pages = ", in.pages, " is negative");
  if (in.pages == 0) return status::ok();
  if (!in.src_slot || !in.dst_slot || !in.src.base || !in.dst.base)
    return status::make(errc::invalid_argument, "retier: src_slot, dst_slot and both pools must be set");
  if (in.src.page_bytes != src_layout::page_bytes)
    return status::make(errc::geometry_mismatch, "retier: src.page_bytes = ", in.src.page_bytes,
                        " but tier From's layout needs ", src_layout::page_bytes);
  if (in.dst.page_bytes != dst_layout::page_bytes)
    return status::make(errc::geometry_mismatch, "retier: dst.page_bytes = ", in.dst.page_bytes,
                        " but tier To's layout needs ", dst_layout::page_bytes);
  const std::int64_t warps = std::int64_t(in.pages) * Geometry::kv_heads * Geometry::page_tokens * 2;
  std::int64_t blocks = (warps + detail::retier_warps - 1) / detail::retier_warps;
  if (blocks > detail::retier_max_blocks) blocks = detail::retier_max_blocks;
  detail::retier_kernel<Geometry, From, To><<<unsigned(blocks), detail::retier_warps * 32, 0, stream>>>(in);
  return check_launch("retier_kernel");
}

}  // namespace tierkv::cuda
