// SPDX-License-Identifier: Apache-2.0
// gpubench_prefill --out FILE.json [--commit SHA] [--quick] [--mix M] [--chunk C]
// The chunked prefill over mixed pages (cuda/prefill.cuh), one sequence: a chunk of C queries,
// causal inside itself, over P cached tokens (kv_len = P + C: the chunk's K/V appended first), as
// bench/gpu/flashinfer_prefill.py times FlashInfer. Shape (24, 4, 256) (Qwen3-like), pages of 16
// and 64 tokens; mixes: all FP8, all TQ3, tiered (page 0 and the newest ~27% FP8, the rest TQ3)
// and int8_rotated + TQ4-key / TQ3-value tiered; chunks 512 and 2048 at P = 32K, and the short
// chunks of speculative verification (1, 4, 8). Median of 30 CUDA-event-timed calls, each behind
// a spin kernel (GPU time, not launch latency). Reports µs and the attention TFLOP/s (4 C kv d hq
// over the causal kv lengths).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_support.cuh"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/prefill.cuh"

using namespace tierkv;
using namespace tierkv::bench;

namespace {

std::string rows_json;
std::string only_mix;  // --mix M: one mix
int only_chunk = 0;    // --chunk C: one chunk length

template <class G, class Recent, class Stale>
void bench_mix(const char* mix, int prefix, int chunk, cudaStream_t s) {
  constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens, QH = G::q_heads;
  using KF = typename Recent::template key_codec<D>;
  using VF = typename Recent::template value_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, VF>;
  using L3 = page_layout<G, KT, VT>;
  if ((!only_mix.empty() && only_mix != mix) || (only_chunk != 0 && only_chunk != chunk)) return;
  const int kv_len = prefix + chunk;
  const int n = (kv_len + T - 1) / T;
  const std::string m = mix;
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
  std::uint8_t *p8 = nullptr, *p3 = nullptr;
  CK(cudaMalloc(&p8, L8::page_bytes * cap8));
  CK(cudaMalloc(&p3, L3::page_bytes * cap3));
  const bool fp8 = KF::format == storage_format::fp8_e4m3;
  fill_pages<<<1024, 256, 0, s>>>(p8, L8::page_bytes * cap8, 1 + std::uint64_t(kv_len), fp8);
  fill_pages<<<1024, 256, 0, s>>>(p3, L3::page_bytes * cap3, 2 + std::uint64_t(kv_len), 0);
  fill_meta<<<1024, 256, 0, s>>>(p8, L8::page_bytes, L8::key_meta_offset, std::size_t(2) * H * T,
                                 cap8, fp8 ? 3.f / 448.f : 3.f / 127.f, 3);
  fill_meta<<<1024, 256, 0, s>>>(p3, L3::page_bytes, L3::key_meta_offset, std::size_t(2) * H * T,
                                 cap3, std::sqrt(float(D)), 4);
  CK(cudaGetLastError());
  // physical slots shuffled, as an allocator leaves them after churn
  std::mt19937 rng{std::uint32_t(kv_len)};
  std::vector<std::int32_t> slot[2], logical[2];
  for (int f = 0; f < 2; ++f) {
    std::vector<std::int32_t> perm(static_cast<std::size_t>(counts[f]));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    slot[f] = perm;
  }
  for (int i = 0; i < n; ++i) logical[page_tier[std::size_t(i)]].push_back(i);
  std::int32_t *d_len, *d_qip, *d_ip[2], *d_slot[2], *d_log[2];
  const std::int32_t len_h = kv_len, qip_h[2] = {0, chunk};
  CK(cudaMalloc(&d_len, sizeof(int)));
  CK(cudaMemcpy(d_len, &len_h, sizeof(int), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&d_qip, 2 * sizeof(int)));
  CK(cudaMemcpy(d_qip, qip_h, 2 * sizeof(int), cudaMemcpyHostToDevice));
  for (int f = 0; f < 2; ++f) {
    const std::int32_t ip[2] = {0, counts[f]};
    CK(cudaMalloc(&d_ip[f], 2 * sizeof(int)));
    CK(cudaMemcpy(d_ip[f], ip, 2 * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_slot[f], sizeof(int) * std::max(1, counts[f])));
    CK(cudaMalloc(&d_log[f], sizeof(int) * std::max(1, counts[f])));
    if (counts[f] > 0) {
      CK(cudaMemcpy(d_slot[f], slot[f].data(), sizeof(int) * std::size_t(counts[f]),
                    cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_log[f], logical[f].data(), sizeof(int) * std::size_t(counts[f]),
                    cudaMemcpyHostToDevice));
    }
  }
  float* q = nullptr;
  std::uint16_t* out = nullptr;
  CK(cudaMalloc(&q, sizeof(float) * std::size_t(chunk) * QH * D));
  CK(cudaMalloc(&out, sizeof(std::uint16_t) * std::size_t(chunk) * QH * D));
  fill_floats<<<256, 256, 0, s>>>(q, std::size_t(chunk) * QH * D, 7);
  auto plan = cuda::plan_prefill<G>(1, chunk);
  die_if(plan.error_status());
  void* ws = nullptr;
  CK(cudaMalloc(&ws, plan->workspace_bytes));
  die_if(cuda::prefill_workspace_init(*plan, ws, plan->workspace_bytes, s));
  cuda::prefill_inputs<2> in;
  in.index.batch = 1;
  in.index.seq_len = d_len;
  for (int f = 0; f < 2; ++f) in.index.formats[f] = {d_ip[f], d_slot[f], d_log[f]};
  in.pools[0] = {p8, L8::page_bytes, cap8};
  in.pools[1] = {p3, L3::page_bytes, cap3};
  in.queries = q;
  in.q_indptr = d_qip;
  in.softmax_scale = 1.f / std::sqrt(float(D));
  in.cache_seed = 0x5eed;
  in.out = out;
  in.out_type = cuda::output_type::bf16;
  using TL = tiers<Recent, Stale>;
  for (int w = 0; w < 3; ++w) die_if(cuda::prefill<G, TL>(*plan, in, ws, plan->workspace_bytes, s));
  CK(cudaStreamSynchronize(s));
  std::vector<float> times;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int r = 0; r < 30; ++r) {
    spin(s);
    CK(cudaEventRecord(a, s));
    die_if(cuda::prefill<G, TL>(*plan, in, ws, plan->workspace_bytes, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    times.push_back(ms * 1000.f);
  }
  std::sort(times.begin(), times.end());
  const double us = times[times.size() / 2];
  auto err = cuda::prefill_device_error(*plan, ws, s);
  die_if(err.error_status());
  if (*err != errc::ok) {
    std::fprintf(stderr, "gpubench_prefill: device error %d\n", int(*err));
    std::exit(1);
  }
  // attention FLOPs: query j attends prefix + j + 1 tokens; 2 GEMMs of 2 flops per MAC
  const double macs = double(QH) * D * (double(chunk) * prefix + double(chunk) * (chunk + 1) / 2);
  const double tflops = 4.0 * macs / (us * 1e-6) / 1e12;
  std::printf("prefill %-13s %3d/%d/%3d p%-2d prefix %6d chunk %5d: %9.1f us  %6.1f TFLOP/s\n", mix,
              QH, H, D, T, prefix, chunk, us, tflops);
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      "%s{\"mix\":\"%s\",\"q_heads\":%d,\"kv_heads\":%d,\"head_dim\":%d,\"page_tokens\":%d,"
      "\"prefix\":%d,\"chunk\":%d,\"us\":%.2f,\"tflops\":%.2f}",
      rows_json.empty() ? "" : ",", mix, QH, H, D, T, prefix, chunk, us, tflops);
  rows_json += buf;
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  for (void* p :
       {static_cast<void*>(p8), static_cast<void*>(p3), static_cast<void*>(q),
        static_cast<void*>(out), ws, static_cast<void*>(d_len), static_cast<void*>(d_qip)})
    CK(cudaFree(p));
  for (int f = 0; f < 2; ++f) {
    CK(cudaFree(d_ip[f]));
    CK(cudaFree(d_slot[f]));
    CK(cudaFree(d_log[f]));
  }
}

using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using int8r_tier = tier<int8_rotated, int8_rotated>;
using tq3_tier = tier<tq3_key, tq3_value>;
using k4_tier = tier<tq4_key, tq3_value>;

template <int T>
using qwen = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<T>>;

template <int T>
void bench_pages(const std::vector<int>& chunks, int prefix, cudaStream_t s) {
  for (int c : chunks) {
    bench_mix<qwen<T>, fp8_tier, tq3_tier>("fp8", prefix, c, s);
    bench_mix<qwen<T>, fp8_tier, tq3_tier>("tq3", prefix, c, s);
    bench_mix<qwen<T>, fp8_tier, tq3_tier>("tiered", prefix, c, s);
    bench_mix<qwen<T>, int8r_tier, k4_tier>("int8r", prefix, c, s);
    bench_mix<qwen<T>, int8r_tier, k4_tier>("tiered_int8r", prefix, c, s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = nullptr;
  const char* commit = "unknown";
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc)
      out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--commit") && i + 1 < argc)
      commit = argv[++i];
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--mix") && i + 1 < argc)
      only_mix = argv[++i];
    else if (!std::strcmp(argv[i], "--chunk") && i + 1 < argc)
      only_chunk = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr,
                   "usage: gpubench_prefill --out FILE.json [--commit SHA] [--quick] [--mix M] "
                   "[--chunk C]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpubench_prefill: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  const int prefix = 32768;
  bench_pages<16>(quick ? std::vector<int>{512} : std::vector<int>{512, 2048, 1, 4, 8}, prefix, s);
  if (!quick) bench_pages<64>({512, 2048}, prefix, s);
  if (out_path) {
    FILE* f = std::fopen(out_path, "w");
    if (!f) {
      std::perror(out_path);
      return 1;
    }
    std::fprintf(
        f, "{\"bench\":\"gpubench_prefill\",\"commit\":\"%s\",\"device\":\"%s\",\"rows\":[%s]}\n",
        commit, prop.name, rows_json.c_str());
    std::fclose(f);
  }
  return 0;
}
