// SPDX-License-Identifier: Apache-2.0
// gpubench_decode [--out FILE.json] [--commit SHA] [--quick] [--compare] [--ctx L] [--batch B]
//                 [--dim D] [--mix M] [--no-retier] [--retier-only] [--max-chunks N]
//                 [--min-chunk-kb N] [--resident N] [--int8r | --int8r-only] [--k4 | --k4-only]
//                 [--cold | --cold-only]
//                 [--balance bytes|work] [--unpack-work N] [--waves N] [--shared]
//                 [--benchmark_* flags]
// Mixed-format paged decode on the GPU (docs/gpu.md) over the benchmark shapes, contexts,
// batches and mixes, stream launch and CUDA-graph replay; retier throughput both ways and
// append latency at B = 64 per tier pair. Google Benchmark: one benchmark per (shape, mix, path,
// context, batch), e.g. decode/shape:24x4x256/mix:tiered/path:graph/context:32768/batch:8,
// 25 repetitions of one timed call after 3 warm-up calls, the median reported (bench_support.cuh:
// L2 flushed before each call, the call behind a ~100 us spin kernel, CUDA-event manual time).
// Counters: bytes (page bytes + queries + outputs), GB/s, frac_copy (of the device-to-device copy
// measured at the start: context copy_gbps), chunks (per sequence). Random (never zero) pages.
// bench/gpu/gbench_record.py turns the JSON into the decode record (rows, retier_append).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_support.cuh"
#include "gbench_main.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/append/append.cuh"
#include "tierkv/cuda/decode.cuh"
#include "tierkv/cuda/retier/retier.cuh"

namespace {

using namespace tierkv;
using namespace tierkv::bench;
using recent = tier<fp8_e4m3, fp8_e4m3>;
using stale = tier<tq3_key, tq3_value>;
using recent_int8r = tier<int8_rotated, int8_rotated>;
using stale_k4 = tier<tq4_key, tq3_value>;
using recent_dense = tier<dense_bf16, dense_bf16>;  // the BF16 control arm
using cold_v2 = tier<tq3_key, tq2_value>;           // the Cold tier: 2-bit values
using cold = tier<tq2_key, tq2_value>;              // the Cold tier: 2-bit keys and values
using g256 = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<64>>;
using g128 = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
using g64 = geometry<head_dim<64>, kv_heads<3>, group_size<3>, page_tokens<64>>;

struct options {
  bool quick = false, compare = false, retier = true, decode = true;
  bool with_int8r = false, int8r_only = false;  // also / only the int8_rotated recent tier
  bool with_k4 = false, k4_only = false;        // also / only int8_rotated + TQ4-key Stale tiers
  bool with_dense = false;                      // also dense bf16 recent pages (the control arm)
  bool with_cold = false, cold_only = false;    // also / only int8_rotated + TQ2 (Cold) tiers
  std::vector<int> ctx, batch;                  // empty: the defaults
  int dim = 0;                                  // 0: all shapes
  std::string mix;                              // empty: every mix
  int max_chunks = cuda::decode_capacity{}.max_chunks_per_seq;
  std::int64_t min_chunk_kb = cuda::decode_default_min_chunk_bytes / 1024;
  int resident = 0;  // plan_decode's resident_blocks; 0: its default (decode_blocks_per_sm)
  cuda::balance balance_by = cuda::balance::work;
  int unpack_work = 0;  // 0: each codec's decode_work_percent
  int waves = cuda::decode_default_waves;
  bool shared = false;  // every sequence reads the same pages (a prefix shared by the batch)
};
options opt;

struct device_state {
  cudaStream_t stream = nullptr;
  int sms = 0;
  double copy_gbps = 0;
  std::unique_ptr<l2_flusher> flush;
};
device_state dev;
case_cache cache;

constexpr int decode_reps = 25, decode_warm = 3;
constexpr int retier_reps = 9, retier_warm = 2;
constexpr int append_reps = 51, append_warm = 5;

// The floor of a decode step as the rows time it: two empty kernels launched as decode
// launches its split and merge (the second with programmatic stream serialization).
__global__ void floor_split_kernel() { cuda::detail::allow_dependent_launch(); }
__global__ void floor_merge_kernel() { cuda::detail::wait_for_prerequisite_grid(); }
void launch_floor_pair(cudaStream_t s) {
  floor_split_kernel<<<256, cuda::detail::decode_threads, 0, s>>>();
  CK(cuda::detail::launch_dependent(floor_merge_kernel, dim3(24),
                                    dim3(cuda::detail::decode_threads), s));
}

enum class path { stream, graph, cuda_core_stream, cuda_core_graph, waves3_stream };
const char* path_name(path p) {
  switch (p) {
    case path::stream:
      return "stream";
    case path::graph:
      return "graph";
    case path::cuda_core_stream:
      return "cuda_core_stream";
    case path::cuda_core_graph:
      return "cuda_core_graph";
    case path::waves3_stream:
      return "waves3_stream";
  }
  return "?";
}

// The tier of each page of an n-page sequence (0 recent, 1 stale) for mix mi: 0 all recent,
// 1 all stale, 2 tiered (page 0 and the newest ~26% recent).
std::vector<int> page_tiers(int n, int mi) {
  std::vector<int> tier(static_cast<std::size_t>(n));
  const int recent_pages = (n * 27 + 99) / 100 - 1;
  for (int i = 0; i < n; ++i)
    tier[std::size_t(i)] = mi == 0 ? 0 : mi == 1 ? 1 : ((i == 0 || i >= n - recent_pages) ? 0 : 1);
  return tier;
}

// One decode case: a batch of B sequences of L tokens, pages of mix mi in one set of pools
// (the L2 flush keeps every call cache-cold), the plan and workspace; graphs and the one-wave
// plan are made by prepare() for the paths that use them. With --shared the pools hold one
// sequence's pages and every sequence's page table names them (bytes counts them once).
template <class G, class Recent, class Stale>
struct decode_case {
  static constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens, QH = G::q_heads;
  using KF = typename Recent::template key_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;
  using TL = tiers<Recent, Stale>;

