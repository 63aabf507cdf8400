// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side (decode_kernels*.cu: decode.cuh needs nvcc); the planner
// (decode_plan.cuh) is host code and decode.cpp calls it directly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/decode_plan.cuh"

namespace cuda_test {

using decode_recent = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using decode_int8r = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
using decode_stale = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using decode_stale_k4 = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;
using decode_qwen = tierkv::geometry<tierkv::head_dim<256>, tierkv::kv_heads<4>,
                                     tierkv::group_size<6>, tierkv::page_tokens<64>>;
using decode_llama = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<8>,
                                      tierkv::group_size<4>, tierkv::page_tokens<64>>;
using decode_smol = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<3>,
                                     tierkv::group_size<3>, tierkv::page_tokens<64>>;
using decode_small_pages = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>,
                                            tierkv::group_size<1>, tierkv::page_tokens<16>>;
// TQ3 / TQ4 tiers step 32 tokens at a time (tensor-core kernel): one step a page here
using decode_pages32 = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<2>,
                                        tierkv::group_size<4>, tierkv::page_tokens<32>>;

// cuda::decode_path.
enum class decode_path : std::uint8_t { tensor_core = 0, cuda_core = 1 };

// cuda::decode_inputs<2>, field for field (f32 queries), with its defaults.
struct decode_args {
  tierkv::batch_index_view<2> index;
  tierkv::pool_view pools[2];
  const float* queries = nullptr;
  float softmax_scale = 0.f;
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
