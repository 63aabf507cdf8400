// SPDX-License-Identifier: Apache-2.0
// Host planner of the split-KV decode: how many chunks a sequence is cut into, balanced by
// the BYTES its pages cost to read (a TQ3 page is ~2.6x cheaper than an FP8 one), and how
// large the fixed-capacity workspace is, so a decode step is CUDA-graph capturable.
#pragma once

#include "tierkv/core/config.hpp"

#include <array>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::cuda {

/// The most chunks one sequence may be split in (the workspace holds a state and an
/// accumulator per chunk).
inline constexpr int decode_capacity_max_chunks = 4096;
/// Attention-mass slots per page in the workspace: one per 16-token step, because the
/// tensor-core kernel's warps may split a page's steps between them (the CUDA-core kernel
/// writes a page's mass to its first slot); the page-mass kernel adds a page's slots.
template <class Geometry>
inline constexpr int mass_slots_per_page = Geometry::page_tokens / 16;

/// Blocks per SM the tensor-core split kernel is built for (its __launch_bounds__: 128
/// registers a thread at head_dim <= 128, 168 above; ptxas -v, docs/gpu.md): the planner's
/// default size of one wave.
template <class Geometry>
inline constexpr int decode_blocks_per_sm = Geometry::head_dim <= 128 ? 4 : 3;

/// What a plan must hold: the largest batch, the most chunks a sequence may be split in
/// (the workspace holds one partial state per chunk), and for the optional per-page
/// attention mass the most logical pages a sequence may have.
struct decode_capacity {
  int max_batch = 0;            ///< largest batch
  int max_chunks_per_seq = 64;  ///< most chunks a sequence may be split in
  int max_pages_per_seq = 0;    ///< only needed with page_mass
  bool page_mass = false;       ///< reserve workspace for the per-page attention mass
};

/// A plan is plain data: the run reads it by value, so a captured graph replays it.
///   page_cost[f]: a page's weight on a sequence's cost line (bytes or work, see `balance`);
///   target_chunk_bytes (in page_cost units): a sequence of total cost T (per KV head) runs in
///     clamp(ceil(T / target_chunk_bytes), 1, min(max_chunks, its page count)) chunks;
///   every chunk gets a contiguous, equal share of the sequence's cost (pages ordered
///   format by format; the merge is order-independent).
struct decode_plan {
  static constexpr int max_formats = 8;  ///< most tiers (formats) a plan covers
  /// Weight of one page of each tier on a sequence's cost line (what chunks are balanced by).
  std::int64_t page_cost[max_formats] = {};
  int max_batch = 0;                    ///< largest batch
  int max_chunks = 1;                   ///< most chunks per sequence
  int max_pages = 0;                    ///< most logical pages per sequence (page mass only)
  bool page_mass = false;               ///< workspace holds the per-page attention mass
  std::int64_t target_chunk_bytes = 0;  ///< target cost of one chunk, in page_cost units
  std::size_t workspace_bytes = 0;      ///< bytes of device workspace the run needs
  // Offsets inside the workspace (bytes, 256-aligned).
  std::size_t state_offset = 0;  ///< float2 {m (log2 units), l} [max_batch][q_heads][max_chunks]
  std::size_t acc_offset = 0;    ///< float [max_batch][q_heads][max_chunks][head_dim]
  std::size_t mass_offset =
      0;  ///< float [max_batch][q_heads][max_pages][mass_slots_per_page] (log2 masses)
  std::size_t error_offset =
      0;  ///< one int: the running step's first device-side errc (0 between steps)
  std::size_t result_offset = 0;  ///< one int: the last step's errc (decode_device_error)
};

