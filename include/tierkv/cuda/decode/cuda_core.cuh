// SPDX-License-Identifier: Apache-2.0
// The CUDA-core split kernel of the mixed-format decode (decode_path::cuda_core, the reference
// GPU path): fp32 FMA per scalar through each format's slice reader, every loaded slice used by
// all query heads of the group.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "tierkv/attention/logits.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/decode/common.cuh"
namespace tierkv::cuda::detail {

template <class Geometry>
struct decode_shape {
  static constexpr int d = Geometry::head_dim;
  static constexpr int g = Geometry::group_size;
  static constexpr int qh = Geometry::q_heads;
  static constexpr int lanes_per_token = d / 16;  // 16 scalars per lane slice
  static constexpr int token_groups = decode_threads / lanes_per_token;
  static constexpr int tile = Geometry::page_tokens < 64 ? Geometry::page_tokens : 64;
  static constexpr int iters = tile / token_groups > 0 ? tile / token_groups : 1;
  // Resident blocks per SM the register budget is set for: g x 16 accumulators per thread
  // fit 168 registers (3 blocks) up to g = 4; g = 5..8 take 2 blocks (255 registers) rather
  // than spill inside the inner loop (ptxas -v, docs/gpu.md).
  static constexpr int min_blocks = g <= 4 ? 3 : 2;
  static_assert(lanes_per_token <= 32, "decode: head_dim above 512 is not supported");
  static_assert(Geometry::page_tokens % tile == 0,
                "decode: page_tokens must be a multiple of 64 or below 64");
  static_assert(
      g <= 8,
      "decode: the CUDA-core decode keeps group_size x 16 accumulators per thread; "
      "group sizes above 8 are not supported (the tensor-core kernel has 8 head columns)");

