// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side, FP8 Recent tiers (no Catch2 here); decode_kernels_int8r.cu
// has the int8_rotated ones.
#include "decode_kernels.cuh"

namespace cuda_test {

tierkv::status decode_workspace_init(const tierkv::cuda::decode_plan& plan, void* workspace,
                                     std::size_t workspace_bytes, cudaStream_t stream) {
  return tierkv::cuda::decode_workspace_init(plan, workspace, workspace_bytes, stream);
}

tierkv::result<tierkv::errc> decode_device_error(const tierkv::cuda::decode_plan& plan,
                                                 const void* workspace, cudaStream_t stream) {
  return tierkv::cuda::decode_device_error(plan, workspace, stream);
}

}  // namespace cuda_test

CUDA_TEST_DECODE(decode_qwen, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_llama, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_smol, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_small_pages, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_pages32, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_qwen, decode_recent, decode_stale_k4)
CUDA_TEST_DECODE(decode_llama, decode_recent, decode_stale_k4)
CUDA_TEST_DECODE(decode_smol, decode_recent, decode_stale_k4)
CUDA_TEST_DECODE(decode_pages32, decode_recent, decode_stale_k4)
