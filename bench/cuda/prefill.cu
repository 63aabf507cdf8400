// SPDX-License-Identifier: Apache-2.0
// gpubench_prefill [--out FILE.json] [--commit SHA] [--quick] [--mix M] [--chunk C] [--d128]
//                  [--benchmark_* flags]
// The chunked prefill over mixed pages (cuda/prefill.cuh), one sequence: a chunk of C queries,
// causal inside itself, over P cached tokens (kv_len = P + C: the chunk's K/V appended first), as
// bench/gpu/flashinfer_prefill.py times FlashInfer. Shape (24, 4, 256) (Qwen3-like), pages of 16
// and 64 tokens; mixes: all FP8, all TQ3, tiered (page 0 and the newest ~27% FP8, the rest TQ3)
// and int8_rotated + TQ4-key / TQ3-value tiered; chunks 512 and 2048 at P = 32K, and the short
// chunks of speculative verification (1, 4, 8); --d128 adds shape (32, 8, 128) (Llama-3-8B-like,
// pages of 16, chunks 512 and 2048), where a warp's 16 x 128 O takes half the registers. Google
// Benchmark: one benchmark per case, e.g.
// prefill/shape:24x4x256/page_tokens:16/mix:tiered/prefix:32768/chunk:512, 30 repetitions of one
// timed call after 3 warm-up calls, the median reported (bench_support.cuh: L2 flushed before
// each call, the call behind a spin kernel, CUDA-event manual time). Counters: flop (4 C kv d hq
// over the causal kv lengths) and TFLOP/s. bench/gpu/gbench_record.py turns the JSON into the
// prefill record (rows of mix, shape, page_tokens, prefix, chunk, us, tflops).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_support.cuh"
#include "gbench_main.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/prefill.cuh"

namespace {

using namespace tierkv;
using namespace tierkv::bench;

struct options {
  bool quick = false;
  std::string mix;    // --mix M: one mix
  int chunk = 0;      // --chunk C: one chunk length
  bool d128 = false;  // --d128: shape (32, 8, 128) too
};
options opt;

struct device_state {
  cudaStream_t stream = nullptr;
  std::unique_ptr<l2_flusher> flush;
};
device_state dev;
case_cache cache;

constexpr int reps = 30, warm = 3;
constexpr int prefix_tokens = 32768;

template <class G, class Recent, class Stale>
struct prefill_case {
  static constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens, QH = G::q_heads;
  using KF = typename Recent::template key_codec<D>;
  using VF = typename Recent::template value_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, VF>;
  using L3 = page_layout<G, KT, VT>;
  using TL = tiers<Recent, Stale>;

  int chunk;
  device_array<std::uint8_t> p8, p3, ws;
  device_array<std::int32_t> len, qip, indptr[2], slot[2], logical[2];
  device_array<float> q;
  device_array<std::uint16_t> out;
  cuda::prefill_plan plan{};
  cuda::prefill_inputs<2> in;
  double flop = 0;

