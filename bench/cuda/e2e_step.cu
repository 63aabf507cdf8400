// SPDX-License-Identifier: Apache-2.0
// Host cost of one scheduler step of cuda::tiered_cache at serving scale: `batch` sequences of
// `context` tokens, 32 layers, (32, 8, 128) heads, int8_rotated Recent/Anchor pages with TQ4
// Stale keys and TQ3 Stale values. A step is begin_step (1 new token each), 32 x (append +
// decode), end_step (page mass of mass_layers layers -> policy, retier batch on the side stream).
// The stream is synchronized before end_step, so end_step's time is its own host work and not a
// wait for the GPU; begin_step and the launches never wait. Also reported: the GPU time of the
// step's forward work (CUDA events), and the host<->device bytes the façade moved per step.
//
//   gpubench_e2e_step [batch=256] [context=4096] [steps=30] [mass_layers=1] [--out FILE.json]
//                     [--commit SHA] [--benchmark_* flags]
// Google Benchmark: one benchmark, e2e_step/batch:B/context:L/steps:S/mass_layers:M; the first
// two thirds of the steps run untimed (the prefill's demotions), each of the last third is one
// iteration whose manual time is the step's host time (begin_step + launches + end_step, a
// steady clock; this one is not a kernel timing, so no L2 flush or spin kernel). Counters: the
// means of the measured steps (host_us_*, gpu_forward_us, bytes per step, conversions) and the
// pages in use. bench/gpu/gbench_record.py turns the JSON into the old one-line record.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
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
using G = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<16>>;
using TL = tiers<tier<int8_rotated, int8_rotated>, tier<tq4_key, tq3_value>>;
using cache = tierkv::cuda::tiered_cache<G, TL>;
using clock_type = std::chrono::steady_clock;

int arg_batch = 256, arg_context = 4096, arg_steps = 30, arg_mass_layers = 1;
int positional_seen = 0;

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

