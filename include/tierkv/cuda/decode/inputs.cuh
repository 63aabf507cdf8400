// SPDX-License-Identifier: Apache-2.0
// The inputs of one layer's decode step (device pointers), shared by both split kernels.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/index_view.hpp"
namespace tierkv::cuda {

enum class query_type : std::uint8_t { f32 = 0, bf16 = 1 };

// One layer's decode step. Device pointers; `index` and `pools` in the cache's tier order.
template <int NumFormats>
struct decode_inputs {
  batch_index_view<NumFormats> index;  // batch, seq_len[b], one CSR per format
  pool_view pools[NumFormats];
  const void* queries = nullptr;  // [batch][q_heads][head_dim], post-RoPE
  query_type queries_type = query_type::f32;
  float softmax_scale = 0.f;  // natural-log units, usually 1/sqrt(head_dim)
  std::uint64_t cache_seed =
      0;              // codec contexts: make_codec_context(seed, layer, head_base + head, role)
  int head_base = 0;  // global index of KV head 0 (a tensor-parallel rank's first head)
  int layer = 0;
  float* out = nullptr;  // [batch][q_heads][head_dim]
  float* lse = nullptr;  // optional [batch][q_heads], natural log; -inf when empty
  // Optional, needs plan.page_mass: [batch][page_mass_stride]; entry (b, i) = softmax mass of
  // logical page i averaged over the layer's q_heads (sums to 1 per non-empty sequence).
  float* page_mass = nullptr;
  int page_mass_stride = 0;
};

}  // namespace tierkv::cuda
