// SPDX-License-Identifier: Apache-2.0
// test_cuda_retier's device side (retier_kernels.cu: cuda/retier/retier.cuh needs nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/status.hpp"

namespace cuda_test {

using retier_recent = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using retier_int8r = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
using retier_stale = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using retier_stale_k4 = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;
using retier_cold_v2 = tierkv::tier<tierkv::tq3_key, tierkv::tq2_value>;
using retier_cold = tierkv::tier<tierkv::tq2_key, tierkv::tq2_value>;
// keys and values of different families (8-bit keys for routing, TQ3 values)
using retier_k8v3 = tierkv::tier<tierkv::int8_rotated, tierkv::tq3_value>;
using retier_qwen = tierkv::geometry<tierkv::head_dim<256>, tierkv::kv_heads<4>,
                                     tierkv::group_size<6>, tierkv::page_tokens<64>>;
using retier_llama = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<8>,
                                      tierkv::group_size<4>, tierkv::page_tokens<64>>;
using retier_smol = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<3>,
                                     tierkv::group_size<3>, tierkv::page_tokens<64>>;

// cuda::retier_inputs, field for field, with its defaults.
struct retier_args {
  tierkv::pool_view src;
  tierkv::pool_view dst;
  const std::int32_t* src_slot = nullptr;
  const std::int32_t* dst_slot = nullptr;
  const std::int32_t* layer_of = nullptr;
  int layer = 0;
  int pages = 0;
  std::uint64_t cache_seed = 0;
  int head_base = 0;
  int* error = nullptr;
};

// cuda::retier<G, From, To>; retier_kernels.cu instantiates the (G, From, To) that retier.cpp
// runs (another one is a link error).
template <class G, class From, class To>
tierkv::status retier(const retier_args& in, cudaStream_t stream);

}  // namespace cuda_test
