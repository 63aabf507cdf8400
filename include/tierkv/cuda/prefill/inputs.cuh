// SPDX-License-Identifier: Apache-2.0
// The inputs of one layer's chunked prefill (device pointers).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/cuda/kernel/io_types.cuh"
#include "tierkv/cuda/kernel/pool_check.cuh"
namespace tierkv::cuda {

/// One layer's chunked prefill, host_prefill's semantics (attention/host_prefill.hpp): the engine
/// appends the chunk's K/V first; sequence b's chunk is its last n_b = q_indptr[b+1] - q_indptr[b]
/// tokens, and query j (position p = seq_len[b] - n_b + j) attends every token at a position
/// <= p, the chunk read in its stored format. n_b = 1 is a decode step; n_b = 0 writes nothing.
template <int NumFormats>
struct prefill_inputs {
  batch_index_view<NumFormats> index;  ///< seq_len[b] counts the chunk
  pool_view pools[NumFormats];         ///< one pool per format, in tier order
  const void* queries = nullptr;  ///< [total_q][q_heads][head_dim], post-RoPE, packed by sequence
  query_type queries_type = query_type::f32;  ///< element type of queries
  const std::int32_t* q_indptr = nullptr;     ///< [batch + 1], device memory
  float softmax_scale = 0.f;                  ///< natural-log units, usually 1/sqrt(head_dim)
  float soft_cap = 0.f;                       ///< > 0: logits s -> soft_cap tanh(s / soft_cap)
  int window = 0;  ///< > 0: a query at p attends positions (p - window, p] (sliding-window layers)
  std::uint64_t cache_seed =
      0;                ///< codec contexts: make_codec_context(seed, layer, head_base + h, role)
  int head_base = 0;    ///< global index of KV head 0 (a tensor-parallel rank's first head)
  int layer = 0;        ///< the layer computed (codec contexts)
  void* out = nullptr;  ///< [total_q][q_heads][head_dim]
  output_type out_type = output_type::f32;  ///< element type of out
  float* lse = nullptr;                     ///< optional [total_q][q_heads], natural log
  /// Optional centring means of this layer, as decode_inputs': lse += softmax_scale *
  /// q.key_mean of the row's KV head. Needs soft_cap = 0.
  const float* key_mean = nullptr;
  /// Optional centring means of values: out += value_mean of the row's KV head.
  const float* value_mean = nullptr;
};

}  // namespace tierkv::cuda
