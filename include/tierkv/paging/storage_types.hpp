// SPDX-License-Identifier: Apache-2.0
// The plain types paged_storage is built from and its users name: block references, the
// options, the room hook concept, the accounting lines, the slot mapping of a reservation,
// the per-tier page layouts and pools, and compile-time tier loops.
#pragma once

#include "tierkv/core/config.hpp"

#include <array>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/page_pool.hpp"

namespace tierkv {

/// A shared logical page (all layers); the generation detects a stale reference.
struct block_ref {
  std::uint32_t index = std::numeric_limits<std::uint32_t>::max();  ///< the block's slot
  std::uint32_t generation = 0;  ///< the slot's generation when the reference was made
  /// False for a default-constructed reference.
  bool valid() const noexcept { return index != std::numeric_limits<std::uint32_t>::max(); }
  /// Same slot and generation.
  friend constexpr bool operator==(const block_ref&, const block_ref&) = default;
};

/// The options of a paged_storage (and tiered_cache_options::storage).
template <int NumTiers>
struct storage_options {
  int num_layers = 1;                  ///< model layers (a page exists per logical page and layer)
  std::uint32_t max_sequences = 1024;  ///< live sequences at most
  std::array<std::uint32_t, NumTiers> pages_per_tier{};  ///< pool capacities, in physical pages
  std::uint64_t codec_seed = 0;                          ///< rotation seeds (make_codec_context)
  /// Global index of this storage's first KV head: codec contexts use head_base + local
  /// head, so a tensor-parallel rank's pages are the head slices of an unsharded cache's.
  int head_base = 0;
};

/// Called by append and fork with the tier-0 pages they are about to allocate, once every
/// other check has passed and their bookkeeping memory is reserved: a caller that frees tier-0
/// pages by demoting (tier_controller::make_room, through tiered_cache) does it here, so a
/// refused operation never demotes first. A failing status refuses the operation.
template <class F>
concept room_hook = std::invocable<F&, std::uint32_t> &&
    std::convertible_to<std::invoke_result_t<F&, std::uint32_t>, status>;
/// A room_hook that frees nothing (paged_storage used without a tier controller).
struct no_room {
  /// Accepts; the allocation then succeeds or is refused on its own.
  status operator()(std::uint32_t) const { return {}; }
};

/// The byte lines the storage charges its host bookkeeping to (see report.hpp).
struct storage_lines {
  std::size_t pool_bookkeeping = 0;  ///< per-slot generation, refcount, state, free list
  std::size_t page_tables = 0;       ///< sequences, their logical page lists, blocks
  std::size_t index_arrays = 0;      ///< index_arrays buffers made from this storage
  std::size_t prefix_index = 0;      ///< a prefix_index over this storage
  std::size_t scratch = 0;           ///< the host façade's centring means (and, during a call,
                                     ///< its centred copy of the input)
};

/// Which tokens of a sequence an index (or a mass observation) covers: the committed ones
/// (decode between steps), or the committed ones and the outstanding reservation (a forward pass
/// attending to the tokens it has just written, before commit: chunked prefill, or a decode step
/// written layer by layer).
enum class index_scope : std::uint8_t { committed, readable };

/// Where the tokens of a reservation go, in cuda::append_inputs's layout (caller memory; the
/// storage only fills it): reserved token i (sequence position length + i) of layer l goes to
/// slot[l * layer_stride + i], a slot of the append tier's (tier 0's) pool, at token row
/// offset[i] of that page; the offset is the same for every layer. layer_stride 0 means n (a
/// dense [layers][n] array); a larger one lets several sequences' reservations share one array
/// (pass spans starting at each sequence's first column). An empty span is not filled.
struct slot_mapping {
  std::span<std::int32_t> slot;    ///< >= (num_layers - 1) * layer_stride + n entries
  std::int64_t layer_stride = 0;   ///< >= n, or 0 for n
  std::span<std::int32_t> offset;  ///< >= n entries
};

namespace detail {
template <class Geometry, class Tier>
using tier_layout = page_layout<Geometry, typename Tier::template key_codec<Geometry::head_dim>,
                                typename Tier::template value_codec<Geometry::head_dim>>;

template <class Geometry, class Tiers, class PageAlloc, class MetaAlloc>
struct pool_tuple;
template <class Geometry, class... Ts, class PageAlloc, class MetaAlloc>
struct pool_tuple<Geometry, tiers<Ts...>, PageAlloc, MetaAlloc> {
  using type = std::tuple<page_pool<tier_layout<Geometry, Ts>, PageAlloc, MetaAlloc>...>;
};

template <int N, class F>
void for_each_index(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }
  (std::make_integer_sequence<int, N>{});
}
/// Calls f(std::integral_constant<int, I>) for the runtime index i (0 <= i < N).
template <int N, class F>
void with_index(int i, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (void)((i == I ? (f(std::integral_constant<int, I>{}), true) : false) || ...);
  }
  (std::make_integer_sequence<int, N>{});
}
}  // namespace detail

}  // namespace tierkv
