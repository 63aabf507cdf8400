// SPDX-License-Identifier: Apache-2.0
// Google Benchmark of host decode over mixed FP8/TQ3 pages: items = context tokens read
// (batch x context, one layer, all KV heads).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "tierkv/attention/host_decode.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"

using namespace tierkv;

namespace {
using mixed = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>;

template <class Geo>
void bm_host_decode(benchmark::State& state) {
  constexpr int D = Geo::head_dim, P = Geo::page_tokens, KVH = Geo::kv_heads;
  const int batch = int(state.range(0)), len = int(state.range(1));
  const unsigned threads = unsigned(state.range(2));
  const int pages = (len + P - 1) / P;
  const int fp8_pages = int(std::lround(0.27 * pages));
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(D);
  std::vector<std::uint8_t> store[2];
  std::vector<std::int32_t> indptr[2], slot[2], logical[2];
  std::vector<std::int32_t> lens(std::size_t(batch), len);
  pool_view pools[2];
  auto fill = [&](auto layout_tag, int f) {
    using layout = decltype(layout_tag);
    using KC = typename layout::key_codec;
    using VC = typename layout::value_codec;
    indptr[f].assign(std::size_t(batch) + 1, 0);
    for (int b = 0; b < batch; ++b) {
      for (int p = 0; p < pages; ++p)
        if ((p == 0 || p >= pages - fp8_pages + 1 ? 0 : 1) == f) {
          slot[f].push_back(std::int32_t(slot[f].size()));
          logical[f].push_back(p);
        }
      indptr[f][std::size_t(b) + 1] = std::int32_t(slot[f].size());
    }
    store[f].assign((slot[f].size() + 1) * layout::page_bytes, 0);
    for (std::size_t s = 0; s < slot[f].size(); ++s)
      for (int h = 0; h < KVH; ++h)
        for (int t = 0; t < P; ++t) {
          std::uint8_t* page = store[f].data() + s * layout::page_bytes;
          typename KC::meta_type km{};
          typename VC::meta_type vm{};
          for (auto& e : x) e = nd(rng);
          (void)KC::encode(x.data(), page + layout::key_payload(h, t), km,
                           make_codec_context(0, 0, h, kv_role::key), nullptr);
          for (auto& e : x) e = nd(rng);
          (void)VC::encode(x.data(), page + layout::value_payload(h, t), vm,
                           make_codec_context(0, 0, h, kv_role::value), nullptr);
          std::memcpy(page + layout::key_meta(h, t), &km, KC::meta_bytes);
          std::memcpy(page + layout::value_meta(h, t), &vm, VC::meta_bytes);
        }
    pools[f] = pool_view{store[f].data(), layout::page_bytes, std::uint32_t(slot[f].size() + 1)};
  };
  fill(page_layout<Geo, codec_for<fp8_e4m3, D>, codec_for<fp8_e4m3, D>>{}, 0);
  fill(page_layout<Geo, codec_for<tq3_key, D>, codec_for<tq3_value, D>>{}, 1);
  std::vector<float> q(std::size_t(batch) * Geo::q_heads * D), out(q.size());
  for (auto& e : q) e = nd(rng);
  host_decode_args<2> a;
  a.queries = q.data();
  a.index.batch = batch;
  a.index.seq_len = lens.data();
  for (int f = 0; f < 2; ++f)
    a.index.formats[f] = {indptr[f].data(), slot[f].data(), logical[f].data()};
  a.pools = pools;
  a.logits = {1.f / std::sqrt(float(D)), 0.f};
  a.out = out.data();
  host_attention_workspace ws(threads);
  for (auto _ : state) {
    const status s = host_decode<Geo, mixed>(ws, a);
    if (!s) state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations() * std::int64_t(batch) * len);
}

using llama8b = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
using smollm = geometry<head_dim<64>, kv_heads<3>, group_size<3>, page_tokens<64>>;
}  // namespace

BENCHMARK(bm_host_decode<llama8b>)
    ->Args({1, 8192, 1})
    ->Args({1, 8192, 2})
    ->Args({4, 16384, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(bm_host_decode<smollm>)
    ->Args({1, 8192, 1})
    ->Args({8, 4096, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
