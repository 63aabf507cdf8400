// SPDX-License-Identifier: Apache-2.0
// The tensor-core split kernel of the mixed-format decode (decode_path::tensor_core, the
// default): the chunking, workspace states and second pass of decode/common.cuh, with the score
// and value products on mma.sync: m16n8k16 (f16 in, f32 acc) for values and FP8 keys, m16n8k32
// (int8 in, int32 acc) for TQ3, TQ4 and int8_rotated keys. Each format's fragments come from
// its device codec (cuda/codec/).
//
// Shape (docs/gpu.md): each warp walks a stream of steps (16 tokens, 32 for TQ3 / TQ4 tiers:
// mma_staging::substeps) of the chunk's pages (whole pages round robin, or a balanced range of
// steps in small chunks), each step staged global -> shared memory by cp.async and read into
// registers. Tokens are the M rows, the group's query heads the N = 8 columns:
//   S^T[16 tok x 8 heads] = K[16 x d] . Q^T[d x 8]   (A = key codes, B = queries)
//   O^T[d x 8 heads]     += V^T[d x 16 tok] . P^T     (A = value codes, B = probabilities)
// so codes become f16 (or int8) A fragments in registers, with no shared-memory transpose.
// The k slots of a fragment may be mapped to any coordinates as long as the other operand
// uses the same map: keys take 4 contiguous codes per slot quadruple, values take the token
// pair of a lane by one byte-permute. Queries are split into f16 hi + lo parts (FP8 keys:
// scores keep ~fp32 precision) or int8 digits (13 or 20 bits); per-token key scales and value
// scales multiply S^T rows.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "tierkv/attention/int8_query.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/cuda/arch/convert.cuh"
#include "tierkv/cuda/arch/cp_async.cuh"
#include "tierkv/cuda/arch/math.cuh"
#include "tierkv/cuda/arch/mma.cuh"
#include "tierkv/cuda/decode/common.cuh"
#include "tierkv/cuda/warp/lane_group.cuh"