  // Shared memory in floats.
  static constexpr int q_raw = g * d;      // queries as given (float)
  static constexpr int q_prep = g * d;     // prepared for the current key codec, lane-interleaved
  static constexpr int acc_part = g * d;   // one tier's accumulator (also prepare scratch)
  static constexpr int acc_total = g * d;  // finalized accumulators of the tiers done
  static constexpr int scores = g * tile;
  static constexpr int probs = g * tile;
  static constexpr int vscale = tile;     // per-token value scale / norm of the tile
  static constexpr int per_head = 8 * g;  // m, l, alpha, m_ref, page m, page l
  static constexpr int floats =
      q_raw + q_prep + acc_part + acc_total + scores + probs + vscale + per_head;
  static constexpr std::size_t smem_bytes = std::size_t(floats) * sizeof(float);
};

struct decode_smem {
  float* q_raw;
  float* q_prep;
  float* acc_part;
  float* acc_total;
  float* scores;
  float* probs;
  float* vscale;
  float* m;
  float* l;
  float* alpha;
  float* m_ref;
  float* page_m;
  float* page_l;
};

// The compile-time shape of one tier's pages on the CUDA cores, in one place so the stages of
// decode_tier_pages below agree on a tile.
template <class Geometry, class Tier>
struct cuda_core_tier : tier_codecs<Geometry, Tier> {
  using S = decode_shape<Geometry>;
  using KR = slice_reader<typename tier_codecs<Geometry, Tier>::K>;
  using VR = slice_reader<typename tier_codecs<Geometry, Tier>::V>;
  static constexpr int D = S::d, G = S::g, LPT = S::lanes_per_token, NTG = S::token_groups;
  static constexpr int TILE = S::tile, IT = S::iters, IB = std::min(IT, 4);
};

// A thread's place: its 16-scalar slice of a token, its token group, its warp and lane.
struct cuda_core_lane {
  int tid, slice, tg, warp, lane;
};

// The queries in the key codec's domain (identity for FP8, rotation for TQ3), then laid out so
// lane `slice` reads its 4 float4 without bank conflicts.
template <class C>
__device__ __forceinline__ void cuda_core_prepare_queries(const decode_smem& sm,
                                                          const codec_context& kctx, int tid) {
  using K = typename C::K;
  constexpr int D = C::D, G = C::G, LPT = C::LPT;
  __syncthreads();
  group_prepare_query<K, G>(sm.q_raw, sm.acc_part, kctx);
  __syncthreads();
  for (int i = tid; i < G * D / 4; i += decode_threads) {
    const int h = i / (D / 4), r = i % (D / 4);  // float4 r of head h: slice r/4, quarter r%4
    const float4 v = reinterpret_cast<const float4*>(sm.acc_part + h * D)[r];
    reinterpret_cast<float4*>(sm.q_prep + h * D)[(r % 4) * LPT + r / 4] = v;
  }
  __syncthreads();
}

// The online softmax of the tile, one warp per query head: m, l and the rescale alpha per head,
// the probabilities (x the value scale) -> sm.probs, and the page's mass, tile by tile.
template <class C>
__device__ __forceinline__ void cuda_core_tile_softmax(const decode_smem& sm,
                                                       const cuda_core_lane& at) {
  constexpr int G = C::G, TILE = C::TILE;
  const int warp = at.warp, lane = at.lane;
  for (int h = warp; h < G; h += decode_warps) {
    float tmax = -INFINITY;
    for (int t = lane; t < TILE; t += 32) tmax = fmaxf(tmax, sm.scores[h * TILE + t]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
    const float m_old = sm.m[h];
    const float m_new = fmaxf(m_old, tmax);
    float sum = 0.f;
    for (int t = lane; t < TILE; t += 32) {
      const float s = sm.scores[h * TILE + t];
      const float p = s == -INFINITY ? 0.f : exp2f(s - m_new);
      sum += p;
      sm.probs[h * TILE + t] = p * sm.vscale[t];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    __syncwarp();  // every lane has read m[h] / page state before lane 0 updates them
    if (lane == 0) {
      const float alpha = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
      sm.alpha[h] = alpha;
      sm.m[h] = m_new;
      sm.l[h] = sm.l[h] * alpha + sum;
      // page mass in log2 units: page_m + log2(page_l), tile by tile
      const float pm_old = sm.page_m[h];
      const float pm_new = fmaxf(pm_old, m_new);
      sm.page_l[h] = (pm_old == -INFINITY ? 0.f : sm.page_l[h] * exp2f(pm_old - pm_new)) +
                     sum * exp2f(m_new - pm_new);
      sm.page_m[h] = pm_new;
    }
  }
}

// The end of the tier: the token groups' accumulators folded into acc_part (inside a warp by
// shuffles, then warp after warp: fixed order, deterministic), back to the model's domain
// (identity for FP8, inverse rotation for TQ3), then folded into acc_total.
template <class C>
__device__ __forceinline__ void cuda_core_fold_tier(float (&acc)[C::G][16],
                                                    const codec_context& vctx,
                                                    const decode_smem& sm,
                                                    const cuda_core_lane& at) {
  using V = typename C::V;
  using VR = typename C::VR;
  constexpr int D = C::D, G = C::G, LPT = C::LPT;
  const int tid = at.tid, slice = at.slice, warp = at.warp, lane = at.lane;
#pragma unroll
  for (int off = LPT; off < 32; off <<= 1)
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[h][i] += __shfl_xor_sync(0xffffffffu, acc[h][i], off);
  __syncthreads();
  for (int w = 0; w < decode_warps; ++w) {
    if (warp == w && lane < LPT) {
#pragma unroll
      for (int h = 0; h < G; ++h)
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          float& dst = sm.acc_part[h * D + slice * 16 + i];
          const float v = acc[h][i] * VR::code_scale;
          dst = w == 0 ? v : dst + v;
        }
    }
    __syncthreads();
  }
  // Back to the model's domain once per tier (identity for FP8, inverse rotation for TQ3).
  group_finalize<V, G>(sm.acc_part, vctx);
  __syncthreads();
  for (int i = tid; i < G * D; i += decode_threads) {
    const int h = i / D;
    const float ref = sm.m_ref[h];
    const float scale = ref == -INFINITY ? 0.f : exp2f(ref - sm.m[h]);
    sm.acc_total[i] = sm.acc_total[i] * scale + sm.acc_part[i];
  }
  __syncthreads();
  if (tid < G) sm.m_ref[tid] = sm.m[tid];
  __syncthreads();
}

// One tier's pages of this chunk: keys with the key codec's loop, values with the value
// codec's, every loaded slice used by all g query heads. The running max m continues
// across tiers; the accumulator of each tier is finalized in its own domain and folded
// into acc_total. Per page, tokens [t_lo, ntok) are in the window: the tiles before t_lo's
// are skipped, the rest of the tokens before it masked (t_lo = 0 without a window). Per tile,
// the scores in batches of IB independent 16-byte (TQ3: 12-byte) loads in flight per thread (IB
// bounded so acc + loads stay in registers at 3 blocks per SM), the online softmax, then the
// values from the same slices (p already carries the per-token scale / norm). The cap's code
// runs only when it is on (uniform). The key and value loops stay in this body: as functions of
// their own they changed the kernels' code (per-function SASS, bench/gpu/sass_compare.py).
template <class Geometry, class Tier, int N>
__device__ void decode_tier_pages(const decode_inputs<N>& in, const decode_plan& plan, int f, int b,
                                  int kvh, int e_begin, int e_end, const decode_smem& sm,
                                  float* mass_ws, int* err) {
  using C = cuda_core_tier<Geometry, Tier>;
  using K = typename C::K;
  using V = typename C::V;
  using KR = typename C::KR;
  using VR = typename C::VR;
  constexpr int D = C::D, G = C::G, LPT = C::LPT, NTG = C::NTG;
  constexpr int TILE = C::TILE, IT = C::IT, IB = C::IB;
  const int tid = int(threadIdx.x), slice = tid % LPT, tg = tid / LPT;
  const int warp = tid / 32, lane = tid % 32;
  const codec_context kctx =
      make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::key);
  const codec_context vctx =
      make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::value);
  const float score_scale = in.softmax_scale * log2e * KR::code_scale;
  const soft_cap cap = soft_cap::make<log_base::two>(in.soft_cap);
  const int first = window_first(in, b);  // the window's first position (0 without one)
  const cuda_core_lane at{tid, slice, tg, warp, lane};
  cuda_core_prepare_queries<C>(sm, kctx, tid);
  float acc[G][16];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[h][i] = 0.f;
  const format_pages_view fv = in.index.formats[f];
  const pool_view pool = in.pools[f];
  for (int e = e_begin; e < e_end; ++e) {
    const std::int32_t slot = fv.slot[e], logical = fv.logical[e];
    if (slot < 0 || std::uint32_t(slot) >= pool.capacity || logical < 0) {
      report_error(err, errc::out_of_range);
      continue;  // uniform across the block: every thread reads the same entry
    }
    const int ntok = in.index.tokens_in_page(b, logical, Geometry::page_tokens);
    const head_regions<typename C::layout> hr(pool.page(std::uint32_t(slot)), kvh);
    const int t_lo = first_in_page<Geometry::page_tokens>(logical, first, ntok);
    if (warp == 0 && lane < G) {
      sm.page_m[lane] = -INFINITY;
      sm.page_l[lane] = 0.f;
    }
    for (int t0 = t_lo / TILE * TILE; t0 < ntok; t0 += TILE) {
#pragma unroll
      for (int u0 = 0; u0 < IT; u0 += IB) {
        typename KR::raw kr[IB];
        float km[IB], vm[IB];
#pragma unroll
        for (int uu = 0; uu < IB; ++uu) {
          const int u = u0 + uu;
          const int t = t0 + tg + u * NTG;
          if (u < IT && tg + u * NTG < TILE && t < ntok) {
            kr[uu] = KR::load(hr.keys + std::size_t(t) * K::payload_bytes, slice);
            km[uu] = token_scaled<K> ? bf16_bits_to_float(__ldg(hr.key_meta + t)) : 1.f;
            vm[uu] = token_scaled<V> ? bf16_bits_to_float(__ldg(hr.value_meta + t)) : 1.f;
          }
        }
#pragma unroll
        for (int uu = 0; uu < IB; ++uu) {
          const int u = u0 + uu;
          const int tl = tg + u * NTG;
          if (u >= IT || tl >= TILE) break;
          const bool live = t0 + tl < ntok;
          float dot[G];
#pragma unroll
          for (int h = 0; h < G; ++h) dot[h] = 0.f;
          if (live) {
            float x[16];
            KR::unpack(kr[uu], slice, x);
#pragma unroll
            for (int h = 0; h < G; ++h) {
              const float4* q4 = reinterpret_cast<const float4*>(sm.q_prep + h * D);
#pragma unroll
              for (int qq = 0; qq < 4; ++qq) {
                const float4 q = q4[qq * LPT + slice];
                dot[h] = fmaf(q.x, x[4 * qq + 0], dot[h]);
                dot[h] = fmaf(q.y, x[4 * qq + 1], dot[h]);
                dot[h] = fmaf(q.z, x[4 * qq + 2], dot[h]);
                dot[h] = fmaf(q.w, x[4 * qq + 3], dot[h]);
              }
            }
          }
#pragma unroll
          for (int off = 1; off < LPT; off <<= 1)
#pragma unroll
            for (int h = 0; h < G; ++h) dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], off);
          if (slice == 0) {
            float z[G];
#pragma unroll
            for (int h = 0; h < G; ++h) z[h] = dot[h] * km[uu] * score_scale;
            if (cap.on()) {  // in log2 units, on the MUFU unit
#pragma unroll
              for (int h = 0; h < G; ++h) z[h] = cap.apply(z[h], mufu_exp2{}, mufu_rcp{});
            }
            const bool seen = unsigned(t0 + tl - t_lo) < unsigned(ntok - t_lo);
#pragma unroll
            for (int h = 0; h < G; ++h) sm.scores[h * TILE + tl] = seen ? z[h] : -INFINITY;
            sm.vscale[tl] = live ? vm[uu] : 0.f;
          }
        }
      }
      __syncthreads();
      cuda_core_tile_softmax<C>(sm, at);
      __syncthreads();
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float a = sm.alpha[h];
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[h][i] *= a;
      }
