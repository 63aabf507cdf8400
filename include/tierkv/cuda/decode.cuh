// SPDX-License-Identifier: Apache-2.0
// Mixed-format paged decode attention for one layer over a batch, split over
// (sequence, KV head, chunk of pages) and merged by log-sum-exp in a second kernel.
// Two split kernels behind one plan / workspace / merge: the tensor-core kernel
// (detail/decode_mma.cuh, the default) and the CUDA-core kernel below (decode_path::cuda_core).
// Design, instruction counts and measurements: docs/gpu.md.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <utility>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/decode_plan.cuh"
#include "tierkv/cuda/slice_unpack.cuh"
#include "tierkv/cuda/warp_vector.cuh"
#include "tierkv/memory/page_layout.hpp"
#include "tierkv/paging/index_view.hpp"

namespace tierkv::cuda {

enum class query_type : std::uint8_t { f32 = 0, bf16 = 1 };

// One layer's decode step. Device pointers; `index` and `pools` in the cache's tier order.
template <int NumFormats>
struct decode_inputs {
  batch_index_view<NumFormats> index;  // batch, seq_len[b], one CSR per format
  pool_view pools[NumFormats];
  const void* queries = nullptr;       // [batch][q_heads][head_dim], post-RoPE
  query_type queries_type = query_type::f32;
  float softmax_scale = 0.f;           // natural-log units, usually 1/sqrt(head_dim)
  std::uint64_t cache_seed = 0;        // codec contexts: make_codec_context(seed, layer, head_base + head, role)
  int head_base = 0;                   // global index of KV head 0 (a tensor-parallel rank's first head)
  int layer = 0;
  float* out = nullptr;                // [batch][q_heads][head_dim]
  float* lse = nullptr;                // optional [batch][q_heads], natural log; -inf when empty
  // Optional, needs plan.page_mass: [batch][page_mass_stride]; entry (b, i) = softmax mass of
  // logical page i averaged over the layer's q_heads (sums to 1 per non-empty sequence).
  float* page_mass = nullptr;
  int page_mass_stride = 0;
};

namespace detail {

inline constexpr int decode_threads = 128;
inline constexpr int decode_warps = decode_threads / 32;
inline constexpr float log2e = 1.4426950408889634f;

template <class Geometry>
struct decode_shape {
  static constexpr int d = Geometry::head_dim;
  static constexpr int g = Geometry::group_size;
  static constexpr int qh = Geometry::q_heads;
  static constexpr int lanes_per_token = d / 16;       // 16 scalars per lane slice
  static constexpr int token_groups = decode_threads / lanes_per_token;
  static constexpr int tile = Geometry::page_tokens < 64 ? Geometry::page_tokens : 64;
  static constexpr int iters = tile / token_groups > 0 ? tile / token_groups : 1;
  // Resident blocks per SM the register budget is set for: g x 16 accumulators per thread
  // fit 168 registers (3 blocks) up to g = 4; g = 5..8 take 2 blocks (255 registers) rather
  // than spill inside the inner loop (ptxas -v, docs/gpu.md).
  static constexpr int min_blocks = g <= 4 ? 3 : 2;
  static_assert(lanes_per_token <= 32, "decode: head_dim above 512 is not supported");
  static_assert(Geometry::page_tokens % tile == 0, "decode: page_tokens must be a multiple of 64 or below 64");
  static_assert(g <= 8,
                "decode: the CUDA-core decode keeps group_size x 16 accumulators per thread; "
                "group sizes above 8 are not supported (the tensor-core kernel has 8 head columns)");

