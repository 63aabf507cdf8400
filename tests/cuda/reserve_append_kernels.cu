// SPDX-License-Identifier: Apache-2.0
// test_cuda_reserve_append's device side: cuda::append (append_kernels.cuh) at its geometry.
#include "append_kernels.cuh"

namespace cuda_test {

template tierkv::status append<reserve_geo, append_recent>(const append_args&, cudaStream_t);
template tierkv::status append<reserve_geo, append_int8r>(const append_args&, cudaStream_t);

}  // namespace cuda_test