#pragma unroll
      for (int u0 = 0; u0 < IT; u0 += IB) {
        typename VR::raw vr[IB];
#pragma unroll
        for (int uu = 0; uu < IB; ++uu) {
          const int u = u0 + uu;
          const int t = t0 + tg + u * NTG;
          if (u < IT && tg + u * NTG < TILE && t < ntok)
            vr[uu] = VR::load(hr.values + std::size_t(t) * V::payload_bytes, slice);
        }
#pragma unroll
        for (int uu = 0; uu < IB; ++uu) {
          const int u = u0 + uu;
          const int tl = tg + u * NTG;
          if (u >= IT || tl >= TILE || t0 + tl >= ntok) break;
          float x[16];
          VR::unpack(vr[uu], slice, x);
#pragma unroll
          for (int h = 0; h < G; ++h) {
            const float p = sm.probs[h * TILE + tl];
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[h][i] = fmaf(p, x[i], acc[h][i]);
          }
        }
      }
    }
    if (mass_ws != nullptr && warp == 0 && lane < G) {
      if (logical < plan.max_pages) {
        const std::size_t row =
            std::size_t(b) * C::S::qh + std::size_t(kvh) * G + std::size_t(lane);
        constexpr int SL = mass_slots_per_page<Geometry>;
        float* slots = mass_ws + (row * std::size_t(plan.max_pages) + std::size_t(logical)) * SL;
        slots[0] = sm.page_m[lane] + log2f(sm.page_l[lane]);  // the whole page in its first slot
        for (int k = 1; k < SL; ++k) slots[k] = -INFINITY;
      } else {
        report_error(err, errc::out_of_range);
      }
    }
  }
  cuda_core_fold_tier<C>(acc, vctx, sm, at);
}

