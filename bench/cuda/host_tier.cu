// SPDX-License-Identifier: Apache-2.0
// gpubench_host_tier [context=131072] [--out FILE.json] [--commit SHA] [--benchmark_* flags]:
// the host tier of cuda::tiered_cache (cache/host_tier.cuh, issue 55). One sequence of `context`
// tokens, 16 layers of (24, 4, 256), pages of 16 tokens, is offloaded to pinned host memory and
// restored (format:tierkv: the recommended tiers, int8_rotated Recent / Anchor, TQ4 keys and TQ3
// values Stale, its pages demoted by the default policy after the prefill), against the same
// sequence in BF16 pages restored by the same batch copy (format:bf16, bf16_restore below: the
// engines' offload of uncompressed pages); each with its copies on the SMs (path:kernel) or on
// the copy engines (path:copy_engines, cudaMemcpyBatchAsync). Plus the measured copy roofline of
// this machine: one cudaMemcpyAsync of 1 GiB pinned host -> device and device -> host
// (copy/dir:h2d, copy/dir:d2h). The restore's copies go out in chunks of `chunk` pages as its page
// table is built (options:: host_restore_chunk; 1 << 30: one launch at the end, no overlap). An
// iteration is offload + restore; its manual time is the restore's wall time (host work, then the
// copy, until the copy's event: what a prefix hit waits for). Counters (means over the iterations):
// restore_ms (= the manual time), restore_gpu_ms (events on the cache's stream from before the call
// to the copy's end, await_restore), restore_host_ms (the
// call's host time: page table, pool allocation, copy list), offload_ms (wall, the same way),
// parked_bytes (the host range of one conversation), page_bytes (the pages alone), restore_gbps =
// page_bytes / restore_ms. Checked every iteration: the restored sequence exports to the bytes it
// exported before the first offload (exit status 2 if not).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_support.cuh"
#include "gbench_main.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/tiered_cache.cuh"

