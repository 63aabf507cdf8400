// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the transfer tests: random K/V, host decode of one layer, retier.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "catch.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/tiering/conversion.hpp"

namespace tierkv::test_transfer {

// [layer][token][kv_head][dim] floats: Gaussian with a few large channels (keys look like that).
inline std::vector<float> random_kv(std::mt19937_64& rng, int layers, std::int64_t tokens,
                                    int heads, int dim) {
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> x(std::size_t(layers) * std::size_t(tokens) * std::size_t(heads) *
                       std::size_t(dim));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = g(rng) * ((i % std::size_t(dim)) < 2 ? 8.f : 1.f);
  return x;
}

// One decode step of one layer for one sequence: out [q_heads][head_dim], lse [q_heads].
template <class Storage>
status decode_layer(const Storage& s, seq_id seq, int layer, std::span<const float> queries,
                    std::vector<float>& out, std::vector<float>& lse) {
  using G = typename Storage::geometry;
  const index_layout<Storage::num_tiers> layout{1, 512};
  std::vector<std::uint8_t> buf(layout.bytes());
  const seq_id batch[1] = {seq};
  auto view = build_batch_index(s, layer, std::span<const seq_id>(batch, 1), layout,
                                std::span<std::uint8_t>(buf));
  if (!view) return view.error_status();
  out.assign(std::size_t(G::q_heads) * G::head_dim, -1.f);
  lse.assign(std::size_t(G::q_heads), -1.f);
  const auto pools = s.views();
  host_attention_workspace ws{1};
  host_decode_args<Storage::num_tiers> a;
  a.queries = queries.data();
  a.index = *view;
  a.pools = pools.data();
  a.source = layer_source{s.config().codec_seed, layer, s.config().head_base};
  a.logits.softmax_scale = 1.f / std::sqrt(float(G::head_dim));
  a.out = out.data();
  a.lse = lse.data();
  return host_decode<G, typename Storage::tier_list>(ws, a);
}

// Moves (logical page j, layer l) of seq to tier `to` on the host (the controller's step).
template <class Storage>
status retier(Storage& s, seq_id seq, std::int64_t j, int layer, int to) {
  auto b = s.block_of(seq, j);
  if (!b) return b.error_status();
  conversion_counters c;
  auto p = convert_page(s, *b, layer, to, c);
  return p ? status{} : p.error_status();
}

// Tokens in logical page j of seq (page_tokens unless it is the open last page).
template <class Storage>
int fill_of(const Storage& s, seq_id seq, std::int64_t j) {
  const std::int64_t left = s.length(seq).value() - j * Storage::page_tokens;
  return int(std::min<std::int64_t>(left, Storage::page_tokens));
}

// Same bytes on both pages: the whole page (padding and unused slots included) when
// fill is page_tokens or < 0; else the first `fill` token slots of every head in each of
// the four regions (what an export carries of a partial page; the rest is zero there).
template <class SA, class SB>
bool pages_equal(SA& a, page_id pa, SB& b, page_id pb, int fill = -1) {
  auto x = a.page_bytes(pa);
  auto y = b.page_bytes(pb);
  if (!x || !y || x->size() != y->size()) return false;
  if (fill < 0 || fill >= SA::page_tokens) return std::equal(x->begin(), x->end(), y->begin());
  if (pa.format != pb.format) return false;
  bool same = true;
  detail::with_index<SA::num_tiers>(pa.format, [&](auto I) {
    using L = typename SA::template layout<I>;
    const auto eq = [&](std::size_t off, std::size_t n) {
      return n == 0 || std::memcmp(x->data() + off, y->data() + off, n) == 0;
    };
    for (int h = 0; h < SA::kv_heads; ++h)
      for (int t = 0; t < fill; ++t)
        same = same && eq(L::key_payload(h, t), L::key_codec::payload_bytes) &&
               eq(L::value_payload(h, t), L::value_codec::payload_bytes) &&
               eq(L::key_meta(h, t), L::key_codec::meta_bytes) &&
               eq(L::value_meta(h, t), L::value_codec::meta_bytes);
  });
  return same;
}

}  // namespace tierkv::test_transfer
