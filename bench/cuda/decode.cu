// SPDX-License-Identifier: Apache-2.0
// gpubench_decode --out FILE.json [--commit SHA] [--quick] [--compare] [--ctx L] [--batch B]
//                 [--dim D] [--mix fp8|tq3|tiered] [--no-retier] [--retier-only] [--max-chunks N]
//                 [--int8r | --int8r-only] [--k4 | --k4-only] [--balance bytes|work] [--tq3-work N]
//                 [--waves N]: mixed-format paged decode on the
// GPU over the benchmark shapes, contexts, batches and mixes (docs/gpu.md), the
// device-to-device copy roofline measured in the same run, CUDA-graph replay, retier
// throughput and append latency at B = 64. Random (never zero) pages, cache-cold: buffer
// sets are rotated so every timed launch reads at least 4x the L2 size of fresh data.
// Every timed call is enqueued behind a ~100 us spin kernel, so the times are GPU time
// (an engine enqueues its steps ahead; host launch latency is not the kernels' cost).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_support.cuh"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/append.cuh"
#include "tierkv/cuda/decode.cuh"
#include "tierkv/cuda/retier.cuh"

namespace {

using namespace tierkv;
using namespace tierkv::bench;
using recent = tier<fp8_e4m3, fp8_e4m3>;
using stale = tier<tq3_key, tq3_value>;
using two_tiers = tiers<recent, stale>;

struct timer {
  cudaEvent_t a, b;
  timer() {
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  ~timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

template <class F>
double median_us(F&& f, int warm, int reps, cudaStream_t s) {
  timer t;
  for (int i = 0; i < warm; ++i) f(i);
  CK(cudaStreamSynchronize(s));
  std::vector<double> v;
  for (int i = 0; i < reps; ++i) {
    spin(s);  // hides the host's launch latency: GPU time only
    CK(cudaEventRecord(t.a, s));
    f(warm + i);
    CK(cudaEventRecord(t.b, s));
    CK(cudaEventSynchronize(t.b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, t.a, t.b));
    v.push_back(double(ms) * 1e3);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct row {
  int qh, kvh, d, context, batch;
  std::string mix;
  double time_us, graph_us, bytes, gbps, frac_roofline;
  int chunks;
  double cc_time_us = 0, cc_graph_us = 0;  // the CUDA-core split kernel, same run and inputs
  double tc_waves3_us = 0;                 // tensor-core kernel, plan with waves = 3 (one wave)
};
std::vector<row> rows;
std::string extra_json;
double copy_gbps = 0;
double launch_floor_us = 0;  // an empty split + programmatic merge pair, timed as a decode step

// The floor of a decode step as the rows time it: two empty kernels launched as decode
// launches its split and merge (the second with programmatic stream serialization).
__global__ void floor_split_kernel() { cuda::detail::allow_dependent_launch(); }
__global__ void floor_merge_kernel() { cuda::detail::wait_for_prerequisite_grid(); }
void launch_floor_pair(cudaStream_t s) {
  floor_split_kernel<<<256, cuda::detail::decode_threads, 0, s>>>();
  CK(cuda::detail::launch_dependent(floor_merge_kernel, dim3(24),
                                    dim3(cuda::detail::decode_threads), s));
}
std::size_t l2_bytes = 0;
int sms = 0;
bool compare = false;  // also time the CUDA-core kernel and the one-wave plan (same inputs)
int max_chunks = cuda::decode_capacity{}.max_chunks_per_seq;              // --max-chunks N
std::int64_t min_chunk_kb = cuda::decode_default_min_chunk_bytes / 1024;  // --min-chunk-kb N
int resident =
    0;  // --resident N: plan_decode's resident_blocks; 0: its default (decode_blocks_per_sm)
int only_dim = 0;                                      // 0: all shapes
std::string only_mix;                                  // empty: fp8, tq3 and tiered
cuda::balance balance_by = cuda::balance::work;        // --balance bytes|work
int tq3_work = cuda::decode_default_tq3_work_percent;  // --tq3-work N
int waves = cuda::decode_default_waves;                // --waves N

template <class G, class Recent = recent, class Stale = stale>
void bench_shape(const std::vector<int>& contexts, const std::vector<int>& batches,
                 cudaStream_t s) {
  constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens, QH = G::q_heads;
  if (only_dim != 0 && only_dim != D) return;
  using KF = typename Recent::template key_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;
  constexpr bool int8r = KF::format == storage_format::int8_rotated;
  constexpr bool k4 = KT::format == storage_format::tq4;  // Stale: TQ4 keys, TQ3 values
  const char* mixes[] = {
      int8r ? "int8r" : "fp8", k4 ? "tq4k" : "tq3",
      k4 ? (int8r ? "tiered_k4" : "tiered_fp8_k4") : (int8r ? "tiered_int8r" : "tiered")};
  for (int L : contexts)
    for (int B : batches)
      for (int mi = 0; mi < 3; ++mi) {
        if (!only_mix.empty() && only_mix != mixes[mi]) continue;
        if (k4 && mi == 0) continue;            // all-recent pages do not depend on the Stale tier
        if (int8r && !k4 && mi == 1) continue;  // all-Stale pages do not depend on the recent tier
        const int n = L / T;
        std::vector<int> tier(n);
        const int recent_pages = (n * 27 + 99) / 100 - 1;
        for (int i = 0; i < n; ++i)
          tier[i] = mi == 0 ? 0 : mi == 1 ? 1 : ((i == 0 || i >= n - recent_pages) ? 0 : 1);
        int n8 = 0;
        for (int t : tier) n8 += t == 0;
        const int n3 = n - n8;
        const double bytes_per_set =
            double(B) * (double(n8) * double(L8::page_bytes) + double(n3) * double(L3::page_bytes));
        if (bytes_per_set > 40e9) continue;
        const int sets =
            std::max(1, std::min(32, int(std::ceil(4.0 * double(l2_bytes) / bytes_per_set))));
        const std::uint32_t cap8 = std::uint32_t(std::max(1, B * n8 * sets));
        const std::uint32_t cap3 = std::uint32_t(std::max(1, B * n3 * sets));
        std::uint8_t *p8 = nullptr, *p3 = nullptr;
        CK(cudaMalloc(&p8, L8::page_bytes * cap8));
        CK(cudaMalloc(&p3, L3::page_bytes * cap3));
        fill_pages<<<1024, 256, 0, s>>>(p8, L8::page_bytes * cap8, 1 + L, 1);
        fill_pages<<<1024, 256, 0, s>>>(p3, L3::page_bytes * cap3, 2 + L, 0);
        // FP8 scales ~ amax/448 for unit-variance data; TQ3 norms ~ sqrt(d).
        fill_meta<<<1024, 256, 0, s>>>(p8, L8::page_bytes, L8::key_meta_offset,
                                       std::size_t(2) * H * T, cap8, 3.f / 448.f, 3);
        fill_meta<<<1024, 256, 0, s>>>(p3, L3::page_bytes, L3::key_meta_offset,
                                       std::size_t(2) * H * T, cap3, std::sqrt(float(D)), 4);
        CK(cudaGetLastError());
        // Index arrays of every set (physical pages shuffled within a set's range).
        std::vector<std::int32_t> seq_len(B, L);
        std::vector<std::int32_t> all[2][3];  // [tier][-, slot, logical], sets concatenated
        std::vector<std::int32_t> counts;
        for (int b = 0; b < B; ++b) {
          counts.push_back(n8);
          counts.push_back(n3);
        }
        for (int set = 0; set < sets; ++set) {
          int next[2] = {set * B * n8, set * B * n3};
          for (int b = 0; b < B; ++b)
            for (int i = 0; i < n; ++i) {
              const int f = tier[i];
              all[f][1].push_back(next[f]++);
              all[f][2].push_back(i);
            }
        }
        // Every set has the same indptr (B+1 entries); its slot/logical arrays start at set*B*n_f.
        std::vector<std::int32_t> indptr[2];
        for (int f = 0; f < 2; ++f) {
          indptr[f].resize(B + 1);
          for (int b = 0; b <= B; ++b) indptr[f][b] = b * (f == 0 ? n8 : n3);
        }
        std::int32_t *d_len, *d_ip[2], *d_slot[2], *d_log[2];
        CK(cudaMalloc(&d_len, sizeof(int) * B));
        CK(cudaMemcpy(d_len, seq_len.data(), sizeof(int) * B, cudaMemcpyHostToDevice));
        for (int f = 0; f < 2; ++f) {
          CK(cudaMalloc(&d_ip[f], sizeof(int) * (B + 1)));
          CK(cudaMemcpy(d_ip[f], indptr[f].data(), sizeof(int) * (B + 1), cudaMemcpyHostToDevice));
          const std::size_t ne = std::max<std::size_t>(1, all[f][1].size());
          CK(cudaMalloc(&d_slot[f], sizeof(int) * ne));
          CK(cudaMalloc(&d_log[f], sizeof(int) * ne));
          if (!all[f][1].empty()) {
            CK(cudaMemcpy(d_slot[f], all[f][1].data(), sizeof(int) * all[f][1].size(),
                          cudaMemcpyHostToDevice));
            CK(cudaMemcpy(d_log[f], all[f][2].data(), sizeof(int) * all[f][2].size(),
                          cudaMemcpyHostToDevice));
          }
        }
        float *q, *out, *lse;
        CK(cudaMalloc(&q, sizeof(float) * B * QH * D));
        CK(cudaMalloc(&out, sizeof(float) * B * QH * D));
        CK(cudaMalloc(&lse, sizeof(float) * B * QH));
        fill_floats<<<256, 256, 0, s>>>(q, std::size_t(B) * QH * D, 7);
        cuda::decode_capacity cap{B, max_chunks, 0, false};
        auto plan = cuda::plan_decode<G, tiers<Recent, Stale>>(
            cap, counts.data(), B, sms, waves, min_chunk_kb * 1024, balance_by,
            cuda::decode_default_min_chunk_pages,
            resident > 0 ? resident : cuda::decode_blocks_per_sm<G>, tq3_work);
        die_if(plan.error_status());
        std::uint8_t* ws;
        CK(cudaMalloc(&ws, plan->workspace_bytes));
        die_if(cuda::decode_workspace_init(*plan, ws, plan->workspace_bytes, s));
        auto inputs_for = [&](int set) {
          cuda::decode_inputs<2> in;
          in.index.batch = B;
          in.index.seq_len = d_len;
          in.index.formats[0] = {d_ip[0], d_slot[0] + std::size_t(set) * B * n8,
                                 d_log[0] + std::size_t(set) * B * n8};
          in.index.formats[1] = {d_ip[1], d_slot[1] + std::size_t(set) * B * n3,
                                 d_log[1] + std::size_t(set) * B * n3};
          in.pools[0] = {p8, L8::page_bytes, cap8};
          in.pools[1] = {p3, L3::page_bytes, cap3};
          in.queries = q;
          in.softmax_scale = 1.f / std::sqrt(float(D));
          in.cache_seed = 42;
          in.out = out;
          in.lse = lse;
          return in;
        };
        const double t = median_us(
            [&](int i) {
              die_if(cuda::decode<G, tiers<Recent, Stale>>(*plan, inputs_for(i % sets), ws,
                                                           plan->workspace_bytes, s));
            },
            3, 25, s);
        // Graph replay: one graph per set, captured once.
        std::vector<cudaGraphExec_t> execs(sets);
        for (int set = 0; set < sets; ++set) {
          cudaGraph_t g;
          CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
          die_if(cuda::decode<G, tiers<Recent, Stale>>(*plan, inputs_for(set), ws,
                                                       plan->workspace_bytes, s));
          CK(cudaStreamEndCapture(s, &g));
          CK(cudaGraphInstantiate(&execs[set], g, 0));
          CK(cudaGraphDestroy(g));
        }
        const double tg =
            median_us([&](int i) { CK(cudaGraphLaunch(execs[i % sets], s)); }, 3, 25, s);
        for (auto e : execs) CK(cudaGraphExecDestroy(e));
        // With --compare: the CUDA-core split kernel on the same inputs (decode_path::cuda_core)
        // and the tensor-core kernel under the one-wave plan (waves = 3).
        double tcc = 0, tgcc = 0, t3 = 0;
        if (compare) {
          tcc = median_us(
              [&](int i) {
                die_if(cuda::decode<G, tiers<Recent, Stale>, cuda::decode_path::cuda_core>(
                    *plan, inputs_for(i % sets), ws, plan->workspace_bytes, s));
              },
              3, 25, s);
          for (int set = 0; set < sets; ++set) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            die_if(cuda::decode<G, tiers<Recent, Stale>, cuda::decode_path::cuda_core>(
                *plan, inputs_for(set), ws, plan->workspace_bytes, s));
            CK(cudaStreamEndCapture(s, &g));
            CK(cudaGraphInstantiate(&execs[set], g, 0));
            CK(cudaGraphDestroy(g));
          }
          tgcc = median_us([&](int i) { CK(cudaGraphLaunch(execs[i % sets], s)); }, 3, 25, s);
          for (auto e : execs) CK(cudaGraphExecDestroy(e));
          {
            auto plan3 = cuda::plan_decode<G, tiers<Recent, Stale>>(
                cap, counts.data(), B, sms, 3, min_chunk_kb * 1024, balance_by);
            die_if(plan3.error_status());
            std::uint8_t* ws3;
            CK(cudaMalloc(&ws3, plan3->workspace_bytes));
            die_if(cuda::decode_workspace_init(*plan3, ws3, plan3->workspace_bytes, s));
            t3 = median_us(
                [&](int i) {
                  die_if(cuda::decode<G, tiers<Recent, Stale>>(*plan3, inputs_for(i % sets), ws3,
                                                               plan3->workspace_bytes, s));
                },
                3, 25, s);
            CK(cudaFree(ws3));
          }
        }
        int maxc = 0;
        {
          // chunk count the device computes for these sequences
          const std::int64_t tot =
              std::int64_t(n8) * plan->page_cost[0] + std::int64_t(n3) * plan->page_cost[1];
          maxc = int(std::min<std::int64_t>(
              {(tot + plan->target_chunk_bytes - 1) / plan->target_chunk_bytes, max_chunks, n}));
        }
        const double bytes = bytes_per_set + double(B) * QH * D * 8.0;  // pages + queries + outputs
        const double best = std::min(t, tg);
        row r{QH, H, D, L, B, mixes[mi], t, tg, bytes, bytes / best * 1e-3, 0, maxc};
        r.frac_roofline = r.gbps / copy_gbps;
        r.cc_time_us = tcc;
        r.cc_graph_us = tgcc;
        r.tc_waves3_us = t3;
        rows.push_back(r);
        std::printf(
            "%3d %2d %3d %7d %3d %-7s %10.1f %10.1f %12.0f %8.1f %6.2f %4d %10.1f %10.1f %10.1f\n",
            QH, H, D, L, B, mixes[mi], t, tg, bytes, r.gbps, r.frac_roofline, maxc, tcc, tgcc, t3);
        std::fflush(stdout);
        CK(cudaFree(ws));
        CK(cudaFree(q));
        CK(cudaFree(out));
        CK(cudaFree(lse));
        CK(cudaFree(d_len));
        for (int f = 0; f < 2; ++f) {
          CK(cudaFree(d_ip[f]));
          CK(cudaFree(d_slot[f]));
          CK(cudaFree(d_log[f]));
        }
        CK(cudaFree(p8));
        CK(cudaFree(p3));
      }
}

template <class G, class Recent = recent, class Stale = stale>
void bench_retier_append(cudaStream_t s) {
  constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens;
  using KF = typename Recent::template key_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;
  const int pages = int(std::min<std::size_t>(16384, (std::size_t(1) << 30) / L8::page_bytes));
  std::uint8_t *p8, *p3;
  CK(cudaMalloc(&p8, L8::page_bytes * pages));
  CK(cudaMalloc(&p3, L3::page_bytes * pages));
  fill_pages<<<1024, 256, 0, s>>>(p8, L8::page_bytes * pages, 11, 1);
  fill_meta<<<1024, 256, 0, s>>>(p8, L8::page_bytes, L8::key_meta_offset, std::size_t(2) * H * T,
                                 pages, 3.f / 448.f, 12);
  std::vector<std::int32_t> ids(pages);
  for (int i = 0; i < pages; ++i) ids[i] = i;
  std::int32_t* d_ids;
  CK(cudaMalloc(&d_ids, sizeof(int) * pages));
  CK(cudaMemcpy(d_ids, ids.data(), sizeof(int) * pages, cudaMemcpyHostToDevice));
  cuda::retier_inputs r;
  r.src = {p8, L8::page_bytes, std::uint32_t(pages)};
  r.dst = {p3, L3::page_bytes, std::uint32_t(pages)};
  r.src_slot = d_ids;
  r.dst_slot = d_ids;
  r.pages = pages;
  r.cache_seed = 5;
  const double t_down =
      median_us([&](int) { die_if(cuda::retier<G, Recent, Stale>(r, s)); }, 2, 9, s);
  cuda::retier_inputs u = r;
  u.src = r.dst;
  u.dst = r.src;
  const double t_up =
      median_us([&](int) { die_if(cuda::retier<G, Stale, Recent>(u, s)); }, 2, 9, s);
  const double in8 = double(L8::page_bytes) * pages, in3 = double(L3::page_bytes) * pages;
  // Append: B = 64 sequences, one token each, one layer.
  const int Bq = 64;
  float *k, *v;
  CK(cudaMalloc(&k, sizeof(float) * Bq * H * D));
  CK(cudaMalloc(&v, sizeof(float) * Bq * H * D));
  fill_floats<<<64, 256, 0, s>>>(k, std::size_t(Bq) * H * D, 1);
  fill_floats<<<64, 256, 0, s>>>(v, std::size_t(Bq) * H * D, 2);
  std::vector<std::int32_t> slot(Bq), off(Bq);
  for (int b = 0; b < Bq; ++b) {
    slot[b] = b * 37 % pages;
    off[b] = b % T;
  }
  std::int32_t *d_slot, *d_off;
  CK(cudaMalloc(&d_slot, sizeof(int) * Bq));
  CK(cudaMalloc(&d_off, sizeof(int) * Bq));
  CK(cudaMemcpy(d_slot, slot.data(), sizeof(int) * Bq, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_off, off.data(), sizeof(int) * Bq, cudaMemcpyHostToDevice));
  cuda::append_inputs a;
  a.k = k;
  a.v = v;
  a.slot = d_slot;
  a.offset = d_off;
  a.tokens = Bq;
  a.pool = {p8, L8::page_bytes, std::uint32_t(pages)};
  const double t_app = median_us([&](int) { die_if(cuda::append<G, Recent>(a, s)); }, 5, 51, s);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  die_if(cuda::append<G, Recent>(a, s));
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  const double t_app_g = median_us([&](int) { CK(cudaGraphLaunch(ge, s)); }, 5, 51, s);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "%s{\"recent_format\":\"%s\",\"stale_key_format\":\"%s\",\"q_heads\":%d,\"kv_"
                "heads\":%d,\"head_dim\":%d,\"pages\":%d,"
                "\"fp8_to_tq3_us\":%.2f,\"fp8_to_tq3_gbps_fp8_input\":%.1f,"
                "\"tq3_to_fp8_us\":%.2f,\"tq3_to_fp8_gbps_fp8_output\":%.1f,"
                "\"append_b64_us\":%.2f,\"append_b64_graph_us\":%.2f}",
                extra_json.empty() ? "" : ",", KF::name, KT::name, G::q_heads, H, D, pages, t_down,
                in8 / t_down * 1e-3, t_up, in8 / t_up * 1e-3, t_app, t_app_g);
  extra_json += buf;
  std::printf(
      "retier %s -> %s keys %d/%d/%d: fp8->tq3 %.1f us (%.0f GB/s fp8 in, %.2f of copy; %.0f GB/s "
      "in+out) "
      "tq3->fp8 %.1f us (%.0f GB/s fp8 out); append B=64 %.2f us (graph %.2f us)\n",
      KF::name, KT::name, G::q_heads, H, D, t_down, in8 / t_down * 1e-3,
      in8 / t_down * 1e-3 / copy_gbps, (in8 + in3) / t_down * 1e-3, t_up, in8 / t_up * 1e-3, t_app,
      t_app_g);
  CK(cudaFree(p8));
  CK(cudaFree(p3));
  CK(cudaFree(d_ids));
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(d_slot));
  CK(cudaFree(d_off));
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, commit = "unknown";
  bool quick = false, retier = true, decode = true;
  bool with_int8r = false, int8r_only = false;  // also / only the int8_rotated recent tier
  bool with_k4 = false, k4_only = false;        // also / only int8_rotated + TQ4-key Stale tiers
  std::vector<int> ctx_only, batch_only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc)
      out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--commit") && i + 1 < argc)
      commit = argv[++i];
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--compare"))
      compare = true;
    else if (!std::strcmp(argv[i], "--no-retier"))
      retier = false;
    else if (!std::strcmp(argv[i], "--retier-only"))
      decode = false;
    else if (!std::strcmp(argv[i], "--ctx") && i + 1 < argc)
      ctx_only.push_back(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--batch") && i + 1 < argc)
      batch_only.push_back(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--dim") && i + 1 < argc)
      only_dim = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--max-chunks") && i + 1 < argc)
      max_chunks = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--min-chunk-kb") && i + 1 < argc)
      min_chunk_kb = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--resident") && i + 1 < argc)
      resident = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--mix") && i + 1 < argc)
      only_mix = argv[++i];
    else if (!std::strcmp(argv[i], "--int8r"))
      with_int8r = true;
    else if (!std::strcmp(argv[i], "--int8r-only"))
      with_int8r = int8r_only = true;
    else if (!std::strcmp(argv[i], "--balance") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v == "bytes")
        balance_by = cuda::balance::bytes;
      else if (v == "work")
        balance_by = cuda::balance::work;
      else {
        std::fprintf(stderr, "gpubench_decode: --balance bytes|work, got %s\n", v.c_str());
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--tq3-work") && i + 1 < argc)
      tq3_work = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--waves") && i + 1 < argc)
      waves = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--k4"))
      with_k4 = true;
    else if (!std::strcmp(argv[i], "--k4-only"))
      with_k4 = k4_only = true;
    else {
      std::fprintf(stderr, "gpubench_decode: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  sms = prop.multiProcessorCount;
  l2_bytes = std::size_t(prop.l2CacheSize);
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  {
    const std::size_t n = std::size_t(2) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    fill_pages<<<1024, 256, 0, s>>>(static_cast<std::uint8_t*>(a), n, 9, 0);
    const double t = median_us(
        [&](int) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, s)); }, 2, 10, s);
    copy_gbps = 2.0 * double(n) / t * 1e-3;
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  launch_floor_us = median_us([&](int) { launch_floor_pair(s); }, 5, 51, s);
  std::printf(
      "device %s, %d SMs, L2 %zu MB, copy %.0f GB/s (read + write), empty split + merge pair %.1f "
      "us\n",
      prop.name, sms, l2_bytes >> 20, copy_gbps, launch_floor_us);
  std::printf(
      " qh kv   d context   B mix       time_us   graph_us        bytes     GB/s  frac chunks  "
      "cc_time_us cc_graph_us  waves3_us\n");
  std::vector<int> ctx = quick ? std::vector<int>{32768} : std::vector<int>{8192, 32768, 131072};
  std::vector<int> bat = quick ? std::vector<int>{1, 8} : std::vector<int>{1, 8, 32};
  if (!ctx_only.empty()) ctx = ctx_only;
  if (!batch_only.empty()) bat = batch_only;
  using g256 = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<64>>;
  using g128 = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
  using g64 = geometry<head_dim<64>, kv_heads<3>, group_size<3>, page_tokens<64>>;
  using recent_int8r = tier<int8_rotated, int8_rotated>;
  using stale_k4 = tier<tq4_key, tq3_value>;
  const bool base = !int8r_only && !k4_only;
  if (decode && base) {
    bench_shape<g256>(ctx, bat, s);
    bench_shape<g128>(ctx, bat, s);
    bench_shape<g64>(ctx, bat, s);
  }
  if (decode && with_k4) {
    bench_shape<g256, recent_int8r, stale_k4>(ctx, bat, s);
    bench_shape<g128, recent_int8r, stale_k4>(ctx, bat, s);
    bench_shape<g64, recent_int8r, stale_k4>(ctx, bat, s);
  }
  if (decode && with_int8r && !k4_only) {
    bench_shape<g256, recent_int8r>(ctx, bat, s);
    bench_shape<g128, recent_int8r>(ctx, bat, s);
    bench_shape<g64, recent_int8r>(ctx, bat, s);
  }
  if (retier && base) {
    bench_retier_append<g256>(s);
    bench_retier_append<g128>(s);
    bench_retier_append<g64>(s);
  }
  if (retier && with_int8r && !k4_only) {
    bench_retier_append<g256, recent_int8r>(s);
    bench_retier_append<g128, recent_int8r>(s);
    bench_retier_append<g64, recent_int8r>(s);
  }
  if (retier && with_k4) {
    bench_retier_append<g256, recent_int8r, stale_k4>(s);
    bench_retier_append<g128, recent_int8r, stale_k4>(s);
    bench_retier_append<g64, recent_int8r, stale_k4>(s);
  }
  CK(cudaStreamDestroy(s));

  if (!out_path.empty()) {
    FILE* f = std::fopen(out_path.c_str(), "w");
    if (!f) {
      std::perror(out_path.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"gpu\":\"%s\",\"sms\":%d,\"l2_bytes\":%zu,\"commit\":\"%s\",\"copy_gbps\":%.1f,"
                 "\"launch_floor_us\":%.2f,\n\"rows\":[\n",
                 prop.name, sms, l2_bytes, commit.c_str(), copy_gbps, launch_floor_us);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& r = rows[i];
      std::fprintf(
          f,
          "%s{\"q_heads\":%d,\"kv_heads\":%d,\"head_dim\":%d,\"context\":%d,\"batch\":%d,"
          "\"mix\":\"%s\",\"time_us\":%.2f,\"graph_us\":%.2f,\"bytes_read\":%.0f,\"gbps\":%.1f,"
          "\"frac_of_copy_roofline\":%.3f,\"chunks_per_seq\":%d,\"path\":\"tensor_core\","
          "\"cuda_core_time_us\":%.2f,\"cuda_core_graph_us\":%.2f,\"tensor_core_waves3_time_us\":%."
          "2f}\n",
          i ? "," : "", r.qh, r.kvh, r.d, r.context, r.batch, r.mix.c_str(), r.time_us, r.graph_us,
          r.bytes, r.gbps, r.frac_roofline, r.chunks, r.cc_time_us, r.cc_graph_us, r.tc_waves3_us);
    }
    std::fprintf(f, "],\n\"retier_append\":[%s]}\n", extra_json.c_str());
    std::fclose(f);
  }
  return 0;
}
