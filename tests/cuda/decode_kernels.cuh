// SPDX-License-Identifier: Apache-2.0
// decode_kernels.hpp's cuda_test::decode, defined for the decode_kernels*.cu files (nvcc only),
// each instantiating a share of the (geometry, tiers) decode.cpp runs: one unit with all of them
// took ~125 s of CPU here, over the device build's 120 s limit per unit (scripts/gpu-check).
#pragma once

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
  in.soft_cap = a.soft_cap;
  in.window = a.window;
  in.cache_seed = a.cache_seed;
  in.head_base = a.head_base;
  in.layer = a.layer;
  in.out = a.out;
  in.lse = a.lse;
  in.page_mass = a.page_mass;
  in.page_mass_stride = a.page_mass_stride;
  constexpr cuda::decode_path path = Path == decode_path::tensor_core
                                         ? cuda::decode_path::tensor_core
                                         : cuda::decode_path::cuda_core;
  return cuda::decode<G, TierList, path>(plan, in, workspace, workspace_bytes, stream);
}

}  // namespace cuda_test

// Both paths of cuda_test::decode for one (geometry, Recent tier, Stale tier) of cuda_test.
#define CUDA_TEST_DECODE(G, Recent, Stale)                                                     \
  template tierkv::status                                                                      \
  cuda_test::decode<cuda_test::G, tierkv::tiers<cuda_test::Recent, cuda_test::Stale>,          \
                    cuda_test::decode_path::tensor_core>(const tierkv::cuda::decode_plan&,     \
                                                         const cuda_test::decode_args&, void*, \
                                                         std::size_t, cudaStream_t);           \
  template tierkv::status                                                                      \
  cuda_test::decode<cuda_test::G, tierkv::tiers<cuda_test::Recent, cuda_test::Stale>,          \
                    cuda_test::decode_path::cuda_core>(const tierkv::cuda::decode_plan&,       \
                                                       const cuda_test::decode_args&, void*,   \
                                                       std::size_t, cudaStream_t);