namespace detail {
// floor(a / b) for 0 <= a < 2^62, 0 < b and a quotient below 2^50 (chunk counts and page
// indices; a larger one, only from a hand-made plan, is clamped to max_chunks anyway): the
// double quotient is within 1 of the exact one, then one integer correction (checked against
// int64 division on 5e7 random pairs). An int64 division compiles to a ~100-instruction routine,
// and the chunking needs several before a block issues its first load (tiered chunks at
// B = 1: ~1 us of per-CTA %clock64 trace, against ~0.25 us for one format).
TIERKV_HD_INLINE std::int64_t div_floor(std::int64_t a, std::int64_t b) {
  std::int64_t q = std::int64_t(double(a) / double(b));
  if (q * b > a)
    --q;
  else if ((q + 1) * b <= a)
    ++q;
  return q;
}

// The chunks of a sequence whose pages cost `total` per KV head on the plan's cost line:
// ceil(total / target), at most max_chunks and its page count (the split and merge kernels
// both count them so; a plan's launched blocks are their sum times kv_heads).
TIERKV_HD_INLINE int sequence_chunks(std::int64_t total, int pages, std::int64_t target,
                                     int max_chunks) {
  std::int64_t k = div_floor(total + target - 1, target);
  if (k > max_chunks) k = max_chunks;
  if (k > pages) k = pages;
  return int(k);
}

constexpr std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

// Bytes one KV head of one page of a tier costs to read (payloads and meta, keys and values).
template <class Geometry, class Tier>
constexpr std::int64_t tier_page_cost() {
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  return std::int64_t(Geometry::page_tokens) *
         std::int64_t(K::payload_bytes + V::payload_bytes + K::meta_bytes + V::meta_bytes);
}

template <class Geometry, class TierList>
struct page_costs;
template <class Geometry, class... Tiers>
struct page_costs<Geometry, tiers<Tiers...>> {
  static constexpr int n = int(sizeof...(Tiers));
  static constexpr std::int64_t value[sizeof...(Tiers)] = {tier_page_cost<Geometry, Tiers>()...};
};
}  // namespace detail

/// What a chunk is balanced by. `bytes`: the bytes a page costs to read (right for a kernel at
/// the bandwidth roofline). `work`: the time a page costs in the present kernels: scalars x
/// each codec's decode_work_percent (codec/codec.hpp), where TQ3 pages are instruction-bound
/// per scalar, so a TQ3 page (2.6x fewer bytes) takes about 3/4 of an FP8 page's time
/// (docs/gpu.md); balancing by bytes left the TQ3 chunks of a tiered batch much longer than
/// the FP8 ones. plan_decode's unpack_work_percent, when > 0, replaces the figure of every
/// codec that declares one below 100 (a benchmark sweeps it).
enum class balance : std::uint8_t { bytes = 0, work = 1 };

namespace detail {
template <class C>
constexpr int role_work_percent(int unpack_percent) {
  constexpr int declared = codec_decode_work_percent<C>();
  return declared < 100 && unpack_percent > 0 ? unpack_percent : declared;
}
template <class Geometry, class Tier>
constexpr std::int64_t tier_page_work(int unpack_percent) {
  using K = typename Tier::template key_codec<Geometry::head_dim>;
  using V = typename Tier::template value_codec<Geometry::head_dim>;
  // scalars per page and head, x each role's work percent / 100: see `balance`
  const std::int64_t per_role = std::int64_t(Geometry::page_tokens) * Geometry::head_dim * 100;
  return per_role * role_work_percent<K>(unpack_percent) / 100 +
         per_role * role_work_percent<V>(unpack_percent) / 100;
}
template <class Geometry, class TierList>
struct page_works;
template <class Geometry, class... Tiers>
struct page_works<Geometry, tiers<Tiers...>> {
  static constexpr std::array<std::int64_t, sizeof...(Tiers)> of(int unpack_percent) {
    return {tier_page_work<Geometry, Tiers>(unpack_percent)...};
  }
};
}  // namespace detail

/// plan_decode's defaults, named so that benchmarks and tests can start from them.
inline constexpr int decode_default_waves = 12;
/// Default `min_chunk_bytes`: no chunk reads less (bytes).
inline constexpr std::int64_t decode_default_min_chunk_bytes = 16 * 1024;
/// Default `min_chunk_pages`: no chunk gets fewer average pages.
inline constexpr int decode_default_min_chunk_pages = 16;

