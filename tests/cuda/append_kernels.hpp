// SPDX-License-Identifier: Apache-2.0
// test_cuda_append's device side (append_kernels.cu: cuda/append/append.cuh needs nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"

namespace cuda_test {

using append_recent = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using append_int8r = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
using append_qwen = tierkv::geometry<tierkv::head_dim<256>, tierkv::kv_heads<4>,
                                     tierkv::group_size<6>, tierkv::page_tokens<64>>;
using append_smol = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<3>,
                                     tierkv::group_size<3>, tierkv::page_tokens<64>>;

// test_cuda_reserve_append's geometry (reserve_append_kernels.cu instantiates it).
using reserve_geo = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>,
                                     tierkv::group_size<2>, tierkv::page_tokens<16>>;

// cuda::append_inputs, field for field (bf16 for input_type::bf16), with its defaults.
struct append_args {
  const void* k = nullptr;
  const void* v = nullptr;
  bool bf16 = false;
  std::int64_t layer_stride = 0;
  const std::int32_t* slot = nullptr;
  std::int64_t slot_layer_stride = 0;
  const std::int32_t* offset = nullptr;
  int tokens = 0;
  int layers = 1;
  tierkv::pool_view pool;
  std::uint64_t cache_seed = 0;
  int head_base = 0;
  int layer_base = 0;
  int* error = nullptr;
};

// cuda::append<G, Tier>; instantiated in append_kernels.cu for G in {append_qwen, append_smol}
// and in reserve_append_kernels.cu for reserve_geo, Tier in {append_recent, append_int8r}.
template <class G, class Tier>
tierkv::status append(const append_args& in, cudaStream_t stream);

}  // namespace cuda_test
