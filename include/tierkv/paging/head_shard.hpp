// SPDX-License-Identifier: Apache-2.0
// Head-sharded (tensor-parallel) caches: T ranks, each holding kv_heads / T of the KV
// heads of every page, with identical page tables. Contract (docs/multigpu.md):
//   * rank r holds KV heads [r * kv_heads / T, (r + 1) * kv_heads / T) and the query
//     heads of their GQA groups, [r * q_heads / T, (r + 1) * q_heads / T);
//   * every structural operation (create, append of the rank's head slice of K/V, fork,
//     release, retier decisions) is decided once and applied to all ranks in the same
//     order, so page tables (tier and page id of every logical page and layer) agree;
//   * rank r's storage is created with head_base = r * kv_heads / T (rank_options), so its
//     codec contexts are those of the GLOBAL KV heads it holds: its pages, TQ3 included,
//     are byte for byte the head slices of an unsharded cache with the same seed and the
//     same operations, and a head slice [b, b + n) of any cache imports into a storage
//     whose head_base is b (import_pages checks it for rotation-dependent formats).
//   * on the GPU, pass the same head_base in cuda::decode_inputs / cuda::retier_inputs.
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/paging/paged_storage.hpp"

namespace tierkv {

/// The geometry of one of T ranks: same head_dim, group size and page size, kv_heads / T heads.
template <class Geometry, int Ranks>
struct shard_geometry {
  static_assert(is_geometry_v<Geometry>,
                "shard_geometry: Geometry must be a tierkv::geometry<...>");
  static_assert(Ranks >= 1, "shard_geometry: at least one rank");
  static_assert(Geometry::kv_heads % Ranks == 0,
                "shard_geometry: kv_heads must be divisible by the number of ranks (whole KV heads "
                "per rank)");
  /// the geometry of one rank: kv_heads / Ranks KV heads
  using type =
      geometry<tierkv::head_dim<Geometry::head_dim>, tierkv::kv_heads<Geometry::kv_heads / Ranks>,
               tierkv::group_size<Geometry::group_size>,
               tierkv::page_tokens<Geometry::page_tokens>>;
};
/// shard_geometry<Geometry, Ranks>::type
template <class Geometry, int Ranks>
using shard_geometry_t = typename shard_geometry<Geometry, Ranks>::type;

/// Which heads rank r of T holds.
struct rank_heads {
  int kv_begin = 0;  ///< first KV head
  int kv_count = 0;  ///< KV heads
  int q_begin = 0;   ///< first query head
  int q_count = 0;   ///< query heads (their GQA groups)
};
/// The heads of rank `rank` of `ranks` (invalid_argument unless kv_heads divides evenly).
inline result<rank_heads> heads_of_rank(int kv_heads, int group_size, int ranks, int rank) {
  if (ranks < 1 || kv_heads % ranks != 0)
    return status::make(errc::invalid_argument, "tensor parallel: ", kv_heads,
                        " KV heads do not split over ", ranks, " ranks");
  if (rank < 0 || rank >= ranks) return status::out_of_range("rank", rank, ranks);
  const int n = kv_heads / ranks;
  return rank_heads{rank * n, n, rank * n * group_size, n * group_size};
}

/// Rank r's storage options: the unsharded cache's `opt` with head_base advanced by the
/// rank's first KV head (r * kv_heads / T when the unsharded cache starts at head 0).
template <int NumTiers>
result<storage_options<NumTiers>> rank_options(storage_options<NumTiers> opt, int kv_heads,
                                               int ranks, int rank) {
  auto h = heads_of_rank(kv_heads, 1, ranks, rank);
  if (!h) return h.error_status();
  opt.head_base += h->kv_begin;
  return opt;
}

/// Rank r's slice of a token-major tensor [rows][heads][dim] (K/V of an append, or
/// queries / outputs): heads [begin, begin + count) of every row, in order.
inline status slice_heads(std::span<const float> all, int heads, int dim, int begin, int count,
                          std::span<float> out) {
  const std::size_t per_row = std::size_t(heads) * std::size_t(dim);
  if (begin < 0 || count < 1 || begin + count > heads)
    return status::make(errc::out_of_range, "head slice [", begin, ", ", begin + count, ") of ",
                        heads, " heads");
  if (per_row == 0 || all.size() % per_row != 0)
    return status::make(errc::invalid_argument, "slice_heads: ", all.size(),
                        " floats are not rows of ", heads, " x ", dim);
  const std::size_t rows = all.size() / per_row;
  const std::size_t chunk = std::size_t(count) * std::size_t(dim);
  if (out.size() != rows * chunk)
    return status::make(errc::invalid_argument, "slice_heads: output holds ", out.size(),
                        " floats, ", rows * chunk, " needed");
  for (std::size_t r = 0; r < rows; ++r)
    std::copy_n(all.data() + r * per_row + std::size_t(begin) * std::size_t(dim), chunk,
                out.data() + r * chunk);
  return {};
}
/// The inverse: writes a rank's [rows][count][dim] slice into heads [begin, begin + count) of out.
inline status join_heads(std::span<const float> part, int heads, int dim, int begin, int count,
                         std::span<float> out) {
  const std::size_t per_row = std::size_t(heads) * std::size_t(dim);
  const std::size_t chunk = std::size_t(count) * std::size_t(dim);
  if (begin < 0 || count < 1 || begin + count > heads)
    return status::make(errc::out_of_range, "head slice [", begin, ", ", begin + count, ") of ",
                        heads, " heads");
  if (out.size() % per_row != 0 || part.size() != out.size() / per_row * chunk)
    return status::make(errc::invalid_argument, "join_heads: ", part.size(),
                        " floats do not fill heads [", begin, ", ", begin + count, ") of ",
                        out.size(), " floats of rows of ", heads, " x ", dim);
  const std::size_t rows = out.size() / per_row;
  for (std::size_t r = 0; r < rows; ++r)
    std::copy_n(part.data() + r * chunk, chunk,
                out.data() + r * per_row + std::size_t(begin) * std::size_t(dim));
  return {};
}

/// Exports rank r's head slice (of T) of logical pages [first, first + count) of seq,
/// for import_pages into that rank's cache (made with rank_options, so TQ3 pages fit).
template <class Storage>
result<std::vector<std::uint8_t>> export_rank_pages(
    const Storage& s, seq_id seq, int ranks, int rank, std::int64_t first = 0,
    std::int64_t count = -1) requires Storage::page_allocator::host_accessible {
  auto h = heads_of_rank(Storage::kv_heads, Storage::geometry::group_size, ranks, rank);
  if (!h) return h.error_status();
  return export_pages(s, seq, first, count, head_slice{h->kv_begin, h->kv_count});
}

/// Whether the page tables of two storages (ranks) agree for a sequence on each: same
/// length, and the same tier and page id for every (logical page, layer). Names the
/// first difference.
template <class StorageA, class StorageB>
status compare_page_tables(const StorageA& a, seq_id sa, const StorageB& b, seq_id sb) {
  auto la = a.length(sa);
  if (!la) return la.error_status();
  auto lb = b.length(sb);
  if (!lb) return lb.error_status();
  if (*la != *lb)
    return status::make(errc::corrupt_data, "page tables differ: lengths ", *la, " and ", *lb);
  if (a.num_layers() != b.num_layers())
    return status::make(errc::geometry_mismatch, "page tables differ: ", a.num_layers(), " and ",
                        b.num_layers(), " layers");
  const std::int64_t n = *a.logical_pages(sa);
  for (std::int64_t j = 0; j < n; ++j)
    for (int l = 0; l < a.num_layers(); ++l) {
      const page_id pa = *a.page(sa, l, j), pb = *b.page(sb, l, j);
      if (!(pa == pb))
        return status::make(errc::corrupt_data, "page tables differ at logical page ", j, " layer ",
                            l, ": ", pa, " vs ", pb);
    }
  return {};
}

}  // namespace tierkv