  // Shared memory in floats.
  static constexpr int q_raw = g * d;      // queries as given (float)
  static constexpr int q_prep = g * d;     // prepared for the current key codec, lane-interleaved
  static constexpr int acc_part = g * d;   // one tier's accumulator (also prepare scratch)
  static constexpr int acc_total = g * d;  // finalized accumulators of the tiers done
  static constexpr int scores = g * tile;
  static constexpr int probs = g * tile;
  static constexpr int vscale = tile;      // per-token value scale / norm of the tile
  static constexpr int per_head = 8 * g;   // m, l, alpha, m_ref, page m, page l
  static constexpr int floats = q_raw + q_prep + acc_part + acc_total + scores + probs + vscale + per_head;
  static constexpr std::size_t smem_bytes = std::size_t(floats) * sizeof(float);
};

// Per-sequence chunking shared by the decode and merge kernels (same arithmetic, so the
// merge knows which chunk states exist without any extra buffer). When a sequence gets at
// least one chunk per format it holds, chunks never mix formats: format f gets per[f] of the
// C chunks (largest remainder of C x its share of the cost, at least 1), each an equal
// slice of its pages. A mixed chunk would run two tier passes one after the other, and its
// warps' pages of both formats add up (H200, (24,4,256) 32K B=1: tiered 73 us vs 51 / 53 us
// for all-FP8 / all-TQ3). Otherwise (C below the number of formats) chunks take equal
// shares of the concatenated cost line, format after format.
template <int N>
struct chunking {
  std::int64_t total = 0;
  int chunks = 0;
  bool by_format = false;
  int count[N];
  int first[N];
  int per[N];    // by_format: chunks of format f
  int start[N];  // by_format: its first chunk
};

template <int N>
__device__ __forceinline__ chunking<N> chunk_sequence(const batch_index_view<N>& index, int b,
                                                      const std::int64_t (&cost)[N],
                                                      std::int64_t target, int max_chunks) {
  chunking<N> c;
  int pages = 0, formats = 0;
#pragma unroll
  for (int f = 0; f < N; ++f) {
    c.first[f] = index.formats[f].indptr[b];
    c.count[f] = index.formats[f].indptr[b + 1] - c.first[f];
    if (c.count[f] < 0) c.count[f] = 0;
    c.total += std::int64_t(c.count[f]) * cost[f];
    pages += c.count[f];
    formats += c.count[f] > 0;
  }
  c.chunks = sequence_chunks(c.total, pages, target, max_chunks);
  c.by_format = formats > 1 && c.chunks >= formats;
  if (c.by_format) {
    int assigned = 0;
#pragma unroll
    for (int f = 0; f < N; ++f) {
      const std::int64_t t = std::int64_t(c.count[f]) * cost[f];
      c.per[f] = c.count[f] > 0 ? int(div_floor(std::int64_t(c.chunks) * t, c.total)) : 0;
      if (c.count[f] > 0 && c.per[f] < 1) c.per[f] = 1;
      if (c.per[f] > c.count[f]) c.per[f] = c.count[f];
      assigned += c.per[f];
    }
    // Settle the sum to C: take from the format with the least cost per chunk (> 1 chunk),
    // give to the one with the most (that has pages to spare). Fewer than N rounds each.
    while (assigned > c.chunks) {
      int best = -1;
      for (int f = 0; f < N; ++f)
        if (c.per[f] > 1 && (best < 0 || std::int64_t(c.count[f]) * cost[f] * c.per[best] <
                                             std::int64_t(c.count[best]) * cost[best] * c.per[f]))
          best = f;
      if (best < 0) break;
      --c.per[best];
      --assigned;
    }
    while (assigned < c.chunks) {
      int best = -1;
      for (int f = 0; f < N; ++f)
        if (c.per[f] > 0 && c.per[f] < c.count[f] &&
            (best < 0 || std::int64_t(c.count[f]) * cost[f] * c.per[best] >
                             std::int64_t(c.count[best]) * cost[best] * c.per[f]))
          best = f;
      if (best < 0) break;
      ++c.per[best];
      ++assigned;
    }
    c.chunks = assigned;  // <= the C above: never more states than the plan's max_chunks
    int s = 0;
#pragma unroll
    for (int f = 0; f < N; ++f) {
      c.start[f] = s;
      s += c.per[f];
    }
  }
  return c;
}

// Entries [lo, hi) of format f that chunk k reads: by format, slice k - start[f] of per[f]
// equal slices of the format's pages; otherwise the entries whose start offset on the
// concatenated cost line falls in chunk k's share [k*T/C, (k+1)*T/C).
template <int N>
__device__ __forceinline__ void chunk_range(const chunking<N>& c, const std::int64_t (&cost)[N],
                                            int k, int f, int& lo, int& hi) {
  if (c.by_format) {
    const int j = k - c.start[f];
    if (j < 0 || j >= c.per[f]) {
      lo = hi = 0;
      return;
    }
    lo = int(div_floor(std::int64_t(c.count[f]) * j, c.per[f]));
    hi = int(div_floor(std::int64_t(c.count[f]) * (j + 1), c.per[f]));
    return;
  }
  const std::int64_t a = div_floor(c.total * k, c.chunks);
  const std::int64_t z = div_floor(c.total * (k + 1), c.chunks);
  std::int64_t base = 0;
  for (int i = 0; i < f; ++i) base += std::int64_t(c.count[i]) * cost[i];
  auto first_at_or_after = [&](std::int64_t x) {
    if (x <= base) return std::int64_t(0);
    std::int64_t i = div_floor(x - base + cost[f] - 1, cost[f]);
    return i > c.count[f] ? std::int64_t(c.count[f]) : i;
  };
  lo = int(first_at_or_after(a));
  hi = int(first_at_or_after(z));
}

// One KV head's regions of a page: key / value payload rows and their bf16 metas.
template <class Layout>
struct head_regions {
  const std::uint8_t* keys;
  const std::uint8_t* values;
  const std::uint16_t* key_meta;
  const std::uint16_t* value_meta;
  __device__ __forceinline__ head_regions(const std::uint8_t* page, int kvh)
      : keys(page + Layout::key_payload(kvh, 0)),
        values(page + Layout::value_payload(kvh, 0)),
        key_meta(reinterpret_cast<const std::uint16_t*>(page + Layout::key_meta(kvh, 0))),
        value_meta(reinterpret_cast<const std::uint16_t*>(page + Layout::value_meta(kvh, 0))) {}
};

__device__ __forceinline__ void report_error(int* flag, errc e) {
  if (flag) atomicCAS(flag, 0, int(e));
}

// The group's G x D queries (bf16 or f32) -> q_raw, and acc_total <- 0, by the block. Whole
// 16-byte units per thread, every load issued before the first store: one element per
// iteration put an L2 round trip per element on every chunk's start (ncu, (24,4,256) 32K
// B = 1: 3.5% of the split kernel's stall samples).
template <int G, int D, class Inputs>
__device__ __forceinline__ void load_group_queries(const Inputs& in, std::size_t qrow, float* q_raw, float* acc_total) {
  constexpr int V = G * D / 4;  // float4 units
  constexpr int per = (V + decode_threads - 1) / decode_threads;
  static_assert(D % 4 == 0, "decode: head_dim must be a multiple of 4");
  const int tid = int(threadIdx.x);
  const bool bf16 = in.queries_type == query_type::bf16;
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(in.queries) + qrow * D * (bf16 ? 2 : 4);
  if (base % (bf16 ? 8 : 16) != 0) {  // an unaligned caller buffer: element by element
    for (int i = tid; i < G * D; i += decode_threads) {
      const std::size_t at = qrow * D + std::size_t(i);
      q_raw[i] = bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(in.queries)[at])
                      : static_cast<const float*>(in.queries)[at];
      acc_total[i] = 0.f;
    }
    return;
  }
  float4 v[per];
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int i = tid + k * decode_threads;
    if (i < V) {
      if (bf16) {
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(base) + i);
        v[k] = make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u), __uint_as_float(w.y << 16),
                           __uint_as_float(w.y & 0xffff0000u));
      } else {
        v[k] = __ldg(reinterpret_cast<const float4*>(base) + i);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int i = tid + k * decode_threads;
    if (i < V) {
      reinterpret_cast<float4*>(q_raw)[i] = v[k];
      reinterpret_cast<float4*>(acc_total)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// The chunk's state of the group's heads -> workspace: {m, l} per head and the G x D
// accumulator, in 16-byte units with every shared load before the first global store (one
// element per iteration and head was 9.7% of the split kernel's stall samples at B = 1).
template <int G, int D>
__device__ __forceinline__ void store_chunk_state(const decode_plan& plan, std::uint8_t* workspace, std::size_t qrow,
                                                  int c, const float* m, const float* l, const float* acc_total) {
  constexpr int V = G * D / 4, VH = D / 4;
  constexpr int per = (V + decode_threads - 1) / decode_threads;
  const int tid = int(threadIdx.x);
  float2* states = reinterpret_cast<float2*>(workspace + plan.state_offset);
  float4* accs = reinterpret_cast<float4*>(workspace + plan.acc_offset);
  auto at = [&](int h) { return (qrow + std::size_t(h)) * std::size_t(plan.max_chunks) + std::size_t(c); };
  float4 v[per];
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int i = tid + k * decode_threads;
    if (i < V) v[k] = reinterpret_cast<const float4*>(acc_total)[i];
  }
  if (tid < G) states[at(tid)] = make_float2(m[tid], l[tid]);
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const int i = tid + k * decode_threads;
    if (i < V) accs[at(i / VH) * VH + std::size_t(i % VH)] = v[k];
  }
}

