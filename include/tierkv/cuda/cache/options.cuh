// SPDX-License-Identifier: Apache-2.0
// What a cuda::tiered_cache is created with (tiered_cache_options) and what it counts as it runs:
// the host<->device bytes it moved (transfer_counters) and the host time it spent, by part
// (host_times). Also the option checks past the storage's and the controller's.
#pragma once

#include "tierkv/core/config.hpp"

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/kernel/page_copy.cuh"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace tierkv::cuda {

/// The options of a tiered_cache (tiered_cache::options); tiered_cache::validate checks them.
template <class Policy, int NumTiers>
struct tiered_cache_options {
  storage_options<NumTiers> storage{};  ///< layers, sequences, pages per tier, codec seed
  Policy policy{};                      ///< the tier policy (its parameters)
  tier_controller_options tiering{};    ///< the tier controller's knobs
  int max_batch = 64;                   ///< sequences per step
  int max_pages = 4096;                 ///< logical pages per sequence
  int max_step_tokens = 4096;           ///< new tokens of one step over its batch (prefill chunks)
  int max_retier_pages = 1024;          ///< conversions per GPU batch
  int max_chunks_per_seq = 64;          ///< decode split (decode_capacity)
  int mass_layers_per_step = 0;  ///< layers whose page mass feeds the policy a step (0 = all);
                                 ///< only their decodes compute the mass (a device flag)
  float softmax_scale = 0.f;     ///< 0: 1 / sqrt(head_dim)
  /// Centring (tierkv/centering.hpp, as the host tiered_cache's): each layer's per-KV-head
  /// channel means of keys and values are subtracted before encoding and given back in decode
  /// and prefill (outputs and lse). The means are set_centering()'s, or else those of the first
  /// tokens appended to the layer (estimated on the device; not while a graph is captured).
  /// decode / prefill refuse soft_cap > 0 then.
  bool center = false;
  /// Pinned host memory for the host tier (offload / restore of whole sequences in their
  /// compressed pages, cache/host_tier.cuh); 0: none.
  std::uint64_t host_pool_bytes = 0;
  /// How the host tier's page copies run (kernel/page_copy.cuh).
  copy_path host_copy = copy_path::kernel;
  /// Pages a restore copies per launch while it builds the page table (>= 1): the GPU copies
  /// one chunk while the host builds the next.
  int host_restore_chunk = 8192;
};

/// Host<->device bytes the façade moved: metadata, and page bytes only where pages leave or
/// enter the cache (export_pages, import_pages); no step, fork or conversion moves any.
struct transfer_counters {
  /// Mirror journals, batch rows, slot mappings, retier lists
  std::uint64_t h2d_metadata_bytes = 0;
  std::uint64_t d2h_metadata_bytes = 0;  ///< page masses, error words
  std::uint64_t page_bytes = 0;  ///< host<->device page bytes: export, import, offload, restore
};

/// Host time the façade spent since create, by part (steady clock, nanoseconds): where a
/// model-level step's host time goes. "waits" are host blocking on the GPU.
struct host_times {
  std::uint64_t steps = 0;          ///< end_step calls
  std::uint64_t begin_step_ns = 0;  ///< all of begin_step, of which:
  std::uint64_t make_room_ns = 0;   ///<   demotions under memory pressure (waits for them)
  std::uint64_t index_ns = 0;       ///<   the index arrays' build and the decode plan
  std::uint64_t end_step_ns = 0;    ///< all of end_step, of which:
  std::uint64_t mass_wait_ns = 0;   ///<   waiting for the previous step's page masses
  std::uint64_t mass_fold_ns = 0;   ///<   feeding the page masses to the policy
  std::uint64_t plan_ns = 0;        ///<   the controller's plan
  std::uint64_t retier_ns = 0;      ///<   publishing and enqueueing retier batches
};

namespace detail {
// tiered_cache::validate's checks after the storage's and the controller's, in its order:
// at most `layers_max` layers, `max_tier_pages` pages per tier (what the mirror can pack).
template <class Policy, int NumTiers>
status validate_cache_limits(const tiered_cache_options<Policy, NumTiers>& opt, int layers_max,
                             std::uint32_t max_tier_pages) {
  if (opt.storage.num_layers > layers_max)
    return status::exceeds(errc::invalid_argument, "num_layers", opt.storage.num_layers,
                           layers_max);
  for (int f = 0; f < NumTiers; ++f)
    if (opt.storage.pages_per_tier[std::size_t(f)] > max_tier_pages)
      return status::exceeds(errc::invalid_argument, "pages_per_tier",
                             opt.storage.pages_per_tier[std::size_t(f)], max_tier_pages);
  const int values[] = {opt.max_batch,        opt.max_pages,          opt.max_step_tokens,
                        opt.max_retier_pages, opt.max_chunks_per_seq, opt.host_restore_chunk};
  const char* names[] = {"max_batch",        "max_pages",          "max_step_tokens",
                         "max_retier_pages", "max_chunks_per_seq", "host_restore_chunk"};
  for (int i = 0; i < 6; ++i)
    if (values[i] < 1)
      return status::make(errc::invalid_argument, names[i], " = ", values[i], " must be >= 1");
  if (opt.max_pages > 65535)
    return status::exceeds(errc::invalid_argument, "max_pages", opt.max_pages, 65535);
  if (opt.mass_layers_per_step < 0)
    return status::make(errc::invalid_argument, "mass_layers_per_step = ", opt.mass_layers_per_step,
                        " must be >= 0 (0 = every layer)");
  if (!(opt.softmax_scale >= 0.f) || !std::isfinite(opt.softmax_scale))
    return status::make(errc::invalid_argument, "softmax_scale = ", opt.softmax_scale,
                        " must be finite and >= 0 (0 = 1 / sqrt(head_dim))");
  return {};
}

// Adds the nanoseconds its scope lasted to a host_times field (every return path counts).
struct scoped_time {
  using clock = std::chrono::steady_clock;
  std::uint64_t& ns;
  clock::time_point t0 = clock::now();
  ~scoped_time() {
    ns += std::uint64_t(
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count());
  }
};
}  // namespace detail

}  // namespace tierkv::cuda
