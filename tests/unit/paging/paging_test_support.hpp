// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the paging tests: a small geometry, seeded token contents, and
// a snapshot of everything observable in a storage (for strong-guarantee checks).
#pragma once

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "tierkv/codec/dense.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/report.hpp"

namespace paging_test {

using namespace tierkv;

using small_geometry = geometry<head_dim<16>, kv_heads<2>, group_size<1>, page_tokens<16>>;
using dense_tier = tier<dense_f32, dense_f32>;
using two_dense = tiers<dense_tier, dense_tier>;
using storage_t = paged_storage<small_geometry, two_dense, host_allocator, failing_allocator>;

// The head_dim scalars of (token content seed, layer, head, role): deterministic,
// finite, varied; one hash per vector, then an LCG step per scalar (cheap enough for
// tens of millions of checks).
inline void pattern_vector(std::uint64_t token_seed, int layer, int head, int role, int dim,
                           float* out) {
  std::uint64_t h =
      mix64(token_seed * 0x9E3779B97F4A7C15ull ^
            (std::uint64_t(layer) << 40 | std::uint64_t(head) << 24 | std::uint64_t(role) << 16));
  for (int d = 0; d < dim; ++d) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    out[d] = float(std::int64_t(h >> 40) - (1 << 23)) / float(1 << 20);  // in [-8, 8)
  }
}

// keys and values for tokens with the given seeds, laid out [layer][token][head][dim].
template <class Storage>
void make_kv(int layers, const std::vector<std::uint64_t>& seeds, std::vector<float>& keys,
             std::vector<float>& values) {
  constexpr int H = Storage::kv_heads;
  constexpr int D = Storage::head_dim;
  keys.resize(std::size_t(layers) * seeds.size() * H * D);
  values.resize(keys.size());
  std::size_t i = 0;
  for (int l = 0; l < layers; ++l)
    for (std::uint64_t s : seeds)
      for (int h = 0; h < H; ++h, i += D) {
        pattern_vector(s, l, h, 0, D, keys.data() + i);
        pattern_vector(s, l, h, 1, D, values.data() + i);
      }
}

// True when token `token` of seq decodes exactly to the pattern of `seed` (lossless tiers).
template <class Storage>
bool token_matches(const Storage& s, seq_id seq, std::int64_t token, std::uint64_t seed,
                   int layer) {
  constexpr int D = Storage::head_dim;
  float k[D], v[D], ek[D], ev[D];
  for (int h = 0; h < Storage::kv_heads; ++h) {
    if (!s.read_token(seq, layer, token, h, k, v)) return false;
    pattern_vector(seed, layer, h, 0, D, ek);
    pattern_vector(seed, layer, h, 1, D, ev);
    if (std::memcmp(k, ek, sizeof k) != 0 || std::memcmp(v, ev, sizeof v) != 0) return false;
  }
  return true;
}

struct snapshot {
  std::vector<std::tuple<std::uint32_t, std::int64_t, std::vector<std::uint32_t>>>
      seqs;  // id, len, pages
  std::vector<std::uint32_t> free_pages;
  std::size_t page_bytes = 0;
  std::size_t meta_bytes = 0;
  std::size_t page_tables = 0;
  std::size_t prefix = 0;
  std::uint32_t blocks = 0;
  friend bool operator==(const snapshot&, const snapshot&) = default;
};

template <class Storage>
snapshot take_snapshot(const Storage& s) {
  snapshot snap;
  s.for_each_sequence([&](seq_id id, std::int64_t len) {
    std::vector<std::uint32_t> pages;
    for (int l = 0; l < s.num_layers(); ++l)
      s.for_each_page(id, l, [&](std::int64_t, page_id p) {
        pages.push_back(p.slot);
        pages.push_back(p.generation);
        pages.push_back(p.format);
      });
    snap.seqs.emplace_back(id.value, len, std::move(pages));
  });
  for (int t = 0; t < Storage::num_tiers; ++t) snap.free_pages.push_back(s.free_pages(t));
  snap.page_bytes = s.page_alloc().bytes_allocated();
  snap.meta_bytes = s.meta_alloc().bytes_allocated();
  snap.page_tables = s.lines().page_tables;
  snap.prefix = s.lines().prefix_index;
  snap.blocks = s.live_blocks();
  return snap;
}

}  // namespace paging_test