  prefill_case(const std::string& m, int prefix, int chunk_, cudaStream_t s) : chunk(chunk_) {
    const int kv_len = prefix + chunk;
    const int n = (kv_len + T - 1) / T;
    std::vector<int> page_tier(static_cast<std::size_t>(n));
    const int recent_pages = (n * 27 + 99) / 100 - 1;
    const bool all_recent = m == "fp8" || m == "int8r", all_stale = m == "tq3";
    for (int i = 0; i < n; ++i) {
      int f = (i == 0 || i >= n - recent_pages) ? 0 : 1;
      if (all_recent) f = 0;
      if (all_stale) f = 1;
      page_tier[std::size_t(i)] = f;
    }
    int counts[2] = {0, 0};
    for (int t : page_tier) ++counts[t];
    const std::uint32_t cap8 = std::uint32_t(std::max(1, counts[0]));
    const std::uint32_t cap3 = std::uint32_t(std::max(1, counts[1]));
    p8 = device_array<std::uint8_t>(L8::page_bytes * cap8);
    p3 = device_array<std::uint8_t>(L3::page_bytes * cap3);
    const bool fp8 = KF::format == storage_format::fp8_e4m3;
    fill_pages<<<1024, 256, 0, s>>>(p8.get(), p8.size(), 1 + std::uint64_t(kv_len), fp8);
    fill_pages<<<1024, 256, 0, s>>>(p3.get(), p3.size(), 2 + std::uint64_t(kv_len), 0);
    fill_meta<<<1024, 256, 0, s>>>(p8.get(), L8::page_bytes, L8::key_meta_offset,
                                   std::size_t(2) * H * T, cap8, fp8 ? 3.f / 448.f : 3.f / 127.f,
                                   3);
    fill_meta<<<1024, 256, 0, s>>>(p3.get(), L3::page_bytes, L3::key_meta_offset,
                                   std::size_t(2) * H * T, cap3, std::sqrt(float(D)), 4);
    CK(cudaGetLastError());
    // physical slots shuffled, as an allocator leaves them after churn
    std::mt19937 rng{std::uint32_t(kv_len)};
    std::vector<std::int32_t> sl[2], lg[2];
    for (int f = 0; f < 2; ++f) {
      sl[f].resize(static_cast<std::size_t>(counts[f]));
      std::iota(sl[f].begin(), sl[f].end(), 0);
      std::shuffle(sl[f].begin(), sl[f].end(), rng);
    }
    for (int i = 0; i < n; ++i) lg[page_tier[std::size_t(i)]].push_back(i);
    len = device_array<std::int32_t>(std::vector<std::int32_t>{kv_len});
    qip = device_array<std::int32_t>(std::vector<std::int32_t>{0, chunk});
    for (int f = 0; f < 2; ++f) {
      indptr[f] = device_array<std::int32_t>(std::vector<std::int32_t>{0, counts[f]});
      slot[f] = device_array<std::int32_t>(sl[f]);
      logical[f] = device_array<std::int32_t>(lg[f]);
    }
    const std::size_t qn = std::size_t(chunk) * QH * D;
    q = device_array<float>(qn);
    out = device_array<std::uint16_t>(qn);
    fill_floats<<<256, 256, 0, s>>>(q.get(), qn, 7);
    plan = take(cuda::plan_prefill<G>(1, chunk));
    ws = device_array<std::uint8_t>(plan.workspace_bytes);
    die_if(cuda::prefill_workspace_init(plan, ws.get(), plan.workspace_bytes, s));
    in.index.batch = 1;
    in.index.seq_len = len.get();
    for (int f = 0; f < 2; ++f)
      in.index.formats[f] = {indptr[f].get(), slot[f].get(), logical[f].get()};
    in.pools[0] = {p8.get(), L8::page_bytes, cap8};
    in.pools[1] = {p3.get(), L3::page_bytes, cap3};
    in.queries = q.get();
    in.q_indptr = qip.get();
    in.softmax_scale = 1.f / std::sqrt(float(D));
    in.cache_seed = 0x5eed;
    in.out = out.get();
    in.out_type = cuda::output_type::bf16;
    // attention FLOPs: query j attends prefix + j + 1 tokens; 2 GEMMs of 2 flops per MAC
    flop = 4.0 * double(QH) * D * (double(chunk) * prefix + double(chunk) * (chunk + 1) / 2);
    CK(cudaStreamSynchronize(s));
  }

  void launch(cudaStream_t s) {
    die_if(cuda::prefill<G, TL>(plan, in, ws.get(), plan.workspace_bytes, s));
  }