// A lane's P consecutive floats of shared memory in the widest aligned vectors (warp_vector.cuh's
// load_words): lanes P words apart make scalar accesses P-way bank conflicted (d = 256: 8-way;
// ~0.7 us of a chunk for each of prepare_query and finalize at B = 1, per-CTA %clock64 trace,
// session 7).
template <int P>
inline constexpr int lane_float_alignment = P % 4 == 0 ? 16 : P % 2 == 0 ? 8 : 4;
template <int P>
__device__ __forceinline__ void load_lane_floats(const float* p, float (&x)[P]) {
  std::uint32_t w[P];
  load_words<lane_float_alignment<P>, P>(reinterpret_cast<const std::uint8_t*>(p), w);
#pragma unroll
  for (int r = 0; r < P; ++r) x[r] = __uint_as_float(w[r]);
}
template <int P>
__device__ __forceinline__ void store_lane_floats(float* p, const float (&x)[P]) {
  std::uint32_t w[P];
#pragma unroll
  for (int r = 0; r < P; ++r) w[r] = __float_as_uint(x[r]);
  store_words<lane_float_alignment<P>, P>(reinterpret_cast<std::uint8_t*>(p), w);
}
// The codec's prepare_query / finalize over the group's heads, one warp per head (head h on
// warp h % decode_warps). TQ3 uses the warp Walsh-Hadamard of warp_vector.cuh, whose stage
// order makes it bit-identical to the codec's serial functions (int8_rotated: the same
// rotation); FP8's are the identity.
template <class C, int G>
__device__ __forceinline__ void group_prepare_query(const float* q, float* out, const codec_context& ctx) {
  constexpr int D = C::head_dim;
  if constexpr (rotated_format<C>) {
    constexpr int P = D / 32;
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const float inv_d = tierkv::detail::exp2i(-tierkv::detail::log2_of<D>);
    for (int h = warp; h < G; h += decode_warps) {
      float x[P];
      load_lane_floats<P>(q + h * D + lane * P, x);
      warp_signs<P>(x, ctx.seed, lane);
      warp_wht<P>(x, lane);
#pragma unroll
      for (int r = 0; r < P; ++r) x[r] *= inv_d;
      store_lane_floats<P>(out + h * D + lane * P, x);
    }
  } else {  // identity, by the same head -> warp map (the tensor-core kernel relies on it)
    static_assert(C::format == storage_format::fp8_e4m3, "decode: prepare_query for fp8, tq3, tq4 or int8_rotated only");
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    for (int h = warp; h < G; h += decode_warps)
      for (int i = lane; i < D; i += 32) out[h * D + i] = q[h * D + i];
  }
}
template <class C, int G>
__device__ __forceinline__ void group_finalize(float* acc, const codec_context& ctx) {
  constexpr int D = C::head_dim;
  if constexpr (rotated_format<C>) {
    constexpr int P = D / 32;
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    for (int h = warp; h < G; h += decode_warps) {
      float x[P];
      load_lane_floats<P>(acc + h * D + lane * P, x);
      warp_inverse_rotation<D, P>(x, ctx.seed, lane);
      store_lane_floats<P>(acc + h * D + lane * P, x);
    }
  } else {
    static_assert(C::format == storage_format::fp8_e4m3, "decode: finalize for fp8, tq3, tq4 or int8_rotated only");
  }
}