/// Plans a decode for `capacity`, sized by a representative step: pages_per_format[b*N + f]
/// is the number of pages sequence b holds in tier f (host memory, batch rows). The chunk
/// size is chosen so that all (sequence, KV head, chunk) blocks number about `waves` x
/// `sm_count` (12 = about 4 waves of 3 resident blocks per SM, so the last, partial wave
/// costs little), but beyond one wave (`resident_blocks` x sm_count blocks, less one block
/// per (sequence, KV head) because each rounds its chunk count up: without that slack, 4
/// blocks per SM at head_dim <= 128 made (32,8,128) 8K B = 8 a wave and a tenth, +18%, which
/// planning with 3 had hidden; with it, against 3 and no slack: (32,8,128) 32K B = 1 -7..-16%,
/// (24,4,256) 8K B = 8 -8..-19%, B = 32 unchanged; H200 A/B in
/// bench/results/decode/ab/ab-h200-2026-11-30-plan-wave.txt) no chunk gets fewer than
/// `min_chunk_pages` average pages (large chunks hand whole pages to the kernel's 4 warps: 16 pages
/// = 4 per warp), and no chunk reads less than `min_chunk_bytes` (per-chunk setup and the merge
/// cost about as much as reading ~16 KB; with 64 KB, the earlier default, TQ3 pages at d = 64 got
/// 26 chunks per sequence where FP8 got 64
/// (bench/results/decode/ab/ab-h200-2026-11-30-min-chunk.txt): H200 A/B at B = 1, 8K-32K: -16%
/// geometric mean, TQ3 at d = 64 34.5 -> 21.9 us, no row slower by > 2%). Under balance::work a
/// role weighs its codec's decode_work_percent (`balance`; unpack_work_percent > 0 overrides the
/// unpack-bound ones). docs/gpu.md has the H200 measurements behind these defaults.
template <class Geometry, class TierList>
result<decode_plan> plan_decode(
    const decode_capacity& capacity, const std::int32_t* pages_per_format, int batch, int sm_count,
    int waves = decode_default_waves, std::int64_t min_chunk_bytes = decode_default_min_chunk_bytes,
    balance by = balance::work, int min_chunk_pages = decode_default_min_chunk_pages,
    int resident_blocks = decode_blocks_per_sm<Geometry>, int unpack_work_percent = 0) {
  using costs = detail::page_costs<Geometry, TierList>;
  const auto works = detail::page_works<Geometry, TierList>::of(unpack_work_percent);
  constexpr int n = costs::n;
  static_assert(n <= decode_plan::max_formats, "plan_decode: at most 8 tiers");
  if (capacity.max_batch < 1)
    return status::make(errc::invalid_argument,
                        "plan_decode: capacity.max_batch = ", capacity.max_batch,
                        " must be at least 1");
  if (batch < 0 || batch > capacity.max_batch)
    return status::out_of_range("plan_decode: batch", batch, capacity.max_batch + 1);
  if (capacity.max_chunks_per_seq < 1 || capacity.max_chunks_per_seq > decode_capacity_max_chunks)
    return status::make(errc::invalid_argument,
                        "plan_decode: capacity.max_chunks_per_seq = ", capacity.max_chunks_per_seq,
                        " must lie in [1, ", decode_capacity_max_chunks, "]");
  if (capacity.page_mass && capacity.max_pages_per_seq < 1)
    return status::make(errc::invalid_argument,
                        "plan_decode: page_mass needs capacity.max_pages_per_seq >= 1, got ",
                        capacity.max_pages_per_seq);
  if (sm_count < 1 || waves < 1 || min_chunk_bytes < 1 || min_chunk_pages < 1 ||
      resident_blocks < 1 || unpack_work_percent < 0)
    return status::make(
        errc::invalid_argument, "plan_decode: sm_count = ", sm_count, ", waves = ", waves,
        ", min_chunk_bytes = ", min_chunk_bytes, ", min_chunk_pages = ", min_chunk_pages,
        ", resident_blocks = ", resident_blocks, ", unpack_work_percent = ", unpack_work_percent,
        " must all be positive (unpack_work_percent >= 0: 0 = the codecs' own)");
  if (batch > 0 && pages_per_format == nullptr)
    return status::make(errc::invalid_argument, "plan_decode: pages_per_format is null");

  std::int64_t total = 0, pages = 0, sequences = 0;  // sequences: those with pages
  for (int b = 0; b < batch; ++b) {
    std::int64_t seq_pages = 0;
    for (int f = 0; f < n; ++f) {
      const std::int32_t c = pages_per_format[std::size_t(b) * n + std::size_t(f)];
      if (c < 0)
        return status::make(errc::invalid_argument, "plan_decode: pages_per_format[", b, "][", f,
                            "] = ", c, " is negative");
      total += std::int64_t(c) * costs::value[f];
      seq_pages += c;
    }
    pages += seq_pages;
    sequences += seq_pages > 0;
  }
  total *= Geometry::kv_heads;
  pages *= Geometry::kv_heads;
  const std::int64_t pairs =
      sequences * Geometry::kv_heads;  // (sequence, KV head) pairs with pages
  auto per_block = [&](std::int64_t blocks) { return (total + blocks - 1) / blocks; };
  std::int64_t target = per_block(std::int64_t(sm_count) * waves);
  if (waves > resident_blocks && pages > 0) {
    const std::int64_t floor_pages = total / pages * min_chunk_pages;  // average page bytes x pages
    const std::int64_t slots = std::int64_t(sm_count) * resident_blocks;
    const std::int64_t one_wave = per_block(slots > pairs ? slots - pairs : 1);
    const std::int64_t floor = floor_pages < one_wave ? floor_pages : one_wave;
    if (target < floor) target = floor;
  }
  if (target < min_chunk_bytes) target = min_chunk_bytes;

  decode_plan p;
  for (int f = 0; f < n; ++f)
    p.page_cost[f] = by == balance::bytes ? costs::value[f] : works[std::size_t(f)];
  // The target is in bytes; on the work line a chunk gets the same share of the total.
  if (by == balance::work && total > 0) {
    std::int64_t total_work = 0;
    for (int b = 0; b < batch; ++b)
      for (int f = 0; f < n; ++f)
        total_work += std::int64_t(pages_per_format[std::size_t(b) * n + std::size_t(f)]) *
                      works[std::size_t(f)];
    total_work *= Geometry::kv_heads;
    const long double chunks = (long double)total / (long double)target;
    target = std::int64_t((long double)total_work / chunks) + 1;
  } else if (by == balance::work) {
    target = std::int64_t(min_chunk_bytes) * works[0] / costs::value[0] + 1;
  }
  p.max_batch = capacity.max_batch;
  p.max_chunks = capacity.max_chunks_per_seq;
  p.max_pages = capacity.page_mass ? capacity.max_pages_per_seq : 0;
  p.page_mass = capacity.page_mass;
  p.target_chunk_bytes = target;
  const std::size_t rows = std::size_t(p.max_batch) * Geometry::q_heads;
  p.state_offset = 0;
  p.acc_offset = detail::align256(p.state_offset + rows * p.max_chunks * 2 * sizeof(float));
  p.mass_offset = detail::align256(
      p.acc_offset + rows * p.max_chunks * std::size_t(Geometry::head_dim) * sizeof(float));
  p.error_offset = detail::align256(p.mass_offset + rows * std::size_t(p.max_pages) *
                                                        std::size_t(mass_slots_per_page<Geometry>) *
                                                        sizeof(float));
  p.result_offset = p.error_offset + sizeof(int);
  p.workspace_bytes = detail::align256(p.result_offset + sizeof(int));
  return p;
}

}  // namespace tierkv::cuda