namespace tierkv::cuda::detail {

inline constexpr int mma_warps = 4;

template <class Geometry>
struct mma_shape {
  static constexpr int d = Geometry::head_dim;
  static constexpr int g = Geometry::group_size;
  static constexpr int qh = Geometry::q_heads;
  static constexpr int steps =
      d / 16;  // k steps of the score product = m-tiles of the value product
  // Q fragments live in shared memory (one LDS.128 per k step), so 3 blocks (12 warps) fit
  // per SM at d = 256 without spills (ptxas -v, docs/gpu.md).
  // d <= 128 fits 4 blocks (16 warps; <= 128 registers, no spills, ptxas -v): more warps to
  // hide the mma and unpack dependency chains (ncu at d = 256: 6.3 cycles per issued
  // instruction per warp, 0.7 eligible warps per scheduler).
  static constexpr int min_blocks = decode_blocks_per_sm<Geometry>;
  // Independent accumulator chains of the score product (query hi / lo parts). H200 A/B at
  // 128K B=32 (bench/results/decode/decode-h200-2026-11-29-run6.json): two chains took d = 256 fp8
  // / tq3 / tiered from 3.12 / 2.44 / 2.58 ms to 2.74 / 2.33 / 2.41 ms and d = 64 1-2% down, but d
  // = 128 (at its 128-register cap, 20 bytes of spill) up to 2.5% slower.
  static constexpr int score_chains = d == 128 ? 1 : 2;
  static_assert(g <= 8,
                "tensor-core decode: the group's query heads are the 8 columns (group_size <= 8)");
  static_assert(Geometry::page_tokens % 16 == 0,
                "tensor-core decode: page_tokens must be a multiple of 16");
  // Shared memory in floats: raw queries, prepared queries / tier accumulator, chunk
  // accumulator, per-warp {m, m_v, l} x 8 heads, m, l, m_ref, query exponent, sum of the
  // int8-rounded query (TQ4 keys), then the query B fragments (f16 [step][lane][hi0 hi1 lo0
  // lo1], or int8 [step][digit][lane][2]: at most as large) (16-byte aligned: all counts x 4).
  static constexpr int floats = 3 * g * d + mma_warps * 8 * 3 + 6 * 8 + steps * 32 * 4;
  static constexpr std::size_t smem_bytes = std::size_t(floats) * sizeof(float);
};

// A warp's staging slot: one step of 16 x `substeps` tokens: key rows, value rows, key metas,
// value metas (bf16), as in the page. One slot per warp: 33 KB per block for FP8 at d = 256
// (3 blocks per SM fit).
template <class Geometry, class Tier>
struct mma_staging {
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  using KC = mma_codec<K>;
  using VC = mma_codec<V>;
  // 16-token sub-steps per step. Int8-scored keys with TQ3 values (TQ3 and TQ4 tiers) take
  // 32-token steps: their unpacking is about half of a 16-token step's instructions, the rest
  // (page bookkeeping, staging addresses and waits, the query fragments' shared loads, the
  // softmax's column reductions and rescales) is per step (SASS, docs/gpu.md). So do FP8
  // tiers at d <= 128 (bench/results/decode/ab/ab-h200-2026-11-30-fp8-step32.txt: 783 SASS for 32
  // tokens against 2 x 541 at d = 128, 594 against 2 x 413 at d = 64; H200 A/B: fp8 rows at d = 64
  // -3..-20%, tiered rows at d <= 128 and L >= 32K -1.5..-7% at B >= 8 (8K: +1..+2%), fp8 rows at d
  // = 128 -5..+3%); at d = 256 their 66 KB slot per block would leave 2 blocks per SM. int8_rotated
  // tiers keep 16-token steps (not measured).
  static constexpr int substeps =
      Geometry::page_tokens % 32 == 0 && ((KC::s8_keys && VC::long_steps_with_s8_keys) ||
                                          Geometry::head_dim <= KC::long_steps_max_head_dim)
          ? 2
          : 1;
  // Phased (key rows, then value rows) where a step's code words and the accumulators (per
  // lane) would not fit the registers together: 8-bit rows at d = 256 (64 + 64 words, spilled
  // at 168 registers); 32-token steps from 72 words (TQ3 at d = 256: 48 + 64, unphased it
  // spilled 7 words in the step loop and slowed the kernel's 8-bit tier 1-5%; TQ4 at d = 128:
  // 40 + 32, phased -2..-5%, while TQ3 there, 36 + 32, measured +1..+3% phased). Elsewhere
  // one wait per step keeps a whole step in flight: phasing cost 16-token TQ3 steps 3-8%.
  // (H200 A/Bs, docs/gpu.md.)
  static constexpr int code_words = substeps * (2 * KC::key_words + 4 * VC::value_words);
  static constexpr bool phased = code_words + Geometry::head_dim / 4 >= (substeps == 2 ? 72 : 96);
  static constexpr int rows = 16 * substeps;
  static constexpr std::size_t key_bytes = std::size_t(rows) * K::payload_bytes;
  // 8-bit value rows at d >= 128 are read as 16 bytes at 16 g of rows 2c, 2c + 1, ... (lane
  // 4g + c): rows d bytes apart put the 4 rows of a quarter-warp on the same banks (4-way
  // conflicts, ncu in bench/results/decode/ab/ab-h200-2026-11-30-value-pad.txt: 4x the ideal
  // wavefronts). A 16-byte pad per row moves row 2c by 8c banks.
  static constexpr bool pad_values = V::payload_bytes == std::size_t(Geometry::head_dim) &&
                                     Geometry::head_dim >= 128 && V::payload_bytes / 16 <= 32 &&
                                     32 % (V::payload_bytes / 16) == 0;
  static constexpr std::size_t value_stride = V::payload_bytes + (pad_values ? 16 : 0);
  static constexpr std::size_t value_bytes = std::size_t(rows) * value_stride;
  static_assert(key_bytes % 16 == 0 && value_bytes % 16 == 0,
                "decode: staged rows must be whole 16-byte units");
  // bf16 key metas, then value metas, of the roles with a per-token scale: rows x 2 bytes / 16
  static constexpr int key_meta_chunks = token_scaled<K> ? rows / 8 : 0;
  static constexpr int value_meta_chunks = token_scaled<V> ? rows / 8 : 0;
  static constexpr std::size_t meta_bytes = std::size_t(key_meta_chunks + value_meta_chunks) * 16;
  static constexpr std::size_t slot_bytes = key_bytes + value_bytes + meta_bytes;
  static constexpr int key_chunks = int(key_bytes / 16);
  static constexpr int value_chunks = int(std::size_t(rows) * V::payload_bytes / 16);
  static constexpr int value_cpr = int(V::payload_bytes / 16);
  static constexpr std::size_t block_bytes = std::size_t(mma_warps) * slot_bytes;
};
// The end of a tier's pages: each warp's accumulator fragments (d/4 values per lane, value
// k = 4 mt + i of o[mt][i]) go to its slice of the idle staging ring in fragment order, row k
// of 32 lanes padded to 33 words, so the stores and the block's sum (32 consecutive k of one
// lane) are free of bank conflicts. Stored at their head coordinates instead (the layout
// before bench/results/decode/ab/ab-h200-2026-11-30-fold-prologue.txt), the rows of a
// quarter-warp's heads lay d words apart and the value coordinates of its row groups 16 or 64 words
// apart: 16- to 32-way conflicts, 3-4 us of a chunk at d = 256 (per-CTA %clock64 trace, B = 1).
template <class Geometry>
struct mma_fold {
  static constexpr int values = Geometry::head_dim / 4;  // per lane: d/16 m-tiles x 4
  static constexpr int row = 33;
  static constexpr int slice = values * row;  // floats per warp
  static constexpr std::size_t bytes = std::size_t(mma_warps) * slice * sizeof(float);
};

template <class Geometry, class TierList>
struct mma_smem_size;
template <class Geometry, class... Tiers>
struct mma_smem_size<Geometry, tiers<Tiers...>> {
  // The ring also holds the warps' accumulators when a tier's pages are done (the fold).
  static constexpr std::size_t ring =
      std::max({mma_fold<Geometry>::bytes, mma_staging<Geometry, Tiers>::block_bytes...});
  static constexpr std::size_t bytes = mma_shape<Geometry>::smem_bytes + ring;
};

struct mma_smem {
  std::uint8_t* ring;  // staging slots (mma_staging), 16-byte aligned
  float* q_raw;
  float* acc_part;
  float* acc_total;
  float* wstate;  // [warp][3][8]
  float* m;
  float* l;
  float* m_ref;
  float* qexp;
  float* qsum;           // per head: sum of the int8-rounded query (TQ4 keys' level offset)
  std::uint32_t* table;  // [0]: the TQ3 value table's low word (mma_codec<tq3>::value_table)
  uint4* qfrag;
};

// The compile-time shape of one tier's pages on the tensor cores, in one place so the pieces of
// mma_tier_pages below cannot disagree on a step.
template <class Geometry, class Tier>
struct mma_tier_config {
  using geometry = Geometry;
  using S = mma_shape<Geometry>;
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  using layout = page_layout<Geometry, K, V>;
  using KC = mma_codec<K>;
  using VC = mma_codec<V>;
  using staging = mma_staging<Geometry, Tier>;
  static constexpr int D = S::d, G = S::g, ST = S::steps;
  static constexpr int P = staging::substeps,
                       RT = staging::rows;               // 16-token sub-steps and tokens per step
  static constexpr int SL = Geometry::page_tokens / RT;  // steps per page
  // Int8 keys (TQ3 and TQ4 levels, int8_rotated codes) score on int8 mma against the query
  // rounded to 13 (TQ3, TQ4) or 20 (int8_rotated) bits of its largest element, as int8 digits
  // (s8_keys). FP8 keys take the f16 hi + lo split (~fp32 queries).
  static constexpr bool s8_keys = KC::s8_keys;
  static constexpr int KS = s8_keys ? D / 32 : ST;  // k steps of the score product
  // Key codes that enter the mma as level + offset (TQ4: c = level + 7.5, as uint8): subtract
  // the offset x (the head's sum of its rounded query, an exact integer) per head.
  static constexpr bool key_offset = s8_keys && KC::key_level_offset != 0.f;
  static_assert(
      requires { VC::value_words; },
      "tensor-core decode: this value codec has no value fragments (TQ4 is a key codec here: "
      "tier<tq4_key, tq3_value>); use another value codec, or decode_path::cuda_core");
  // the 16-bit operand types of the f16 path's key (scores) and value products
  static constexpr operand_type KT = KC::key_operand, VT = VC::value_operand;
  // int8 queries: Q = rint(q 2^(bits - e)) as QP balanced base-128 digits
  // (attention/int8_query.hpp), digit p in its own int8 fragment; the score is the sum of
  // 128^p (K.digit_p), each product exact in int32.
  static constexpr int QP = s8_keys ? KC::query_parts : 1;
  static constexpr int s8_query_bits = int8_query_bits<QP>;
  // Biased value fragments (TQ3) where the step is phased (H200 A/B,
  // bench/results/decode/ab/ab-h200-2026-11-30-value-bias.txt: phased TQ3 / TQ4-key tiers -0.5..-4%
  // at B = 32; the unphased TQ3 steps at d <= 128 +0..+2%): the bias's share of o, the same in
  // every row (o's columns), is accumulated apart (mma_warp_state::ob) and subtracted at the end.
  static constexpr bool value_bias = VC::value_bias_pair != 0u && staging::phased;
  static constexpr float value_log2_unit = VC::value_log2_unit(value_bias);
  // Value rows past ntok hold whatever the page holds there. Their probabilities are 0, so
  // only codes that can decode to NaN / Inf (FP8 E4M3 0x7F, 0xFF; bf16) must be zeroed.
  static constexpr bool zero_tail_values = !VC::value_codes_finite;
  static constexpr bool phased = staging::phased;
};

// A thread's place in the block and in the m16n8 fragments: row group qg (tokens of S^T, heads
// of B operands), column pair qc.
struct mma_lane {
  int tid, warp, lane, qg, qc;
  __device__ __forceinline__ mma_lane()
      : tid(int(threadIdx.x)), warp(tid / 32), lane(tid % 32), qg(lane / 4), qc(lane % 4) {}
};

// A warp's staging slot (mma_staging): one step's key rows + metas (cp.async group K) and value
// rows (group V) copied in, then read into fragment registers. Region by region with
// compile-time trip counts: no per-chunk branch (a generic loop compiled to ~200 instructions
// per step, SASS before the staging). An empty group when there is no next step keeps the wait
// counts uniform.
template <class C>
struct mma_slot {
  using K = typename C::K;
  using V = typename C::V;
  using KC = typename C::KC;
  using VC = typename C::VC;
  using layout = typename C::layout;
  using staging = typename C::staging;
  std::uint8_t* p;
  const std::uint8_t* kst;
  const std::uint8_t* vst;
  const std::uint16_t* kms;
  const std::uint16_t* vms;
  int kvh;
  mma_lane at;