// grid (kv_heads, max_chunks, batch); decode_finish (decode/common.cuh) merges the chunk states.
template <class Geometry, class TierList>
struct cuda_core_kernels;

template <class Geometry, class... Tiers>
struct cuda_core_kernels<Geometry, tiers<Tiers...>> {
  static constexpr int N = int(sizeof...(Tiers));
  using S = decode_shape<Geometry>;

  // One chunk (run_split_block, decode/common.cuh): its tiers' pages, then its state to the
  // workspace.
  static __device__ __forceinline__ void chunk(const decode_inputs<N>& in, const decode_plan& plan,
                                               std::uint8_t* workspace, int kvh, int c, int b,
                                               const chunking<N>& ch, const std::int64_t (&cost)[N],
                                               int* err, float* mass_ws) {
    constexpr int D = S::d, G = S::g;
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    decode_smem sm;
    sm.q_raw = smem;
    sm.q_prep = sm.q_raw + S::q_raw;
    sm.acc_part = sm.q_prep + S::q_prep;
    sm.acc_total = sm.acc_part + S::acc_part;
    sm.scores = sm.acc_total + S::acc_total;
    sm.probs = sm.scores + S::scores;
    sm.vscale = sm.probs + S::probs;
    sm.m = sm.vscale + S::vscale;
    sm.l = sm.m + G;
    sm.alpha = sm.l + G;
    sm.m_ref = sm.alpha + G;
    sm.page_m = sm.m_ref + G;
    sm.page_l = sm.page_m + G;

    const int tid = int(threadIdx.x);
    const std::size_t qrow = std::size_t(b) * S::qh + std::size_t(kvh) * G;
    load_group_queries<G, D>(in, qrow, sm.q_raw, sm.acc_total);
    if (tid < G) {
      sm.m[tid] = -INFINITY;
      sm.l[tid] = 0.f;
      sm.m_ref[tid] = -INFINITY;
    }
    run_tiers(in, plan, ch, cost, c, b, kvh, sm, mass_ws, err, std::make_index_sequence<N>{});
    __syncthreads();  // a chunk without pages ran no tier: order the init before the write

    store_chunk_state<G, D>(plan, workspace, qrow, c, sm.m, sm.l, sm.acc_total);
  }

