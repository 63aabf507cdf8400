// SPDX-License-Identifier: Apache-2.0
// gpubench_retier_overlap [--out FILE.json] [--commit SHA] [--benchmark_* flags]: a decode step
// of L = 1 or 16 layer calls (tiered mix, context 32K) with one batch of FP8 -> TQ3 conversions
// of 1% / 5% of the live pages of every layer (N = pct x live x L pages, one launch):
//   decode      the decode alone;
//   retier      the retier batch alone;
//   serial      decode then retier on one stream;
//   overlap     decode on the main stream, the batch on a low-priority side stream through
//               cuda/retier/async.cuh (events);
//   overlap_eq  the same with the side stream at the main stream's priority.
// Google Benchmark: one benchmark per (shape, batch, layers[, pct], mode), e.g.
// retier_overlap/shape:24x4x256/batch:8/layers:16/pct:5/mode:overlap, 25 repetitions of one step
// after 3 warm-up steps (bench_support.cuh: L2 flushed, spin kernel on the main stream, events).
// A step's manual time is its wall time (the main stream joined with the side stream's
// conversions); counter main_us is the main stream's own time (the step's last decode); the
// record takes their medians. Checked on the device in every overlap / overlap_eq repetition:
// the decode outputs equal the decode alone's bit for bit (outputs_bit_equal) and the pages
// converted on the side stream equal one-stream retier's byte for byte (retiered_bytes_equal;
// the record takes the "min" aggregate, so one failed repetition shows); the retier error flag
// stays 0. Exit status 2 when a check failed. bench/gpu/gbench_record.py turns the JSON into the
// retier-overlap record.
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
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/cuda/decode.cuh"
#include "tierkv/cuda/retier/async.cuh"
#include "tierkv/cuda/retier/retier.cuh"

namespace {

using namespace tierkv;
using namespace tierkv::bench;
using recent = tier<fp8_e4m3, fp8_e4m3>;
using stale = tier<tq3_key, tq3_value>;
using two_tiers = tiers<recent, stale>;
using g256 = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<64>>;
using g128 = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;

constexpr int warm = 3, reps = 25;
constexpr int context = 32768;

struct device_state {
  cudaStream_t main = nullptr, side = nullptr, side_eq = nullptr;
  int sms = 0;
  std::unique_ptr<l2_flusher> flush;
};
device_state dev;
case_cache cache;
bool checks_failed = false;

enum class mode { decode, retier, serial, overlap, overlap_eq };
const char* mode_name(mode m) {
  switch (m) {
    case mode::decode:
      return "decode";
    case mode::retier:
      return "retier";
    case mode::serial:
      return "serial";
    case mode::overlap:
      return "overlap";
    case mode::overlap_eq:
      return "overlap_eq";
  }
  return "?";
}

// Counts the bytes where a and b differ and the nonzero bytes of b.
__global__ void compare_bytes(const std::uint8_t* a, const std::uint8_t* b, std::size_t n,
                              unsigned long long* counts) {
  unsigned long long diff = 0, nonzero = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    diff += a[i] != b[i];
    nonzero += b[i] != 0;
  }
  if (diff) atomicAdd(&counts[0], diff);
  if (nonzero) atomicAdd(&counts[1], nonzero);
}

// One (shape, batch, layers) case: a batch of B sequences of 32K tokens (tiered mix) in one
// set of pools, its plan, the decode alone's output (the reference), and per pct the retier
// batch's lists, destinations and the one-stream conversion's bytes (the reference).
template <class G>
struct overlap_case {
  static constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens, QH = G::q_heads;
  using KF = recent::key_codec<D>;
  using KT = stale::key_codec<D>;
  using VT = stale::value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;

  struct batch_lists {
    int n1 = 0, n = 0;  // pages per layer, per step
    device_array<std::int32_t> src, dst, layer_of;
  };

  int B, layers, n8 = 0, n3 = 0, live = 0, nmax = 0;
  std::uint32_t cap8 = 1, cap3 = 1;
  device_array<std::uint8_t> p8, p3, dst_serial, dst_async, ws;
  two_tier_index table;
  device_array<std::int32_t> len;
  device_array<float> q, out;
  device_array<int> err;
  device_array<unsigned long long> counts;
  cuda::decode_plan plan{};
  cuda::retier_async_events ev;
  std::vector<float> ref_out;
  batch_lists lists[2];  // pct 1, 5
  int ref_pct = 0;       // whose one-stream conversion dst_serial holds

