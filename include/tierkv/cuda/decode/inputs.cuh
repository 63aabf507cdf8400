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
namespace tierkv::cuda {

/// Element type of the queries: f32 or bf16.
enum class query_type : std::uint8_t { f32 = 0, bf16 = 1 };
/// Attention outputs: f32, or bf16 as models consume them (rounded once, from the f32 result).
enum class output_type : std::uint8_t { f32 = 0, bf16 = 1 };

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

namespace detail {

// Every pool must be set and hold pages of exactly its tier's layout (`what` names the caller).
template <class Geometry, int N, class... Tiers>
status check_pools(const char* what, const batch_index_view<N>& index, const pool_view (&pools)[N],
                   tiers<Tiers...>*) {
  static_assert(N == int(sizeof...(Tiers)), "check_pools: one pool per tier");
  constexpr std::size_t expect[] = {
      page_layout<Geometry, typename Tiers::template key_codec<Geometry::head_dim>,
                  typename Tiers::template value_codec<Geometry::head_dim>>::page_bytes...};
  for (int f = 0; f < N; ++f) {
    const pool_view& p = pools[f];
    if (p.capacity > 0 && p.base == nullptr)
      return status::make(errc::invalid_argument, what, ": pools[", f, "].base is null");
    if (p.page_bytes != expect[f])
      return status::make(errc::geometry_mismatch, what, ": pools[", f,
                          "].page_bytes = ", p.page_bytes, " but the tier's page_layout needs ",
                          expect[f]);
    if (index.batch > 0 && index.formats[f].indptr == nullptr)
      return status::make(errc::invalid_argument, what, ": index.formats[", f, "].indptr is null");
  }
  return status::ok();
}

}  // namespace detail
}  // namespace tierkv::cuda
