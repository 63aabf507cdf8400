// SPDX-License-Identifier: Apache-2.0
// test_cuda_retier_driver's device side (retier_driver_kernels.cu: cuda/retier/driver.cuh needs
// nvcc), for the test's storage over page-locked memory and its controller.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <span>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace cuda_test {

using driver_geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>,
                                         tierkv::group_size<2>, tierkv::page_tokens<16>>;
using driver_tiers = tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>,
                                   tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>>;
using gpu_storage =
    tierkv::paged_storage<driver_geometry, driver_tiers, tierkv::pinned_host_allocator>;
using gpu_ctl = tierkv::tier_controller<gpu_storage>;

// cuda::retier_driver<gpu_storage>, member for member (its Controller is gpu_ctl).
class retier_driver {
 public:
  static tierkv::result<std::unique_ptr<retier_driver>> create(gpu_storage& storage,
                                                               int max_batch_pages,
                                                               cudaStream_t side);
  ~retier_driver();
  retier_driver(const retier_driver&) = delete;
  retier_driver& operator=(const retier_driver&) = delete;

  std::size_t pages_held() const noexcept;
  tierkv::result<std::size_t> enqueue(gpu_ctl& ctl, std::span<const tierkv::conversion> plan,
                                      cudaStream_t main, tierkv::retier_stats& stats,
                                      bool all_or_none = false);
  tierkv::result<bool> try_publish(gpu_ctl& ctl, tierkv::retier_stats& stats);
  tierkv::status mark_decodes_enqueued(cudaStream_t main);
  tierkv::result<std::size_t> reclaim();

 private:
  struct impl;
  explicit retier_driver(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

// cuda::create_side_stream.
tierkv::result<cudaStream_t> create_side_stream();

// Enqueues one thread spinning `cycles` clock64 cycles on `stream` (launch errors:
// cudaGetLastError).
void spin(cudaStream_t stream, long long cycles);

}  // namespace cuda_test