void e2e_step(benchmark::State& st) {
  const int batch = int(st.range(0)), context = int(st.range(1)), steps = int(st.range(2)),
            mass_layers = int(st.range(3));
  const int measured = std::max(1, steps / 3);  // the last third, one iteration each
  constexpr int layers = 32, T = G::page_tokens;
  const int pages = (context + steps + T - 1) / T;
  const std::uint32_t total_pages = std::uint32_t(batch) * std::uint32_t(pages) * layers;

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cache::options opt;
  opt.storage.num_layers = layers;
  opt.storage.max_sequences = std::uint32_t(batch);
  // Room for every page in either tier: this measures the step, not make_room (whose candidate
  // scan is O(pages) a call, docs/gpu-cache.md).
  opt.storage.pages_per_tier = {total_pages + 1024, total_pages + 1024};
  opt.storage.codec_seed = 5;
  opt.max_batch = batch;
  opt.max_pages = pages;
  opt.max_step_tokens = 65536;
  opt.max_retier_pages = 8192;
  opt.mass_layers_per_step = mass_layers;
  {
    auto c_ptr = bench::take(cache::create(opt, stream));
    auto& c = *c_ptr;

    std::vector<seq_id> seqs;
    for (int b = 0; b < batch; ++b) seqs.push_back(c.create_sequence().value());
    const std::size_t vec = std::size_t(G::kv_heads) * G::head_dim;
    bench::device_array<float> k(65536 * vec), v(65536 * vec);
    const std::size_t qn = std::size_t(batch) * G::q_heads * G::head_dim;
    bench::device_array<float> q(qn), out(qn);
    bench::fill_floats<<<1024, 256, 0, stream>>>(k.get(), 65536 * vec, 1);
    bench::fill_floats<<<1024, 256, 0, stream>>>(v.get(), 65536 * vec, 2);
    bench::fill_floats<<<1024, 256, 0, stream>>>(q.get(), qn, 3);

    // Prefill every sequence to `context` tokens in chunks of <= 65536 tokens a step.
    std::uint64_t step = 0;
    const int per_step = std::max(1, std::min(context, 65536 / batch));
    for (int done = 0; done < context; done += per_step) {
      const int n = std::min(per_step, context - done);
      std::vector<std::int32_t> counts(std::size_t(batch), n);
      bench::die_if(c.begin_step(seqs, counts));
      for (int l = 0; l < layers; ++l)
        bench::die_if(c.append(l, k.get(), v.get(), tierkv::cuda::input_type::f32));
      bench::die_if(c.end_step(++step, true).error_status());
    }
    CK(cudaStreamSynchronize(stream));
    std::fprintf(stderr, "prefilled %d x %d tokens in %llu steps\n", batch, context,
                 (unsigned long long)step);

    // Decode steps: the first few demote most of the prefill (retier batches), then steady state.
    std::vector<std::int32_t> ones(std::size_t(batch), 1);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double begin_us = 0, launch_us = 0, end_us = 0, gpu_ms = 0;
    std::uint64_t converted = 0, converted_measured = 0;
    const auto bytes0 = c.transfers();
    // One step; returns its host time (begin_step + launches + end_step) in microseconds.
    auto run_step = [&](bool measure) {
      auto t0 = clock_type::now();
      bench::die_if(c.begin_step(seqs, ones));
      const double b_us = us_since(t0);
      CK(cudaEventRecord(e0, stream));
      t0 = clock_type::now();
      for (int l = 0; l < layers; ++l) {
        bench::die_if(c.append(l, k.get(), v.get(), tierkv::cuda::input_type::f32));
        bench::die_if(c.decode(l, q.get(), tierkv::cuda::query_type::f32, out.get()));
      }
      const double l_us = us_since(t0);
      CK(cudaEventRecord(e1, stream));
      CK(cudaStreamSynchronize(stream));
      t0 = clock_type::now();
      auto done = c.end_step(++step, false);
      const double e_us = us_since(t0);
      bench::die_if(done.error_status());
      converted += done.value().converted;
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (measure) {
        begin_us += b_us;
        launch_us += l_us;
        end_us += e_us;
        gpu_ms += ms;
        converted_measured += done.value().converted;
      }
      return b_us + l_us + e_us;
    };
    for (int s = 0; s < steps - measured; ++s) run_step(false);
    for (auto _ : st) st.SetIterationTime(run_step(true) * 1e-6);
    bench::die_if(c.device_error());
    const auto bytes1 = c.transfers();
    const double m = measured;
    st.counters["measured_steps"] = m;
    st.counters["layers"] = layers;
    st.counters["host_us_begin_step"] = begin_us / m;
    st.counters["host_us_launch_32_layers"] = launch_us / m;
    st.counters["host_us_end_step"] = end_us / m;
    st.counters["host_us_per_step"] = (begin_us + launch_us + end_us) / m;
    st.counters["gpu_forward_us"] = 1000.0 * gpu_ms / m;
    st.counters["h2d_metadata_bytes_per_step"] =
        double(bytes1.h2d_metadata_bytes - bytes0.h2d_metadata_bytes) / steps;
    st.counters["d2h_metadata_bytes_per_step"] =
        double(bytes1.d2h_metadata_bytes - bytes0.d2h_metadata_bytes) / steps;
    st.counters["page_bytes_per_step"] = double(bytes1.page_bytes - bytes0.page_bytes) / steps;
    st.counters["conversions"] = double(converted);
    st.counters["conversions_per_measured_step"] = double(converted_measured) / m;
    st.counters["tier0_pages_used"] =
        double(opt.storage.pages_per_tier[0] - c.storage().free_pages(0));
    st.counters["tier1_pages_used"] =
        double(opt.storage.pages_per_tier[1] - c.storage().free_pages(1));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  CK(cudaStreamDestroy(stream));
}

void register_all() {
  const int measured = std::max(1, arg_steps / 3);
  benchmark::RegisterBenchmark("e2e_step/geometry:32x8x128/page_tokens:16", e2e_step)
      ->Args({arg_batch, arg_context, arg_steps, arg_mass_layers})
      ->ArgNames({"batch", "context", "steps", "mass_layers"})
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->Iterations(measured);
}

}  // namespace

int main(int argc, char** argv) {
  bench::program p;
  p.name = "gpubench_e2e_step";
  p.summary =
      "Host cost of one cuda::tiered_cache scheduler step at serving scale (32 layers, "
      "(32, 8, 128), int8_rotated + TQ4-key / TQ3-value tiers), on Google Benchmark "
      "(docs/gpu-cache.md).";
  p.positional_help = "[batch=256] [context=4096] [steps=30] [mass_layers=1]";
  p.positional = [](const std::string& s) {
    int* slots[] = {&arg_batch, &arg_context, &arg_steps, &arg_mass_layers};
    if (positional_seen >= 4) {
      std::fprintf(stderr, "gpubench_e2e_step: at most 4 positional arguments\n");
      std::exit(2);
    }
    *slots[positional_seen++] = bench::to_int("gpubench_e2e_step argument", s);
  };
  p.register_benchmarks = register_all;
  return bench::run(argc, argv, p);
}
