// SPDX-License-Identifier: Apache-2.0
// test_cuda_prefill's device side (prefill_kernels*.cu: prefill.cuh needs nvcc); the planner
// (prefill_plan.cuh) is host code and prefill.cpp calls it directly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "test_shapes.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/prefill_plan.cuh"

namespace cuda_test {

// cuda::prefill_inputs<2>, field for field, with its defaults.
struct prefill_args {
  tierkv::batch_index_view<2> index;
  tierkv::pool_view pools[2];
  const void* queries = nullptr;
  bool queries_bf16 = false;
  const std::int32_t* q_indptr = nullptr;
  float softmax_scale = 0.f;
  float soft_cap = 0.f;
  int window = 0;
  std::uint64_t cache_seed = 0;
  int head_base = 0;
  int layer = 0;
  void* out = nullptr;
  bool out_bf16 = false;
  float* lse = nullptr;
};

// cuda::prefill<G, TierList>; prefill_kernels*.cu instantiate the (G, TierList) that prefill.cpp
// runs (another one is a link error).
template <class G, class TierList>
tierkv::status prefill(const tierkv::cuda::prefill_plan& plan, const prefill_args& in,
                       void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// cuda::prefill_workspace_init and cuda::prefill_device_error.
tierkv::status prefill_workspace_init(const tierkv::cuda::prefill_plan& plan, void* workspace,
                                      std::size_t workspace_bytes, cudaStream_t stream);
tierkv::result<tierkv::errc> prefill_device_error(const tierkv::cuda::prefill_plan& plan,
                                                  void* workspace, cudaStream_t stream);

}  // namespace cuda_test
