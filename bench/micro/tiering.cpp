// SPDX-License-Identifier: Apache-2.0
// Host cost of tier_controller::plan per scheduler step, incremental (the default) against the
// full scan of every (block, layer) page, in steady state: `seqs` sequences of `pages` pages x
// `layers` layers, already in the tiers the policy wants; each step appends one token to every
// sequence, feeds one layer's page mass of every sequence (cuda::tiered_cache sampling one layer a
// step) and plans. Arguments: {seqs, pages per sequence, layers}.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace {

using namespace tierkv;
using G = geometry<head_dim<64>, kv_heads<1>, group_size<2>, page_tokens<16>>;
using TL = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>;
using storage = paged_storage<G, TL, host_allocator>;
using controller = tier_controller<storage>;
void bm_plan(benchmark::State& state, bool incremental) {
  const int seqs = int(state.range(0)), pages = int(state.range(1)), layers = int(state.range(2));
  const std::uint32_t total = std::uint32_t(seqs) * std::uint32_t(pages + 64) * layers;
  storage::options so;
  so.num_layers = layers;
  so.max_sequences = std::uint32_t(seqs);
  so.pages_per_tier = {total, total};
  auto s = std::move(storage::create(so).value());
  policy::recency_anchor::options po;
  po.recent_pages = 4;
  po.sink_pages = 1;
  po.min_dwell_steps = 4;
  tier_controller_options co;
  co.incremental_plan = incremental;
  auto c = std::move(controller::create(*s, policy::recency_anchor(po), co).value());
  std::vector<seq_id> ids;
  const std::int64_t tokens = std::int64_t(pages) * G::page_tokens;
  const std::vector<float> kv(std::size_t(tokens) * layers * G::head_dim, 0.25f);
  for (int i = 0; i < seqs; ++i) {
    ids.push_back(s->create_sequence().value());
    s->append(ids.back(), tokens, kv, kv).throw_if_error();
  }
  std::uint64_t step = 0;
  for (int i = 0; i < 8; ++i) (void)c->apply(c->plan(++step));  // settle into the wanted tiers
  std::mt19937 rng(1);
  std::vector<float> mass(std::size_t(pages + 64));
  const std::vector<float> one(std::size_t(layers) * G::head_dim, 0.25f);
  std::size_t planned = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (const seq_id id : ids) s->append(id, 1, one, one).throw_if_error();
    const int layer = int(step % layers);
    for (const seq_id id : ids) {
      const auto n = std::size_t(*s->logical_pages(id));
      for (std::size_t i = 0; i < n; ++i) mass[i] = float(rng() % 1000) / 1000.f / float(n);
      c->observe_mass(id, layer, std::span<const float>(mass.data(), n)).throw_if_error();
    }
    state.ResumeTiming();
    const auto todo = c->plan(++step);
    benchmark::DoNotOptimize(todo.data());
    state.PauseTiming();
    planned += todo.size();
    (void)c->apply(todo);
    state.ResumeTiming();
  }
  state.counters["pages"] = double(std::uint64_t(seqs) * std::uint64_t(pages) * layers);
  state.counters["planned_per_step"] = double(planned) / double(state.iterations());
}

void bm_plan_incremental(benchmark::State& state) { bm_plan(state, true); }
void bm_plan_full_scan(benchmark::State& state) { bm_plan(state, false); }