  overlap_case(int B_, int layers_, cudaStream_t s) : B(B_), layers(layers_) {
    const int n = context / T;
    std::vector<int> tier(static_cast<std::size_t>(n));
    const int recent_pages = (n * 27 + 99) / 100 - 1;
    for (int i = 0; i < n; ++i) tier[std::size_t(i)] = (i == 0 || i >= n - recent_pages) ? 0 : 1;
    for (int t : tier) n8 += t == 0;
    n3 = n - n8;
    cap8 = std::uint32_t(B * n8);
    cap3 = std::uint32_t(B * n3);
    live = B * n;
    nmax = std::max(1, live * 5 / 100) * layers;  // retier pages of a step, all layers
    p8 = device_array<std::uint8_t>(L8::page_bytes * cap8);
    p3 = device_array<std::uint8_t>(L3::page_bytes * cap3);
    dst_serial = device_array<std::uint8_t>(L3::page_bytes * std::size_t(nmax));
    dst_async = device_array<std::uint8_t>(L3::page_bytes * std::size_t(nmax));
    fill_pages<<<1024, 256, 0, s>>>(p8.get(), p8.size(), 1 + context, 1);
    fill_pages<<<1024, 256, 0, s>>>(p3.get(), p3.size(), 2 + context, 0);
    fill_meta<<<1024, 256, 0, s>>>(p8.get(), L8::page_bytes, L8::key_meta_offset,
                                   std::size_t(2) * H * T, cap8, 3.f / 448.f, 3);
    fill_meta<<<1024, 256, 0, s>>>(p3.get(), L3::page_bytes, L3::key_meta_offset,
                                   std::size_t(2) * H * T, cap3, std::sqrt(float(D)), 4);
    CK(cudaGetLastError());
    table = two_tier_index(tier, B);
    len = device_array<std::int32_t>(std::vector<std::int32_t>(std::size_t(B), context));
    const std::size_t qn = std::size_t(B) * QH * D;
    q = device_array<float>(qn);
    out = device_array<float>(qn);
    fill_floats<<<256, 256, 0, s>>>(q.get(), qn, 7);
    err = device_array<int>(std::vector<int>{0});
    counts = device_array<unsigned long long>(2);
    const cuda::decode_capacity cap{B, 64, 0, false};
    plan = take(cuda::plan_decode<G, two_tiers>(cap, table.counts.data(), B, dev.sms));
    ws = device_array<std::uint8_t>(plan.workspace_bytes);
    die_if(cuda::decode_workspace_init(plan, ws.get(), plan.workspace_bytes, s));
    ev = take(cuda::retier_async_events::create());
    // Prime `converted` so the join wait of a step with nothing on the side is well defined.
    CK(cudaEventRecord(ev.converted(), dev.side));
    for (int k = 0; k < 2; ++k) {
      const int pct = k == 0 ? 1 : 5;
      batch_lists& bl = lists[k];
      bl.n1 = std::max(1, live * pct / 100);
      bl.n = bl.n1 * layers;
      // Sources: N1 FP8 pages per layer spread over the sequences; destinations: fresh TQ3
      // pages outside every index array (reserved, unpublished).
      std::vector<std::int32_t> src, dst, lay;
      for (int j = 0; j < bl.n; ++j) {
        src.push_back(int(std::int64_t(j % bl.n1) * B * n8 / bl.n1));
        dst.push_back(j);
        lay.push_back(j / bl.n1);
      }
      bl.src = device_array<std::int32_t>(src);
      bl.dst = device_array<std::int32_t>(dst);
      bl.layer_of = device_array<std::int32_t>(lay);
    }
    decode_step(s, [] {});
    CK(cudaStreamSynchronize(s));
    ref_out = out.to_host();
  }

  const batch_lists& lists_of(int pct) const { return lists[pct == 1 ? 0 : 1]; }

