// SPDX-License-Identifier: Apache-2.0
// test_cuda_retier's device side: cuda::retier behind retier_kernels.hpp (no Catch2 here).
#include "retier_kernels.hpp"

#include "tierkv/cuda/retier/retier.cuh"

namespace cuda_test {

template <class G, class From, class To>
tierkv::status retier(const retier_args& a, cudaStream_t stream) {
  tierkv::cuda::retier_inputs in;
  in.src = a.src;
  in.dst = a.dst;
  in.src_slot = a.src_slot;
  in.dst_slot = a.dst_slot;
  in.layer_of = a.layer_of;
  in.layer = a.layer;
  in.pages = a.pages;
  in.cache_seed = a.cache_seed;
  in.head_base = a.head_base;
  in.error = a.error;
  return tierkv::cuda::retier<G, From, To>(in, stream);
}

#define CUDA_TEST_RETIER(G, From, To) \
  template tierkv::status retier<G, From, To>(const retier_args&, cudaStream_t);
CUDA_TEST_RETIER(retier_qwen, retier_recent, retier_stale)
CUDA_TEST_RETIER(retier_llama, retier_recent, retier_stale)
CUDA_TEST_RETIER(retier_smol, retier_recent, retier_stale)
CUDA_TEST_RETIER(retier_qwen, retier_stale, retier_recent)
CUDA_TEST_RETIER(retier_llama, retier_stale, retier_recent)
CUDA_TEST_RETIER(retier_smol, retier_stale, retier_recent)
CUDA_TEST_RETIER(retier_qwen, retier_int8r, retier_stale)
CUDA_TEST_RETIER(retier_llama, retier_int8r, retier_stale)
CUDA_TEST_RETIER(retier_smol, retier_int8r, retier_stale)
CUDA_TEST_RETIER(retier_smol, retier_stale, retier_int8r)
CUDA_TEST_RETIER(retier_llama, retier_stale, retier_int8r)
CUDA_TEST_RETIER(retier_qwen, retier_recent, retier_int8r)
CUDA_TEST_RETIER(retier_smol, retier_int8r, retier_recent)
CUDA_TEST_RETIER(retier_qwen, retier_int8r, retier_stale_k4)
CUDA_TEST_RETIER(retier_llama, retier_recent, retier_stale_k4)
CUDA_TEST_RETIER(retier_smol, retier_int8r, retier_stale_k4)
CUDA_TEST_RETIER(retier_smol, retier_stale_k4, retier_int8r)
CUDA_TEST_RETIER(retier_llama, retier_stale_k4, retier_recent)
CUDA_TEST_RETIER(retier_qwen, retier_stale, retier_stale_k4)
CUDA_TEST_RETIER(retier_qwen, retier_int8r, retier_cold)
CUDA_TEST_RETIER(retier_llama, retier_recent, retier_cold)
CUDA_TEST_RETIER(retier_smol, retier_int8r, retier_cold)
CUDA_TEST_RETIER(retier_smol, retier_cold, retier_int8r)
CUDA_TEST_RETIER(retier_llama, retier_cold, retier_recent)
CUDA_TEST_RETIER(retier_qwen, retier_stale, retier_cold_v2)
CUDA_TEST_RETIER(retier_smol, retier_stale_k4, retier_cold)
CUDA_TEST_RETIER(retier_llama, retier_cold_v2, retier_stale)
CUDA_TEST_RETIER(retier_smol, retier_int8r, retier_k8v3)
CUDA_TEST_RETIER(retier_qwen, retier_k8v3, retier_int8r)
CUDA_TEST_RETIER(retier_llama, retier_recent, retier_k8v3)
CUDA_TEST_RETIER(retier_smol, retier_stale, retier_k8v3)
CUDA_TEST_RETIER(retier_qwen, retier_k8v3, retier_cold_v2)

}  // namespace cuda_test