  static double page_bytes(int L, int B, int mi) {
    if (opt.shared) B = 1;
    int n8 = 0;
    for (int t : page_tiers(L / T, mi)) n8 += t == 0;
    const int n3 = L / T - n8;
    return double(B) * (double(n8) * double(L8::page_bytes) + double(n3) * double(L3::page_bytes));
  }

  int L, B, n8 = 0, n3 = 0;
  std::uint32_t cap8 = 1, cap3 = 1;
  device_array<std::uint8_t> p8, p3, ws, ws3;
  two_tier_index table;
  device_array<std::int32_t> len;
  device_array<float> q, out, lse;
  cuda::decode_plan plan{}, plan3{};
  bool have_plan3 = false;
  graph_exec graph_tc, graph_cc;
  double bytes = 0;
  int chunks = 0;

  decode_case(int L_, int B_, int mi, cudaStream_t s) : L(L_), B(B_) {
    const int n = L / T;
    const std::vector<int> tier = page_tiers(n, mi);
    for (int t : tier) n8 += t == 0;
    n3 = n - n8;
    const int copies = opt.shared ? 1 : B;
    cap8 = std::uint32_t(std::max(1, copies * n8));
    cap3 = std::uint32_t(std::max(1, copies * n3));
    p8 = device_array<std::uint8_t>(L8::page_bytes * cap8);
    p3 = device_array<std::uint8_t>(L3::page_bytes * cap3);
    if constexpr (KF::meta_bytes == 0) {  // dense bf16
      fill_bf16<<<1024, 256, 0, s>>>(p8.get(), p8.size(), 1 + L);
    } else {
      fill_pages<<<1024, 256, 0, s>>>(p8.get(), p8.size(), 1 + L, 1);
      // FP8 scales ~ amax/448 for unit-variance data
      fill_meta<<<1024, 256, 0, s>>>(p8.get(), L8::page_bytes, L8::key_meta_offset,
                                     std::size_t(2) * H * T, cap8, 3.f / 448.f, 3);
    }
    fill_pages<<<1024, 256, 0, s>>>(p3.get(), p3.size(), 2 + L, 0);
    // TQ3 norms ~ sqrt(d).
    fill_meta<<<1024, 256, 0, s>>>(p3.get(), L3::page_bytes, L3::key_meta_offset,
                                   std::size_t(2) * H * T, cap3, std::sqrt(float(D)), 4);
    CK(cudaGetLastError());
    table = two_tier_index(tier, B, opt.shared);
    len = device_array<std::int32_t>(std::vector<std::int32_t>(std::size_t(B), L));
    const std::size_t qn = std::size_t(B) * QH * D;
    q = device_array<float>(qn);
    out = device_array<float>(qn);
    lse = device_array<float>(std::size_t(B) * QH);
    fill_floats<<<256, 256, 0, s>>>(q.get(), qn, 7);
    const cuda::decode_capacity cap{B, opt.max_chunks, 0, false};
    plan = take(cuda::plan_decode<G, TL>(
        cap, table.counts.data(), B, dev.sms, opt.waves, opt.min_chunk_kb * 1024, opt.balance_by,
        cuda::decode_default_min_chunk_pages,
        opt.resident > 0 ? opt.resident : cuda::decode_blocks_per_sm<G>, opt.unpack_work));
    ws = device_array<std::uint8_t>(plan.workspace_bytes);
    die_if(cuda::decode_workspace_init(plan, ws.get(), plan.workspace_bytes, s));
    // the chunk count the device computes for these sequences
    const std::int64_t tot =
        std::int64_t(n8) * plan.page_cost[0] + std::int64_t(n3) * plan.page_cost[1];
    chunks = int(std::min<std::int64_t>(
        {(tot + plan.target_chunk_bytes - 1) / plan.target_chunk_bytes, opt.max_chunks, n}));
    bytes = page_bytes(L, B, mi) + double(B) * QH * D * 8.0;  // pages + queries + outputs
    CK(cudaStreamSynchronize(s));
  }