// Programmatic dependent launch (sm_90): every split block allows the merge grid to launch
// as soon as all split blocks run, so the merge's launch and chunking overlap the split's
// last blocks; the merge waits for the split grid's completion (and its memory) before it
// reads the workspace. Without the launch attribute (or before sm_90) both are no-ops.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Launches `kernel` on `stream` with programmatic stream serialization: it may start while
// the previous kernel (which calls allow_dependent_launch) still runs, and waits for it with
// wait_for_prerequisite_grid.
template <class... Params, class... Args>
inline cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                                    Args&&... args) {
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cfg.attrs = pdl;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

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

// One tier's pages of this chunk: keys with the key codec's loop, values with the value
// codec's, every loaded slice used by all g query heads. The running max m continues
// across tiers; the accumulator of each tier is finalized in its own domain and folded
// into acc_total.
template <class Geometry, class Tier, int N>
__device__ void decode_tier_pages(const decode_inputs<N>& in, const decode_plan& plan, int f, int b,
                                  int kvh, int e_begin, int e_end, const decode_smem& sm,
                                  float* mass_ws, int* err) {
  using S = decode_shape<Geometry>;
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  using layout = page_layout<Geometry, K, V>;
  using KR = slice_reader<K>;
  using VR = slice_reader<V>;
  static_assert(K::meta_bytes == 2 && V::meta_bytes == 2,
                "decode: per-token meta must be bf16 bits (docs/formats.md)");
  constexpr int D = S::d, G = S::g, LPT = S::lanes_per_token, NTG = S::token_groups;
  constexpr int TILE = S::tile, IT = S::iters, IB = IT < 4 ? IT : 4;
  const int tid = int(threadIdx.x);
  const int slice = tid % LPT;
  const int tg = tid / LPT;
  const int warp = tid / 32, lane = tid % 32;
  const codec_context kctx = make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::key);
  const codec_context vctx = make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::value);
  const float score_scale = in.softmax_scale * log2e * KR::code_scale;

  // Prepare the queries in the key codec's domain (identity for FP8, rotation for TQ3),
  // then lay them out so lane `slice` reads its 4 float4 without bank conflicts.
  __syncthreads();
  group_prepare_query<K, G>(sm.q_raw, sm.acc_part, kctx);
  __syncthreads();
  for (int i = tid; i < G * D / 4; i += decode_threads) {
    const int h = i / (D / 4), r = i % (D / 4);  // float4 r of head h: slice r/4, quarter r%4
    const float4 v = reinterpret_cast<const float4*>(sm.acc_part + h * D)[r];
    reinterpret_cast<float4*>(sm.q_prep + h * D)[(r % 4) * LPT + r / 4] = v;
  }
  __syncthreads();

  float acc[G][16];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[h][i] = 0.f;

  const format_pages_view fv = in.index.formats[f];
  const pool_view pool = in.pools[f];
  for (int e = e_begin; e < e_end; ++e) {
    const std::int32_t slot = fv.slot[e];
    const std::int32_t logical = fv.logical[e];
    if (slot < 0 || std::uint32_t(slot) >= pool.capacity || logical < 0) {
      report_error(err, errc::out_of_range);
      continue;  // uniform across the block: every thread reads the same entry
    }
    const int ntok = in.index.tokens_in_page(b, logical, Geometry::page_tokens);
    const head_regions<layout> hr(pool.page(std::uint32_t(slot)), kvh);
    if (warp == 0 && lane < G) {
      sm.page_m[lane] = -INFINITY;
      sm.page_l[lane] = 0.f;
    }
    for (int t0 = 0; t0 < ntok; t0 += TILE) {
      // ---- scores: batches of IB independent 16-byte (TQ3: 12-byte) loads in flight per
      // thread (IB bounded so acc + loads stay in registers at 3 blocks per SM)
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
          km[uu] = bf16_bits_to_float(__ldg(hr.key_meta + t));
          vm[uu] = bf16_bits_to_float(__ldg(hr.value_meta + t));
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
#pragma unroll
          for (int h = 0; h < G; ++h)
            sm.scores[h * TILE + tl] = live ? dot[h] * km[uu] * score_scale : -INFINITY;
          sm.vscale[tl] = live ? vm[uu] : 0.f;
        }
      }
      }
      __syncthreads();
      // ---- online softmax of this tile, one warp per query head
      for (int h = warp; h < G; h += decode_warps) {
        float tmax = -INFINITY;
        for (int t = lane; t < TILE; t += 32) tmax = fmaxf(tmax, sm.scores[h * TILE + t]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
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
      __syncthreads();
      // ---- values: the same slices, p already carries the per-token scale / norm
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
          if (u < IT && tg + u * NTG < TILE && t < ntok) vr[uu] = VR::load(hr.values + std::size_t(t) * V::payload_bytes, slice);
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
        const std::size_t row = std::size_t(b) * S::qh + std::size_t(kvh) * G + std::size_t(lane);
        constexpr int SL = mass_slots_per_page<Geometry>;
        float* slots = mass_ws + (row * std::size_t(plan.max_pages) + std::size_t(logical)) * SL;
        slots[0] = sm.page_m[lane] + log2f(sm.page_l[lane]);  // the whole page in its first slot
        for (int k = 1; k < SL; ++k) slots[k] = -INFINITY;
      } else {
        report_error(err, errc::out_of_range);
      }
    }
  }

  // ---- fold the token groups' accumulators into acc_part: inside a warp by shuffles,
  // then warp after warp (fixed order: deterministic).
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

