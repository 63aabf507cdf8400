// SPDX-License-Identifier: Apache-2.0
// The tensor-core decode's compile-time shapes (decode/tensor_core.cuh): the block's shared
// memory, a warp's staging slot, the fold of the warps' accumulators, one tier's configuration,
// and a thread's place in the m16n8 fragments.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "tierkv/attention/int8_query.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/cuda/arch/mma.cuh"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/decode/common.cuh"
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
struct mma_tier_config : tier_codecs<Geometry, Tier> {
  using S = mma_shape<Geometry>;
  using KC = mma_codec<typename tier_codecs<Geometry, Tier>::K>;
  using VC = mma_codec<typename tier_codecs<Geometry, Tier>::V>;
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

}  // namespace tierkv::cuda::detail
