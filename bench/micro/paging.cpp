// SPDX-License-Identifier: Apache-2.0
// Google Benchmark: append (FP8 encode into pages), fork + release, and the host
// index builder, for a Llama-3-8B-like layer geometry (8 KV heads, head_dim 128).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/paging/paged_storage.hpp"

using namespace tierkv;

namespace {
using G = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
using S = paged_storage<G, tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>>;

std::unique_ptr<S> make(int layers, std::uint32_t pages, std::uint32_t seqs) {
  S::options o;
  o.num_layers = layers;
  o.max_sequences = seqs;
  o.pages_per_tier = {pages, 1};
  auto created = S::create(o);
  return std::move(created.value());
}

std::vector<float> random_floats(std::size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

void BM_append_one_token(benchmark::State& state) {
  const int layers = int(state.range(0));
  auto s = make(layers, std::uint32_t(layers * 64), 1);
  const auto k = random_floats(std::size_t(layers) * 8 * 128);
  const auto v = random_floats(k.size());
  seq_id id = *s->create_sequence();
  std::int64_t n = 0;
  for (auto _ : state) {
    if (++n == 64 * 63) {  // keep the pool from filling
      state.PauseTiming();
      (void)s->release(id);
      id = *s->create_sequence();
      n = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(s->append(id, 1, k, v));
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * std::int64_t(k.size() + v.size()) * 4);
}
BENCHMARK(BM_append_one_token)->Arg(1)->Arg(32);

// The same token layer by layer: reserve (slot mapping into a reused buffer), one
// write_layer per layer, commit.
void BM_reserve_write_commit_one_token(benchmark::State& state) {
  const int layers = int(state.range(0));
  auto s = make(layers, std::uint32_t(layers * 64), 1);
  const auto k = random_floats(std::size_t(layers) * 8 * 128);
  const auto v = random_floats(k.size());
  std::vector<std::int32_t> slot(static_cast<std::size_t>(layers)), offset(1);
  seq_id id = *s->create_sequence();
  std::int64_t n = 0;
  for (auto _ : state) {
    if (++n == 64 * 63) {  // keep the pool from filling
      state.PauseTiming();
      (void)s->release(id);
      id = *s->create_sequence();
      n = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(s->reserve(id, 1, slot_mapping{slot, 0, offset}));
    for (int l = 0; l < layers; ++l) {
      const std::span<const float> kl(k.data() + std::size_t(l) * 8 * 128, 8 * 128);
      const std::span<const float> vl(v.data() + std::size_t(l) * 8 * 128, 8 * 128);
      benchmark::DoNotOptimize(s->write_layer(id, l, kl, vl));
    }
    benchmark::DoNotOptimize(s->commit(id, 1));
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * std::int64_t(k.size() + v.size()) * 4);
}
BENCHMARK(BM_reserve_write_commit_one_token)->Arg(1)->Arg(32);

// Metadata only: reserve + commit of one token (what an engine whose kernel writes the
// pages pays on the host per sequence and step).
void BM_reserve_commit_one_token(benchmark::State& state) {
  const int layers = int(state.range(0));
  auto s = make(layers, std::uint32_t(layers * 64), 1);
  std::vector<std::int32_t> slot(static_cast<std::size_t>(layers)), offset(1);
  seq_id id = *s->create_sequence();
  std::int64_t n = 0;
  for (auto _ : state) {
    if (++n == 64 * 63) {
      state.PauseTiming();
      (void)s->release(id);
      id = *s->create_sequence();
      n = 0;
      state.ResumeTiming();
    }
    benchmark::DoNotOptimize(s->reserve(id, 1, slot_mapping{slot, 0, offset}));
    benchmark::DoNotOptimize(s->commit(id, 1));
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_reserve_commit_one_token)->Arg(1)->Arg(32);

void BM_fork_release(benchmark::State& state) {
  const int layers = 32;
  const std::int64_t tokens = state.range(0);
  auto s = make(layers, std::uint32_t(layers * (tokens / 64 + 3)), 2);
  const auto k = random_floats(std::size_t(layers) * std::size_t(tokens) * 8 * 128);
  const seq_id id = *s->create_sequence();
  (void)s->append(id, tokens, k, k);
  for (auto _ : state) {
    auto c = s->fork(id);
    benchmark::DoNotOptimize(s->release(*c));
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_fork_release)->Arg(1024)->Arg(1000)->Arg(8000);

void BM_build_index(benchmark::State& state) {
  const int batch = int(state.range(0));
  const int tokens = 4096;
  auto s = make(1, std::uint32_t(batch * tokens / 64), std::uint32_t(batch));
  const auto k = random_floats(std::size_t(tokens) * 8 * 128);
  std::vector<seq_id> ids;
  for (int b = 0; b < batch; ++b) {
    ids.push_back(*s->create_sequence());
    (void)s->append(ids.back(), tokens, k, k);
  }
  const index_layout<2> layout{batch, tokens / 64};
  std::vector<std::uint64_t> buf(layout.bytes() / 8 + 2);
  std::span<std::uint8_t> bytes(reinterpret_cast<std::uint8_t*>(buf.data()), layout.bytes());
  for (auto _ : state)
    benchmark::DoNotOptimize(build_batch_index(*s, 0, std::span<const seq_id>(ids), layout, bytes));
  state.SetItemsProcessed(state.iterations() * batch * (tokens / 64));
}
BENCHMARK(BM_build_index)->Arg(8)->Arg(64);

// The page table of a sequence built from whole pages (detail::build_sequence: an import's and
// the GPU host tier's restore's host work, bench/results/host-tier/), arg logical pages x 16
// layers, 87.5% of them Stale (tier 1) as after the default policy; the bytes are not copied
// (the restore copies them on the GPU). Items = pages. Small pages: the cost is per page.
void BM_build_sequence(benchmark::State& state) {
  using G1 = geometry<head_dim<64>, kv_heads<1>, group_size<1>, page_tokens<16>>;
  using S1 = paged_storage<G1, tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>>;
  constexpr int layers = 16;
  const auto pages = std::uint32_t(state.range(0));
  S1::options o;
  o.num_layers = layers;
  o.max_sequences = 2;
  o.pages_per_tier = {pages * layers + 64, pages * layers + 64};
  auto s = std::move(S1::create(o).value());
  const auto tier_of = [&](std::uint32_t j, std::uint32_t l) {
    return (l % 8 == 0 || j == 0 || j + 4 >= pages) ? 0 : 1;  // 2 of 16 layers, sinks, newest
  };
  for (auto _ : state) {
    auto seq = detail::build_sequence(
        *s, pages, layers, "restore",
        [&](std::uint32_t j, std::uint32_t l) {
          detail::page_record r;
          r.tier = tier_of(j, l);
          r.fill = 16;
          return r;
        },
        [](page_id, const detail::page_record&) { return status{}; });
    state.PauseTiming();
    (void)s->release(*seq);
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * std::int64_t(pages) * layers);
}
BENCHMARK(BM_build_sequence)->Arg(8192)->Unit(benchmark::kMillisecond);
}  // namespace
