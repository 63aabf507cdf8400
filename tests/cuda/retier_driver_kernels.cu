// SPDX-License-Identifier: Apache-2.0
// test_cuda_retier_driver's device side: cuda::retier_driver and a spin kernel behind
// retier_driver_kernels.hpp (no Catch2 here).
#include "retier_driver_kernels.hpp"

#include <utility>

#include "tierkv/cuda/retier/async.cuh"
#include "tierkv/cuda/retier/driver.cuh"

namespace cuda_test {
namespace {

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

}  // namespace

struct retier_driver::impl {
  std::unique_ptr<tierkv::cuda::retier_driver<gpu_storage>> d;
};

retier_driver::retier_driver(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
retier_driver::~retier_driver() = default;

tierkv::result<std::unique_ptr<retier_driver>> retier_driver::create(gpu_storage& storage,
                                                                     int max_batch_pages,
                                                                     cudaStream_t side) {
  auto d = tierkv::cuda::retier_driver<gpu_storage>::create(storage, max_batch_pages, side);
  if (!d) return d.error_status();
  return std::unique_ptr<retier_driver>(
      new retier_driver(std::unique_ptr<impl>(new impl{std::move(*d)})));
}

std::size_t retier_driver::pages_held() const noexcept { return impl_->d->pages_held(); }

tierkv::result<std::size_t> retier_driver::enqueue(gpu_ctl& ctl,
                                                   std::span<const tierkv::conversion> plan,
                                                   cudaStream_t main, tierkv::retier_stats& stats,
                                                   bool all_or_none) {
  return impl_->d->enqueue(ctl, plan, main, stats, tierkv::no_faults{}, all_or_none);
}

tierkv::result<bool> retier_driver::try_publish(gpu_ctl& ctl, tierkv::retier_stats& stats) {
  return impl_->d->try_publish(ctl, stats);
}

tierkv::status retier_driver::mark_decodes_enqueued(cudaStream_t main) {
  return impl_->d->mark_decodes_enqueued(main);
}

tierkv::result<std::size_t> retier_driver::reclaim() { return impl_->d->reclaim(); }

tierkv::result<cudaStream_t> create_side_stream() { return tierkv::cuda::create_side_stream(); }

void spin(cudaStream_t stream, long long cycles) { spin_kernel<<<1, 1, 0, stream>>>(cycles); }

}  // namespace cuda_test