  __device__ __forceinline__ mma_slot(std::uint8_t* ring, int kvh_, const mma_lane& at_)
      : p(ring + std::size_t(at_.warp) * staging::slot_bytes),
        kst(p),
        vst(p + staging::key_bytes),
        kms(reinterpret_cast<const std::uint16_t*>(vst + staging::value_bytes)),
        vms(kms + (token_scaled<K> ? C::RT : 0)),
        kvh(kvh_),
        at(at_) {}

  __device__ __forceinline__ void issue_keys(const std::uint8_t* page, int step) const {
    if (page != nullptr) {
      cp_async_region<staging::key_chunks>(p, page + layout::key_payload(kvh, C::RT * step),
                                           at.lane);
      constexpr int KMC = staging::key_meta_chunks, VMC = staging::value_meta_chunks;
      // the step's bf16 key metas, then its value metas, 16 bytes a lane
      if (at.lane < KMC + VMC) {
        const std::uint8_t* src =
            at.lane < KMC ? page + layout::key_meta(kvh, C::RT * step) + 16 * at.lane
                          : page + layout::value_meta(kvh, C::RT * step) + 16 * (at.lane - KMC);
        cp_async_16(p + staging::key_bytes + staging::value_bytes + 16 * at.lane, src);
      }
    }
    cp_async_commit();
  }
  __device__ __forceinline__ void issue_values(const std::uint8_t* page, int step) const {
    if (page != nullptr) {
      const std::uint8_t* src = page + layout::value_payload(kvh, C::RT * step);
      if constexpr (staging::pad_values)
        cp_async_rows<staging::value_chunks, staging::value_cpr, int(staging::value_stride)>(
            p + staging::key_bytes, src, at.lane);
      else
        cp_async_region<staging::value_chunks>(p + staging::key_bytes, src, at.lane);
    }
    cp_async_commit();
  }
  // Key rows and metas of sub-step h (rows 16h + qg, 16h + qg + 8). Rows past the page's
  // tokens are read as staged (mma_step_softmax masks them): at fixed offsets from one base, the
  // loads take immediates (clamping the row to a real token cost ~6 instructions a row).
  __device__ __forceinline__ void read_keys(int h, std::uint32_t (&kw)[2][KC::key_words],
                                            float (&ks)[2], float (&lvs)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * h + at.qg + 8 * r;
      KC::template load_key<true>(kst + std::size_t(row) * K::payload_bytes, at.qc, kw[r]);
      ks[r] = token_scaled<K> ? bf16_bits_to_float(kms[row]) : 1.f;
      lvs[r] = token_scaled<V> ? fast_log2(bf16_bits_to_float(vms[row])) : 0.f;
      if constexpr (C::value_log2_unit != 0.f)
        lvs[r] += C::value_log2_unit;  // (x + 0 is not x for -0)
    }
  }
  // Value rows of sub-step h (tokens 2qc, 2qc + 1, 2qc + 8, 2qc + 9); those at or past ntok
  // zeroed where their codes may be non-finite (C::zero_tail_values).
  __device__ __forceinline__ void read_values(int h, int t0, int ntok,
                                              std::uint32_t (&vw)[4][VC::value_words]) const {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int row = 16 * h + 2 * at.qc + (v & 1) + 8 * (v >> 1);
      VC::template load_value<true>(vst + std::size_t(row) * staging::value_stride, at.qg, vw[v]);
    }
    if constexpr (C::zero_tail_values) {
      // the last step of a partial page only (uniform across the warp)
      if (t0 + 16 * (h + 1) > ntok) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const bool tail = t0 + 16 * h + 2 * at.qc + (v & 1) + 8 * (v >> 1) >= ntok;
#pragma unroll
          for (int i = 0; i < VC::value_words; ++i) vw[v][i] = tail ? 0u : vw[v][i];
        }
      }
    }
  }
};

// Which steps a warp takes, and where their pages are: the warp's pages are one stream of steps
// (C::RT tokens); valid_from skips the pages without a valid slot (reported), page_at is the
// page of a step. It refers to fv, pool and j_end of mma_tier_pages (j_end is clamped once the
// first step is in flight), as the lambdas it replaces did.
template <class C>
struct mma_page_stream {
  static constexpr int SL = C::SL;
  const format_pages_view& fv;
  const pool_view& pool;
  int e_begin;
  int stride;  // pages from one of the warp's pages to its next
  const unsigned& j_end;
  int* err;

  __device__ __forceinline__ bool valid_page(int e) const {
    const std::int32_t s = fv.slot[e];
    return s >= 0 && std::uint32_t(s) < pool.capacity && fv.logical[e] >= 0;
  }
  // j, or the first step of the warp's next page with a valid slot (j_end when none is left)
  __device__ __forceinline__ unsigned valid_from(unsigned j) const {
    while (j < j_end && !valid_page(e_begin + int(j / SL))) {
      report_error(err, errc::out_of_range);
      j = (j / SL + stride) * SL;
    }
    return j < j_end ? j : j_end;
  }
  // the page of step j; null past the warp's steps
  __device__ __forceinline__ const std::uint8_t* page_at(unsigned j) const {
    return j < j_end ? pool.page(std::uint32_t(fv.slot[e_begin + int(j / SL)])) : nullptr;
  }
};

// Per lane, its two columns' (heads 2 qc, 2 qc + 1) score scale and key offset.
struct mma_columns {
  float scale[2];
  float koff[2];
};

