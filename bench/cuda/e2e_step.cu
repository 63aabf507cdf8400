// SPDX-License-Identifier: Apache-2.0
// Host cost of one scheduler step of cuda::tiered_cache at serving scale: `batch` sequences of
// `context` tokens, 32 layers, (32, 8, 128) heads, int8_rotated Recent/Anchor pages with TQ4
// Stale keys and TQ3 Stale values. A step is begin_step (1 new token each), 32 x (append +
// decode), end_step (page mass of mass_layers layers -> policy, retier batch on the side stream).
// The stream is synchronized before end_step, so end_step's time is its own host work and not a
// wait for the GPU; begin_step and the launches never wait. Also reported: the GPU time of the
// step's forward work (CUDA events), and the host<->device bytes the façade moved per step.
//
//   gpubench_e2e_step [batch=256] [context=4096] [steps=30] [mass_layers=1]
// One JSON object per line.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_support.cuh"
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

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : 256;
  const int context = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 30;
  const int mass_layers = argc > 4 ? std::atoi(argv[4]) : 1;
  constexpr int layers = 32, T = G::page_tokens;
  const int pages = (context + steps + T - 1) / T;
  const std::uint32_t total_pages = std::uint32_t(batch) * std::uint32_t(pages) * layers;

  cudaStream_t stream;
  bench::die_if(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
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
  auto made = cache::create(opt, stream);
  bench::die_if(made.error_status());
  auto& c = *made.value();

  std::vector<seq_id> seqs;
  for (int b = 0; b < batch; ++b) seqs.push_back(c.create_sequence().value());
  const std::size_t vec = std::size_t(G::kv_heads) * G::head_dim;
  float *k, *v, *q, *out;
  bench::die_if(cudaMalloc(&k, 65536 * vec * sizeof(float)), "k");
  bench::die_if(cudaMalloc(&v, 65536 * vec * sizeof(float)), "v");
  const std::size_t qn = std::size_t(batch) * G::q_heads * G::head_dim;
  bench::die_if(cudaMalloc(&q, qn * sizeof(float)), "q");
  bench::die_if(cudaMalloc(&out, qn * sizeof(float)), "out");
  bench::fill_floats<<<1024, 256, 0, stream>>>(k, 65536 * vec, 1);
  bench::fill_floats<<<1024, 256, 0, stream>>>(v, 65536 * vec, 2);
  bench::fill_floats<<<1024, 256, 0, stream>>>(q, qn, 3);

  // Prefill every sequence to `context` tokens in chunks of <= 65536 tokens a step.
  std::uint64_t step = 0;
  const int per_step = std::max(1, std::min(context, 65536 / batch));
  for (int done = 0; done < context; done += per_step) {
    const int n = std::min(per_step, context - done);
    std::vector<std::int32_t> counts(std::size_t(batch), n);
    bench::die_if(c.begin_step(seqs, counts));
    for (int l = 0; l < layers; ++l)
      bench::die_if(c.append(l, k, v, tierkv::cuda::input_type::f32));
    bench::die_if(c.end_step(++step, true).error_status());
  }
  bench::die_if(cudaStreamSynchronize(stream), "prefill");
  std::fprintf(stderr, "prefilled %d x %d tokens in %llu steps\n", batch, context,
               (unsigned long long)step);

  // Decode steps: the first few demote most of the prefill (retier batches), then steady state.
  std::vector<std::int32_t> ones(std::size_t(batch), 1);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  double begin_us = 0, launch_us = 0, end_us = 0, gpu_ms = 0;
  int measured = 0;
  std::uint64_t converted = 0, converted_measured = 0;
  const auto bytes0 = c.transfers();
  for (int s = 0; s < steps; ++s) {
    const bool measure = s >= steps - std::max(1, steps / 3);  // the last third
    auto t0 = clock_type::now();
    bench::die_if(c.begin_step(seqs, ones));
    const double b_us = us_since(t0);
    cudaEventRecord(e0, stream);
    t0 = clock_type::now();
    for (int l = 0; l < layers; ++l) {
      bench::die_if(c.append(l, k, v, tierkv::cuda::input_type::f32));
      bench::die_if(c.decode(l, q, tierkv::cuda::query_type::f32, out));
    }
    const double l_us = us_since(t0);
    cudaEventRecord(e1, stream);
    bench::die_if(cudaStreamSynchronize(stream), "step");
    t0 = clock_type::now();
    auto st = c.end_step(++step, false);
    const double e_us = us_since(t0);
    bench::die_if(st.error_status());
    converted += st.value().converted;
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (measure) {
      begin_us += b_us;
      launch_us += l_us;
      end_us += e_us;
      gpu_ms += ms;
      converted_measured += st.value().converted;
      ++measured;
    }
  }
  bench::die_if(c.device_error());
  const auto bytes1 = c.transfers();
  std::printf(
      "{\"bench\": \"e2e_step\", \"geometry\": \"(32,8,128) page 16\", \"tiers\": "
      "\"int8_rotated + tq4k/tq3v\", \"batch\": %d, \"layers\": %d, \"context\": %d, "
      "\"mass_layers_per_step\": %d, \"measured_steps\": %d, \"host_us_begin_step\": %.1f, "
      "\"host_us_launch_32_layers\": %.1f, \"host_us_end_step\": %.1f, \"host_us_per_step\": %.1f, "
      "\"gpu_forward_us\": %.1f, \"h2d_metadata_bytes_per_step\": %.0f, "
      "\"d2h_metadata_bytes_per_step\": %.0f, \"page_bytes_per_step\": %.0f, "
      "\"conversions\": %llu, \"conversions_per_measured_step\": %.1f, \"tier0_pages_used\": %llu, "
      "\"tier1_pages_used\": %llu}\n",
      batch, layers, context, mass_layers, measured, begin_us / measured, launch_us / measured,
      end_us / measured, (begin_us + launch_us + end_us) / measured, 1000.0 * gpu_ms / measured,
      double(bytes1.h2d_metadata_bytes - bytes0.h2d_metadata_bytes) / steps,
      double(bytes1.d2h_metadata_bytes - bytes0.d2h_metadata_bytes) / steps,
      double(bytes1.page_bytes - bytes0.page_bytes) / steps, (unsigned long long)converted,
      double(converted_measured) / measured,
      (unsigned long long)(opt.storage.pages_per_tier[0] - c.storage().free_pages(0)),
      (unsigned long long)(opt.storage.pages_per_tier[1] - c.storage().free_pages(1)));
  return 0;
}
