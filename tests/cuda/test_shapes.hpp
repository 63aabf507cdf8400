// SPDX-License-Identifier: Apache-2.0
// The tier pairs and geometries the GPU attention tests (decode, prefill) run.
#pragma once

#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/core/geometry.hpp"

namespace cuda_test {

using decode_recent = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
// the BF16 control arm (dense pages through the same kernels)
using decode_dense = tierkv::tier<tierkv::dense_bf16, tierkv::dense_bf16>;
using decode_int8r = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
using decode_stale = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using decode_stale_k4 = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;
// the Cold tier's 2-bit codes: values alone, and keys and values
using decode_cold_v2 = tierkv::tier<tierkv::tq3_key, tierkv::tq2_value>;
using decode_cold = tierkv::tier<tierkv::tq2_key, tierkv::tq2_value>;
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

}  // namespace cuda_test