  cuda::retier_inputs batch(int pct, std::uint8_t* dpool) const {
    const batch_lists& bl = lists_of(pct);
    cuda::retier_inputs r;
    r.src = {p8.get(), L8::page_bytes, cap8};
    r.dst = {dpool, L3::page_bytes, std::uint32_t(nmax)};
    r.src_slot = bl.src.get();
    r.dst_slot = bl.dst.get();
    r.pages = bl.n;
    r.layer_of = bl.layer_of.get();
    r.cache_seed = 42;
    r.error = err.get();
    return r;
  }

  // `layers` decodes on stream st; after_first() runs after the first one is enqueued (where a
  // step's retier batch is enqueued, so it can start while the first layer runs).
  template <class F>
  void decode_step(cudaStream_t st, F&& after_first) {
    for (int layer = 0; layer < layers; ++layer) {
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
      in.layer = layer;
      in.out = out.get();  // the last layer's output is the one checked
      die_if(cuda::decode<G, two_tiers>(plan, in, ws.get(), plan.workspace_bytes, st));
      if (layer == 0) after_first();
    }
  }

  void retier_serial(int pct, cudaStream_t s) {
    die_if(cuda::retier<G, recent, stale>(batch(pct, dst_serial.get()), s));
  }

  // dst_serial holds pct's one-stream conversion (the bytes the side stream must produce).
  void reference(int pct, cudaStream_t s) {
    if (ref_pct == pct) return;
    CK(cudaMemsetAsync(dst_serial.get(), 0, dst_serial.bytes(), s));
    retier_serial(pct, s);
    CK(cudaStreamSynchronize(s));
    ref_pct = pct;
  }

  // After an overlap step (synchronized): {outputs equal, converted bytes equal and written}.
  std::pair<bool, bool> check(int pct, cudaStream_t s) {
    const bool outputs_equal = out.to_host() == ref_out;
    const std::size_t n = L3::page_bytes * std::size_t(lists_of(pct).n);
    CK(cudaMemsetAsync(counts.get(), 0, counts.bytes(), s));
    compare_bytes<<<1024, 256, 0, s>>>(dst_serial.get(), dst_async.get(), n, counts.get());
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s));
    const std::vector<unsigned long long> c = counts.to_host();
    int e = 0;
    CK(cudaMemcpy(&e, err.get(), sizeof(int), cudaMemcpyDeviceToHost));
    if (e != 0) {
      std::fprintf(stderr, "gpubench_retier_overlap: retier device error %d\n", e);
      std::exit(1);
    }
    return {outputs_equal, c[0] == 0 && c[1] > 0};
  }
};

// One step between events on the main stream: e0, the step's work, e1, the join with the side
// stream's conversions (a no-op wait when nothing ran there), e2. The L2 flush and the spin
// kernel come before e0.
struct step_timer {
  cudaEvent_t e0 = nullptr, e1 = nullptr, e2 = nullptr;
  step_timer() {
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e2));
  }
  ~step_timer() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaEventDestroy(e2);
  }
  step_timer(const step_timer&) = delete;
  step_timer& operator=(const step_timer&) = delete;
  // {main stream us (e0 -> e1), wall us (e0 -> e2)}
  template <class F>
  std::pair<double, double> step(cudaEvent_t converted, F&& enqueue) {
    cudaStream_t s = dev.main;
    dev.flush->run(s);
    spin(s);
    CK(cudaEventRecord(e0, s));
    enqueue();
    CK(cudaEventRecord(e1, s));
    CK(cudaStreamWaitEvent(s, converted, 0));
    CK(cudaEventRecord(e2, s));
    CK(cudaEventSynchronize(e2));
    float m1 = 0, m2 = 0;
    CK(cudaEventElapsedTime(&m1, e0, e1));
    CK(cudaEventElapsedTime(&m2, e0, e2));
    return {double(m1) * 1e3, double(m2) * 1e3};
  }
};