namespace {

using namespace tierkv;
using G = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<16>>;
using rec_tiers = tiers<tier<int8_rotated, int8_rotated>, tier<tq4_key, tq3_value>>;
using clock_type = std::chrono::steady_clock;
constexpr int layers = 16;

int arg_context = 131072;
int positional_seen = 0;
bool checks_failed = false;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

void offload_restore(benchmark::State& st) {
  using cache = tierkv::cuda::tiered_cache<G, rec_tiers>;
  const auto path =
      st.range(0) == 0 ? tierkv::cuda::copy_path::kernel : tierkv::cuda::copy_path::copy_engines;
  const int context = arg_context, T = G::page_tokens;
  const int pages = (context + T - 1) / T;
  const std::uint32_t total = std::uint32_t(pages) * layers + 1024;

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  typename cache::options opt;
  opt.storage.num_layers = layers;
  opt.storage.max_sequences = 2;
  opt.storage.pages_per_tier = {total, total};
  opt.storage.codec_seed = 5;
  opt.max_batch = 1;
  opt.max_pages = pages;
  opt.max_step_tokens = 8192;
  opt.max_retier_pages = 16384;
  opt.host_copy = path;
  opt.host_restore_chunk = int(st.range(1));
  // The host pool: one conversation with every page at the larger tier's size, plus the copy
  // list (24 B a page), each page's 16-byte alignment, and slack.
  using S = typename cache::storage_type;
  constexpr std::size_t largest =
      std::max(S::template layout<0>::page_bytes, S::template layout<1>::page_bytes);
  opt.host_pool_bytes = std::uint64_t(pages) * layers * (largest + 16 + 24) + (8u << 20);
  {
    auto c_ptr = bench::take(cache::create(opt, stream));
    auto& c = *c_ptr;
    seq_id s = c.create_sequence().value();
    const std::size_t vec = std::size_t(G::kv_heads) * G::head_dim;
    bench::device_array<float> k(8192 * vec), v(8192 * vec);
    bench::fill_floats<<<1024, 256, 0, stream>>>(k.get(), 8192 * vec, 1);
    bench::fill_floats<<<1024, 256, 0, stream>>>(v.get(), 8192 * vec, 2);
    std::uint64_t step = 0;
    for (int done = 0; done < context; done += 8192) {
      const std::int32_t n = std::min(8192, context - done);
      bench::die_if(c.begin_step(std::vector<seq_id>{s}, std::vector<std::int32_t>{n}));
      for (int l = 0; l < layers; ++l)
        bench::die_if(c.append(l, k.get(), v.get(), tierkv::cuda::input_type::f32));
      bench::die_if(c.end_step(++step, true).error_status());
    }
    // Steps without new tokens until the policy's demotions are done (max_retier_pages a step).
    for (int i = 0; i < 2 * layers * pages / opt.max_retier_pages + 2; ++i) {
      bench::die_if(c.begin_step(std::vector<seq_id>{s}, std::vector<std::int32_t>{0}));
      bench::die_if(c.end_step(++step, true).error_status());
    }
    bench::die_if(c.drain());
    const auto reference = bench::take(c.export_pages(s));
    const double stale = 1.0 - double(opt.storage.pages_per_tier[0] - c.storage().free_pages(0)) /
                                   (double(pages) * layers);

    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double restore_ms = 0, restore_gpu_ms = 0, restore_host_ms = 0, offload_ms = 0;
    std::uint64_t parked_bytes = 0, page_bytes = 0;
    int n = 0;
    for (auto _ : st) {
      auto t0 = clock_type::now();
      const auto id = bench::take(c.offload(s));
      CK(cudaStreamSynchronize(stream));
      offload_ms += ms_since(t0);
      parked_bytes = c.host_stats().used_bytes;
      const auto moved0 = c.host_stats().bytes_restored;
      t0 = clock_type::now();
      CK(cudaEventRecord(e0, stream));
      s = bench::take(c.restore(id));
      const double host = ms_since(t0);
      bench::die_if(c.await_restore(s));  // the copy runs on the host tier's stream
      CK(cudaEventRecord(e1, stream));
      CK(cudaEventSynchronize(e1));
      const double wall = ms_since(t0);
      float gpu = 0;
      CK(cudaEventElapsedTime(&gpu, e0, e1));
      page_bytes = c.host_stats().bytes_restored - moved0;
      restore_ms += wall;
      restore_gpu_ms += gpu;
      restore_host_ms += host;
      ++n;
      st.SetIterationTime(wall * 1e-3);
      if (bench::take(c.export_pages(s)) != reference) checks_failed = true;
    }
    st.counters["restore_ms"] = restore_ms / n;
    st.counters["restore_gpu_ms"] = restore_gpu_ms / n;
    st.counters["restore_host_ms"] = restore_host_ms / n;
    st.counters["offload_ms"] = offload_ms / n;
    st.counters["parked_bytes"] = double(parked_bytes);
    st.counters["page_bytes"] = double(page_bytes);
    st.counters["restore_gbps"] = double(page_bytes) / (restore_ms / n) * 1e-6;
    st.counters["stale_page_share"] = stale;
    st.counters["context"] = context;
    st.counters["layers"] = layers;
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  CK(cudaStreamDestroy(stream));
}

// The control: the same sequence in BF16 pages (16 x 4 x 256 x 2 x 2 B = 64 KiB each, the
// engines' paged layout), restored by the same batch copy from pinned memory into a device pool
// at scattered slots (the list built in the timed region, as the host tier builds its own; no
// page table to rebuild, which favours the control).
void bf16_restore(benchmark::State& st) {
  const auto path =
      st.range(0) == 0 ? tierkv::cuda::copy_path::kernel : tierkv::cuda::copy_path::copy_engines;
  constexpr std::size_t page = std::size_t(G::page_tokens) * G::kv_heads * G::head_dim * 2 * 2;
  const std::size_t n = std::size_t((arg_context + G::page_tokens - 1) / G::page_tokens) * layers;
  std::uint8_t *host = nullptr, *dev = nullptr;
  tierkv::cuda::page_copy* list = nullptr;
  CK(cudaMallocHost(reinterpret_cast<void**>(&host), n * page));
  CK(cudaMallocHost(reinterpret_cast<void**>(&list), n * sizeof(tierkv::cuda::page_copy)));
  CK(cudaMalloc(reinterpret_cast<void**>(&dev), n * page));
  std::memset(host, 3, n * page);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  double total = 0;
  for (auto _ : st) {
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < n; ++i)  // slot i * 7919 mod n: a scattered, full permutation
      list[i] = {host + i * page, dev + (i * 7919 % n) * page, page};
    bench::die_if(tierkv::cuda::copy_pages({list, n}, path, stream));
    CK(cudaStreamSynchronize(stream));
    const double wall = ms_since(t0);
    st.SetIterationTime(wall * 1e-3);
    total += wall;
  }
  st.counters["restore_ms"] = total / double(st.iterations());
  st.counters["page_bytes"] = double(n * page);
  st.counters["restore_gbps"] = double(n * page) / (total / double(st.iterations())) * 1e-6;
  CK(cudaStreamDestroy(stream));
  CK(cudaFree(dev));
  CK(cudaFreeHost(list));
  CK(cudaFreeHost(host));
}

// One 1 GiB cudaMemcpyAsync between pinned host memory and the device: the copy roofline.
void copy_roofline(benchmark::State& st) {
  const bool h2d = st.range(0) == 0;
  constexpr std::size_t bytes = std::size_t(1) << 30;
  void *host = nullptr, *dev = nullptr;
  CK(cudaMallocHost(&host, bytes));
  CK(cudaMalloc(&dev, bytes));
  std::memset(host, 1, bytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  double total = 0;
  int n = 0;
  for (auto _ : st) {
    CK(cudaEventRecord(e0, stream));
    CK(cudaMemcpyAsync(h2d ? dev : host, h2d ? host : dev, bytes,
                       h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream));
    CK(cudaEventRecord(e1, stream));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    st.SetIterationTime(ms * 1e-3);
    total += ms;
    ++n;
  }
  st.counters["gbps"] = double(bytes) / (total / n) * 1e-6;
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(stream));
  CK(cudaFree(dev));
  CK(cudaFreeHost(host));
}

void register_all() {
  for (int dir = 0; dir < 2; ++dir)
    benchmark::RegisterBenchmark(dir == 0 ? "copy/dir:h2d" : "copy/dir:d2h", copy_roofline)
        ->Arg(dir)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(10);
  // restore_chunk: pages a launch (host_restore_chunk); 1 << 30 = one launch after the whole
  // page table is built (no overlap)
  for (int path = 0; path < 2; ++path) {
    const std::string p = path == 0 ? "kernel" : "copy_engines";
    for (int chunk : {1 << 30, 32768, 8192, 2048})
      benchmark::RegisterBenchmark(
          ("host_tier/format:tierkv/path:" + p + "/chunk:" + std::to_string(chunk)).c_str(),
          offload_restore)
          ->Args({path, chunk})
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(5);
    benchmark::RegisterBenchmark(("host_tier/format:bf16/path:" + p).c_str(), bf16_restore)
        ->Args({path, 0})
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(5);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::program p;
  p.name = "gpubench_host_tier";
  p.summary =
      "cuda::tiered_cache's host tier: offload and restore of one long sequence (16 layers of "
      "(24, 4, 256)) in the recommended tiers and in BF16 pages, against the pinned copy rate "
      "(docs/gpu-cache.md, \"Host tier\").";
  p.positional_help = "[context=131072]";
  p.positional = [](const std::string& s) {
    if (positional_seen++ >= 1) {
      std::fprintf(stderr, "gpubench_host_tier: at most 1 positional argument\n");
      std::exit(2);
    }
    arg_context = bench::to_int("gpubench_host_tier context", s);
  };
  p.register_benchmarks = register_all;
  p.exit_status = [] { return checks_failed ? 2 : 0; };
  return bench::run(argc, argv, p);
}