template <class Geometry, class TierList> struct decode_kernels;

template <class Geometry, class... Tiers>
struct decode_kernels<Geometry, tiers<Tiers...>> {
  static constexpr int N = int(sizeof...(Tiers));
  using S = decode_shape<Geometry>;

  // grid (kv_heads, max_chunks, batch); chunks beyond the sequence's count exit at once.
  static __device__ void split(const decode_inputs<N>& in, const decode_plan& plan, std::uint8_t* workspace) {
    constexpr int D = S::d, G = S::g;
    std::int64_t cost[N];
#pragma unroll
    for (int f = 0; f < N; ++f) cost[f] = plan.page_cost[f];
    const int kvh = int(blockIdx.x), c = int(blockIdx.y), b = int(blockIdx.z);
    if (b >= in.index.batch) return;
    const chunking<N> ch = chunk_sequence<N>(in.index, b, cost, plan.target_chunk_bytes, plan.max_chunks);
    if (c >= ch.chunks) return;
    int* err = reinterpret_cast<int*>(workspace + plan.error_offset);
    float* mass_ws = plan.page_mass ? reinterpret_cast<float*>(workspace + plan.mass_offset) : nullptr;

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
    if (hi > lo)
      decode_tier_pages<Geometry, Tier, N>(in, plan, F, b, kvh, ch.first[F] + lo, ch.first[F] + hi,
                                           sm, mass_ws, err);
  }

