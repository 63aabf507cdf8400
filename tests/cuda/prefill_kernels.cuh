// SPDX-License-Identifier: Apache-2.0
// prefill_kernels.hpp's cuda_test::prefill, defined for the prefill_kernels*.cu files (nvcc
// only), each instantiating a share of the (geometry, tiers) prefill.cpp runs (a unit per share
// keeps each under the device build's 120 s limit, scripts/gpu-check).
#pragma once

#include "prefill_kernels.hpp"

#include "tierkv/cuda/prefill.cuh"

namespace cuda_test {

template <class G, class TierList>
tierkv::status prefill(const tierkv::cuda::prefill_plan& plan, const prefill_args& a,
                       void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  namespace cuda = tierkv::cuda;
  cuda::prefill_inputs<2> in;
  in.index = a.index;
  in.pools[0] = a.pools[0];
  in.pools[1] = a.pools[1];
  in.queries = a.queries;
  in.queries_type = a.queries_bf16 ? cuda::query_type::bf16 : cuda::query_type::f32;
  in.q_indptr = a.q_indptr;
  in.softmax_scale = a.softmax_scale;
  in.soft_cap = a.soft_cap;
  in.window = a.window;
  in.cache_seed = a.cache_seed;
  in.head_base = a.head_base;
  in.layer = a.layer;
  in.out = a.out;
  in.out_type = a.out_bf16 ? cuda::output_type::bf16 : cuda::output_type::f32;
  in.lse = a.lse;
  return cuda::prefill<G, TierList>(plan, in, workspace, workspace_bytes, stream);
}

}  // namespace cuda_test

// cuda_test::prefill for one (geometry, Recent tier, Stale tier) of cuda_test.
#define CUDA_TEST_PREFILL(G, Recent, Stale)                                                  \
  template tierkv::status                                                                    \
  cuda_test::prefill<cuda_test::G, tierkv::tiers<cuda_test::Recent, cuda_test::Stale>>(      \
      const tierkv::cuda::prefill_plan&, const cuda_test::prefill_args&, void*, std::size_t, \
      cudaStream_t);