  template <std::size_t... I>
  static __device__ void run_tiers(const decode_inputs<N>& in, const decode_plan& plan,
                                   const chunking<N>& ch, const std::int64_t (&cost)[N], int c,
                                   int b, int kvh, const decode_smem& sm, float* mass_ws, int* err,
                                   std::index_sequence<I...>) {
    (run_tier<int(I), Tiers>(in, plan, ch, cost, c, b, kvh, sm, mass_ws, err), ...);
  }
  template <int F, class Tier>
  static __device__ void run_tier(const decode_inputs<N>& in, const decode_plan& plan,
                                  const chunking<N>& ch, const std::int64_t (&cost)[N], int c,
                                  int b, int kvh, const decode_smem& sm, float* mass_ws, int* err) {
    int lo = 0, hi = 0;
    chunk_range<N>(ch, cost, c, F, lo, hi);
    lo += ch.first[F];
    hi += ch.first[F];
    if (in.window > 0 && hi > lo)  // the pages wholly before the window are not read
      lo = first_window_entry<Geometry::page_tokens>(in.index.formats[F], lo, hi,
                                                     window_first(in, b));
    if (hi > lo)
      decode_tier_pages<Geometry, Tier, N>(in, plan, F, b, kvh, lo, hi, sm, mass_ws, err);
  }
};

template <class Geometry, class TierList>
__global__ void __launch_bounds__(decode_threads, decode_shape<Geometry>::min_blocks)
    decode_split_kernel(decode_inputs<TierList::size> in, decode_plan plan,
                        std::uint8_t* workspace) {
  allow_dependent_launch();
  run_split_block<cuda_core_kernels<Geometry, TierList>>(in, plan, workspace);
}

}  // namespace tierkv::cuda::detail