// The host side of one cuda::tiered_cache decode step, metadata only (no page bytes written:
// the pages are reserved and committed as the GPU path does, and conversions are staged and
// committed without a fill): `batch` of `seqs` sequences of `pages` pages x `layers` layers gain
// a token, one layer's page mass of the batch is fed, the controller plans, and up to 65536
// conversions are staged and committed. The sequences are filled to `pages` first, in chunks, with
// the same plan/stage/commit after each chunk, so the pages sit where the default policy puts
// them. Arguments: {seqs, pages per sequence, layers, batch}.
void bm_decode_step_host(benchmark::State& state) {
  const int seqs = int(state.range(0)), pages = int(state.range(1)), layers = int(state.range(2));
  const int batch = int(state.range(3));
  const std::uint32_t per_seq = std::uint32_t(pages + 32);
  storage::options so;
  so.num_layers = layers;
  so.max_sequences = std::uint32_t(seqs);
  // tier 0: two whole layers (keep_first/last_layers), the Recent and sink pages of the others,
  // and the fill's pages waiting out min_dwell_steps (8 chunks of 64 pages)
  so.pages_per_tier = {std::uint32_t(seqs) * (2 * per_seq + std::uint32_t(layers) * (16 + 8 * 64)),
                       std::uint32_t(seqs) * per_seq * std::uint32_t(layers)};
  auto s = std::move(storage::create(so).value());
  auto c = std::move(controller::create(*s, policy::recency_anchor{}).value());
  std::vector<seq_id> ids;
  for (int i = 0; i < seqs; ++i) ids.push_back(s->create_sequence().value());
  std::vector<staged_conversion> staged(65536);
  const std::vector<char> filled_bytes(staged.size(), 1);
  const std::span<const bool> filled(reinterpret_cast<const bool*>(filled_bytes.data()),
                                     filled_bytes.size());
  std::uint64_t step = 0;
  auto retier = [&] {
    const auto todo = c->plan(++step);
    retier_stats st;
    const std::size_t n = c->stage(todo.first(std::min(todo.size(), staged.size())), staged, st);
    c->commit(std::span<staged_conversion>(staged.data(), n), filled.first(n), st);
  };
  const std::int64_t chunk = 1024;
  std::vector<std::int32_t> slot(std::size_t(layers) * chunk), offset(chunk);
  auto add = [&](seq_id id, std::int64_t n) {
    slot_mapping m{std::span<std::int32_t>(slot.data(), std::size_t(layers - 1) * n + n), n,
                   std::span<std::int32_t>(offset.data(), std::size_t(n))};
    s->reserve(id, n, m).throw_if_error();
    s->commit(id, n).throw_if_error();
  };
  for (std::int64_t done = 0; done < std::int64_t(pages - 1) * G::page_tokens; done += chunk) {
    for (const seq_id id : ids) add(id, chunk);
    retier();
  }
  for (int i = 0; i < 12; ++i) retier();  // past the dwell: the steady state
  std::mt19937 rng(1);
  std::vector<float> mass(static_cast<std::size_t>(per_seq));
  for (auto _ : state) {
    for (int b = 0; b < batch; ++b) add(ids[std::size_t(b)], 1);
    const int layer = int(step % std::uint64_t(layers));
    for (int b = 0; b < batch; ++b) {
      const auto n = std::size_t(*s->logical_pages(ids[std::size_t(b)]));
      state.PauseTiming();
      for (std::size_t i = 0; i < n; ++i) mass[i] = float(rng() % 1000) / 1000.f / float(n);
      state.ResumeTiming();
      c->observe_mass(ids[std::size_t(b)], layer, std::span<const float>(mass.data(), n))
          .throw_if_error();
    }
    retier();
  }
  state.counters["pages"] = double(std::uint64_t(seqs) * std::uint64_t(pages) * layers);
}

}  // namespace

// 256 steps: the sequences grow by 16 pages, within the 64 pages of headroom the pools hold.
BENCHMARK(bm_plan_incremental)
    ->Args({64, 512, 8})
    ->Args({64, 128, 32})
    ->Iterations(256)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_plan_full_scan)
    ->Args({64, 512, 8})
    ->Args({64, 128, 32})
    ->Iterations(256)
    ->Unit(benchmark::kMicrosecond);
// The torch_e2e model's geometry (16 layers) at a quarter of its 128K context (2048 pages of 16
// tokens, not 8208, so the host pools fit a CI machine): batch 8 and every sequence.
BENCHMARK(bm_decode_step_host)
    ->Args({46, 2048, 16, 8})
    ->Args({46, 2048, 16, 46})
    ->Iterations(64)
    ->Unit(benchmark::kMillisecond);