  // grid (q_heads, batch, ceil(D / merge_slice)): log-sum-exp merge of the chunk states of
  // one query head over merge_slice dims; writes out and (slice 0) lse. Small batches are
  // latency-bound here (a serial walk costs one L2 round trip per chunk), so: every warp finds
  // the max over all chunk states itself (no block barrier), the warps take every 4th chunk,
  // and the first batch of accumulator loads is issued before the max is known: with up to
  // 64 chunks a block waits for about two round trips. The 4 warp sums are added in a fixed
  // order (deterministic).
  static constexpr int merge_slice = 64;  // dims per block: lanes hold 2 each
  static constexpr int merge_batch = 16;  // chunks per warp with loads in flight
  static __device__ void merge(const decode_inputs<N>& in, const decode_plan& plan, std::uint8_t* workspace) {
    constexpr int D = S::d;
    constexpr int U = merge_batch;
    static_assert(D % 2 == 0, "decode merge: float2 lanes");
    __shared__ float part[decode_warps][merge_slice + 1];
    std::int64_t cost[N];
#pragma unroll
    for (int f = 0; f < N; ++f) cost[f] = plan.page_cost[f];
    const int h = int(blockIdx.x), b = int(blockIdx.y), slice = int(blockIdx.z);
    if (b >= in.index.batch) return;
    const chunking<N> ch = chunk_sequence<N>(in.index, b, cost, plan.target_chunk_bytes, plan.max_chunks);
    const int chunks = ch.chunks;
    const std::size_t row = std::size_t(b) * S::qh + std::size_t(h);
    wait_for_prerequisite_grid();  // the split kernel's chunk states
    // The step's error word -> its result, and back to 0 for the next step (no memset per
    // step: decode_workspace_init zeroes it once).
    if (h == 0 && b == 0 && slice == 0 && threadIdx.x == 0)
      *reinterpret_cast<int*>(workspace + plan.result_offset) = atomicExch(reinterpret_cast<int*>(workspace + plan.error_offset), 0);
    const float2* states = reinterpret_cast<const float2*>(workspace + plan.state_offset) +
                           row * std::size_t(plan.max_chunks);
    const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
    if (chunks == 0) {  // an empty sequence: no split block stored a state (the loads below would read slot 0)
      if (tid < merge_slice && slice * merge_slice + tid < D) in.out[row * D + std::size_t(slice * merge_slice + tid)] = 0.f;
      if (tid == 0 && slice == 0 && in.lse != nullptr) in.lse[row] = -INFINITY;
      return;
    }
    const int dim = slice * merge_slice + 2 * lane;
    const bool live = dim < D;
    const float* accs = reinterpret_cast<const float*>(workspace + plan.acc_offset) +
                        row * std::size_t(plan.max_chunks) * D + (live ? dim : 0);
    // Unconditional, independent loads (a chunk past the end reads chunk 0 and gets weight 0).
    float2 a[U], st[U];
    auto load = [&](int k0) {
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int k = k0 + decode_warps * j;
        const int kk = k < chunks ? k : 0;
        a[j] = __ldg(reinterpret_cast<const float2*>(accs + std::size_t(kk) * D));
        st[j] = __ldg(states + kk);
        if (k >= chunks) st[j].y = 0.f;
      }
    };
    load(warp);
    float mx = -INFINITY;
    for (int k = lane; k < chunks; k += 32) {
      const float2 s = __ldg(states + k);
      if (s.y > 0.f) mx = fmaxf(mx, s.x);
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float2 o = make_float2(0.f, 0.f);
    float l = 0.f;
    for (int k0 = warp;;) {
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const float w = st[j].y > 0.f ? exp2f(st[j].x - mx) : 0.f;
        l = fmaf(st[j].y, w, l);
        o.x = w != 0.f ? fmaf(a[j].x, w, o.x) : o.x;  // a select: an unused chunk's slot may hold anything
        o.y = w != 0.f ? fmaf(a[j].y, w, o.y) : o.y;
      }
      k0 += decode_warps * U;
      if (k0 >= chunks) break;
      load(k0);
    }
    part[warp][2 * lane] = o.x;
    part[warp][2 * lane + 1] = o.y;
    if (lane == 0) part[warp][merge_slice] = l;
    __syncthreads();
    float lt = part[0][merge_slice];
#pragma unroll
    for (int w = 1; w < decode_warps; ++w) lt += part[w][merge_slice];
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    if (tid < merge_slice && slice * merge_slice + tid < D) {
      float x = part[0][tid];
#pragma unroll
      for (int w = 1; w < decode_warps; ++w) x += part[w][tid];
      in.out[row * D + std::size_t(slice * merge_slice + tid)] = x * inv;
    }
    if (tid == 0 && slice == 0 && in.lse != nullptr)
      in.lse[row] = lt > 0.f ? (mx + log2f(lt)) / log2e : -INFINITY;
  }

  // grid (batch): per-page mass averaged over q_heads, from the log2 page masses.
  static __device__ void page_mass(const decode_inputs<N>& in, const decode_plan& plan, const std::uint8_t* workspace) {
    const int b = int(blockIdx.x);
    if (b >= in.index.batch) return;
    const float* mass_ws = reinterpret_cast<const float*>(workspace + plan.mass_offset);
    int pages = 0;
    for (int f = 0; f < N; ++f)
      pages += in.index.formats[f].indptr[b + 1] - in.index.formats[f].indptr[b];
    if (pages > plan.max_pages) pages = plan.max_pages;
    if (pages > in.page_mass_stride) pages = in.page_mass_stride;
    constexpr int SL = mass_slots_per_page<Geometry>;
    for (int p = int(threadIdx.x); p < pages; p += decode_threads) {
      // the slots the split kernels wrote: one per step of the page (at least one)
      const int steps = std::max(1, (in.index.tokens_in_page(b, p, Geometry::page_tokens) + 15) / 16);
      float s = 0.f;
      for (int h = 0; h < S::qh; ++h) {
        const std::size_t row = std::size_t(b) * S::qh + std::size_t(h);
        const float lse2 = in.lse[row] * log2e;
        const float* slots = mass_ws + (row * std::size_t(plan.max_pages) + std::size_t(p)) * SL;
        for (int k = 0; k < steps; ++k) {
          const float lm = slots[k];
          if (lse2 != -INFINITY && lm != -INFINITY) s += exp2f(lm - lse2);
        }
      }
      in.page_mass[std::size_t(b) * std::size_t(in.page_mass_stride) + std::size_t(p)] = s / float(S::qh);
    }
  }
};

