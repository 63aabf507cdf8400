// SPDX-License-Identifier: Apache-2.0
// gpubench_retier_overlap --out FILE.json [--commit SHA]: a decode step of L = 1 or 16 layer
// calls (tiered mix, context 32K) with one batch of FP8 -> TQ3 conversions of 1% / 5% of the
// live pages of every layer (N = pct x live x L pages, one launch):
//   (a) decode alone; (r) the retier batch alone; (b) decode then retier on one stream;
//   (c) decode on the main stream, the batch on a low-priority side stream through
//       retier_async.cuh (events): main-stream step time and wall time (both streams joined);
//       the same with the side stream at the main stream's priority (eq_*).
// Medians of 25 steps after 3 warm-up steps; page sets rotated to stay cache-cold (as
// bench/cuda/decode.cu). Checked on the device: decode outputs of (c) equal (a)'s bit for bit,
// and the pages (c) converted equal (b)'s byte for byte; the retier error flag stays 0.
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
#include "tierkv/codec/tq3.hpp"
#include "tierkv/cuda/decode.cuh"
#include "tierkv/cuda/retier.cuh"
#include "tierkv/cuda/retier_async.cuh"

namespace {

using namespace tierkv;
using namespace tierkv::bench;
using recent = tier<fp8_e4m3, fp8_e4m3>;
using stale = tier<tq3_key, tq3_value>;
using two_tiers = tiers<recent, stale>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct row {
  int qh, kvh, d, context, batch, layers, pct, pages_live, pages_retiered;
  double decode_us, retier_us, serial_us, overlap_main_us, overlap_wall_us, eqprio_main_us,
      eqprio_wall_us;
  bool outputs_equal, pages_equal;
};
std::vector<row> rows;
std::size_t l2_bytes = 0;
int sms = 0;
constexpr int warm = 3, reps = 25;

template <class G>
void bench_shape(int B, int layers, cudaStream_t s, cudaStream_t side, cudaStream_t side_eq) {
  constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens, QH = G::q_heads;
  using KF = recent::key_codec<D>;
  using KT = stale::key_codec<D>;
  using VT = stale::value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;
  const int L = 32768, n = L / T;
  std::vector<int> tier(n);
  const int recent_pages = (n * 27 + 99) / 100 - 1;
  for (int i = 0; i < n; ++i) tier[i] = (i == 0 || i >= n - recent_pages) ? 0 : 1;
  int n8 = 0;
  for (int t : tier) n8 += t == 0;
  const int n3 = n - n8;
  const double bytes_per_set =
      double(B) * (double(n8) * double(L8::page_bytes) + double(n3) * double(L3::page_bytes));
  const int sets =
      std::max(1, std::min(32, int(std::ceil(4.0 * double(l2_bytes) / bytes_per_set))));
  const std::uint32_t cap8 = std::uint32_t(B * n8 * sets), cap3 = std::uint32_t(B * n3 * sets);
  const int live = B * n;
  const int nmax = std::max(1, live * 5 / 100) * layers;  // retier pages of a step, all layers
  std::uint8_t *p8, *p3, *dst_serial, *dst_async;
  const std::size_t dst_bytes = L3::page_bytes * std::size_t(nmax) * std::size_t(sets);
  CK(cudaMalloc(&p8, L8::page_bytes * cap8));
  CK(cudaMalloc(&p3, L3::page_bytes * cap3));
  CK(cudaMalloc(&dst_serial, dst_bytes));
  CK(cudaMalloc(&dst_async, dst_bytes));
  fill_pages<<<1024, 256, 0, s>>>(p8, L8::page_bytes * cap8, 1 + L, 1);
  fill_pages<<<1024, 256, 0, s>>>(p3, L3::page_bytes * cap3, 2 + L, 0);
  fill_meta<<<1024, 256, 0, s>>>(p8, L8::page_bytes, L8::key_meta_offset, std::size_t(2) * H * T,
                                 cap8, 3.f / 448.f, 3);
  fill_meta<<<1024, 256, 0, s>>>(p3, L3::page_bytes, L3::key_meta_offset, std::size_t(2) * H * T,
                                 cap3, std::sqrt(float(D)), 4);
  CK(cudaGetLastError());
  std::vector<std::int32_t> seq_len(B, L), counts;
  std::vector<std::int32_t> slot[2], logical[2];
  for (int b = 0; b < B; ++b) {
    counts.push_back(n8);
    counts.push_back(n3);
  }
  for (int set = 0; set < sets; ++set) {
    int next[2] = {set * B * n8, set * B * n3};
    for (int b = 0; b < B; ++b)
      for (int i = 0; i < n; ++i) {
        slot[tier[i]].push_back(next[tier[i]]++);
        logical[tier[i]].push_back(i);
      }
  }
  std::vector<std::int32_t> indptr[2];
  for (int f = 0; f < 2; ++f)
    for (int b = 0; b <= B; ++b) indptr[f].push_back(b * (f == 0 ? n8 : n3));
  std::int32_t *d_len, *d_ip[2], *d_slot[2], *d_log[2];
  CK(cudaMalloc(&d_len, sizeof(int) * B));
  CK(cudaMemcpy(d_len, seq_len.data(), sizeof(int) * B, cudaMemcpyHostToDevice));
  for (int f = 0; f < 2; ++f) {
    CK(cudaMalloc(&d_ip[f], sizeof(int) * (B + 1)));
    CK(cudaMemcpy(d_ip[f], indptr[f].data(), sizeof(int) * (B + 1), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_slot[f], sizeof(int) * slot[f].size()));
    CK(cudaMalloc(&d_log[f], sizeof(int) * slot[f].size()));
    CK(cudaMemcpy(d_slot[f], slot[f].data(), sizeof(int) * slot[f].size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_log[f], logical[f].data(), sizeof(int) * slot[f].size(),
                  cudaMemcpyHostToDevice));
  }
  float *q, *out;
  CK(cudaMalloc(&q, sizeof(float) * B * QH * D));
  CK(cudaMalloc(&out, sizeof(float) * B * QH * D));
  fill_floats<<<256, 256, 0, s>>>(q, std::size_t(B) * QH * D, 7);
  int* d_err;
  CK(cudaMalloc(&d_err, sizeof(int)));
  CK(cudaMemset(d_err, 0, sizeof(int)));
  cuda::decode_capacity cap{B, 64, 0, false};
  auto plan = cuda::plan_decode<G, two_tiers>(cap, counts.data(), B, sms);
  die_if(plan.error_status());
  std::uint8_t* ws;
  CK(cudaMalloc(&ws, plan->workspace_bytes));
  die_if(cuda::decode_workspace_init(*plan, ws, plan->workspace_bytes, s));
  // L layer decodes; after_first() runs after the first layer's enqueue (where a step's
  // retier batch is enqueued, so it can start while the first layer runs).
  auto decode_set = [&](int set, cudaStream_t st, auto&& after_first) {
    for (int layer = 0; layer < layers; ++layer) {
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
      in.layer = layer;
      in.out = out;  // the last layer's output is the one checked
      die_if(cuda::decode<G, two_tiers>(*plan, in, ws, plan->workspace_bytes, st));
      if (layer == 0) after_first();
    }
  };
  auto nothing = [] {};
  auto host_out = [&] {
    std::vector<float> h(std::size_t(B) * QH * D);
    CK(cudaMemcpy(h.data(), out, sizeof(float) * h.size(), cudaMemcpyDeviceToHost));
    return h;
  };
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  auto ev = cuda::retier_async_events::create();
  die_if(ev.error_status());

  // One step per call: f(set) enqueues between e0 (main) and e1 (main); e2 after the join.
  // Returns {median e0->e1, median e0->e2}.
  auto steps = [&](auto&& f) {
    std::vector<double> a, w;
    for (int i = 0; i < warm + reps; ++i) {
      CK(cudaEventRecord(e0, s));
      f(i % sets);
      CK(cudaEventRecord(e1, s));
      CK(cudaStreamWaitEvent(s, ev->converted(), 0));  // no-op wait when nothing ran on side
      CK(cudaEventRecord(e2, s));
      CK(cudaEventSynchronize(e2));
      float m1 = 0, m2 = 0;
      CK(cudaEventElapsedTime(&m1, e0, e1));
      CK(cudaEventElapsedTime(&m2, e0, e2));
      if (i >= warm) {
        a.push_back(double(m1) * 1e3);
        w.push_back(double(m2) * 1e3);
      }
    }
    return std::pair<double, double>{median(a), median(w)};
  };
  // Prime `converted` so the join wait of the first steps is well defined.
  CK(cudaEventRecord(ev->converted(), side));
  const double t_decode = steps([&](int set) { decode_set(set, s, nothing); }).first;
  const int last_set = (warm + reps - 1) % sets;
  decode_set(last_set, s, nothing);
  CK(cudaStreamSynchronize(s));
  const std::vector<float> ref_out = host_out();

  for (int pct : {1, 5}) {
    const int N1 = std::max(1, live * pct / 100), N = N1 * layers;  // N1 per layer
    // Sources: N FP8 pages of each set spread over its sequences; destinations: N fresh TQ3
    // pages per set outside every index array (reserved, unpublished).
    std::vector<std::int32_t> src(std::size_t(N) * sets), dst(std::size_t(N) * sets),
        lay(std::size_t(N) * sets);
    for (int set = 0; set < sets; ++set)
      for (int j = 0; j < N; ++j) {
        src[std::size_t(set) * N + j] = set * B * n8 + int(std::int64_t(j % N1) * B * n8 / N1);
        dst[std::size_t(set) * N + j] = set * nmax + j;
        lay[std::size_t(set) * N + j] = j / N1;
      }
    std::int32_t *d_src, *d_dst, *d_lay;
    CK(cudaMalloc(&d_lay, sizeof(int) * lay.size()));
    CK(cudaMemcpy(d_lay, lay.data(), sizeof(int) * lay.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d_src, sizeof(int) * src.size()));
    CK(cudaMalloc(&d_dst, sizeof(int) * dst.size()));
    CK(cudaMemcpy(d_src, src.data(), sizeof(int) * src.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_dst, dst.data(), sizeof(int) * dst.size(), cudaMemcpyHostToDevice));
    CK(cudaMemset(dst_serial, 0, dst_bytes));
    CK(cudaMemset(dst_async, 0, dst_bytes));
    auto batch = [&](int set, std::uint8_t* dpool) {
      cuda::retier_inputs r;
      r.src = {p8, L8::page_bytes, cap8};
      r.dst = {dpool, L3::page_bytes, std::uint32_t(nmax * sets)};
      r.src_slot = d_src + std::size_t(set) * N;
      r.dst_slot = d_dst + std::size_t(set) * N;
      r.pages = N;
      r.layer_of = d_lay + std::size_t(set) * N;
      r.cache_seed = 42;
      r.error = d_err;
      return r;
    };
    const double t_retier = steps([&](int set) {
                              die_if(cuda::retier<G, recent, stale>(batch(set, dst_serial), s));
                            }).first;
    const double t_serial = steps([&](int set) {
                              decode_set(set, s, nothing);
                              die_if(cuda::retier<G, recent, stale>(batch(set, dst_serial), s));
                            }).first;
    const auto ovl = steps([&](int set) {
      die_if(cuda::mark_sources_ready(*ev, s));
      decode_set(set, s, [&] {
        die_if(cuda::enqueue_retier_async<G, recent, stale>(batch(set, dst_async), *ev, side));
      });
    });
    CK(cudaDeviceSynchronize());
    const bool outputs_equal_low = host_out() == ref_out;
    // The same overlap with the side stream at the main stream's (highest) priority.
    const auto eq = steps([&](int set) {
      die_if(cuda::mark_sources_ready(*ev, s));
      decode_set(set, s, [&] {
        die_if(cuda::enqueue_retier_async<G, recent, stale>(batch(set, dst_async), *ev, side_eq));
      });
    });
    CK(cudaDeviceSynchronize());
    const bool outputs_equal =
        outputs_equal_low && host_out() == ref_out;  // both ended on last_set
    std::vector<std::uint8_t> hs(dst_bytes), ha(dst_bytes);
    CK(cudaMemcpy(hs.data(), dst_serial, dst_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ha.data(), dst_async, dst_bytes, cudaMemcpyDeviceToHost));
    const bool written = std::any_of(ha.begin(), ha.end(), [](std::uint8_t x) { return x != 0; });
    const bool pages_equal = written && hs == ha;
    int err = 0;
    CK(cudaMemcpy(&err, d_err, sizeof(int), cudaMemcpyDeviceToHost));
    if (err != 0) {
      std::fprintf(stderr, "retier device error %d\n", err);
      std::exit(1);
    }
    row r{QH,
          H,
          D,
          L,
          B,
          layers,
          pct,
          live,
          N,
          t_decode,
          t_retier,
          t_serial,
          ovl.first,
          ovl.second,
          eq.first,
          eq.second,
          outputs_equal,
          pages_equal};
    rows.push_back(r);
    std::printf(
        "%3d %2d %3d %3d %2d %3d%% %6d %6d %9.1f %9.1f %9.1f %9.1f %9.1f %6.3f %6.2f %9.1f %9.1f  "
        "%s %s\n",
        QH, H, D, B, layers, pct, live, N, t_decode, t_retier, t_serial, ovl.first, ovl.second,
        ovl.first / t_decode, (t_serial - ovl.second) / t_retier, eq.first, eq.second,
        outputs_equal ? "yes" : "NO", pages_equal ? "yes" : "NO");
    std::fflush(stdout);
    CK(cudaFree(d_src));
    CK(cudaFree(d_dst));
    CK(cudaFree(d_lay));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaEventDestroy(e2));
  CK(cudaFree(ws));
  CK(cudaFree(q));
  CK(cudaFree(out));
  CK(cudaFree(d_len));
  CK(cudaFree(d_err));
  for (int f = 0; f < 2; ++f) {
    CK(cudaFree(d_ip[f]));
    CK(cudaFree(d_slot[f]));
    CK(cudaFree(d_log[f]));
  }
  CK(cudaFree(p8));
  CK(cudaFree(p3));
  CK(cudaFree(dst_serial));
  CK(cudaFree(dst_async));
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, commit = "unknown";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc)
      out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--commit") && i + 1 < argc)
      commit = argv[++i];
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  sms = prop.multiProcessorCount;
  l2_bytes = std::size_t(prop.l2CacheSize);
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s;
  CK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
  auto side = cuda::create_side_stream();
  die_if(side.error_status());
  cudaStream_t side_eq;
  CK(cudaStreamCreateWithPriority(&side_eq, cudaStreamNonBlocking, greatest));
  std::printf(
      "device %s, %d SMs, L2 %zu MB; stream priorities main %d, side %d; step = L layer decodes, "
      "context 32K, tiered; N = pct of live pages x L\n",
      prop.name, sms, l2_bytes >> 20, greatest, least);
  std::printf(
      " qh kv   d   B  L  pct   live      N decode_us retier_us serial_us  ovl_main  ovl_wall "
      "slowdn hidden   eq_main   eq_wall  out= pages=\n");
  for (int layers : {1, 16})
    for (int B : {8, 32}) {
      bench_shape<geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<64>>>(
          B, layers, s, *side, side_eq);
      bench_shape<geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>>(
          B, layers, s, *side, side_eq);
    }
  std::printf(
      "slowdn = ovl_main / decode_us; hidden = (serial_us - ovl_wall) / retier_us (1 = retier "
      "fully hidden); eq_* = side stream at the main stream's priority\n");
  CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(*side));
  CK(cudaStreamDestroy(side_eq));
  bool all_ok = true;
  for (const row& r : rows) all_ok = all_ok && r.outputs_equal && r.pages_equal;
  if (!out_path.empty()) {
    FILE* f = std::fopen(out_path.c_str(), "w");
    if (!f) {
      std::perror(out_path.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"gpu\":\"%s\",\"sms\":%d,\"l2_bytes\":%zu,\"commit\":\"%s\",\"step\":\"L layer "
                 "decodes in sequence (live = one layer's pages; retier_pages = pct x live x L), "
                 "tiered mix, context 32768, median of %d steps after %d warm-up\",\n\"rows\":[\n",
                 prop.name, sms, l2_bytes, commit.c_str(), reps, warm);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& r = rows[i];
      std::fprintf(f,
                   "%s{\"q_heads\":%d,\"kv_heads\":%d,\"head_dim\":%d,\"context\":%d,\"batch\":%d,"
                   "\"layers\":%d,"
                   "\"retier_pct\":%d,\"live_pages\":%d,\"retier_pages\":%d,\"decode_us\":%.2f,"
                   "\"retier_alone_us\":%.2f,\"serial_us\":%.2f,\"overlap_main_us\":%.2f,"
                   "\"overlap_wall_us\":%.2f,\"equal_priority_main_us\":%.2f,\"equal_priority_wall_"
                   "us\":%.2f,\"outputs_bit_equal\":%s,\"retiered_bytes_equal\":%s}\n",
                   i ? "," : "", r.qh, r.kvh, r.d, r.context, r.batch, r.layers, r.pct,
                   r.pages_live, r.pages_retiered, r.decode_us, r.retier_us, r.serial_us,
                   r.overlap_main_us, r.overlap_wall_us, r.eqprio_main_us, r.eqprio_wall_us,
                   r.outputs_equal ? "true" : "false", r.pages_equal ? "true" : "false");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return all_ok ? 0 : 2;
}
