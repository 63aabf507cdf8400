// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side (decode_kernels*.cu: decode.cuh needs nvcc); the planner
// (decode_plan.cuh) is host code and decode.cpp calls it directly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "test_shapes.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/decode_plan.cuh"

namespace cuda_test {

// cuda::decode_path.
enum class decode_path : std::uint8_t { tensor_core = 0, cuda_core = 1 };

// cuda::decode_inputs<2>, field for field (f32 queries), with its defaults.
struct decode_args {
  tierkv::batch_index_view<2> index;
  tierkv::pool_view pools[2];
  const float* queries = nullptr;
  float softmax_scale = 0.f;
  float soft_cap = 0.f;
  int window = 0;
  std::uint64_t cache_seed = 0;
  int head_base = 0;
  int layer = 0;
  float* out = nullptr;
  float* lse = nullptr;
  float* page_mass = nullptr;
  int page_mass_stride = 0;
};

// cuda::decode<G, TierList, Path>; the decode_kernels*.cu files instantiate, for both paths, the
// (G, TierList) that decode.cpp runs (another one is a link error).
template <class G, class TierList, decode_path Path = decode_path::tensor_core>
tierkv::status decode(const tierkv::cuda::decode_plan& plan, const decode_args& in, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream);

// cuda::decode_workspace_init and cuda::decode_device_error.
tierkv::status decode_workspace_init(const tierkv::cuda::decode_plan& plan, void* workspace,
                                     std::size_t workspace_bytes, cudaStream_t stream);
tierkv::result<tierkv::errc> decode_device_error(const tierkv::cuda::decode_plan& plan,
                                                 const void* workspace, cudaStream_t stream);

}  // namespace cuda_test
