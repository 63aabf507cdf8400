// SPDX-License-Identifier: Apache-2.0
// test_cuda_prefill's device side, FP8 Recent tiers (no Catch2 here); prefill_kernels_int8r.cu
// has the int8_rotated ones.
#include "prefill_kernels.cuh"

namespace cuda_test {

tierkv::status prefill_workspace_init(const tierkv::cuda::prefill_plan& plan, void* workspace,
                                      std::size_t workspace_bytes, cudaStream_t stream) {
  return tierkv::cuda::prefill_workspace_init(plan, workspace, workspace_bytes, stream);
}

tierkv::result<tierkv::errc> prefill_device_error(const tierkv::cuda::prefill_plan& plan,
                                                  void* workspace, cudaStream_t stream) {
  return tierkv::cuda::prefill_device_error(plan, workspace, stream);
}

}  // namespace cuda_test

CUDA_TEST_PREFILL(decode_qwen, decode_recent, decode_stale)
CUDA_TEST_PREFILL(decode_llama, decode_recent, decode_stale)
CUDA_TEST_PREFILL(decode_smol, decode_recent, decode_stale)
CUDA_TEST_PREFILL(decode_small_pages, decode_recent, decode_stale)
CUDA_TEST_PREFILL(decode_pages32, decode_recent, decode_stale)