// Per head h of warp h % 4 (group_prepare_query's map): the query's exponent e (max |q 2^-e| <
// 1) and, for key offsets, the sum of its int8-rounded elements.
template <class C>
__device__ __forceinline__ void mma_query_exponents(const mma_smem& sm, const mma_lane& at) {
  constexpr int D = C::D;
  for (int h = at.warp; h < C::G; h += mma_warps) {
    float mx = 0.f;
    bool finite = true;
    for (int i = at.lane; i < D; i += 32) {
      const float a = fabsf(sm.acc_part[h * D + i]);
      finite = finite && a < INFINITY;  // false for NaN too
      mx = fmaxf(mx, a);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    int e = 0;
    if (mx > 0.f && mx < INFINITY) frexpf(mx, &e);
    // A non-finite query element would round to an int8 code silently: its head's scores are
    // made NaN instead, as the f16 path's are.
    finite = __all_sync(0xffffffffu, finite);
    if (at.lane == 0) sm.qexp[h] = C::s8_keys && !finite ? NAN : float(e);
    if constexpr (C::key_offset) {  // the int8-rounded query the fragments will hold, summed
      const float qs = exp2f(float(C::s8_query_bits) - float(e));
      int sum = 0;
      for (int i = at.lane; i < D; i += 32) sum += __float2int_rn(sm.acc_part[h * D + i] * qs);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (at.lane == 0) sm.qsum[h] = float(sum);  // |sum| < 2^13 x 512: exact
    }
  }
}

// A warp's running state over the tier's steps. The value product accumulates p x value_scale
// relative to its own running max mv (so the f16 probabilities are <= 1 whatever the scales); l
// keeps the score max m; both are rebased at the tier's end. References to arrays of
// mma_tier_pages, as its lambdas held them: the arrays as members of one struct took other
// registers (per-function SASS, bench/gpu/sass_compare.py).
template <class C>
struct mma_warp_state {
  float (&o)[C::ST][4];  // O^T fragments: value k = 4 mt + i of o[mt][i] (mma_fold)
  float (&ob)[2];        // the value bias's share of o (C::value_bias)
  float (&m)[2];
  float (&mv)[2];
  float (&l)[2];
};

// The key product of one step: S^T of each sub-step (rows tokens qg, qg + 8; columns heads
// 2qc, 2qc + 1), unscaled. Query hi and lo parts in two independent accumulator chains
// (summed at the end) where it measured faster: one chain of 2 x d/16 dependent mma was the
// step's critical path at d = 256 (ncu: 6.3 cycles per issued instruction per warp, 3 warps
// per scheduler).
template <class C>
__device__ __forceinline__ void mma_step_scores(
    const std::uint32_t (&kw)[C::P][2][C::KC::key_words], const mma_smem& sm, const mma_lane& at,
    float (&sc)[C::P][4]) {
  using KC = typename C::KC;
  constexpr int P = C::P, QP = C::QP;
  const int lane = at.lane, qc = at.qc;
  if constexpr (C::s8_keys) {  // int8 levels x int8 query digits: one chain per digit and sub-step
    int acc[P][QP][4] = {};
    const uint2* qf = reinterpret_cast<const uint2*>(sm.qfrag);
#pragma unroll
    for (int s = 0; s < C::KS; ++s) {
      uint2 q[QP];  // one shared load per k step serves every sub-step
#pragma unroll
      for (int p = 0; p < QP; ++p) q[p] = qf[(s * QP + p) * 32 + lane];
#pragma unroll
      for (int h = 0; h < P; ++h) {
        std::uint32_t a[4];
        KC::key_frag_s8(kw[h][0], qc, s, a[0], a[2]);
        KC::key_frag_s8(kw[h][1], qc, s, a[1], a[3]);
#pragma unroll
        for (int p = 0; p < QP; ++p) mma_16832_s8<KC::key_unsigned>(acc[h][p], a, q[p].x, q[p].y);
      }
    }
#pragma unroll
    for (int h = 0; h < P; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // |acc| <= 64 x 127 x 512 < 2^23: exact in f32
        float x = float(acc[h][QP - 1][i]);
#pragma unroll
        for (int p = QP - 2; p >= 0; --p) x = fmaf(x, 128.f, float(acc[h][p][i]));
        sc[h][i] = x;
      }
  } else {
    // f16 keys (FP8): query hi and lo parts, one shared load per k step for every sub-step
    float lo[P][4];
#pragma unroll
    for (int h = 0; h < P; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[h][i] = lo[h][i] = 0.f;
#pragma unroll
    for (int s = 0; s < C::ST; ++s) {
      const uint4 q = sm.qfrag[s * 32 + lane];
#pragma unroll
      for (int h = 0; h < P; ++h) {
        std::uint32_t a[4];
        KC::key_frag(kw[h][0], qc, s, a[0], a[2]);
        KC::key_frag(kw[h][1], qc, s, a[1], a[3]);
        mma_16816_of<C::KT>(sc[h], a, q.x, q.y);
        mma_16816_of<C::KT>(C::S::score_chains == 2 ? lo[h] : sc[h], a, q.z, q.w);
      }
    }
    if constexpr (C::S::score_chains == 2) {
#pragma unroll
      for (int h = 0; h < P; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) sc[h][i] += lo[h][i];
    }
  }
}

// One online-softmax update for the step's 16 P tokens, from the raw scores sc: scaled per row
// (key scale) and column (cols), masked, soft-capped (Local), then the column maxima, rescales
// of l and o, and P^T of each sub-step as the value product's B fragments pb. ps: the step's
// column sums, relative to the new m. Rows at or past ntok are masked, and so are the rows
// before the window's first token t_lo of the page: t0 and ntok come relative to t_lo (0
// without a window), so one unsigned compare a row does both.
template <class C, bool Local, int N>
__device__ __forceinline__ void mma_step_softmax(const decode_inputs<N>& in, float (&sc)[C::P][4],
                                                 const float (&ks)[C::P][2],
                                                 const float (&lvs)[C::P][2], int t0, int ntok,
                                                 const mma_columns& cols, int qg,
                                                 const mma_warp_state<C>& ws, float (&ps)[2],
                                                 std::uint32_t (&pb)[C::P][2]) {
  constexpr int P = C::P;
  // rows at or past ntok: -inf (their key and value metas may be anything, NaN included); rows
  // before the window's first token too
  float sv[P][4];  // log2 of p x value scale, up to the running max
#pragma unroll
  for (int h = 0; h < P; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (C::key_offset) sc[h][i] -= cols.koff[i % 2];
      const int r = i / 2;
      const bool live = Local ? unsigned(t0 + 16 * h + qg + 8 * r) < unsigned(ntok)
                              : t0 + 16 * h + qg + 8 * r < ntok;
      sc[h][i] = live ? sc[h][i] * ks[h][r] * cols.scale[i % 2] : -INFINITY;
      sv[h][i] = live ? sc[h][i] + lvs[h][r] : -INFINITY;
    }
  if (Local && in.soft_cap > 0.f) {  // uniform (a launch parameter): masked scores stay -inf
    const soft_cap cap = soft_cap::make<log_base::two>(in.soft_cap);  // on the MUFU unit
#pragma unroll
    for (int h = 0; h < P; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool masked = sc[h][i] == -INFINITY;
        const float z = cap.apply(sc[h][i], mufu_exp2{}, mufu_rcp{});
        sc[h][i] = masked ? sc[h][i] : z;
        sv[h][i] = masked ? sv[h][i] : z + lvs[h][i / 2];
      }
  }
  // ---- online softmax per column over the step's tokens; p for l, pv = p x value scale for
  // the value product
  float pv[P][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float smax = -INFINITY, vmax = -INFINITY;
#pragma unroll
    for (int h = 0; h < P; ++h) {
      smax = fmax_nan(smax, fmax_nan(sc[h][j], sc[h][j + 2]));
      vmax = fmax_nan(vmax, fmax_nan(sv[h][j], sv[h][j + 2]));
    }
    const float mn = fmax_nan(ws.m[j], quad_col_max(smax));
    const float mvn = fmax_nan(ws.mv[j], quad_col_max(vmax));
    const float alpha = exp2_rel(ws.m[j], mn);
    float psum = 0.f;
#pragma unroll
    for (int h = 0; h < P; ++h) {
      psum += exp2_rel(sc[h][j], mn) + exp2_rel(sc[h][j + 2], mn);
      pv[h][j] = exp2_rel(sv[h][j], mvn);
      pv[h][j + 2] = exp2_rel(sv[h][j + 2], mvn);
    }
    ws.l[j] = ws.l[j] * alpha + psum;
    ps[j] = psum;  // relative to mn: the step's log2 mass is mn + log2 of its column sum
    ws.m[j] = mn;
    const float av = exp2_rel(ws.mv[j], mvn);
    ws.mv[j] = mvn;
    if (__any_sync(0xffffffffu, av != 1.f)) {
#pragma unroll
      for (int mt = 0; mt < C::ST; ++mt) {
        ws.o[mt][j] *= av;
        ws.o[mt][j + 2] *= av;
      }
      if constexpr (C::value_bias) ws.ob[j] *= av;
    }
  }
  // ---- P^T as B fragments (k = tokens, n = head qg) by two 8x8 transposes per sub-step
#pragma unroll
  for (int h = 0; h < P; ++h) {
    pb[h][0] = movmatrix_trans(pack_operand2<C::VT>(pv[h][0], pv[h][1]));
    pb[h][1] = movmatrix_trans(pack_operand2<C::VT>(pv[h][2], pv[h][3]));
  }
}

// The value product of one sub-step: O^T += V^T P^T, value rows vw read by mma_slot::read_values.
template <class C>
__device__ __forceinline__ void mma_step_values(const std::uint32_t (&vw)[4][C::VC::value_words],
                                                const std::uint32_t (&pb)[2], const mma_smem& sm,
                                                int qg, const mma_warp_state<C>& ws) {
  using VC = typename C::VC;
  const std::uint32_t table = VC::value_table(sm.table);
#pragma unroll
  for (int wi = 0; wi < VC::value_eff_words; ++wi) {
    constexpr int MPW = VC::value_mtiles_per_word;
    std::uint32_t lo[MPW][2], hi[MPW][2];
    VC::template value_pairs<C::value_bias>(VC::value_word(vw[0], qg, wi),
                                            VC::value_word(vw[1], qg, wi), lo,
                                            table);  // tokens 2qc, 2qc + 1
    VC::template value_pairs<C::value_bias>(VC::value_word(vw[2], qg, wi),
                                            VC::value_word(vw[3], qg, wi), hi,
                                            table);  // 2qc + 8, 2qc + 9
#pragma unroll
    for (int k = 0; k < MPW; ++k) {
      const std::uint32_t a[4] = {lo[k][0], lo[k][1], hi[k][0], hi[k][1]};
      mma_16816_of<C::VT>(ws.o[wi * MPW + k], a, pb[0], pb[1]);
    }
  }
  if constexpr (C::value_bias) mma_16816_uniform_a(ws.ob, VC::value_bias_pair, pb[0], pb[1]);
}

// One step's log2 mass per query head (relative to nothing: m + log2 of its tokens' sum of
// p) in the slot of its first 16 tokens (logical page, P x step) of the mass workspace
// (mass_slots_per_page a page), -inf in its other sub-steps' slots; the page-mass kernel
// adds the slots. Per step, because a page's steps may be split between two warps.
template <class C>
__device__ __forceinline__ void mma_step_mass(const decode_plan& plan, float* mass_ws, int b,
                                              int kvh, std::int32_t logical, int step,
                                              float (&ps)[2], const mma_warp_state<C>& ws,
                                              const mma_lane& at, int* err) {
  constexpr int G = C::G, P = C::P;
#pragma unroll
  for (int j = 0; j < 2; ++j) ps[j] = quad_col_sum(ps[j]);
  if (logical < plan.max_pages) {
    if (at.qg == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = 2 * at.qc + j;
        if (h < G) {
          const std::size_t row = std::size_t(b) * C::S::qh + std::size_t(kvh) * G + std::size_t(h);
          float* slots = mass_ws +
                         (row * std::size_t(plan.max_pages) + std::size_t(logical)) *
                             std::size_t(mass_slots_per_page<typename C::geometry>) +
                         std::size_t(P * step);
          slots[0] = ws.m[j] + fast_log2(ps[j]);
#pragma unroll
          for (int k = 1; k < P; ++k) slots[k] = -INFINITY;
        }
      }
    }
  } else if (at.lane == 0) {
    report_error(err, errc::out_of_range);
  }
}

// the chunk's new running max of head h: previous tiers and every warp with mass
__device__ __forceinline__ float mma_chunk_max(const mma_smem& sm, int h) {
  float x = sm.m[h];
  for (int w = 0; w < mma_warps; ++w)
    if (sm.wstate[w * 24 + 16 + h] > 0.f) x = fmaxf(x, sm.wstate[w * 24 + h]);
  return x;
}

// One tier's pages of this chunk on the tensor cores: the warp's first step in flight, the query
// prologue, then per step its key rows, scores, one online-softmax update and value product,
// then the warps' states folded into the chunk's. Local: the launch has a soft-cap or a sliding
// window (decode() picks the instantiation, so the plain kernel carries none of their registers:
// bench/results/decode/ab/ for the A/B).
//
// The query fragments, the column scales, a page's token count and the epilogue stay in this
// body: moved into functions of their own, each changed the code of the kernels checked (the
// clamp of j_end below compiled to another, equivalent sequence; a page's token count, other
// registers; per-function SASS, bench/gpu/sass_compare.py).
template <class Geometry, class Tier, int N, bool Local>
__device__ void mma_tier_pages(const decode_inputs<N>& in, const decode_plan& plan, int f, int b,
                               int kvh, int e_begin, int e_end, bool sole, const mma_smem& sm,
                               float* mass_ws, int* err) {
  using C = mma_tier_config<Geometry, Tier>;
  using KC = typename C::KC;
  using VC = typename C::VC;
  constexpr int D = C::D, G = C::G, ST = C::ST, P = C::P, RT = C::RT, SL = C::SL;
  constexpr int KS = C::KS, QP = C::QP;
  const mma_lane at;
  const int tid = at.tid, warp = at.warp, lane = at.lane, qg = at.qg, qc = at.qc;
  const codec_context kctx =
      make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::key);
  const codec_context vctx =
      make_codec_context(in.cache_seed, in.layer, in.head_base + kvh, kv_role::value);
  __syncthreads();

  // ---- the warp's steps (mma_page_stream) through its staging slot (mma_slot). Small chunks (<
  // 4 pages per warp): the steps of the tier's pages in this chunk split into 4 contiguous
  // ranges, balanced to a step (whole pages per warp left up to a page of 4 steps idle per warp
  // on the critical path of small batches; part of
  // bench/results/decode/ab/ab-h200-2026-11-30-run9.txt: B = 1 -10..-18% at d = 256). Larger
  // chunks: whole pages round robin (stride 4 pages), as before; contiguous ranges there
  // measured the same (+-1%). The ranges split the steps as if every page were full, so the
  // first step's address needs no index load but its slot; the sequence's last page may be
  // partial, and j_end is clamped to its tokens once that step is in flight. Step indices are
  // unsigned: j / SL and j % SL are shifts for the usual page sizes.
  const format_pages_view fv = in.index.formats[f];
  const pool_view pool = in.pools[f];
  const mma_slot<C> slot(sm.ring, kvh, at);
  const int pages = e_end - e_begin;
  const bool ranges = pages < 4 * mma_warps;
  const int stride = ranges ? 1 : mma_warps;
  const unsigned nominal = unsigned(pages) * SL;
  unsigned j_end = ranges ? nominal * unsigned(warp + 1) / mma_warps : nominal;
  const mma_page_stream<C> stream{fv, pool, e_begin, stride, j_end, err};
  // The warp's first step is copied before the query prologue, which hides its memory round
  // trip (B = 1: 1-2 us of a chunk, per-CTA %clock64 trace). The last page's index and the
  // sequence's length load alongside the first step's slot (used after that step is issued).
  const std::int32_t last = pages > 0 ? __ldg(fv.logical + e_end - 1) : -1;
  const int length = __ldg(in.index.seq_len + b);
  unsigned j =
      stream.valid_from(ranges ? nominal * unsigned(warp) / mma_warps : unsigned(warp) * SL);
  const std::uint8_t* page = stream.page_at(j);
  slot.issue_keys(page, int(j % SL));
  slot.issue_values(page, int(j % SL));
  if (pages > 0) {  // every page has SL steps but the last (a step past a page's tokens is masked)
    const int last_tok = last >= 0 ? in.index.tokens_in_page_of(length, last, Geometry::page_tokens)
                                   : Geometry::page_tokens;
    const unsigned total_steps =
        unsigned(pages - 1) * SL + unsigned(std::max(1, (last_tok + RT - 1) / RT));
    if (j_end > total_steps) j_end = total_steps;
  }

  // ---- the query prologue: queries in the key codec's domain, per head scaled by 2^-e (max |q|
  // < 1) and split into hi + lo B fragments (f16, or int8 digits for int8 keys): column n = head
  // qg, k slots of lane qc.
  group_prepare_query<typename C::K, G>(sm.q_raw, sm.acc_part, kctx);
  // group_prepare_query gives head h to warp h % 4, as mma_query_exponents does: a warp reads
  // only what it wrote (no block barrier; at B = 1 the per-chunk prologue and epilogue are
  // about half of the split kernel's stall samples, ncu; docs/history/gpu-runs.md).
  static_assert(mma_warps == decode_warps, "decode: the prologue's head-to-warp map");
  __syncwarp();
  mma_query_exponents<C>(sm, at);
  __syncthreads();
  {
    // The block builds the fragments item by item, reading the prepared query as 16-byte
    // vectors in an order with few bank conflicts: per lane (head qg, column pair qc) its
    // coordinates lie a multiple of 32 words apart across qg and qc, so the per-lane loop of
    // scalar loads (before bench/results/decode/ab/ab-h200-2026-11-30-fold-prologue.txt) was 16- to
    // 32-way conflicted (~1.7 us of a chunk at d = 256).
    if constexpr (C::s8_keys) {
      // item (lane, k step s), s fastest: the 8 coordinates [key_coord_s8(qc, s, 0), +8) of head qg
      uint2* qf = reinterpret_cast<uint2*>(sm.qfrag);
      for (unsigned t = tid; t < KS * 32; t += decode_threads) {
        const unsigned s = t % KS, ln = t / KS, g = ln / 4, c = ln % 4;
        std::uint32_t dg[QP][2] = {};
        if (g < unsigned(G)) {
          const float qs = exp2f(float(C::s8_query_bits) - sm.qexp[g]);
          const float4* src =
              reinterpret_cast<const float4*>(sm.acc_part + g * D + KC::key_coord_s8(c, s, 0));
          const float4 a = src[0], b = src[1];
          const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            int d[QP];
            int8_query_digits<QP>(__float2int_rn(x[KC::query_offset_s8(j)] * qs), d);
#pragma unroll
            for (int p = 0; p < QP; ++p)
              dg[p][j / 4] |= (std::uint32_t(d[p]) & 0xffu) << (8 * (j % 4));
          }
        }
#pragma unroll
        for (int p = 0; p < QP; ++p) qf[(s * QP + p) * 32 + ln] = make_uint2(dg[p][0], dg[p][1]);
      }
    } else {
      // item (k step s, lane), lane fastest: the 4 coordinates [key_coord(qc, s, 0), +4) of head qg
      for (unsigned t = tid; t < KS * 32; t += decode_threads) {
        const unsigned ln = t % 32, s = t / 32, g = ln / 4, c = ln % 4;
        float x[4] = {0.f, 0.f, 0.f, 0.f};
        if (g < unsigned(G)) {
          const float qs = exp2f(-sm.qexp[g]);
          const float4 a =
              *reinterpret_cast<const float4*>(sm.acc_part + g * D + KC::key_coord(c, s, 0));
          x[0] = a.x * qs;
          x[1] = a.y * qs;
          x[2] = a.z * qs;
          x[3] = a.w * qs;
        }
        std::uint32_t fr[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (C::KT == operand_type::f16) {
            const __half2 hh = __floats2half2_rn(x[2 * r], x[2 * r + 1]);
            const float2 back = __half22float2(hh);
            fr[r] = *reinterpret_cast<const std::uint32_t*>(&hh);
            fr[2 + r] = pack_half2(x[2 * r] - back.x, x[2 * r + 1] - back.y);
          } else {  // bf16 hi + lo: 16 bits of the scaled query, about 2^-17 relative
            const std::uint32_t hh = pack_bfloat162(x[2 * r], x[2 * r + 1]);
            fr[r] = hh;
            fr[2 + r] = pack_bfloat162(x[2 * r] - __uint_as_float(hh << 16),
                                       x[2 * r + 1] - __uint_as_float(hh & 0xffff0000u));
          }
        }
        sm.qfrag[s * 32 + ln] = make_uint4(fr[0], fr[1], fr[2], fr[3]);
      }
    }
  }
  __syncthreads();
  // Column scale (heads 2 qc, 2 qc + 1): softmax scale x log2(e) x the query's scale (2^e, or
  // 2^(e - bits) for int8 queries) x the scale of the int8 key levels.
  float colscale[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * qc + j;
    colscale[j] = 0.f;
    if (h < G) {
      if constexpr (C::s8_keys) {
        colscale[j] = in.softmax_scale * log2e * exp2f(sm.qexp[h] - float(C::s8_query_bits)) *
                      KC::key_level_scale;
      } else {
        colscale[j] = in.softmax_scale * log2e * exp2f(sm.qexp[h]);
      }
    }
  }
  float koff[2] = {0.f, 0.f};
  if constexpr (C::key_offset) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      koff[j] = 2 * qc + j < G ? KC::key_level_offset * sm.qsum[2 * qc + j] : 0.f;
  }

  // ---- the warp's state (mma_warp_state)
  float o[ST][4];
