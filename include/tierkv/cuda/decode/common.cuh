// SPDX-License-Identifier: Apache-2.0
// What both decode split kernels share: the per-sequence chunking (also the merge's), the
// group's query load and the codec's prepare / finalize over it, the chunk-state store, and the
// second pass (log-sum-exp merge of the chunk states, per-page attention mass).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cmath>
#include <cstdint>

#include "tierkv/attention/logits.hpp"
#include "tierkv/attention/partial_state.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/arch/pdl.cuh"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/decode/inputs.cuh"
#include "tierkv/cuda/decode_plan.cuh"
#include "tierkv/cuda/kernel/centering.cuh"
#include "tierkv/cuda/kernel/error_flag.cuh"
#include "tierkv/cuda/kernel/lane_floats.cuh"
#include "tierkv/cuda/warp/payload.cuh"
#include "tierkv/cuda/warp/rotation.cuh"
namespace tierkv::cuda::detail {

inline constexpr int decode_threads = 128;
inline constexpr int decode_warps = decode_threads / 32;

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

// Whether this launch computes the page mass: asked for (in.page_mass) and not switched off by
// the run-time flag.
template <int N>
__device__ __forceinline__ bool page_mass_wanted(const decode_inputs<N>& in) {
  return in.page_mass != nullptr && (in.page_mass_on == nullptr || *in.page_mass_on != 0);
}

// Sliding windows (decode_inputs::window > 0): the query, at position length - 1, sees the
// positions >= window_first (0 without a window: every position).
__device__ __forceinline__ int window_first(int window, int length) {
  return window > 0 ? length - window : 0;
}
template <int N>
__device__ __forceinline__ int window_first(const decode_inputs<N>& in, int b) {
  return in.window > 0 ? in.index.seq_len[b] - in.window : 0;  // seq_len read only with a window
}
// Tokens [first_in_page, ntok) of logical page `logical` are in the window (0 without one).
template <int T>
__device__ __forceinline__ int first_in_page(std::int32_t logical, int first, int ntok) {
  const std::int64_t t = std::int64_t(first) - std::int64_t(logical) * T;
  return t <= 0 ? 0 : t >= ntok ? ntok : int(t);
}
// Whether logical page `logical` (T tokens a page) lies wholly before position `first`: the split
// kernels do not read it and the page-mass kernel gives it zero mass (the same test in both).
template <int T>
__device__ __forceinline__ bool page_before_window(std::int32_t logical, int first) {
  return (std::int64_t(logical) + 1) * T <= std::int64_t(first);
}
// The first entry in [lo, hi) of `fv` whose page is not wholly before position `first` (hi when
// none), by a warp with all lanes active (each gets the answer): a sequence's entries are sorted by
// logical page, so the pages before the window are a prefix of them. Rounds of 32 probes, one
// index load per lane each: 2 rounds up to 1024 entries.
template <int T>
__device__ __forceinline__ int first_window_entry(const format_pages_view& fv, int lo, int hi,
                                                  int first) {
  const int lane = int(threadIdx.x) % 32;
  while (hi > lo) {
    const int step = (hi - lo + 31) / 32;
    const int e = lo + lane * step;
    const bool before = e < hi && page_before_window<T>(__ldg(fv.logical + e), first);
    // the probes before the window are lo, lo + step, ..., lo + (below - 1) step
    const int below = __popc(__ballot_sync(0xffffffffu, before));
    if (below == 0) break;  // lo is in the window
    lo += (below - 1) * step + 1;
    hi = min(hi, lo - 1 + step);
  }
  return lo;
}

// A split block of `Kernels` (a split kernel's chunk function). Grid (kv_heads, max_chunks,
// batch): the KV head, the chunk and the sequence come from the block index, the chunking is the
// merge's (decode_finish); a block past the batch or past its sequence's chunks returns at once,
// the others run Kernels::chunk. (The chunking kept as this function's local: a struct of these
// returned to the kernel held it in another stack slot, other SASS for the two-tier kernels.)
template <class Kernels, int N>
__device__ __forceinline__ void run_split_block(const decode_inputs<N>& in, const decode_plan& plan,
                                                std::uint8_t* workspace) {
  std::int64_t cost[N];
#pragma unroll
  for (int f = 0; f < N; ++f) cost[f] = plan.page_cost[f];
  const int kvh = int(blockIdx.x), c = int(blockIdx.y), b = int(blockIdx.z);
  if (b >= in.index.batch) return;
  const chunking<N> ch =
      chunk_sequence<N>(in.index, b, cost, plan.target_chunk_bytes, plan.max_chunks);
  if (c >= ch.chunks) return;
  int* err = reinterpret_cast<int*>(workspace + plan.error_offset);
  float* mass_ws = plan.page_mass && page_mass_wanted(in)
                       ? reinterpret_cast<float*>(workspace + plan.mass_offset)
                       : nullptr;
  Kernels::chunk(in, plan, workspace, kvh, c, b, ch, cost, err, mass_ws);
}

// A tier's key and value codecs at the geometry's head_dim and its page layout: what both split
// kernels' per-tier configurations start from.
template <class Geometry, class Tier>
struct tier_codecs {
  using geometry = Geometry;
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  using layout = page_layout<Geometry, K, V>;
};

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

// The group's G x D queries (bf16 or f32) -> q_raw, and acc_total <- 0, by the block. Whole
// 16-byte units per thread, every load issued before the first store: one element per
// iteration put an L2 round trip per element on every chunk's start (ncu, (24,4,256) 32K
// B = 1: 3.5% of the split kernel's stall samples).
template <int G, int D, class Inputs>
__device__ __forceinline__ void load_group_queries(const Inputs& in, std::size_t qrow, float* q_raw,
                                                   float* acc_total) {
  constexpr int V = G * D / 4;  // float4 units
  constexpr int per = (V + decode_threads - 1) / decode_threads;
  static_assert(D % 4 == 0, "decode: head_dim must be a multiple of 4");
  const int tid = int(threadIdx.x);
  const bool bf16 = in.queries_type == query_type::bf16;
  const std::uintptr_t base =
      reinterpret_cast<std::uintptr_t>(in.queries) + qrow * D * (bf16 ? 2 : 4);
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
        v[k] = make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
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
__device__ __forceinline__ void store_chunk_state(const decode_plan& plan, std::uint8_t* workspace,
                                                  std::size_t qrow, int c, const float* m,
                                                  const float* l, const float* acc_total) {
  constexpr int V = G * D / 4, VH = D / 4;
  constexpr int per = (V + decode_threads - 1) / decode_threads;
  const int tid = int(threadIdx.x);
  float2* states = reinterpret_cast<float2*>(workspace + plan.state_offset);
  float4* accs = reinterpret_cast<float4*>(workspace + plan.acc_offset);
  auto at = [&](int h) {
    return (qrow + std::size_t(h)) * std::size_t(plan.max_chunks) + std::size_t(c);
  };
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

// The codec's prepare_query / finalize over the group's heads, one warp per head (head h on
// warp h % decode_warps). TQ3 uses the warp Walsh-Hadamard of warp/rotation.cuh, whose stage
// order makes it bit-identical to the codec's serial functions (int8_rotated: the same
// rotation); FP8's are the identity.
template <class C, int G>
__device__ __forceinline__ void group_prepare_query(const float* q, float* out,
                                                    const codec_context& ctx) {
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
  }  // else the identity
}

// Whether query row `row` (D elements, f32 or bf16) holds a NaN or an infinity, by each thread
// of the block over its share of the row (the caller combines the threads' answers).
template <int D, class Inputs>
__device__ __forceinline__ bool query_has_non_finite(const Inputs& in, std::size_t row) {
  bool bad = false;
  for (int i = int(threadIdx.x); i < D; i += decode_threads) {
    const std::size_t at = row * D + std::size_t(i);
    const std::uint32_t bits =
        in.queries_type == query_type::bf16
            ? std::uint32_t(__bfloat16_as_ushort(static_cast<const __nv_bfloat16*>(in.queries)[at]))
                  << 16
            : __float_as_uint(static_cast<const float*>(in.queries)[at]);
    bad |= (bits & 0x7f800000u) == 0x7f800000u;
  }
  return bad;
}

// The second pass of a decode step, the same for both split kernels: the merge of the chunk
// states and the per-page mass.
template <class Geometry, class TierList>
struct decode_finish;

template <class Geometry, class... Tiers>
struct decode_finish<Geometry, tiers<Tiers...>> {
  static constexpr int N = int(sizeof...(Tiers));
  static constexpr int QH = Geometry::q_heads;

  // grid (q_heads, batch, ceil(D / merge_slice)): log-sum-exp merge of the chunk states of
  // one query head over merge_slice dims; writes out and (slice 0) lse. Small batches are
  // latency-bound here (a serial walk costs one L2 round trip per chunk), so: every warp finds
  // the max over all chunk states itself (no block barrier), the warps take every 4th chunk,
  // and the first batch of accumulator loads is issued before the max is known: with up to
  // 64 chunks a block waits for about two round trips. The 4 warp sums are added in a fixed
  // order (deterministic).
  // One output element in the caller's type (bf16: rounded once from the f32 result).
  static __device__ __forceinline__ void store_out(const decode_inputs<N>& in, std::size_t at,
                                                   float x) {
    if (in.out_type == output_type::bf16)
      static_cast<__nv_bfloat16*>(in.out)[at] = __float2bfloat16_rn(x);
    else
      static_cast<float*>(in.out)[at] = x;
  }
  static constexpr int merge_slice = 64;  // dims per block: lanes hold 2 each
  static constexpr int merge_batch = 16;  // chunks per warp with loads in flight
  static __device__ void merge(const decode_inputs<N>& in, const decode_plan& plan,
                               std::uint8_t* workspace) {
    constexpr int D = Geometry::head_dim;
    constexpr int U = merge_batch;
    static_assert(D % 2 == 0, "decode merge: float2 lanes");
    __shared__ float part[decode_warps][merge_slice + 1];
    std::int64_t cost[N];
#pragma unroll
    for (int f = 0; f < N; ++f) cost[f] = plan.page_cost[f];
    const int h = int(blockIdx.x), b = int(blockIdx.y), slice = int(blockIdx.z);
    if (b >= in.index.batch) return;
    const chunking<N> ch =
        chunk_sequence<N>(in.index, b, cost, plan.target_chunk_bytes, plan.max_chunks);
    const int chunks = ch.chunks;
    const std::size_t row = std::size_t(b) * QH + std::size_t(h);
    // A non-finite query element makes its head's output and lse NaN (and so its sequence's
    // page mass): the split kernels' softmax drops NaN scores, which would leave a silent
    // finite (often zero) output. Read before the wait: the query is an input, so this
    // overlaps the split kernel (arch/pdl.cuh).
    const bool bad_query = query_has_non_finite<D>(in, row);
    wait_for_prerequisite_grid();  // the split kernel's chunk states
    // The step's error word -> its result, and back to 0 for the next step (no memset per
    // step: decode_workspace_init zeroes it once).
    if (h == 0 && b == 0 && slice == 0 && threadIdx.x == 0)
      *reinterpret_cast<int*>(workspace + plan.result_offset) =
          atomicExch(reinterpret_cast<int*>(workspace + plan.error_offset), 0);
    const float2* states = reinterpret_cast<const float2*>(workspace + plan.state_offset) +
                           row * std::size_t(plan.max_chunks);
    const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
    if (chunks == 0) {  // an empty sequence: no split block stored a state (the loads below would
                        // read slot 0)
      const bool poisoned = __syncthreads_or(bad_query) != 0;
      if (tid < merge_slice && slice * merge_slice + tid < D)
        store_out(in, row * D + std::size_t(slice * merge_slice + tid), poisoned ? NAN : 0.f);
      if (tid == 0 && slice == 0 && in.lse != nullptr) in.lse[row] = poisoned ? NAN : -INFINITY;
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
        const float w = softmax_merge::state_weight<log_base::two>(st[j].x, st[j].y, mx);
        l = fmaf(st[j].y, w, l);
        o.x = w != 0.f ? fmaf(a[j].x, w, o.x)
                       : o.x;  // a select: an unused chunk's slot may hold anything
        o.y = w != 0.f ? fmaf(a[j].y, w, o.y) : o.y;
      }
      k0 += decode_warps * U;
      if (k0 >= chunks) break;
      load(k0);
    }
    part[warp][2 * lane] = o.x;
    part[warp][2 * lane + 1] = o.y;
    if (lane == 0) part[warp][merge_slice] = l;
    const bool poisoned = __syncthreads_or(bad_query) != 0;
    float lt = part[0][merge_slice];
#pragma unroll
    for (int w = 1; w < decode_warps; ++w) lt += part[w][merge_slice];
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
    // a NaN chunk state (a non-finite key or value, appended and reported by the cache) makes
    // the head's output NaN: dropping it would leave a plausible wrong output
    const bool nan_state = lt != lt;
    if (tid < merge_slice && slice * merge_slice + tid < D) {
      float x = part[0][tid];
#pragma unroll
      for (int w = 1; w < decode_warps; ++w) x += part[w][tid];
      const int d = slice * merge_slice + tid;
      const float mean = in.value_mean ? in.value_mean[(h / Geometry::group_size) * D + d] : 0.f;
      store_out(in, row * D + std::size_t(d), poisoned || nan_state ? NAN : x * inv + mean);
    }
    if (tid == 0 && slice == 0 && in.lse != nullptr) {
      const float shift =
          in.key_mean
              ? query_mean_logit<D>(in.queries, in.queries_type, row,
                                    in.key_mean + (h / Geometry::group_size) * D, in.softmax_scale)
              : 0.f;
      in.lse[row] = poisoned || nan_state ? NAN
                    : lt > 0.f            ? softmax_merge::to_natural<log_base::two>(
                                     softmax_merge::state_lse<log_base::two>(mx, lt)) +
                                     shift
                               : -INFINITY;
    }
  }

  // grid (ceil(plan.max_pages / decode_threads), batch): one thread a page, its mass averaged
  // over q_heads from the log2 page masses. A thread a page, not a block a sequence: with one
  // block a sequence the kernel took 0.67 ms a layer at 8208 pages, latency-bound
  // (bench/results/model-gpu/torch-e2e-2026-12-03-mass.json).
  static __device__ void page_mass(const decode_inputs<N>& in, const decode_plan& plan,
                                   const std::uint8_t* workspace) {
    const int b = int(blockIdx.y);
    if (b >= in.index.batch || !page_mass_wanted(in)) return;
    __shared__ float lse2[QH];
    for (int h = int(threadIdx.x); h < QH; h += decode_threads) {
      const std::size_t row = std::size_t(b) * QH + std::size_t(h);
      // the masses are of the centred logits: the merge's centring term comes off the lse
      const float shift =
          in.key_mean
              ? query_mean_logit<Geometry::head_dim>(
                    in.queries, in.queries_type, row,
                    in.key_mean + (h / Geometry::group_size) * Geometry::head_dim, in.softmax_scale)
              : 0.f;
      lse2[h] = (in.lse[row] - shift) * log2e;
    }
    __syncthreads();
    const float* mass_ws = reinterpret_cast<const float*>(workspace + plan.mass_offset);
    int pages = 0;
    for (int f = 0; f < N; ++f)
      pages += in.index.formats[f].indptr[b + 1] - in.index.formats[f].indptr[b];
    if (pages > plan.max_pages) pages = plan.max_pages;
    if (pages > in.page_mass_stride) pages = in.page_mass_stride;
    constexpr int SL = mass_slots_per_page<Geometry>;
    const int p = int(blockIdx.x) * decode_threads + int(threadIdx.x);
    if (p >= pages) return;
    // the slots the split kernels wrote: one per step of the page (at least one); none for a page
    // wholly before the window (its mass is 0)
    const int length = in.index.seq_len[b];
    const int steps =
        page_before_window<Geometry::page_tokens>(p, window_first(in.window, length))
            ? 0
            : std::max(1, (in.index.tokens_in_page_of(length, p, Geometry::page_tokens) + 15) / 16);
    float s = 0.f;
    for (int h = 0; h < QH && steps > 0; ++h) {
      const std::size_t row = std::size_t(b) * QH + std::size_t(h);
      const float* slots = mass_ws + (row * std::size_t(plan.max_pages) + std::size_t(p)) * SL;
      for (int k = 0; k < steps; ++k) {
        const float lm = slots[k];
        if (lse2[h] != -INFINITY && lm != -INFINITY) s += exp2f(lm - lse2[h]);
      }
    }
    in.page_mass[std::size_t(b) * std::size_t(in.page_mass_stride) + std::size_t(p)] =
        s / float(QH);
  }
};

template <class Geometry, class TierList>
__global__ void __launch_bounds__(decode_threads)
    decode_merge_kernel(decode_inputs<TierList::size> in, decode_plan plan,
                        std::uint8_t* workspace) {
  decode_finish<Geometry, TierList>::merge(in, plan, workspace);
}
template <class Geometry, class TierList>
__global__ void __launch_bounds__(decode_threads)
    decode_page_mass_kernel(decode_inputs<TierList::size> in, decode_plan plan,
                            const std::uint8_t* workspace) {
  decode_finish<Geometry, TierList>::page_mass(in, plan, workspace);
}

}  // namespace tierkv::cuda::detail
