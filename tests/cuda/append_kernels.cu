// SPDX-License-Identifier: Apache-2.0
// test_cuda_append's device side: cuda::append behind append_kernels.hpp (no Catch2 here).
#include "append_kernels.cuh"

namespace cuda_test {

template tierkv::status append<append_qwen, append_recent>(const append_args&, cudaStream_t);
template tierkv::status append<append_smol, append_recent>(const append_args&, cudaStream_t);
template tierkv::status append<append_qwen, append_int8r>(const append_args&, cudaStream_t);
template tierkv::status append<append_smol, append_int8r>(const append_args&, cudaStream_t);

}  // namespace cuda_test