template <class Geometry, class TierList>
__global__ void __launch_bounds__(decode_threads, decode_shape<Geometry>::min_blocks)
decode_split_kernel(decode_inputs<TierList::size> in, decode_plan plan, std::uint8_t* workspace) {
  allow_dependent_launch();
  decode_kernels<Geometry, TierList>::split(in, plan, workspace);
}
template <class Geometry, class TierList>
__global__ void __launch_bounds__(decode_threads)
decode_merge_kernel(decode_inputs<TierList::size> in, decode_plan plan, std::uint8_t* workspace) {
  decode_kernels<Geometry, TierList>::merge(in, plan, workspace);
}
template <class Geometry, class TierList>
__global__ void __launch_bounds__(decode_threads)
decode_page_mass_kernel(decode_inputs<TierList::size> in, decode_plan plan, const std::uint8_t* workspace) {
  decode_kernels<Geometry, TierList>::page_mass(in, plan, workspace);
}

// Every pool must be set and hold pages of exactly its tier's layout.
template <class Geometry, class... Tiers>
status check_pools(const decode_inputs<int(sizeof...(Tiers))>& in, tiers<Tiers...>*) {
  constexpr std::size_t expect[] = {
      page_layout<Geometry, typename Tiers::template key_codec<Geometry::head_dim>,
                  typename Tiers::template value_codec<Geometry::head_dim>>::page_bytes...};
  for (int f = 0; f < int(sizeof...(Tiers)); ++f) {
    const pool_view& p = in.pools[f];
    if (p.capacity > 0 && p.base == nullptr)
      return status::make(errc::invalid_argument, "decode: pools[", f, "].base is null");
    if (p.page_bytes != expect[f])
      return status::make(errc::geometry_mismatch, "decode: pools[", f, "].page_bytes = ",
                          p.page_bytes, " but the tier's page_layout needs ", expect[f]);
    if (in.index.batch > 0 && in.index.formats[f].indptr == nullptr)
      return status::make(errc::invalid_argument, "decode: index.formats[", f, "].indptr is null");
  }
  return status::ok();
}

}  // namespace detail
}  // namespace tierkv::cuda

#include "tierkv/cuda/detail/decode_mma.cuh"

