// SPDX-License-Identifier: Apache-2.0
// Host encode and decode of token vectors into one page layout, for paged_storage's writers
// (append, write_layer) and read_token: the codec context of (seed, layer, global head, role),
// the finiteness check with the offending (layer, token, head) named, and one layer of a run of
// tokens encoded into the pages a caller maps positions to.
#pragma once

#include "tierkv/core/config.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "tierkv/codec/codec.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv {

/// x holds whole layers of n tokens ([layer][token][kv_head][dim]) starting at first_layer: the
/// first NaN or Inf refuses with non_finite_input naming its layer, token and head. The message
/// starts with op and ends "nothing <done>".
inline status check_finite_tokens(std::span<const float> x, const char* what, std::int64_t n,
                                  int kv_heads, int head_dim, const char* op, int first_layer,
                                  const char* done) {
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      const std::size_t per_token = std::size_t(kv_heads) * std::size_t(head_dim);
      const std::size_t per_layer = std::size_t(n) * per_token;
      return status::make(
          errc::non_finite_input, op, ": ", what, "[", i, "] = ", x[i], " (layer ",
          std::size_t(first_layer) + i / per_layer, ", token ", (i % per_layer) / per_token,
          ", kv head ", (i % per_token) / std::size_t(head_dim), ") is not finite; nothing ", done);
    }
  }
  return {};
}

namespace detail {
template <class C>
void encode_vector(const float* x, std::uint8_t* payload, std::uint8_t* meta,
                   const codec_context& ctx, encode_stats* stats) {
  typename C::meta_type m{};
  (void)C::encode(x, payload, m, ctx, stats);  // finiteness was checked up front
  if constexpr (C::meta_bytes > 0) std::memcpy(meta, &m, C::meta_bytes);
}
template <class C>
void decode_vector(const std::uint8_t* payload, const std::uint8_t* meta, float* out,
                   const codec_context& ctx) {
  typename C::meta_type m{};
  if constexpr (C::meta_bytes > 0) std::memcpy(&m, meta, C::meta_bytes);
  C::decode(payload, m, out, ctx);
}
}  // namespace detail

/// Encodes layer `layer` of tokens [start, start + n) with Layout's codecs: keys / values are
/// [token][kv_head][dim] (finite), page_at(pos) is the host page that holds position pos (row
/// pos % page_tokens). Codec contexts: make_codec_context(seed, layer, head_base + head, role).
template <class Layout, class PageAt>
void encode_token_layer(PageAt&& page_at, std::int64_t start, std::int64_t n, int layer,
                        const float* keys, const float* values, std::uint64_t seed, int head_base,
                        encode_stats* stats) {
  using G = typename Layout::geometry;
  using KC = typename Layout::key_codec;
  using VC = typename Layout::value_codec;
  constexpr int H = G::kv_heads, D = G::head_dim, T = G::page_tokens;
  constexpr std::size_t per_token = std::size_t(H) * D;
  for (int h = 0; h < H; ++h) {
    const int g = head_base + h;  // global KV head: ranks encode as the unsharded cache
    const codec_context kctx = make_codec_context(seed, layer, g, kv_role::key);
    const codec_context vctx = make_codec_context(seed, layer, g, kv_role::value);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t pos = start + i;
      const int t = int(pos % T);
      std::uint8_t* base = page_at(pos);
      const std::size_t off = std::size_t(i) * per_token + std::size_t(h) * D;
      detail::encode_vector<KC>(keys + off, base + Layout::key_payload(h, t),
                                base + Layout::key_meta(h, t), kctx, stats);
      detail::encode_vector<VC>(values + off, base + Layout::value_payload(h, t),
                                base + Layout::value_meta(h, t), vctx, stats);
    }
  }
}

/// Decodes row t, KV head `head` (global head g) of one Layout page into key and value.
template <class Layout>
void decode_token(const std::uint8_t* base, int t, int head, int layer, int g, std::uint64_t seed,
                  float* key, float* value) {
  detail::decode_vector<typename Layout::key_codec>(
      base + Layout::key_payload(head, t), base + Layout::key_meta(head, t), key,
      make_codec_context(seed, layer, g, kv_role::key));
  detail::decode_vector<typename Layout::value_codec>(
      base + Layout::value_payload(head, t), base + Layout::value_meta(head, t), value,
      make_codec_context(seed, layer, g, kv_role::value));
}

}  // namespace tierkv
