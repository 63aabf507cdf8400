// SPDX-License-Identifier: Apache-2.0
// 02_prefix_sharing: two requests share a cached system prompt through the prefix index.
// Request A (system prompt + its question) is appended and its full pages are cached under
// their token ids; request B (same system prompt, another question) starts from the longest
// cached prefix (prefix_index::start_sequence) and appends only its own tokens. report() then
// counts the shared pages once, and B decodes exactly like a control sequence C that appended
// all of B's tokens itself. Exits 1 if a check fails.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <vector>

#include <tierkv/tierkv.hpp>

namespace {

using geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>, tierkv::group_size<2>,
                                  tierkv::page_tokens<16>>;
using fp8 = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using tq3 = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using cache_t = tierkv::tiered_cache<geometry, tierkv::tiers<fp8, tq3>>;

constexpr int kLayers = 2, T = geometry::page_tokens, D = geometry::head_dim,
              KV = geometry::kv_heads;
constexpr std::uint64_t kSalt = 42;  // e.g. the model / adapter: prefixes match only under it

// Stand-in for the model: the key or value scalar of (layer, position, token id, head, dim).
// Equal token ids at equal positions give equal vectors, as a shared prefix does in a model.
float kv_scalar(int role, int layer, long pos, std::int32_t token, int h, int d) {
  const std::uint64_t x = tierkv::mix64(
      (std::uint64_t(role) << 60) ^ (std::uint64_t(layer) << 52) ^ (std::uint64_t(pos) << 24) ^
      (std::uint64_t(std::uint32_t(token)) << 8) ^ std::uint64_t(h * D + d));
  return float(double(x >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

// Appends tokens[from, to) of a request to s: keys and values [layer][token][kv_head][dim].
void append_tokens(cache_t& c, tierkv::seq_id s, const std::vector<std::int32_t>& tokens, long from,
                   long to) {
  const long n = to - from;
  std::vector<float> k(std::size_t(kLayers * n * KV * D)), v(k.size());
  std::size_t i = 0;
  for (int l = 0; l < kLayers; ++l)
    for (long t = from; t < to; ++t)
      for (int h = 0; h < KV; ++h)
        for (int d = 0; d < D; ++d, ++i) {
          k[i] = kv_scalar(0, l, t, tokens[std::size_t(t)], h, d);
          v[i] = kv_scalar(1, l, t, tokens[std::size_t(t)], h, d);
        }
  c.append(s, n, k, v).throw_if_error();
}

std::vector<std::int32_t> request(const std::vector<std::int32_t>& system, int first, int n) {
  std::vector<std::int32_t> r = system;
  for (int i = 0; i < n; ++i) r.push_back(first + i);
  return r;
}

}  // namespace

int main() {
  cache_t::options opt;
  opt.storage.num_layers = kLayers;
  opt.storage.max_sequences = 8;
  opt.storage.pages_per_tier = {64, 64};
  opt.max_batch = 2;
  opt.max_pages = 16;
  auto cache = cache_t::create(opt).value();
  tierkv::prefix_index<cache_t::storage_type> prefixes(cache->storage());

  std::vector<std::int32_t> system(64);  // a 64-token system prompt: 4 full pages
  for (std::size_t i = 0; i < system.size(); ++i) system[i] = std::int32_t(1000 + i);
  const auto a_tokens = request(system, 5000, 37);  // 101 tokens
  const auto b_tokens = request(system, 7000, 29);  // 93 tokens

  // Request A: appended in full, then its full pages (6 of 7) cached under their token ids.
  const tierkv::seq_id a = cache->create_sequence().value();
  append_tokens(*cache, a, a_tokens, 0, long(a_tokens.size()));
  const std::size_t cached = prefixes.insert(a, kSalt, a_tokens).value();

  // Request B: starts from the cached system prompt, appends only its question.
  const auto started = prefixes.start_sequence(kSalt, b_tokens).value();
  const tierkv::seq_id b = started.seq;
  append_tokens(*cache, b, b_tokens, started.cached_tokens, long(b_tokens.size()));
  const tierkv::memory_report shared = cache->report();

  // Control C: all of B's tokens appended without the prefix index.
  const tierkv::seq_id c = cache->create_sequence().value();
  append_tokens(*cache, c, b_tokens, 0, long(b_tokens.size()));

  // One decode step of B and C with the same query: the outputs must be identical.
  const std::size_t row = std::size_t(geometry::q_heads) * D;
  std::vector<float> q(2 * row), out(2 * row);
  for (std::size_t i = 0; i < row; ++i) q[i] = q[row + i] = 4.f * kv_scalar(2, 0, 0, 0, 0, int(i));
  const std::vector<tierkv::seq_id> batch{b, c};
  int identical_layers = 0;
  for (int l = 0; l < kLayers; ++l) {
    cache->attend(l, batch, q, out).throw_if_error();
    bool same = true;
    for (std::size_t i = 0; i < row; ++i) same = same && out[i] == out[row + i];
    identical_layers += same ? 1 : 0;
  }

  const auto pages = [](std::size_t tokens) { return long((tokens + T - 1) / T); };
  const long expect_shared_tokens = long(system.size());
  const long expect_pages =
      kLayers * (pages(a_tokens.size()) + pages(b_tokens.size()) - long(system.size()) / T);
  std::printf("request A: %zu tokens, %zu full pages cached in the prefix index\n", a_tokens.size(),
              cached);
  std::printf("request B: %zu tokens, %ld of them from the cache (%ld pages shared with A)\n",
              b_tokens.size(), long(started.cached_tokens), long(started.cached_tokens) / T);
  std::printf("with A and B live:\n");
  std::cout << shared << "\n";
  std::printf(
      "sequence tokens %llu - live tokens %llu = %llu shared; tier-0 pages %zu (%ld expected)\n",
      static_cast<unsigned long long>(shared.sequence_tokens),
      static_cast<unsigned long long>(shared.live_tokens),
      static_cast<unsigned long long>(shared.sequence_tokens - shared.live_tokens),
      shared.tiers[0].live_pages, expect_pages);
  std::printf("decode of B (shared prefix) vs C (own copy): identical in %d of %d layers\n",
              identical_layers, kLayers);

  bool ok = true;
  auto check = [&](bool cond, const char* what) {
    if (!cond) std::printf("FAILED: %s\n", what);
    ok = ok && cond;
  };
  check(cached == a_tokens.size() / T, "A's full pages are cached");
  check(started.cached_tokens == expect_shared_tokens, "B starts from the whole system prompt");
  check(long(shared.sequence_tokens - shared.live_tokens) == expect_shared_tokens,
        "the report counts the shared tokens once");
  check(long(shared.tiers[0].live_pages) == expect_pages, "shared pages are stored once");
  check(shared.prefix_index > 0 && shared.reconciles(), "the report reconciles");
  check(identical_layers == kLayers, "B decodes exactly like C");
  check(cache->check_invariants().is_ok(), "the cache's invariants hold");
  return ok ? 0 : 1;
}