  cuda::decode_inputs<2> inputs() const {
    cuda::decode_inputs<2> in;
    in.index.batch = B;
    in.index.seq_len = len.get();
    for (int f = 0; f < 2; ++f)
      in.index.formats[f] = {table.indptr[f].get(), table.slot[f].get(), table.logical[f].get()};
    in.pools[0] = {p8.get(), L8::page_bytes, cap8};
    in.pools[1] = {p3.get(), L3::page_bytes, cap3};
    in.queries = q.get();
    in.softmax_scale = 1.f / std::sqrt(float(D));
    in.cache_seed = 42;
    in.out = out.get();
    in.lse = lse.get();
    return in;
  }

  void decode_tc(cudaStream_t s) {
    die_if(cuda::decode<G, TL>(plan, inputs(), ws.get(), plan.workspace_bytes, s));
  }
  void decode_cc(cudaStream_t s) {
    die_if(cuda::decode<G, TL, cuda::decode_path::cuda_core>(plan, inputs(), ws.get(),
                                                             plan.workspace_bytes, s));
  }

  // What path p needs beyond the stream launch, made once (outside the timed calls).
  void prepare(path p, cudaStream_t s) {
    if (p == path::graph && !graph_tc) graph_tc = graph_exec::capture(s, [&] { decode_tc(s); });
    if (p == path::cuda_core_graph && !graph_cc)
      graph_cc = graph_exec::capture(s, [&] { decode_cc(s); });
    if (p == path::waves3_stream && !have_plan3) {
      const cuda::decode_capacity cap{B, opt.max_chunks, 0, false};
      plan3 = take(cuda::plan_decode<G, TL>(cap, table.counts.data(), B, dev.sms, 3,
                                            opt.min_chunk_kb * 1024, opt.balance_by));
      ws3 = device_array<std::uint8_t>(plan3.workspace_bytes);
      die_if(cuda::decode_workspace_init(plan3, ws3.get(), plan3.workspace_bytes, s));
      have_plan3 = true;
    }
  }

