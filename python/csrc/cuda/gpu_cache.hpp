// SPDX-License-Identifier: Apache-2.0
// The run-time face of cuda::tiered_cache, the cache wholly on the GPU, for the C ABI library
// the Python package loads (capi.cpp): one abstract class, implemented once per prebuilt
// instantiation (gpu_cache_impl.cuh). Plain pointers, spans and streams only, so capi.cpp
// compiles with the host compiler alone. Errors are thrown as tierkv::error.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "runtime.hpp"
#include "tierkv/report.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace tierkv_py {

// cache_config's fields (formats, geometry, pools, sequences, policy knobs; `threads` and
// `soft_cap` are the host path's and unused here) plus the GPU façade's capacities.
struct gpu_cache_config : cache_config {
  int max_step_tokens = 4096;         // new tokens of one step over its batch
  int max_retier_pages = 1024;        // conversions per GPU batch
  int max_chunks_per_seq = 64;        // decode split
  int mass_layers_per_step = 1;       // layers whose page mass feeds the policy a step (0 = all)
  std::uint64_t host_pool_bytes = 0;  // the host tier's pinned memory (0: none)
};

// Element types of the tensors the ops pass (the same values as cuda::input_type,
// cuda::query_type and cuda::output_type).
enum class gpu_dtype : int { f32 = 0, bf16 = 1 };

class gpu_cache {
 public:
  virtual ~gpu_cache() = default;
  virtual const gpu_cache_config& config() const = 0;
  virtual int num_tiers() const = 0;

  virtual std::int64_t create_sequence() = 0;
  virtual std::int64_t fork(std::int64_t parent) = 0;
  virtual void release(std::int64_t seq) = 0;
  virtual std::int64_t length(std::int64_t seq) const = 0;
  // Prefix reuse (the façade's prefix index, between steps): new entries; {sequence, cached
  // tokens}; entries evicted.
  virtual std::int64_t prefix_insert(std::int64_t seq, std::uint64_t salt,
                                     std::span<const std::int32_t> tokens) = 0;
  virtual std::array<std::int64_t, 2> prefix_start(std::uint64_t salt,
                                                   std::span<const std::int32_t> tokens) = 0;
  virtual std::int64_t prefix_evict(std::int64_t n) = 0;
  // Finishes the retier batch in flight, gives replaced pages back (blocks on the GPU).
  virtual void drain() = 0;
  // Page transfer, between steps (the façade's export_pages / import_pages: the host's buffer,
  // byte for byte): the export of logical pages [first, first + count) of seq (count < 0: to the
  // end), all layers, KV heads [head_begin, head_begin + head_count) (head_count < 0: to the
  // end); the import of a buffer as a NEW sequence, all or nothing.
  virtual std::vector<std::uint8_t> export_pages(std::int64_t seq, std::int64_t first,
                                                 std::int64_t count, int head_begin,
                                                 int head_count) = 0;
  virtual std::int64_t import_pages(std::span<const std::uint8_t> buf) = 0;
  // The host tier (cache/host_tier.cuh), between steps: offload parks a sequence's pages in
  // pinned host memory and releases it (a parked id); restore makes a NEW sequence of them.
  virtual std::uint64_t offload(std::int64_t seq) = 0;
  virtual std::int64_t restore(std::uint64_t parked) = 0;
  virtual void drop_parked(std::uint64_t parked) = 0;
  // Whether seq's restore copy may still be running (its first step waits for it on the GPU).
  virtual bool restore_pending(std::int64_t seq) = 0;
  // capacity, used, largest free run, parked, offloads, restores, drops, bytes offloaded,
  // bytes restored (cuda::host_tier_stats' fields in order).
  virtual std::array<std::uint64_t, 9> host_stats() = 0;

  // The façade's step (cuda/tiered_cache.cuh): begin_step on the cache's stream (set_stream
  // moves it, between steps), then per layer append and decode or prefill, each enqueued on
  // `stream` (the cache's, or a stream capturing a graph), then end_step.
  virtual void set_stream(cudaStream_t stream) = 0;
  virtual void begin_step(std::span<const std::int64_t> seqs,
                          std::span<const std::int32_t> counts) = 0;
  virtual void append(int layer, const void* k, const void* v, gpu_dtype type,
                      cudaStream_t stream) = 0;
  virtual void decode(int layer, const void* q, gpu_dtype qtype, void* out, gpu_dtype otype,
                      float* lse, float soft_cap, int window, cudaStream_t stream) = 0;
  virtual void prefill(int layer, const void* q, gpu_dtype qtype, void* out, gpu_dtype otype,
                       float* lse, float soft_cap, int window, cudaStream_t stream) = 0;
  virtual tierkv::retier_stats end_step(std::uint64_t step, bool wait) = 0;

  virtual tierkv::memory_report report() const = 0;
  virtual void pin(std::int64_t seq, std::int64_t first_page, std::int64_t pages, bool pinned) = 0;
  // The tier of each committed logical page of seq at one layer.
  virtual std::vector<std::int64_t> page_tiers(std::int64_t seq, int layer) const = 0;
  virtual void check_invariants() const = 0;
  // The device check of the last step's index build, decodes and prefills (synchronizes).
  virtual void device_error() = 0;
  // Host<->device bytes moved: metadata h2d, metadata d2h, page bytes (export, import, the host
  // tier; never a step's).
  virtual std::array<std::uint64_t, 3> transfers() const = 0;
  virtual std::array<std::uint64_t, 9> host_times() const = 0;
  // Every conversion since create (end_step's, make_room's and drain's), retier_stats' fields.
  virtual std::array<std::uint64_t, 8> retier_totals() const = 0;
};

using gpu_factory = std::unique_ptr<gpu_cache> (*)(const gpu_cache_config&, cudaStream_t);

// capi.cpp: the prebuilt set. Instantiation units add themselves at load time.
void register_gpu_combo(const combo& c, gpu_factory f);

}  // namespace tierkv_py
