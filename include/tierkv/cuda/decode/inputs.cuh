// SPDX-License-Identifier: Apache-2.0
// The inputs of one layer's decode step (device pointers), shared by both split kernels.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/kernel/io_types.cuh"
#include "tierkv/cuda/kernel/pool_check.cuh"
namespace tierkv::cuda {

/// One layer's decode step. Device pointers; `index` and `pools` in the cache's tier order.
template <int NumFormats>
struct decode_inputs {
  batch_index_view<NumFormats> index;         ///< batch, seq_len[b], one CSR per format
  pool_view pools[NumFormats];                ///< one pool per format, in tier order
  const void* queries = nullptr;              ///< [batch][q_heads][head_dim], post-RoPE
  query_type queries_type = query_type::f32;  ///< element type of queries
  float softmax_scale = 0.f;                  ///< natural-log units, usually 1/sqrt(head_dim)
  float soft_cap = 0.f;  ///< > 0: logits s -> soft_cap tanh(s / soft_cap) (Gemma 2)
  /// > 0: the query (position seq_len - 1) attends positions >= seq_len - window only
  /// (sliding-window layers; pages wholly before the window are not read and get zero mass)
  int window = 0;
  std::uint64_t cache_seed =
      0;                ///< codec contexts: make_codec_context(seed, layer, head_base + head, role)
  int head_base = 0;    ///< global index of KV head 0 (a tensor-parallel rank's first head)
  int layer = 0;        ///< the layer decoded (codec contexts)
  void* out = nullptr;  ///< [batch][q_heads][head_dim], out_type
  output_type out_type = output_type::f32;  ///< element type of out
  float* lse = nullptr;  ///< optional [batch][q_heads], natural log; -inf when empty
  /// Optional, needs plan.page_mass: [batch][page_mass_stride]; entry (b, i) = softmax mass of
  /// logical page i averaged over the layer's q_heads (sums to 1 per non-empty sequence).
  float* page_mass = nullptr;
  int page_mass_stride = 0;  ///< floats between the rows of page_mass
  /// Optional device flag read at run time: 0 skips the page mass in this launch (a captured
  /// graph decodes every layer each step; the façade turns the mass on for its sampled layers).
  const int* page_mass_on = nullptr;
  /// Optional centring means of this layer ([kv_heads][head_dim] floats each; the pages hold
  /// keys and values minus them, tierkv/centering.hpp): a non-empty sequence's output gets its
  /// KV head's value_mean added and its lse softmax_scale * q.key_mean (softmax ignores a shift
  /// shared by all of a query's logits, so the page mass needs nothing). Needs soft_cap = 0.
  const float* key_mean = nullptr;
  /// Optional centring means of values ([kv_heads][head_dim]), added to the outputs.
  const float* value_mean = nullptr;
};

}  // namespace tierkv::cuda
