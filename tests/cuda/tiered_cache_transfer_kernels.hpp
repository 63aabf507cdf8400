// SPDX-License-Identifier: Apache-2.0
// test_cuda_tiered_cache_transfer's device side: cuda::tiered_cache at the test's geometry behind a
// host-compilable interface (tiered_cache_transfer_kernels.cu; no Catch2 in nvcc), with its
// export_pages / import_pages. The storage type is host-compilable (paged_storage over
// device_allocator), so the test reads page tables directly.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/report.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace cuda_test {

using xfer_geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>,
                                       tierkv::group_size<2>, tierkv::page_tokens<16>>;
using xfer_tiers = tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>,
                                 tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>>;
using xfer_storage = tierkv::paged_storage<xfer_geometry, xfer_tiers, tierkv::device_allocator,
                                           tierkv::host_allocator>;

struct xfer_options {
  tierkv::storage_options<2> storage{};
  tierkv::policy::recency_anchor policy{};
  int max_batch = 8;
  int max_pages = 64;
  int max_step_tokens = 512;
  bool center = false;
  std::uint64_t host_pool_bytes = 0;  // the host tier's pinned memory
  bool copy_engines = false;          // its copies by cudaMemcpyBatchAsync, else the kernel
  int restore_chunk = 8192;           // pages a restore copies per launch
};

// Fails the host tier's copy launch number `fail_at` of `step` (counted from 0 per step);
// conversions never fail.
struct xfer_faults {
  tierkv::transfer_step step = tierkv::transfer_step::offload_copy;
  std::int64_t fail_at = -1;
  std::int64_t calls = 0;  // launches of `step` seen
  tierkv::errc operator()(tierkv::conversion_step, tierkv::block_ref, int) const {
    return tierkv::errc::ok;
  }
  tierkv::errc operator()(tierkv::transfer_step s, std::uint64_t) {
    if (s != step) return tierkv::errc::ok;
    return calls++ == fail_at ? tierkv::errc::injected_fault : tierkv::errc::ok;
  }
};

// cuda::host_tier_stats, host-compilable.
struct host_figures {
  std::uint64_t capacity = 0, used = 0, largest_free = 0, parked = 0;
  std::uint64_t offloads = 0, restores = 0, drops = 0, bytes_offloaded = 0, bytes_restored = 0;
  bool operator==(const host_figures&) const = default;
};

// cuda::tiered_cache<xfer_geometry, xfer_tiers> with the xfer_faults hook; host vectors in and out
// (the wrapper copies them to and from device buffers on the cache's stream).
class xfer_cache {
 public:
  static tierkv::result<std::unique_ptr<xfer_cache>> create(const xfer_options& opt);
  ~xfer_cache();
  xfer_cache(const xfer_cache&) = delete;
  xfer_cache& operator=(const xfer_cache&) = delete;

  tierkv::result<tierkv::seq_id> create_sequence();
  tierkv::status release(tierkv::seq_id s);
  tierkv::result<tierkv::seq_id> fork(tierkv::seq_id parent);
  tierkv::status pin(tierkv::seq_id s, std::int64_t first_page, std::int64_t pages, bool pinned);
  tierkv::status begin_step(std::span<const tierkv::seq_id> batch,
                            std::span<const std::int32_t> new_tokens);
  // k, v: [tokens][kv_heads][head_dim] floats of one layer, the step's tokens in batch order.
  tierkv::status append(int layer, const std::vector<float>& k, const std::vector<float>& v);
  // q: [batch][q_heads][head_dim] -> out (same shape), lse [batch][q_heads].
  tierkv::status decode(int layer, const std::vector<float>& q, std::vector<float>& out,
                        std::vector<float>& lse);
  tierkv::result<tierkv::retier_stats> end_step(std::uint64_t step, bool wait);
  tierkv::status drain();
  tierkv::status set_centering(int layer, std::span<const float> mu_k, std::span<const float> mu_v);

  tierkv::result<std::vector<std::uint8_t>> export_pages(tierkv::seq_id s, std::int64_t first = 0,
                                                         std::int64_t count = -1,
                                                         tierkv::head_slice heads = {});
  tierkv::result<tierkv::seq_id> import_pages(std::span<const std::uint8_t> buf);

  // The host tier.
  tierkv::result<std::uint64_t> offload(tierkv::seq_id s);
  tierkv::result<tierkv::seq_id> restore(std::uint64_t parked);
  tierkv::status drop_parked(std::uint64_t parked);
  tierkv::result<std::int64_t> parked_length(std::uint64_t parked) const;
  host_figures host_tier() const;
  bool restore_pending(tierkv::seq_id s);
  xfer_faults& faults();

  tierkv::status check_invariants() const;
  tierkv::status device_error();
  tierkv::memory_report report() const;
  const xfer_storage& storage() const;
  std::uint64_t page_bytes_moved() const;  // transfers().page_bytes
  std::uint64_t pressure_demoted() const;  // retier_totals().pressure_demoted
  // Test-only read of a whole pool's device memory.
  std::vector<std::uint8_t> pool_bytes(int tier) const;

 private:
  struct impl;
  explicit xfer_cache(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace cuda_test
