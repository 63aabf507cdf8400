// SPDX-License-Identifier: Apache-2.0
// test_cuda_paging_index_builder's device side (paging_index_builder_kernels.cu:
// index_builder.cuh needs nvcc), for the test's three formats.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/index_builder.hpp"

namespace cuda_test {

inline constexpr int index_formats = 3;

// cuda::device_index_builder<index_formats>, member for member.
class device_index_builder {
 public:
  explicit device_index_builder(const tierkv::index_layout<index_formats>& layout);
  ~device_index_builder();
  device_index_builder(const device_index_builder&) = delete;
  device_index_builder& operator=(const device_index_builder&) = delete;

  tierkv::result<std::size_t> scratch_bytes() const;
  tierkv::result<tierkv::batch_index_view<index_formats>> build(const tierkv::page_table_arrays& in,
                                                                void* out, void* scratch,
                                                                std::size_t scratch_size,
                                                                cudaStream_t stream) const;
  tierkv::status error(const void* scratch, cudaStream_t stream) const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

// cuda::index_from_paged_kv_table_device<index_formats>.
tierkv::result<tierkv::batch_index_view<index_formats>> index_from_paged_kv_table_device(
    const tierkv::paged_kv_table& t, int format, const tierkv::index_layout<index_formats>& layout,
    void* out, cudaStream_t stream);

}  // namespace cuda_test