  void launch(path p, cudaStream_t s) {
    switch (p) {
      case path::stream:
        decode_tc(s);
        break;
      case path::graph:
        graph_tc.launch(s);
        break;
      case path::cuda_core_stream:
        decode_cc(s);
        break;
      case path::cuda_core_graph:
        graph_cc.launch(s);
        break;
      case path::waves3_stream:
        die_if(cuda::decode<G, TL>(plan3, inputs(), ws3.get(), plan3.workspace_bytes, s));
        break;
    }
  }
};

template <class G, class Recent = recent, class Stale = stale>
void register_decode(const std::vector<int>& contexts, const std::vector<int>& batches) {
  using C = decode_case<G, Recent, Stale>;
  if (opt.dim != 0 && opt.dim != C::D) return;
  constexpr bool int8r = C::KF::format == storage_format::int8_rotated;
  constexpr bool dense = C::KF::format == storage_format::dense_bf16;
  constexpr bool k4 = C::KT::format == storage_format::tq4;  // Stale: TQ4 keys, TQ3 values
  constexpr bool v2 = C::VT::format == storage_format::tq2;  // Cold: TQ2 values
  constexpr bool k2 = C::KT::format == storage_format::tq2;  // Cold: TQ2 keys too
  constexpr bool own_stale = k4 || v2;  // the mixes of its own Stale (or Cold) tier
  const char* mixes[] = {dense   ? "bf16"
                         : int8r ? "int8r"
                                 : "fp8",
                         k2   ? "tq2"
                         : v2 ? "tq3k_tq2v"
                         : k4 ? "tq4k"
                              : "tq3",
                         k2   ? "tiered_cold"
                         : v2 ? "tiered_cold_v2"
                         : k4 ? (int8r ? "tiered_k4" : "tiered_fp8_k4")
                              : (dense   ? "tiered_bf16"
                                 : int8r ? "tiered_int8r"
                                         : "tiered")};
  std::vector<path> paths{path::stream, path::graph};
  if (opt.compare)
    paths.insert(paths.end(), {path::cuda_core_stream, path::cuda_core_graph, path::waves3_stream});
  const std::string sh = shape(C::QH, C::H, C::D);
  for (int L : contexts)
    for (int B : batches)
      for (int mi = 0; mi < 3; ++mi) {
        if (!opt.mix.empty() && opt.mix != mixes[mi]) continue;
        if (own_stale && mi == 0) continue;  // all-recent pages do not depend on the Stale tier
        if ((int8r || dense) && !own_stale && mi == 1) continue;  // all-Stale: not the recent's
        if (C::page_bytes(L, B, mi) > 40e9) continue;
        const std::string key = bench_name("decode")
                                    .add("shape", sh)
                                    .add("mix", mixes[mi])
                                    .add("L", L)
                                    .add("B", B)
                                    .str();
        for (path p : paths) {
          const bench_name name =
              bench_name("decode").add("shape", sh).add("mix", mixes[mi]).add("path", path_name(p));
          auto* b = benchmark::RegisterBenchmark(
              name.c_str(), [key, mi, p, first = first_time()](benchmark::State& st) {
                const int ctx = int(st.range(0)), batch = int(st.range(1));
                cudaStream_t s = dev.stream;
                C& c = cache.get<C>(key, [&] { return std::make_shared<C>(ctx, batch, mi, s); });
                c.prepare(p, s);
                auto call = [&] { c.launch(p, s); };
                if (first()) warm_up(s, decode_warm, call);
                gpu_timer t(s, dev.flush.get());
                const double us = timed_iterations(st, t, call);
                const double gbps = c.bytes / us * 1e-3;
                st.counters["bytes"] = c.bytes;
                st.counters["GB/s"] = gbps;
                st.counters["frac_copy"] = gbps / dev.copy_gbps;
                st.counters["chunks"] = c.chunks;
              });
          gpu_bench(b, decode_reps)->Args({L, B})->ArgNames({"context", "batch"});
        }
      }
}

// Retier (recent -> stale: "demote", and back: "promote") of whole pages, and append of
// B = 64 new tokens (one per sequence, one layer) into recent-tier pages.
template <class G, class Recent, class Stale>
struct retier_case {
  static constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens;
  using KF = typename Recent::template key_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;
  static constexpr int append_batch = 64;

  int pages = int(std::min<std::size_t>(16384, (std::size_t(1) << 30) / L8::page_bytes));
  device_array<std::uint8_t> p8, p3;
  device_array<std::int32_t> ids, slot, off;
  device_array<float> k, v;
  cuda::retier_inputs down, up;
  cuda::append_inputs app;
  graph_exec app_graph;

