// SPDX-License-Identifier: Apache-2.0
// test_cuda_paging_index_builder's device side: index_builder.cuh behind
// paging_index_builder_kernels.hpp (no Catch2 here).
#include "paging_index_builder_kernels.hpp"

#include "tierkv/cuda/index_builder.cuh"

namespace cuda_test {

struct device_index_builder::impl {
  tierkv::cuda::device_index_builder<index_formats> b;
};

device_index_builder::device_index_builder(const tierkv::index_layout<index_formats>& layout)
    : impl_(new impl{tierkv::cuda::device_index_builder<index_formats>(layout)}) {}

device_index_builder::~device_index_builder() = default;

tierkv::result<std::size_t> device_index_builder::scratch_bytes() const {
  return impl_->b.scratch_bytes();
}

tierkv::result<tierkv::batch_index_view<index_formats>> device_index_builder::build(
    const tierkv::page_table_arrays& in, void* out, void* scratch, std::size_t scratch_size,
    cudaStream_t stream) const {
  return impl_->b.build(in, out, scratch, scratch_size, stream);
}

tierkv::status device_index_builder::error(const void* scratch, cudaStream_t stream) const {
  return impl_->b.error(scratch, stream);
}

tierkv::result<tierkv::batch_index_view<index_formats>> index_from_paged_kv_table_device(
    const tierkv::paged_kv_table& t, int format, const tierkv::index_layout<index_formats>& layout,
    void* out, cudaStream_t stream) {
  return tierkv::cuda::index_from_paged_kv_table_device<index_formats>(t, format, layout, out,
                                                                       stream);
}

}  // namespace cuda_test
