// SPDX-License-Identifier: Apache-2.0
// Retier kernels: convert whole pages between two tiers (FP8 -> TQ3 demotion, TQ3 -> FP8
// promotion, or any pair of supported formats) over a list of (source, destination) page
// slots, on the caller's stream. Codes equal the host codecs' decode-then-encode bit for bit
// (tests/cuda/retier.cpp).
//
// A token vector is held by a lane group of G = d/64 lanes, 64 coordinates each (one lane
// below d = 128; warp/lane_group.cuh), so a warp converts 32/G consecutive tokens of one (page,
// role, head) per iteration: the canonical sums and most of the Walsh-Hadamard run in
// registers rather than through warp shuffles (one warp per vector spent ~66 shuffles per
// vector and was instruction-bound), the per-page work (slot checks, page pointers, codec seed)
// is done once per 32/G vectors, and an FP8 source is read as its code values with the scale
// folded into the encoder's power-of-two multiply and the rotation's signs flipped on the codes.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/codec/formats.cuh"

namespace tierkv::cuda {

/// Page i of the list: src.page(src_slot[i]) (tier From) -> dst.page(dst_slot[i]) (tier To),
/// layer layer_of[i] (or `layer` for all when layer_of is null; codec contexts depend on it).
/// All page_tokens slots are converted: retier seals pages, so they are full. A NaN-poisoned
/// or non-finite source vector gives the destination codec's poison and errc::non_finite_input.
struct retier_inputs {
  pool_view src;                           ///< source pool (tier From), device-addressable
  pool_view dst;                           ///< destination pool (tier To), device-addressable
  const std::int32_t* src_slot = nullptr;  ///< device [pages] source pool slots
  const std::int32_t* dst_slot = nullptr;  ///< device [pages] destination pool slots
  const std::int32_t* layer_of = nullptr;  ///< optional device [pages] layer of each page
  int layer = 0;                           ///< layer of every page when layer_of is null
  int pages = 0;                           ///< pages in the list
  /// Codec contexts: make_codec_context(seed, layer, head_base + head, role)
  std::uint64_t cache_seed = 0;
  /// Global index of KV head 0: contexts use head_base + head (tensor parallel)
  int head_base = 0;
  int* error = nullptr;  ///< optional: first device errc (0 = ok)
  /// optional device [pages]: each page's first errc (0 = ok; a nonzero value on entry stays),
  /// so a caller can fail one page of a list and keep the rest (cuda/retier/driver.cuh)
  int* page_error = nullptr;
};

namespace detail {

// A page's failure: the list's first error, and the page's own.
__device__ inline void report_page_error(const retier_inputs& in, unsigned page, errc e) {
  if (in.error) atomicCAS(in.error, 0, int(e));
  if (in.page_error) atomicCAS(in.page_error + page, 0, int(e));
}

// Whether a row's vectors take the rotation's D on sign-coded (FP8) codes: such a source's for a
// rotated destination (warp_decode_fp8), such a destination's for a rotated source
// (warp_encode_fp8).
template <class SC, class DC, int N>
inline constexpr bool fp8_signs = N % 16 == 0 &&
                                  ((device_codec<SC>::sign_coded && rotated_format<DC>) ||
                                   (rotated_format<SC> && device_codec<DC>::sign_coded));
// Those masks (Runs: for a decoded vector in runs), made once per row in the warp's shared
// `area`; nothing for other pairs.
template <bool Used, int N, int G, bool Runs>
struct row_signs {
  __device__ row_signs(std::uint64_t, uint4*, int) {}
  __device__ const e4m3_sign_masks<N, G, Runs>* get() const { return nullptr; }
};
template <int N, int G, bool Runs>
struct row_signs<true, N, G, Runs> {
  e4m3_sign_masks<N, G, Runs> masks;
  __device__ row_signs(std::uint64_t seed, uint4* area, int lane) : masks{area} {
    masks.make(seed, lane);
  }
  __device__ const e4m3_sign_masks<N, G, Runs>* get() const { return &masks; }
};

// The source vector (FP8: factored, the scale apart) and the destination encode
// (device_codec<C>::warp_decode / warp_encode). Where either side is rotated (same seed) the
// vector comes as D x (lane_vector's Signed): an FP8 source flips its codes' signs (`signs`),
// a rotated source leaves out its last D, and a rotated encoder its first, an FP8 one flips
// its codes' signs. A rotated source decodes in runs where its lane_exchange `ex` has them
// (for an FP8 encoder).
template <class C, int N, bool Signed, class Signs, class Exchange>
__device__ __forceinline__ auto warp_decode_any(const std::uint8_t* payload,
                                                typename C::meta_type meta, std::uint64_t seed,
                                                const Signs* signs, const Exchange& ex, int lane) {
  return device_codec<C>::template warp_decode<N, Signed>(payload, meta, seed, signs, ex, lane);
}
template <class C, int N, bool F, bool S, bool R, class Exchange, int G>
__device__ __forceinline__ bool warp_encode_any(const lane_vector<N, F, S, R>& v,
                                                std::uint8_t* payload, typename C::meta_type* meta,
                                                std::uint64_t seed, int lane, tq_norm norm,
                                                const Exchange& ex,
                                                const e4m3_sign_masks<N, G, R>* signs) {
  return device_codec<C>::template warp_encode<N>(v, payload, meta, seed, lane, norm, ex, signs);
}

// The layout exchanges (warp/rotation.cuh), where runs hold whole canonical lanes (d <= 256): an
// exchange_encode encoder's (TQ3) for an unrotated source in a one-path pair, and a rotated
// decoder's for a stores_runs destination (FP8); none for other pairs (device_codec.cuh's
// policy traits).
template <bool Used, int N, int G>
using exchange_if = std::conditional_t<Used && 32 % (G * G) == 0 && N % (8 * G) == 0,
                                       lane_exchange<N, G>, no_exchange>;
template <class SC, class DC, int N, int G, bool OnePath>
using encode_exchange =
    exchange_if<OnePath && !rotated_format<SC> && device_codec<DC>::exchange_encode, N, G>;
template <class SC, class DC, int N, int G>
using decode_exchange = exchange_if<rotated_format<SC> && device_codec<DC>::stores_runs, N, G>;
// Hidden from Doxygen 1.9, which cannot resolve the member accesses in this expression.
/// \cond
template <class SC, class DC, int N, int G, bool OnePath>
inline constexpr int exchange_float4s =  // per warp
    encode_exchange<SC, DC, N, G, OnePath>::float4s > decode_exchange<SC, DC, N, G>::float4s
        ? encode_exchange<SC, DC, N, G, OnePath>::float4s
        : decode_exchange<SC, DC, N, G>::float4s;
/// \endcond
template <class X>
__device__ __forceinline__ X make_exchange(float4* area) {
  if constexpr (X::runs)
    return X{area};
  else
    return X{};
}

// Lanes per vector: the largest power of two <= d/64 (64 coordinates per lane at d = 64, 128,
// 256, 512), one lane per vector below d = 128, at most 32.
constexpr int retier_lanes(int d) {
  int g = 1;
  while (g < 32 && 2 * g * 64 <= d) g *= 2;
  return g;
}

// Units of 32/G vectors a warp converts per task: a whole row of page_tokens tokens (one kv
// head and role), so the row's seed work is shared; one where 32/G does not divide page_tokens.
template <class Geometry>
inline constexpr int units_per_row =
    Geometry::page_tokens % (32 / retier_lanes(Geometry::head_dim)) == 0
        ? Geometry::page_tokens / (32 / retier_lanes(Geometry::head_dim))
        : 1;

inline constexpr int retier_warps = 4;       // 128 threads per block
inline constexpr int retier_min_blocks = 4;  // per SM: at most 128 registers per thread
// Blocks of a launch: enough to fill an H200 several times over; warps then loop over the
// work (grid stride), so a large batch does not pay a block launch per few vectors.
inline constexpr std::int64_t retier_max_blocks = 132 * 16;

// Whether a tier keeps keys and values in one format (FP8, int8_rotated, TQ3: the key and value
// codecs then differ at most in TQ's norm): a retier between two such tiers runs one code path
// for both roles, the role choosing page offsets and the norm at run time (half the code).
template <class Tier, int D>
inline constexpr bool one_format =
    Tier::template key_codec<D>::format == Tier::template value_codec<D>::format;
template <class From, class To, int D>
inline constexpr bool roles_alike = one_format<From, D>&& one_format<To, D>;

// The vectors of this lane's row (kv head h, tokens t, t + 32/G, ... below units_per_row * 32/G
// further on) of a page: decode with From's codecs, encode with To's. Role 0 / 1: the key / value
// codecs; Role 2 (roles_alike): the key codecs' code, with the value role's offsets and norm
// where `value`. The row's seed work (the FP8 sign masks) is done once. False if any vector was
// non-finite (its destination holds the codec's poison).
template <class Geometry, class From, class To, int Role>
__device__ __forceinline__ bool retier_row(const std::uint8_t* sp, std::uint8_t* dp, int h, int t,
                                           bool value, std::uint64_t seed, float4* area,
                                           uint4* mask_area, int lane) {
  constexpr int D = Geometry::head_dim, G = retier_lanes(D), N = D / G, V = 32 / G;
  using SL = page_layout<Geometry, typename From::template key_codec<D>,
                         typename From::template value_codec<D>>;
  using DL = page_layout<Geometry, typename To::template key_codec<D>,
                         typename To::template value_codec<D>>;
  using SC = std::conditional_t<Role == 1, typename SL::value_codec, typename SL::key_codec>;
  using DC = std::conditional_t<Role == 1, typename DL::value_codec, typename DL::key_codec>;
  const bool v_role = Role == 1 || (Role == 2 && value);
  const std::uint8_t* s_payload = sp + (v_role ? SL::value_payload(h, t) : SL::key_payload(h, t));
  const std::uint8_t* s_meta = sp + (v_role ? SL::value_meta(h, t) : SL::key_meta(h, t));
  std::uint8_t* d_payload = dp + (v_role ? DL::value_payload(h, t) : DL::key_payload(h, t));
  std::uint8_t* d_meta = dp + (v_role ? DL::value_meta(h, t) : DL::key_meta(h, t));
  tq_norm norm = tq_norm::plain;  // TQ destinations: the role's alpha correction
  if constexpr (requires { DC::norm; }) {
    if constexpr (Role == 2)  // one format for both roles (both TQ), the role chosen at run time
      norm = value ? DL::value_codec::norm : DL::key_codec::norm;
    else  // DC is the role's codec (the other role's may have no norm: int8_rotated keys)
      norm = DC::norm;
  }
  constexpr bool signed_vector =
      rotated_format<DC> || fp8_signs<SC, DC, N>;  // the vector comes as D x
  using DX = decode_exchange<SC, DC, N, G>;
  const row_signs<fp8_signs<SC, DC, N>, N, G, DX::runs> signs(seed, mask_area, lane);
  const auto dx = make_exchange<DX>(area);
  const auto ex = make_exchange<encode_exchange<SC, DC, N, G, Role == 2>>(area);
  bool ok = true;
#pragma unroll 1
  for (int u = 0; u < units_per_row<Geometry>; ++u) {
    const auto v = warp_decode_any<SC, N, signed_vector>(
        s_payload + std::size_t(u) * V * SC::payload_bytes,
        reinterpret_cast<const typename SC::meta_type*>(s_meta)[u * V], seed, signs.get(), dx,
        lane);
    ok &= warp_encode_any<DC, N>(v, d_payload + std::size_t(u) * V * DC::payload_bytes,
                                 reinterpret_cast<typename DC::meta_type*>(d_meta) + u * V, seed,
                                 lane, norm, ex, signs.get());
  }
  return ok;
}

// Work unit (task): the units_per_row * 32/G consecutive vectors of a page from one of its
// (role, head) rows (in-page order role, head, token; G lanes per vector), or, where a row holds
// fewer than 32/G vectors, 32/G vectors over consecutive rows. Pages hold 2 * kv_heads *
// page_tokens vectors, a multiple of 32 (page_tokens % 16 == 0): tasks never straddle pages.
// The slot checks, page pointers, codec seed and sign masks are worked out once per task (not
// per 32/G vectors); (page, task) advance by the grid's warp count in 32-bit arithmetic.
template <class Geometry, class From, class To>
__global__ void __launch_bounds__(retier_warps * 32, retier_min_blocks)
    retier_kernel(retier_inputs in) {
  constexpr int H = Geometry::kv_heads, T = Geometry::page_tokens;
  constexpr int G = retier_lanes(Geometry::head_dim), V = 32 / G, W = units_per_row<Geometry> * V;
  constexpr unsigned tasks = unsigned(2 * H * T / W);
  static_assert((2 * H * T) % W == 0, "retier: a page holds whole tasks");
  const int lane = int(threadIdx.x) % 32;
  const unsigned warp = blockIdx.x * unsigned(retier_warps) + threadIdx.x / 32;
  const unsigned warps = gridDim.x * unsigned(retier_warps);
  const unsigned di = warps / tasks, dr = warps % tasks;
  unsigned i = warp / tasks, r = warp % tasks;
  constexpr int D = Geometry::head_dim;
  using FK = typename From::template key_codec<D>;
  using FV = typename From::template value_codec<D>;
  using TK = typename To::template key_codec<D>;
  using TV = typename To::template value_codec<D>;
  constexpr bool one_path = roles_alike<From, To, D>;
  constexpr int kx = exchange_float4s<FK, TK, D / G, G, one_path>,
                vx = exchange_float4s<FV, TV, D / G, G, one_path>;
  constexpr int area_float4s = kx > vx ? kx : vx;  // per warp
  float4* area = nullptr;
  if constexpr (area_float4s > 0) {
    __shared__ float4 exchange_area[retier_warps * area_float4s];
    area = exchange_area + threadIdx.x / 32 * area_float4s;
  }
  uint4* mask_area = nullptr;
  if constexpr (fp8_signs<FK, TK, D / G> || fp8_signs<FV, TV, D / G>) {
    constexpr int per_warp = e4m3_sign_masks<D / G, G>::uint4s;
    __shared__ uint4 sign_masks[retier_warps * per_warp];
    mask_area = sign_masks + threadIdx.x / 32 * per_warp;
  }
  while (i < unsigned(in.pages)) {
    const std::int32_t s = in.src_slot[i], d = in.dst_slot[i];
    if (s < 0 || std::uint32_t(s) >= in.src.capacity || d < 0 ||
        std::uint32_t(d) >= in.dst.capacity) {
      if (lane == 0) detail::report_page_error(in, i, errc::out_of_range);
    } else {
      const int layer = in.layer_of ? in.layer_of[i] : in.layer;
      const int v = int(r) * W + lane / G;  // (role * H + h) * T + t
      const int t = v % T, row = v / T, h = row % H, role = row / H;
      const std::uint64_t seed = make_codec_context(in.cache_seed, layer, in.head_base + h,
                                                    role == 0 ? kv_role::key : kv_role::value)
                                     .seed;
      const std::uint8_t* sp = in.src.page(std::uint32_t(s));
      std::uint8_t* dp = in.dst.page(std::uint32_t(d));
      bool ok;
      if constexpr (roles_alike<From, To, Geometry::head_dim>)
        ok =
            retier_row<Geometry, From, To, 2>(sp, dp, h, t, role != 0, seed, area, mask_area, lane);
      else
        ok = role == 0 ? retier_row<Geometry, From, To, 0>(sp, dp, h, t, false, seed, area,
                                                           mask_area, lane)
                       : retier_row<Geometry, From, To, 1>(sp, dp, h, t, true, seed, area,
                                                           mask_area, lane);
      if (!ok && lane % G == 0) detail::report_page_error(in, i, errc::non_finite_input);
    }
    i += di;
    r += dr;
    if (r >= tasks) {
      r -= tasks;
      ++i;
    }
  }
}

}  // namespace detail

/// Enqueues the conversion of in.pages pages from tier From to tier To on `stream`.
/// Source and destination pages must not overlap (distinct pools or slots).
template <class Geometry, class From, class To>
status retier(const retier_inputs& in, cudaStream_t stream) {
  constexpr int D = Geometry::head_dim;
  static_assert(D % 32 == 0,
                "cuda::retier: head_dim must be a multiple of 32 (canonical 32-lane sums)");
  using src_layout = page_layout<Geometry, typename From::template key_codec<D>,
                                 typename From::template value_codec<D>>;
  using dst_layout = page_layout<Geometry, typename To::template key_codec<D>,
                                 typename To::template value_codec<D>>;
  if (in.pages < 0)
    return status::make(errc::invalid_argument, "retier: pages = ", in.pages, " is negative");
  if (in.pages == 0) return status::ok();
  if (!in.src_slot || !in.dst_slot || !in.src.base || !in.dst.base)
    return status::make(errc::invalid_argument,
                        "retier: src_slot, dst_slot and both pools must be set");
  if (in.src.page_bytes != src_layout::page_bytes)
    return status::make(errc::geometry_mismatch, "retier: src.page_bytes = ", in.src.page_bytes,
                        " but tier From's layout needs ", src_layout::page_bytes);
  if (in.dst.page_bytes != dst_layout::page_bytes)
    return status::make(errc::geometry_mismatch, "retier: dst.page_bytes = ", in.dst.page_bytes,
                        " but tier To's layout needs ", dst_layout::page_bytes);
  constexpr int vectors_per_warp = 32 / detail::retier_lanes(D) * detail::units_per_row<Geometry>;
  const std::int64_t warps =
      std::int64_t(in.pages) * Geometry::kv_heads * Geometry::page_tokens * 2 / vectors_per_warp;
  std::int64_t blocks = (warps + detail::retier_warps - 1) / detail::retier_warps;
  if (blocks > detail::retier_max_blocks) blocks = detail::retier_max_blocks;
  detail::retier_kernel<Geometry, From, To>
      <<<unsigned(blocks), detail::retier_warps * 32, 0, stream>>>(in);
  return check_launch("retier_kernel");
}

}  // namespace tierkv::cuda
