// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side: cuda::decode behind decode_kernels.hpp (no Catch2 here).
#include "decode_kernels.hpp"

#include "tierkv/cuda/decode.cuh"

namespace cuda_test {

template <class G, class TierList, decode_path Path>
tierkv::status decode(const tierkv::cuda::decode_plan& plan, const decode_args& a, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream) {
  namespace cuda = tierkv::cuda;
  cuda::decode_inputs<2> in;
  in.index = a.index;
  in.pools[0] = a.pools[0];
  in.pools[1] = a.pools[1];
  in.queries = a.queries;
  in.queries_type = cuda::query_type::f32;
  in.softmax_scale = a.softmax_scale;
  in.cache_seed = a.cache_seed;
  in.head_base = a.head_base;
  in.layer = a.layer;
  in.out = a.out;
  in.lse = a.lse;
  in.page_mass = a.page_mass;
  in.page_mass_stride = a.page_mass_stride;
  constexpr cuda::decode_path path =
      Path == decode_path::tensor_core ? cuda::decode_path::tensor_core : cuda::decode_path::cuda_core;
  return cuda::decode<G, TierList, path>(plan, in, workspace, workspace_bytes, stream);
}

tierkv::status decode_workspace_init(const tierkv::cuda::decode_plan& plan, void* workspace,
                                     std::size_t workspace_bytes, cudaStream_t stream) {
  return tierkv::cuda::decode_workspace_init(plan, workspace, workspace_bytes, stream);
}

tierkv::result<tierkv::errc> decode_device_error(const tierkv::cuda::decode_plan& plan, const void* workspace,
                                                 cudaStream_t stream) {
  return tierkv::cuda::decode_device_error(plan, workspace, stream);
}

#define CUDA_TEST_DECODE(G, Recent, Stale)                                                                 \
  template tierkv::status decode<G, tierkv::tiers<Recent, Stale>, decode_path::tensor_core>(              \
      const tierkv::cuda::decode_plan&, const decode_args&, void*, std::size_t, cudaStream_t);            \
  template tierkv::status decode<G, tierkv::tiers<Recent, Stale>, decode_path::cuda_core>(                \
      const tierkv::cuda::decode_plan&, const decode_args&, void*, std::size_t, cudaStream_t);
CUDA_TEST_DECODE(decode_qwen, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_llama, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_smol, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_small_pages, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_pages32, decode_recent, decode_stale)
CUDA_TEST_DECODE(decode_qwen, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_llama, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_smol, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_small_pages, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_qwen, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_llama, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_smol, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_small_pages, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_qwen, decode_recent, decode_stale_k4)
CUDA_TEST_DECODE(decode_llama, decode_recent, decode_stale_k4)
CUDA_TEST_DECODE(decode_smol, decode_recent, decode_stale_k4)
CUDA_TEST_DECODE(decode_pages32, decode_recent, decode_stale_k4)

}  // namespace cuda_test