  explicit retier_case(cudaStream_t s)
      : p8(L8::page_bytes * std::size_t(pages)), p3(L3::page_bytes * std::size_t(pages)) {
    fill_pages<<<1024, 256, 0, s>>>(p8.get(), p8.size(), 11, 1);
    fill_meta<<<1024, 256, 0, s>>>(p8.get(), L8::page_bytes, L8::key_meta_offset,
                                   std::size_t(2) * H * T, std::uint32_t(pages), 3.f / 448.f, 12);
    std::vector<std::int32_t> id(std::size_t(pages), 0);
    for (int i = 0; i < pages; ++i) id[std::size_t(i)] = i;
    ids = device_array<std::int32_t>(id);
    down.src = {p8.get(), L8::page_bytes, std::uint32_t(pages)};
    down.dst = {p3.get(), L3::page_bytes, std::uint32_t(pages)};
    down.src_slot = ids.get();
    down.dst_slot = ids.get();
    down.pages = pages;
    down.cache_seed = 5;
    up = down;
    up.src = down.dst;
    up.dst = down.src;
    // the stale pages a promote reads: converted once here, whatever the filter runs
    die_if(cuda::retier<G, Recent, Stale>(down, s));
    const std::size_t kn = std::size_t(append_batch) * H * D;
    k = device_array<float>(kn);
    v = device_array<float>(kn);
    fill_floats<<<64, 256, 0, s>>>(k.get(), kn, 1);
    fill_floats<<<64, 256, 0, s>>>(v.get(), kn, 2);
    std::vector<std::int32_t> sl(append_batch), of(append_batch);
    for (int b = 0; b < append_batch; ++b) {
      sl[std::size_t(b)] = b * 37 % pages;
      of[std::size_t(b)] = b % T;
    }
    slot = device_array<std::int32_t>(sl);
    off = device_array<std::int32_t>(of);
    app.k = k.get();
    app.v = v.get();
    app.slot = slot.get();
    app.offset = off.get();
    app.tokens = append_batch;
    app.pool = {p8.get(), L8::page_bytes, std::uint32_t(pages)};
    app_graph = graph_exec::capture(s, [&] { append(s); });
    CK(cudaStreamSynchronize(s));
  }
  void demote(cudaStream_t s) { die_if(cuda::retier<G, Recent, Stale>(down, s)); }
  void promote(cudaStream_t s) { die_if(cuda::retier<G, Stale, Recent>(up, s)); }
  void append(cudaStream_t s) { die_if(cuda::append<G, Recent>(app, s)); }
};

template <class G, class Recent = recent, class Stale = stale>
void register_retier_append() {
  using C = retier_case<G, Recent, Stale>;
  if (opt.dim != 0 && opt.dim != C::D) return;
  const std::string sh = shape(G::q_heads, C::H, C::D);
  auto base = [&](const char* family) {
    return bench_name(family)
        .add("shape", sh)
        .add("recent", C::KF::name)
        .add("stale_key", C::KT::name);
  };
  const std::string key = base("retier_append").str();
  auto get = [key]() -> C& {
    return cache.get<C>(key, [] { return std::make_shared<C>(dev.stream); });
  };
  for (int dir = 0; dir < 2; ++dir) {
    auto* b = benchmark::RegisterBenchmark(
        base("retier").add("dir", dir == 0 ? "demote" : "promote").c_str(),
        [get, dir, first = first_time()](benchmark::State& st) {
          C& c = get();
          cudaStream_t s = dev.stream;
          auto call = [&] { dir == 0 ? c.demote(s) : c.promote(s); };
          if (first()) warm_up(s, retier_warm, call);
          gpu_timer t(s, dev.flush.get());
          const double us = timed_iterations(st, t, call);
          const double in8 = double(C::L8::page_bytes) * c.pages;
          st.counters["pages"] = c.pages;
          st.counters["fp8_bytes"] = in8;  // the recent tier's side (FP8 or int8_rotated)
          st.counters["stale_bytes"] = double(C::L3::page_bytes) * c.pages;
          st.counters["GB/s"] = in8 / us * 1e-3;
        });
    gpu_bench(b, retier_reps);
  }
  for (int graph = 0; graph < 2; ++graph) {
    auto* b = benchmark::RegisterBenchmark(
        base("append").add("path", graph ? "graph" : "stream").c_str(),
        [get, graph, first = first_time()](benchmark::State& st) {
          C& c = get();
          cudaStream_t s = dev.stream;
          auto call = [&] { graph ? c.app_graph.launch(s) : c.append(s); };
          if (first()) warm_up(s, append_warm, call);
          gpu_timer t(s, dev.flush.get());
          timed_iterations(st, t, call);
          st.counters["tokens"] = C::append_batch;
        });
    gpu_bench(b, append_reps)->Args({C::append_batch})->ArgNames({"batch"});
  }
}

void register_all() {
  std::vector<int> ctx =
      opt.quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
  std::vector<int> bat = opt.quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
  if (!opt.ctx.empty()) ctx = opt.ctx;
  if (!opt.batch.empty()) bat = opt.batch;
  const bool base = !opt.int8r_only && !opt.k4_only && !opt.cold_only;
  if (opt.decode && base) {
    register_decode<g256>(ctx, bat);
    register_decode<g128>(ctx, bat);
    register_decode<g64>(ctx, bat);
  }
  if (opt.decode && opt.with_k4) {
    register_decode<g256, recent_int8r, stale_k4>(ctx, bat);
    register_decode<g128, recent_int8r, stale_k4>(ctx, bat);
    register_decode<g64, recent_int8r, stale_k4>(ctx, bat);
  }
  if (opt.decode && opt.with_int8r && !opt.k4_only) {
    register_decode<g256, recent_int8r>(ctx, bat);
    register_decode<g128, recent_int8r>(ctx, bat);
    register_decode<g64, recent_int8r>(ctx, bat);
  }
  if (opt.decode && opt.with_cold) {
    register_decode<g256, recent_int8r, cold_v2>(ctx, bat);
    register_decode<g256, recent_int8r, cold>(ctx, bat);
    register_decode<g128, recent_int8r, cold_v2>(ctx, bat);
    register_decode<g128, recent_int8r, cold>(ctx, bat);
    register_decode<g64, recent_int8r, cold_v2>(ctx, bat);
    register_decode<g64, recent_int8r, cold>(ctx, bat);
  }
  if (opt.decode && opt.with_dense) {
    register_decode<g256, recent_dense>(ctx, bat);
    register_decode<g128, recent_dense>(ctx, bat);
    register_decode<g64, recent_dense>(ctx, bat);
  }
  if (opt.retier && base) {
    register_retier_append<g256>();
    register_retier_append<g128>();
    register_retier_append<g64>();
  }
  if (opt.retier && opt.with_int8r && !opt.k4_only) {
    register_retier_append<g256, recent_int8r>();
    register_retier_append<g128, recent_int8r>();
    register_retier_append<g64, recent_int8r>();
  }
  if (opt.retier && opt.with_cold) {
    register_retier_append<g256, recent_int8r, cold>();
    register_retier_append<g128, recent_int8r, cold>();
    register_retier_append<g64, recent_int8r, cold>();
  }
  if (opt.retier && opt.with_k4) {
    register_retier_append<g256, recent_int8r, stale_k4>();
    register_retier_append<g128, recent_int8r, stale_k4>();
    register_retier_append<g64, recent_int8r, stale_k4>();
  }
}

// The calibrations of the run (its context): the device-to-device copy roofline (2 GiB, read
// + write) and the launch floor of a decode step (an empty split + programmatic merge pair).
void setup(const device_facts& f) {
  dev.sms = f.sms;
  CK(cudaStreamCreate(&dev.stream));
  dev.flush = std::make_unique<l2_flusher>(f.l2_bytes);
  gpu_timer t(dev.stream, dev.flush.get());
  {
    const std::size_t n = std::size_t(2) << 30;
    device_array<std::uint8_t> a(n), b(n);
    fill_pages<<<1024, 256, 0, dev.stream>>>(a.get(), n, 9, 0);
    const double us = median_us(t, dev.stream, 2, 10, [&] {
      CK(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice, dev.stream));
    });
    dev.copy_gbps = 2.0 * double(n) / us * 1e-3;
  }
  const double floor_us = median_us(t, dev.stream, 5, 51, [] { launch_floor_pair(dev.stream); });
  add_context("copy_gbps", dev.copy_gbps, 1);
  add_context("launch_floor_us", floor_us, 2);
  add_context("l2_flush_bytes", std::to_string(dev.flush->bytes()));
  add_context("max_chunks", std::to_string(opt.max_chunks));
  add_context("min_chunk_kb", std::to_string(opt.min_chunk_kb));
  add_context("resident", std::to_string(opt.resident));
  add_context("balance", opt.balance_by == cuda::balance::bytes ? "bytes" : "work");
  add_context("unpack_work", std::to_string(opt.unpack_work));
  add_context("waves", std::to_string(opt.waves));
  say("gpubench_decode: " + f.name + ", " + std::to_string(f.sms) + " SMs, copy " +
      std::to_string(int(dev.copy_gbps)) + " GB/s (read + write), empty split + merge pair " +
      std::to_string(floor_us) + " us");
}

