// SPDX-License-Identifier: Apache-2.0
// test_cuda_tiered_cache's device side: cuda::tiered_cache at the test's geometry behind a
// host-compilable interface (tiered_cache_kernels.cu; no Catch2 in nvcc). The storage type is
// host-compilable (paged_storage over device_allocator), so the test reads page tables directly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace cuda_test {

using e2e_geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>,
                                      tierkv::group_size<2>, tierkv::page_tokens<16>>;
using e2e_tiers = tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>,
                                tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>>;
using e2e_storage = tierkv::paged_storage<e2e_geometry, e2e_tiers, tierkv::device_allocator,
                                          tierkv::host_allocator>;
using e2e_ctl = tierkv::tier_controller<e2e_storage>;

struct e2e_options {
  tierkv::storage_options<2> storage{};
  tierkv::policy::recency_anchor policy{};
  int max_batch = 8;
  int max_pages = 64;
  int max_step_tokens = 512;
  int max_retier_pages = 4096;
  int mass_layers_per_step = 0;
  bool center = false;  // centring means (the façade's set_centering / estimate)
};

// The wrapper's conversion fault hook: the fail_at-th call (from 0) fails with injected_fault;
// calls counts every call (reserve, fill, publish of every conversion).
struct e2e_faults {
  std::int64_t fail_at = -1;
  std::int64_t calls = 0;
  tierkv::errc operator()(tierkv::conversion_step, tierkv::block_ref, int) {
    return calls++ == fail_at ? tierkv::errc::injected_fault : tierkv::errc::ok;
  }
};

struct e2e_counters {
  std::uint64_t h2d = 0, d2h = 0, page_bytes = 0;
  std::uint64_t pressure_demoted = 0, converted = 0, failed = 0;
};

// cuda::tiered_cache<e2e_geometry, e2e_tiers> with the e2e_faults hook; host vectors in and
// out (the wrapper copies them to and from device buffers on the cache's stream).
class e2e_cache {
 public:
  static tierkv::result<std::unique_ptr<e2e_cache>> create(const e2e_options& opt);
  ~e2e_cache();
  e2e_cache(const e2e_cache&) = delete;
  e2e_cache& operator=(const e2e_cache&) = delete;

  tierkv::result<tierkv::seq_id> create_sequence();
  tierkv::result<tierkv::seq_id> fork(tierkv::seq_id parent);
  tierkv::status release(tierkv::seq_id s);
  // Prefix reuse (the façade's prefix index): new entries; a new sequence and its cached
  // tokens; entries evicted.
  tierkv::result<std::size_t> insert_prefix(tierkv::seq_id s, std::uint64_t salt,
                                            std::span<const std::int32_t> tokens);
  tierkv::result<std::pair<tierkv::seq_id, std::int64_t>> start_from_prefix(
      std::uint64_t salt, std::span<const std::int32_t> tokens);
  tierkv::result<std::size_t> evict_prefixes(std::size_t max_entries);
  tierkv::status begin_step(std::span<const tierkv::seq_id> batch,
                            std::span<const std::int32_t> new_tokens);
  // k, v: [tokens][kv_heads][head_dim] floats of one layer.
  tierkv::status append(int layer, const std::vector<float>& k, const std::vector<float>& v);
  // q: [batch][q_heads][head_dim] -> out, same shape.
  // lse (if given): [batch][q_heads].
  tierkv::status decode(int layer, const std::vector<float>& q, std::vector<float>& out,
                        float soft_cap = 0.f, int window = 0, std::vector<float>* lse = nullptr);
  // q: [step tokens][q_heads][head_dim] (each sequence's new tokens) -> out, same shape; lse (if
  // given): [step tokens][q_heads].
  tierkv::status prefill(int layer, const std::vector<float>& q, std::vector<float>& out,
                         std::vector<float>* lse = nullptr);
  // The façade's set_centering: [kv_heads][head_dim] floats each.
  tierkv::status set_centering(int layer, std::span<const float> mu_k, std::span<const float> mu_v);
  bool centering_known(int layer) const;
  tierkv::result<tierkv::retier_stats> end_step(std::uint64_t step, bool wait);
  // decode with bf16 output: the raw bf16 bits, [batch][q_heads][head_dim].
  tierkv::status decode_bf16(int layer, const std::vector<float>& q,
                             std::vector<std::uint16_t>& out);

  // CUDA graphs. capture_step records every layer's append (one token per sequence, from the
  // wrapper's per-layer k/v buffers) then decode (per-layer q -> out, f32) on a capturing
  // stream; the capture runs nothing. replay_step copies a step's inputs ([layer][batch x ...])
  // into those buffers, launches the graph on the cache's stream and copies the outputs back.
  tierkv::status capture_step();
  tierkv::status replay_step(const std::vector<std::vector<float>>& k,
                             const std::vector<std::vector<float>>& v,
                             const std::vector<std::vector<float>>& q,
                             std::vector<std::vector<float>>& out);
  // decode launched on a stream that is neither the cache's nor capturing (must be refused).
  tierkv::status decode_on_other_stream(int layer);
  // set_stream to a stream of the wrapper's own (the old one stays alive for the hand-off).
  tierkv::status move_to_new_stream();
  tierkv::status check_invariants() const;
  tierkv::status device_error();
  void set_mass_observer(std::function<void(tierkv::seq_id, int, std::span<const float>)> f);

  e2e_storage& storage();
  e2e_ctl& controller();
  e2e_faults& faults();
  e2e_counters counters() const;
  // Test-only reads of device memory: a pool's bytes, layer l's index arrays (mirror build).
  std::vector<std::uint8_t> pool_bytes(int tier) const;
  std::vector<std::uint8_t> index_bytes(int layer) const;

 private:
  struct impl;
  explicit e2e_cache(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace cuda_test
