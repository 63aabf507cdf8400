// SPDX-License-Identifier: Apache-2.0
// A compacted prefix as ordinary pages: the folded keys and compacted values of every
// (layer, KV head), assembled into the [layer][token][kv_head][dim] layout append takes and
// appended to an empty sequence of a tiered_cache through its normal codecs (tier 0: FP8,
// int8_rotated, TQ3, ... whatever the cache's first tier is). Attention then reads it like any
// other sequence, with no bias input; new requests that share the document fork that
// sequence (its sealed pages are shared, not copied).
//
// Contract (docs/compaction.md): the compacted prefix holds t < n tokens whose keys already
// carry their RoPE positions (0..n-1 of the original document), so attention is unaffected by
// the gap, but the cache's length is t. The engine keeps its own position counter: the token
// that follows the prefix has RoPE position n, not t. Causal masks over the cache (prefill)
// see all compacted tokens as earlier, which they are; sliding windows counted in cache
// tokens would not match the original positions. Every head must keep the same number of
// tokens t (a page slot holds one token of every head and layer); the fold requires the
// cache's softmax_scale and no soft cap (the bias is added outside the cap in AM, inside the
// fold's keys it would be capped).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/compaction/fold.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::compaction {

/// A compacted prefix of every (layer, KV head), laid out for tiered_cache::append.
struct compacted_prefix {
  int layers = 0;                    ///< model layers
  int kv_heads = 0;                  ///< KV heads
  int head_dim = 0;                  ///< scalars per vector
  std::int64_t tokens = 0;           ///< t, kept per head
  std::int64_t original_tokens = 0;  ///< n: the next token's RoPE position
  float softmax_scale = 0.f;         ///< what the keys were folded for
  std::vector<float> keys;           ///< [layer][token][kv_head][dim]
  std::vector<float> values;         ///< [layer][token][kv_head][dim]
};

/// heads[l * kv_heads + h] is (layer l, KV head h). All must have the same head_dim, token
/// count, original length and softmax scale.
inline result<compacted_prefix> assemble_prefix(std::span<const folded_head> heads, int layers,
                                                int kv_heads) {
  if (layers < 1 || kv_heads < 1 || heads.size() != std::size_t(layers) * std::size_t(kv_heads))
    return status::make(errc::invalid_argument, "assemble_prefix: ", heads.size(),
                        " heads for layers = ", layers, " x kv_heads = ", kv_heads);
  compacted_prefix p;
  p.layers = layers;
  p.kv_heads = kv_heads;
  p.head_dim = heads[0].head_dim;
  p.tokens = heads[0].size();
  p.original_tokens = heads[0].n;
  p.softmax_scale = heads[0].softmax_scale;
  for (std::size_t i = 0; i < heads.size(); ++i) {
    const auto& f = heads[i];
    if (f.head_dim != p.head_dim || f.size() != p.tokens || f.n != p.original_tokens ||
        f.softmax_scale != p.softmax_scale || f.values.size() != f.keys.size())
      return status::make(errc::geometry_mismatch, "assemble_prefix: head ", i, " (layer ",
                          i / std::size_t(kv_heads), ", kv head ", i % std::size_t(kv_heads),
                          ") holds ", f.size(), " tokens of head_dim ", f.head_dim, " from ", f.n,
                          " at scale ", f.softmax_scale, "; head 0 holds ", p.tokens,
                          " of head_dim ", p.head_dim, " from ", p.original_tokens, " at scale ",
                          p.softmax_scale, " (equal budgets per head are required)");
  }
  const auto D = std::size_t(p.head_dim), H = std::size_t(kv_heads), T = std::size_t(p.tokens);
  p.keys.resize(std::size_t(layers) * T * H * D);
  p.values.resize(p.keys.size());
  for (std::size_t l = 0; l < std::size_t(layers); ++l)
    for (std::size_t h = 0; h < H; ++h) {
      const auto& f = heads[l * H + h];
      for (std::size_t a = 0; a < T; ++a)
        for (std::size_t k = 0; k < D; ++k) {
          const std::size_t at = ((l * T + a) * H + h) * D + k;
          p.keys[at] = f.keys[a * D + k];
          p.values[at] = f.values[a * D + k];
        }
    }
  return p;
}

/// Appends the prefix to the empty sequence s of cache (a tierkv::tiered_cache). Refuses,
/// changing nothing, on a shape that differs from the cache's (geometry_mismatch), a non-empty
/// sequence, a soft cap, or a softmax scale other than the fold's (invalid_argument, naming
/// both values); append's own refusals (capacity, max_pages) are passed on.
template <class Cache>
status write_prefix(Cache& cache, seq_id s, const compacted_prefix& p) {
  using storage = typename Cache::storage_type;
  const int layers = cache.storage().config().num_layers;
  if (p.head_dim != storage::head_dim || p.kv_heads != storage::kv_heads || p.layers != layers)
    return status::make(errc::geometry_mismatch, "write_prefix: the prefix has ", p.layers,
                        " layers x ", p.kv_heads, " kv heads x head_dim ", p.head_dim,
                        ", the cache ", layers, " x ", storage::kv_heads, " x ", storage::head_dim);
  const std::size_t floats = std::size_t(p.layers) * std::size_t(p.tokens) *
                             std::size_t(p.kv_heads) * std::size_t(p.head_dim);
  if (p.keys.size() != floats || p.values.size() != floats)
    return status::make(errc::invalid_argument, "write_prefix: ", p.keys.size(), " key and ",
                        p.values.size(), " value floats, ", floats, " expected");
  const auto& cfg = cache.config();
  if (cfg.soft_cap != 0.f)
    return status::make(errc::invalid_argument,
                        "write_prefix: the cache's soft_cap = ", cfg.soft_cap,
                        " must be 0: a folded bias would pass through the cap; nothing written");
  const float scale =
      cfg.softmax_scale > 0.f ? cfg.softmax_scale : 1.f / std::sqrt(float(storage::head_dim));
  if (std::abs(scale - p.softmax_scale) > 1e-6f * scale)
    return status::make(errc::invalid_argument,
                        "write_prefix: the keys were folded for "
                        "softmax_scale = ",
                        p.softmax_scale, ", the cache uses ", scale, "; nothing written");
  auto len = cache.length(s);
  if (!len) return len.error_status();
  if (*len != 0)
    return status::make(errc::invalid_argument, "write_prefix: sequence holds ", *len,
                        " tokens; a compacted prefix goes into an empty sequence (limit 0)");
  return cache.append(s, p.tokens, p.keys, p.values);
}

}  // namespace tierkv::compaction