void teardown() {
  cache.clear();
  dev.flush.reset();
  if (dev.stream) cudaStreamDestroy(dev.stream);
}

}  // namespace

int main(int argc, char** argv) {
  auto on = [](bool& b) { return [&b](const std::string&) { b = true; }; };
  auto num = [](const char* name, int& v) {
    return [name, &v](const std::string& s) { v = to_int(name, s); };
  };
  program p;
  p.name = "gpubench_decode";
  p.summary =
      "Mixed-format paged decode (stream and CUDA-graph), retier and append on the GPU, on Google "
      "Benchmark (docs/gpu.md).";
  p.flags = {
      {"--quick", "", "contexts 32K, batches 1 and 8 (default 8K 32K 128K x 1 8 32)",
       on(opt.quick)},
      {"--compare", "",
       "also the CUDA-core split kernel (stream, graph) and the one-wave plan (waves = 3)",
       on(opt.compare)},
      {"--ctx", "L", "only context L (repeatable)",
       [](const std::string& s) { opt.ctx.push_back(to_int("--ctx", s)); }},
      {"--batch", "B", "only batch B (repeatable)",
       [](const std::string& s) { opt.batch.push_back(to_int("--batch", s)); }},
      {"--dim", "D", "only the shape of head_dim D (256, 128, 64)", num("--dim", opt.dim)},
      {"--mix", "M",
       "only mix M: fp8 tq3 tiered | int8r tiered_int8r (--int8r) | tq4k tiered_k4 (--k4) | bf16 "
       "tiered_bf16 (--dense) | tq3k_tq2v tiered_cold_v2 tq2 tiered_cold (--cold)",
       [](const std::string& s) { opt.mix = s; }},
      {"--no-retier", "", "no retier / append benchmarks",
       [](const std::string&) { opt.retier = false; }},
      {"--retier-only", "", "only the retier / append benchmarks",
       [](const std::string&) { opt.decode = false; }},
      {"--max-chunks", "N", "plan: chunks per sequence at most",
       num("--max-chunks", opt.max_chunks)},
      {"--min-chunk-kb", "N", "plan: smallest chunk in KB",
       [](const std::string& s) { opt.min_chunk_kb = to_int("--min-chunk-kb", s); }},
      {"--resident", "N", "plan: resident blocks per SM (0: decode_blocks_per_sm)",
       num("--resident", opt.resident)},
      {"--int8r", "", "also the int8_rotated recent tier", on(opt.with_int8r)},
      {"--int8r-only", "", "only the int8_rotated recent tier",
       [](const std::string&) { opt.with_int8r = opt.int8r_only = true; }},
      {"--k4", "", "also int8_rotated + TQ4-key / TQ3-value tiers", on(opt.with_k4)},
      {"--cold", "", "also int8_rotated + TQ2 (Cold) tiers: TQ3 keys / TQ2 values, TQ2 both",
       on(opt.with_cold)},
      {"--cold-only", "", "only the int8_rotated + TQ2 (Cold) tiers",
       [](const std::string&) { opt.with_cold = opt.cold_only = true; }},
      {"--dense", "", "also dense bf16 recent pages, the control arm (mixes bf16, tiered_bf16)",
       on(opt.with_dense)},
      {"--k4-only", "", "only int8_rotated + TQ4-key / TQ3-value tiers",
       [](const std::string&) { opt.with_k4 = opt.k4_only = true; }},
      {"--balance", "bytes|work", "plan: the cost line's page weights",
       [](const std::string& s) {
         if (s == "bytes") {
           opt.balance_by = cuda::balance::bytes;
         } else if (s == "work") {
           opt.balance_by = cuda::balance::work;
         } else {
           std::fprintf(stderr, "gpubench_decode: --balance bytes|work, got %s\n", s.c_str());
           std::exit(2);
         }
       }},
      {"--unpack-work", "N",
       "plan: an unpack-bound role's (TQ3's) work in percent of an 8-bit one's (0: the codecs')",
       num("--unpack-work", opt.unpack_work)},
      {"--waves", "N", "plan: waves of blocks", num("--waves", opt.waves)},
      {"--shared", "", "every sequence of a batch reads the same pages (a shared prefix)",
       on(opt.shared)},
  };
  p.setup = setup;
  p.register_benchmarks = register_all;
  p.teardown = teardown;
  return run(argc, argv, p);
}