namespace tierkv::cuda {

// Which split kernel runs a decode step (same result up to rounding, same plan/workspace).
// tensor_core: scores and values on mma.sync (f16 operands, FP8 queries split hi + lo; int8
// operands for TQ3, TQ4 and int8_rotated keys, queries as int8 digits; f16 probabilities;
// docs/gpu.md); cuda_core: fp32 FMA per scalar (the reference GPU path).
enum class decode_path : std::uint8_t { tensor_core = 0, cuda_core = 1 };

// Zeroes a new workspace's error words, once per workspace and plan (a step leaves them
// zeroed for the next: no memset per step, which cost ~0.8 us of a B = 1 step, H200 A/B in
// docs/gpu.md).
inline status decode_workspace_init(const decode_plan& plan, void* workspace, std::size_t workspace_bytes,
                                    cudaStream_t stream) {
  if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
    return status::exceeds(errc::capacity_exhausted, "decode_workspace_init: plan.workspace_bytes",
                           plan.workspace_bytes, workspace_bytes);
  TIERKV_CUDA_TRY(cudaMemsetAsync(static_cast<std::uint8_t*>(workspace) + plan.error_offset, 0,
                                  plan.result_offset + sizeof(int) - plan.error_offset, stream));
  return status::ok();
}

// Enqueues one decode step on `stream`: the split kernel, the merge, and (with page_mass)
// the per-page mass. Host-side checks only (no synchronization, no allocation): the
// workspace (plan.workspace_bytes, device memory, decode_workspace_init'ed once for this
// plan) must not be used by another stream meanwhile. Capturable in a CUDA graph; replaying
// it reads the index arrays, lengths and queries present at replay time (within the plan's
// capacity).
template <class Geometry, class TierList, decode_path Path = decode_path::tensor_core>
status decode(const decode_plan& plan, const decode_inputs<TierList::size>& in, void* workspace,
              std::size_t workspace_bytes, cudaStream_t stream) {
  if (in.index.batch < 0 || in.index.batch > plan.max_batch)
    return status::out_of_range("decode: batch", in.index.batch, plan.max_batch + 1);
  if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
    return status::exceeds(errc::capacity_exhausted, "decode: plan.workspace_bytes",
                           plan.workspace_bytes, workspace_bytes);
  if (in.queries == nullptr || in.out == nullptr || in.index.seq_len == nullptr)
    return status::make(errc::invalid_argument, "decode: queries, out and index.seq_len must be set");
  if (!(in.softmax_scale > 0.f) || !std::isfinite(in.softmax_scale))
    return status::make(errc::invalid_argument, "decode: softmax_scale = ", in.softmax_scale,
                        " must be positive and finite");
  if (in.page_mass != nullptr &&
      (!plan.page_mass || in.lse == nullptr || in.page_mass_stride < plan.max_pages))
    return status::make(errc::invalid_argument,
                        "decode: page_mass needs a plan with page_mass, an lse output and "
                        "page_mass_stride (", in.page_mass_stride, ") >= plan.max_pages (",
                        plan.max_pages, ")");
  status bad = detail::check_pools<Geometry>(in, static_cast<TierList*>(nullptr));
  if (!bad) return bad;
  if (in.index.batch == 0) return status::ok();

  std::uint8_t* ws = static_cast<std::uint8_t*>(workspace);
  // KV heads fastest: the blocks dispatched to one SM lie kv_heads x 132 apart in launch order,
  // so by-format chunks (a sequence's FP8 chunks, then its TQ3 ones) mix on an SM rather than
  // chunks 4 apart of one head's run, which were mostly of one format.
  const dim3 grid_split(unsigned(Geometry::kv_heads), unsigned(plan.max_chunks), unsigned(in.index.batch));
  if constexpr (Path == decode_path::tensor_core) {
    using S = detail::mma_smem_size<Geometry, TierList>;
    TIERKV_CUDA_TRY(cudaFuncSetAttribute(detail::decode_mma_split_kernel<Geometry, TierList>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::bytes)));
    detail::decode_mma_split_kernel<Geometry, TierList><<<grid_split, detail::decode_threads, S::bytes, stream>>>(in, plan, ws);
  } else {
    using S = detail::decode_shape<Geometry>;
    TIERKV_CUDA_TRY(cudaFuncSetAttribute(detail::decode_split_kernel<Geometry, TierList>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::smem_bytes)));
    detail::decode_split_kernel<Geometry, TierList><<<grid_split, detail::decode_threads, S::smem_bytes, stream>>>(in, plan, ws);
  }
  TIERKV_CUDA_TRY(cudaGetLastError());
  using MK = detail::decode_kernels<Geometry, TierList>;
  const dim3 grid_merge(unsigned(Geometry::q_heads), unsigned(in.index.batch),
                        unsigned((Geometry::head_dim + MK::merge_slice - 1) / MK::merge_slice));
  TIERKV_CUDA_TRY(detail::launch_dependent(detail::decode_merge_kernel<Geometry, TierList>, grid_merge,
                                            dim3(detail::decode_threads), stream, in, plan, ws));
  if (in.page_mass != nullptr) {
    detail::decode_page_mass_kernel<Geometry, TierList><<<unsigned(in.index.batch), detail::decode_threads, 0, stream>>>(in, plan, ws);
    TIERKV_CUDA_TRY(cudaGetLastError());
  }
  return status::ok();
}

// The first device-side error of the last decode on this workspace (errc::ok when none):
// a page slot beyond its pool or a logical page beyond plan.max_pages. Synchronizes `stream`.
inline result<errc> decode_device_error(const decode_plan& plan, const void* workspace,
                                        cudaStream_t stream) {
  int code = 0;
  TIERKV_CUDA_TRY(cudaMemcpyAsync(&code, static_cast<const std::uint8_t*>(workspace) + plan.result_offset,
                                  sizeof(int), cudaMemcpyDeviceToHost, stream));
  TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));
  if (code != int(errc::ok) && code != int(errc::out_of_range))  // the only code the kernels report
    return status::make(errc::invalid_argument, "decode_device_error: the workspace holds ", code,
                        ", no error code of a decode step: it was not decode_workspace_init'ed for this plan");
  return static_cast<errc>(code);
}

}  // namespace tierkv::cuda