  void check_device_error(cudaStream_t s) {
    const errc e = take(cuda::prefill_device_error(plan, ws.get(), s));
    if (e != errc::ok) {
      std::fprintf(stderr, "gpubench_prefill: device error %d\n", int(e));
      std::exit(1);
    }
  }
};

using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using int8r_tier = tier<int8_rotated, int8_rotated>;
using tq3_tier = tier<tq3_key, tq3_value>;
using k4_tier = tier<tq4_key, tq3_value>;

template <int T>
using qwen = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<T>>;
using llama = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<16>>;

template <class G, class Recent, class Stale>
void register_mix(const char* mix, int prefix, int chunk) {
  using C = prefill_case<G, Recent, Stale>;
  if ((!opt.mix.empty() && opt.mix != mix) || (opt.chunk != 0 && opt.chunk != chunk)) return;
  const bench_name name = bench_name("prefill")
                              .add("shape", shape(C::QH, C::H, C::D))
                              .add("page_tokens", C::T)
                              .add("mix", mix);
  auto* b = benchmark::RegisterBenchmark(
      name.c_str(),
      [key = name.str(), m = std::string(mix), first = first_time()](benchmark::State& st) {
        const int pre = int(st.range(0)), ch = int(st.range(1));
        cudaStream_t s = dev.stream;
        C& c = cache.get<C>(key + "/" + std::to_string(pre) + "/" + std::to_string(ch),
                            [&] { return std::make_shared<C>(m, pre, ch, s); });
        auto call = [&] { c.launch(s); };
        if (first()) warm_up(s, warm, call);
        gpu_timer t(s, dev.flush.get());
        const double us = timed_iterations(st, t, call);
        c.check_device_error(s);
        st.counters["flop"] = c.flop;
        st.counters["TFLOP/s"] = c.flop / (us * 1e-6) / 1e12;
      });
  gpu_bench(b, reps)->Args({prefix, chunk})->ArgNames({"prefix", "chunk"});
}

template <class G>
void register_pages(const std::vector<int>& chunks, int prefix) {
  for (int c : chunks) {
    register_mix<G, fp8_tier, tq3_tier>("fp8", prefix, c);
    register_mix<G, fp8_tier, tq3_tier>("tq3", prefix, c);
    register_mix<G, fp8_tier, tq3_tier>("tiered", prefix, c);
    register_mix<G, int8r_tier, k4_tier>("int8r", prefix, c);
    register_mix<G, int8r_tier, k4_tier>("tiered_int8r", prefix, c);
  }
}

void register_all() {
  register_pages<qwen<16>>(opt.quick ? std::vector<int>{512} : std::vector<int>{512, 2048, 1, 4, 8},
                           prefix_tokens);
  if (!opt.quick) register_pages<qwen<64>>({512, 2048}, prefix_tokens);
  if (opt.d128)
    register_pages<llama>(opt.quick ? std::vector<int>{512} : std::vector<int>{512, 2048},
                          prefix_tokens);
}

void setup(const device_facts& f) {
  CK(cudaStreamCreate(&dev.stream));
  dev.flush = std::make_unique<l2_flusher>(f.l2_bytes);
  add_context("l2_flush_bytes", std::to_string(dev.flush->bytes()));
}

void teardown() {
  cache.clear();
  dev.flush.reset();
  if (dev.stream) cudaStreamDestroy(dev.stream);
}

}  // namespace

int main(int argc, char** argv) {
  program p;
  p.name = "gpubench_prefill";
  p.summary =
      "Chunked prefill over mixed pages (one sequence, (24, 4, 256); --d128 adds (32, 8, 128)) on "
      "Google Benchmark "
      "(docs/gpu-prefill.md).";
  p.flags = {
      {"--quick", "", "chunk 512 on 16-token pages only",
       [](const std::string&) { opt.quick = true; }},
      {"--mix", "M", "only mix M: fp8 tq3 tiered int8r tiered_int8r",
       [](const std::string& s) { opt.mix = s; }},
      {"--chunk", "C", "only chunk length C (512 2048 1 4 8)",
       [](const std::string& s) { opt.chunk = to_int("--chunk", s); }},
      {"--d128", "", "shape (32, 8, 128) too (pages of 16, chunks 512 and 2048)",
       [](const std::string&) { opt.d128 = true; }},
  };
  p.setup = setup;
  p.register_benchmarks = register_all;
  p.teardown = teardown;
  return run(argc, argv, p);
}