template <class G>
void register_case(int B, int layers) {
  using C = overlap_case<G>;
  const std::string sh = shape(C::QH, C::H, C::D);
  const std::string key =
      bench_name("retier_overlap").add("shape", sh).add("batch", B).add("layers", layers).str();
  auto add = [&](mode m, int pct) {
    bench_name name =
        bench_name("retier_overlap").add("shape", sh).add("batch", B).add("layers", layers);
    if (m != mode::decode) name.add("pct", pct);
    name.add("mode", mode_name(m));
    auto* b = benchmark::RegisterBenchmark(
        name.c_str(), [key, B, layers, m, pct, first = first_time()](benchmark::State& st) {
          cudaStream_t s = dev.main;
          C& c = cache.get<C>(key, [&] { return std::make_shared<C>(B, layers, s); });
          const bool overlap = m == mode::overlap || m == mode::overlap_eq;
          if (m != mode::decode) c.reference(pct, s);
          auto enqueue = [&] {
            switch (m) {
              case mode::decode:
                c.decode_step(s, [] {});
                break;
              case mode::retier:
                c.retier_serial(pct, s);
                break;
              case mode::serial:
                c.decode_step(s, [] {});
                c.retier_serial(pct, s);
                break;
              case mode::overlap:
              case mode::overlap_eq: {
                cudaStream_t side = m == mode::overlap ? dev.side : dev.side_eq;
                die_if(cuda::mark_sources_ready(c.ev, s));
                c.decode_step(s, [&] {
                  die_if(cuda::enqueue_retier_async<G, recent, stale>(
                      c.batch(pct, c.dst_async.get()), c.ev, side));
                });
                break;
              }
            }
          };
          step_timer t;
          if (first())
            for (int i = 0; i < warm; ++i) t.step(c.ev.converted(), enqueue);
          if (overlap) CK(cudaMemsetAsync(c.dst_async.get(), 0, c.dst_async.bytes(), s));
          double main_us = 0;
          for (auto _ : st) {
            const auto [m_us, wall_us] = t.step(c.ev.converted(), enqueue);
            st.SetIterationTime(wall_us * 1e-6);
            main_us = m_us;
          }
          st.counters["main_us"] = main_us;
          st.counters["live_pages"] = c.live;
          st.counters["retier_pages"] = m == mode::decode ? 0 : c.lists_of(pct).n;
          if (overlap) {
            CK(cudaDeviceSynchronize());
            const auto [outputs_equal, pages_equal] = c.check(pct, s);
            if (!outputs_equal || !pages_equal) checks_failed = true;
            st.counters["outputs_bit_equal"] = outputs_equal ? 1 : 0;
            st.counters["retiered_bytes_equal"] = pages_equal ? 1 : 0;
          }
        });
    gpu_bench(b, reps);
  };
  add(mode::decode, 0);
  for (int pct : {1, 5})
    for (mode m : {mode::retier, mode::serial, mode::overlap, mode::overlap_eq}) add(m, pct);
}

void register_all() {
  for (int layers : {1, 16})
    for (int B : {8, 32}) {
      register_case<g256>(B, layers);
      register_case<g128>(B, layers);
    }
}

void setup(const device_facts& f) {
  dev.sms = f.sms;
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CK(cudaStreamCreateWithPriority(&dev.main, cudaStreamNonBlocking, greatest));
  dev.side = take(cuda::create_side_stream());
  CK(cudaStreamCreateWithPriority(&dev.side_eq, cudaStreamNonBlocking, greatest));
  dev.flush = std::make_unique<l2_flusher>(f.l2_bytes);
  add_context("l2_flush_bytes", std::to_string(dev.flush->bytes()));
  add_context("stream_priorities",
              "main " + std::to_string(greatest) + ", side " + std::to_string(least));
  add_context("step",
              "L layer decodes in sequence (live = one layer's pages; retier_pages = pct x live x "
              "L), tiered mix, context 32768, median of 25 steps after 3 warm-up");
}

void teardown() {
  cache.clear();
  dev.flush.reset();
  for (cudaStream_t s : {dev.main, dev.side, dev.side_eq})
    if (s) cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  program p;
  p.name = "gpubench_retier_overlap";
  p.summary =
      "A decode step with a retier batch on a side stream (docs/tiering.md), on Google Benchmark.";
  p.setup = setup;
  p.register_benchmarks = register_all;
  p.teardown = teardown;
  p.exit_status = [] { return checks_failed ? 2 : 0; };
  return run(argc, argv, p);
}