#pragma unroll
  for (int mt = 0; mt < ST; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[mt][i] = 0.f;
  float ob[2] = {0.f, 0.f};
  float m[2] = {-INFINITY, -INFINITY}, mv[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const mma_warp_state<C> ws{o, ob, m, mv, l};
  const mma_columns cols{{colscale[0], colscale[1]}, {koff[0], koff[1]}};

  // ---- the steps. Sub-step h of a step: key rows 16h + qg, 16h + qg + 8 (kw[h], ks[h]), value
  // rows 16h + 2qc, +1, +8, +9 (vw[h]), log2 value scales lvs[h]. Phased steps (mma_staging)
  // read and reissue the K group before the scores and the V group before the values; the others
  // wait once per step.
  int ntok = 0, t_lo = 0;
  std::int32_t logical = -1;
  while (j < j_end) {
    const int step = int(j % SL);
    if (logical < 0) {  // a new page (or the first step, which may start mid-page)
      logical = fv.logical[e_begin + int(j / SL)];
      if constexpr (Local) {
        const int len = in.index.seq_len[b];
        ntok = in.index.tokens_in_page_of(len, logical, Geometry::page_tokens);
        // tokens before t_lo are outside the window (0 without one)
        t_lo = first_in_page<Geometry::page_tokens>(logical, window_first(in.window, len), ntok);
      } else {
        ntok = in.index.tokens_in_page(b, logical, Geometry::page_tokens);
      }
    }
    // the next step: in this page (same address), else the warp's next valid page
    const bool same_page = (j + 1) % SL != 0;
    const unsigned nj = same_page ? j + 1 : stream.valid_from((j / SL + stride) * SL);
    const std::uint8_t* npage = same_page ? (nj < j_end ? page : nullptr) : stream.page_at(nj);
    const int ns = int(nj % SL);
    float ps[2] = {0.f, 0.f};
    const int t0 = RT * step;
    if constexpr (C::phased) {
      std::uint32_t pb[P][2];
      {
        cp_async_wait<1>();  // this step's K group (its V group may still be in flight)
        __syncwarp();
        std::uint32_t kw[P][2][KC::key_words];
        float ks[P][2], lvs[P][2];
#pragma unroll
        for (int h = 0; h < P; ++h) slot.read_keys(h, kw[h], ks[h], lvs[h]);
        __syncwarp();  // every lane has read the key rows and metas before they are overwritten
        slot.issue_keys(npage, ns);
        float sc[P][4];
        mma_step_scores<C>(kw, sm, at, sc);
        mma_step_softmax<C, Local>(in, sc, ks, lvs, t0 - t_lo, ntok - t_lo, cols, qg, ws, ps, pb);
      }
      cp_async_wait<1>();  // this step's V group (the next K group may still be in flight)
      __syncwarp();
      // sub-step by sub-step (a sub-step's value words in registers at a time); the next V
      // group is issued once the last sub-step's rows are read
#pragma unroll
      for (int h = 0; h < P; ++h) {
        std::uint32_t vw[4][VC::value_words];
        slot.read_values(h, t0, ntok, vw);
        if (h == P - 1) {
          __syncwarp();  // every lane has read the value rows before they are overwritten
          slot.issue_values(npage, ns);
        }
        mma_step_values<C>(vw, pb[h], sm, qg, ws);
      }
    } else {
      cp_async_wait<0>();
      __syncwarp();
      std::uint32_t kw[P][2][KC::key_words];
      std::uint32_t vw[P][4][VC::value_words];
      float ks[P][2], lvs[P][2];
#pragma unroll
      for (int h = 0; h < P; ++h) {
        slot.read_keys(h, kw[h], ks[h], lvs[h]);
        slot.read_values(h, t0, ntok, vw[h]);
      }
      __syncwarp();  // every lane has read the slot before the next step overwrites it
      slot.issue_keys(npage, ns);
      slot.issue_values(npage, ns);
      std::uint32_t pb[P][2];
      float sc[P][4];
      mma_step_scores<C>(kw, sm, at, sc);
      mma_step_softmax<C, Local>(in, sc, ks, lvs, t0 - t_lo, ntok - t_lo, cols, qg, ws, ps, pb);
#pragma unroll
      for (int h = 0; h < P; ++h) mma_step_values<C>(vw[h], pb[h], sm, qg, ws);
    }
    if (mass_ws != nullptr) mma_step_mass<C>(plan, mass_ws, b, kvh, logical, step, ps, ws, at, err);
    if (!same_page) logical = -1;
    page = npage;
    j = nj;
  }
  cp_async_wait<0>();  // the empty groups of the last step

  // ---- the epilogue: the warps' states -> shared memory; rebase to the chunk's running max
#pragma unroll
  for (int j = 0; j < 2; ++j) l[j] = quad_col_sum(l[j]);
  if (qg == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float* wst = sm.wstate + warp * 24;
      wst[2 * qc + j] = m[j];
      wst[8 + 2 * qc + j] = mv[j];
      wst[16 + 2 * qc + j] = l[j];
    }
  }
  __syncthreads();
  float fac[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int h = 2 * qc + j;
    fac[j] = h < G ? exp2_rel(mv[j], mma_chunk_max(sm, h)) : 0.f;
  }
  const float mnew_t = tid < G ? mma_chunk_max(sm, tid) : 0.f;
  // Each warp writes its rescaled accumulator to its own slice of the (now idle) staging
  // ring (mma_fold); one barrier, then the block sums the slices in a fixed warp order
  // (deterministic). Folding the warps one after another behind a barrier each put 4 x d/16
  // x 4 shared read-modify-writes on every chunk's critical path (ncu, B = 1: ~25% of a
  // warp's instructions).
  using fold_shape = mma_fold<Geometry>;
  float* fold = reinterpret_cast<float*>(sm.ring);
#pragma unroll
  for (int mt = 0; mt < ST; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x = C::value_bias ? o[mt][i] - ob[i % 2] : o[mt][i];
      fold[warp * fold_shape::slice + (4 * mt + i) * fold_shape::row + lane] = x * fac[i % 2];
    }
  __syncthreads();
  static_assert(fold_shape::values * 32 % decode_threads == 0,
                "decode: whole fold rounds per thread");
#pragma unroll 4
  for (unsigned n = 0; n < fold_shape::values * 32 / decode_threads; ++n) {
    // value k of lane src (unsigned: the divisions are shifts); the loads unconditional (a
    // dead column's slots are read, not stored), so the unrolled rounds' loads overlap
    const unsigned e = unsigned(tid) + n * decode_threads;
    const unsigned k = e % fold_shape::values, src = e / fold_shape::values;
    float x = fold[k * fold_shape::row + src];
#pragma unroll
    for (int w = 1; w < mma_warps; ++w)
      x += fold[w * fold_shape::slice + k * fold_shape::row + src];
    const unsigned h = 2 * (src % 4) + k % 2;
    if (h < unsigned(G)) sm.acc_part[h * D + VC::value_coord(src / 4, k / 4, (k % 4) / 2)] = x;
  }
  __syncthreads();
  if (tid < G) {
    float lt = sm.l[tid] * exp2_rel(sm.m[tid], mnew_t);
    for (int w = 0; w < mma_warps; ++w)
      lt += sm.wstate[w * 24 + 16 + tid] * exp2_rel(sm.wstate[w * 24 + tid], mnew_t);
    sm.l[tid] = lt;
    sm.m[tid] = mnew_t;
  }
  // Back to the model's domain once per tier (identity for FP8, inverse rotation for TQ3).
  group_finalize<typename C::V, G>(sm.acc_part, vctx);
  // The chunk's only tier: acc_part is the chunk's accumulator, relative to m (the split
  // kernel stores it after its barrier). Otherwise fold it into acc_total.
  if (sole) return;
  __syncthreads();
  for (int i = tid; i < G * D; i += decode_threads) {
    const int h = i / D;
    sm.acc_total[i] = sm.acc_total[i] * exp2_rel(sm.m_ref[h], sm.m[h]) + sm.acc_part[i];
  }
  __syncthreads();
  if (tid < G) sm.m_ref[tid] = sm.m[tid];
  __syncthreads();
}

template <class Geometry, class TierList, bool Local>
struct mma_kernels;

template <class Geometry, class... Tiers, bool Local>
struct mma_kernels<Geometry, tiers<Tiers...>, Local> {
  static constexpr int N = int(sizeof...(Tiers));
  using S = mma_shape<Geometry>;

  // One chunk (run_split_block, decode/common.cuh): its tiers' pages, then its state to the
  // workspace.
  static __device__ __forceinline__ void chunk(const decode_inputs<N>& in, const decode_plan& plan,
                                               std::uint8_t* workspace, int kvh, int c, int b,
                                               const chunking<N>& ch, const std::int64_t (&cost)[N],
                                               int* err, float* mass_ws) {
    constexpr int D = S::d, G = S::g;
    extern __shared__ float4 smem4[];
    float* smem = reinterpret_cast<float*>(smem4);
    mma_smem sm;
    sm.q_raw = smem;
    sm.acc_part = sm.q_raw + G * D;
    sm.acc_total = sm.acc_part + G * D;
    sm.wstate = sm.acc_total + G * D;
    sm.m = sm.wstate + mma_warps * 24;
    sm.l = sm.m + 8;
    sm.m_ref = sm.l + 8;
    sm.qexp = sm.m_ref + 8;
    sm.qsum = sm.qexp + 8;
    sm.table = reinterpret_cast<std::uint32_t*>(sm.qsum + 8);
    sm.qfrag = reinterpret_cast<uint4*>(sm.qsum + 16);
    sm.ring = reinterpret_cast<std::uint8_t*>(sm.qfrag + S::steps * 32);

    const int tid = int(threadIdx.x);
    const std::size_t qrow = std::size_t(b) * S::qh + std::size_t(kvh) * G;
    load_group_queries<G, D>(in, qrow, sm.q_raw, sm.acc_total);
    if (tid == 0) sm.table[0] = tierkv::detail::tq3_u8_0;
    if (tid < G) {
      sm.m[tid] = -INFINITY;
      sm.l[tid] = 0.f;
      sm.m_ref[tid] = -INFINITY;
    }
    // The tiers with pages in this chunk (by-format chunks, the usual case, have one), less the
    // pages wholly before the window (not read; a chunk left without pages stores an empty state).
    int lo[N], hi[N], with_pages = 0;
    if constexpr (!Local) {
#pragma unroll
      for (int f = 0; f < N; ++f) {
        chunk_range<N>(ch, cost, c, f, lo[f], hi[f]);
        with_pages += hi[f] > lo[f];
      }
    } else {
#pragma unroll
      for (int f = 0; f < N; ++f) chunk_range<N>(ch, cost, c, f, lo[f], hi[f]);
      if (in.window > 0) {
        const int first = window_first(in, b);
#pragma unroll
        for (int f = 0; f < N; ++f)
          if (hi[f] > lo[f])
            lo[f] = first_window_entry<Geometry::page_tokens>(
                        in.index.formats[f], ch.first[f] + lo[f], ch.first[f] + hi[f], first) -
                    ch.first[f];
      }
#pragma unroll
      for (int f = 0; f < N; ++f) with_pages += hi[f] > lo[f];
    }
    const bool sole = with_pages == 1;
    run_tiers(in, plan, ch, lo, hi, sole, b, kvh, sm, mass_ws, err, std::make_index_sequence<N>{});
    __syncthreads();

    store_chunk_state<G, D>(plan, workspace, qrow, c, sm.m, sm.l,
                            sole ? sm.acc_part : sm.acc_total);
  }

  template <std::size_t... I>
  static __device__ void run_tiers(const decode_inputs<N>& in, const decode_plan& plan,
                                   const chunking<N>& ch, const int (&lo)[N], const int (&hi)[N],
                                   bool sole, int b, int kvh, const mma_smem& sm, float* mass_ws,
                                   int* err, std::index_sequence<I...>) {
    ((hi[I] > lo[I]
          ? mma_tier_pages<Geometry, Tiers, N, Local>(in, plan, int(I), b, kvh, ch.first[I] + lo[I],
                                                      ch.first[I] + hi[I], sole, sm, mass_ws, err)
          : void()),
     ...);
  }
};

template <class Geometry, class TierList, bool Local>
__global__ void __launch_bounds__(decode_threads, mma_shape<Geometry>::min_blocks)
    decode_mma_split_kernel(decode_inputs<TierList::size> in, decode_plan plan,
                            std::uint8_t* workspace) {
  allow_dependent_launch();  // the merge kernel's programmatic launch (arch/pdl.cuh)
  run_split_block<mma_kernels<Geometry, TierList, Local>>(in, plan, workspace);
}

}  // namespace tierkv::cuda::detail
