// SPDX-License-Identifier: Apache-2.0
// Shared by the GPU benchmarks (bench/cuda/*.cu, Google Benchmark programs run through
// gbench_main.hpp): fatal error checks, random page / query generators (FP8 codes never NaN,
// bf16 metadata positive and finite, floats never zero), device memory and graph holders, and
// the timing every kernel benchmark uses:
//   * before each timed call the L2 is flushed by a read of a scratch buffer twice the L2's
//     size (l2_flusher: a read, not a memset, so the timed call finds clean lines to evict and
//     not a memset's dirty ones to write back), so every call reads its pages from HBM;
//   * then a ~100 us spin kernel is enqueued and the timed work behind it, between two CUDA
//     events: the host enqueues the work while the GPU spins, so the events measure GPU time
//     and not the host's launch latency (an engine enqueues its steps ahead, like here);
//   * one Google Benchmark iteration is one timed call, its event time the iteration's manual
//     time (UseManualTime); gpu_bench() gives a benchmark 1 iteration x N repetitions and
//     reports their aggregates (mean, median, stddev, cv, min); the records take the median.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gbench_main.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::bench {

inline void die_if(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
inline void die_if(const status& s) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    std::exit(1);
  }
}
// The value of a result, or exit(1) with its status.
template <class T>
T take(result<T>&& r) {
  die_if(r.error_status());
  return std::move(r).value();
}

}  // namespace tierkv::bench

#define CK(call) ::tierkv::bench::die_if((call), #call)

namespace tierkv::bench {

// Random page bytes: FP8 codes never NaN; meta overwritten by fill_meta (positive, finite).
__global__ void fill_pages(std::uint8_t* p, std::size_t n, std::uint64_t seed, int fp8) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint8_t v = std::uint8_t(mix64(seed ^ (i * 0x9e3779b97f4a7c15ull)) >> 24);
    if (fp8 && (v & 0x7f) == 0x7f) v = 0x3c;
    p[i] = v;
  }
}
// Random bf16 values of magnitude 2^-3 .. 2^1 (dense bf16 pages: no NaN, no overflowing scores).
__global__ void fill_bf16(std::uint8_t* p, std::size_t n, std::uint64_t seed) {
  std::uint16_t* h = reinterpret_cast<std::uint16_t*>(p);
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n / 2;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::uint64_t r = mix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
    const std::uint32_t sign = std::uint32_t(r >> 63) << 15,
                        exp = 124u + std::uint32_t(r >> 40) % 4u;
    h[i] = std::uint16_t(sign | (exp << 7) | std::uint32_t(r & 0x7fu));
  }
}
__global__ void fill_meta(std::uint8_t* base, std::size_t page_bytes, std::size_t meta_offset,
                          std::size_t meta_count, std::uint32_t pages, float lo,
                          std::uint64_t seed) {
  const std::size_t n = std::size_t(pages) * meta_count;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const std::size_t page = i / meta_count, j = i % meta_count;
    const float u = float(mix64(seed + i) >> 40) * (1.f / 16777216.f);
    const float v = lo * (0.5f + u);
    std::uint32_t bits;
    std::memcpy(&bits, &v, 4);
    reinterpret_cast<std::uint16_t*>(base + page * page_bytes + meta_offset)[j] =
        std::uint16_t(bits >> 16);
  }
}
__global__ void fill_floats(float* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const float u = float(mix64(seed + i) >> 40) * (1.f / 16777216.f);
    p[i] = (u - 0.5f) * 3.f + (u > 0.5f ? 0.01f : -0.01f);
  }
}

// Keeps the stream busy for `cycles` SM clocks (~100 us at 2e5): timed work enqueued behind
// it starts as soon as it ends, so CUDA-event timings measure GPU time and not the host's
// launch latency (an engine's decode steps are enqueued ahead, like here).
__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
inline void spin(cudaStream_t s, long long cycles = 200000) { spin_kernel<<<1, 1, 0, s>>>(cycles); }

// Device memory of n T (at least one element is allocated), freed with its holder.
template <class T>
class device_array {
 public:
  device_array() = default;
  explicit device_array(std::size_t n) : n_(n) {
    CK(cudaMalloc(&p_, sizeof(T) * std::max<std::size_t>(n, 1)));
  }
  explicit device_array(const std::vector<T>& host) : device_array(host.size()) {
    if (!host.empty())
      CK(cudaMemcpy(p_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  }
  device_array(device_array&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(o.n_) {}
  device_array& operator=(device_array&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() {
    if (p_) cudaFree(p_);  // unchecked: a holder may outlive the context at exit
  }
  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    if (n_) CK(cudaMemcpy(h.data(), p_, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

// Index arrays of B sequences whose page i lies in tier tier[i] (0 or 1): each sequence's pages
// of a tier on consecutive slots of that tier's pool, or (shared) every sequence naming the first
// one's slots (a prefix the batch shares). counts: [sequence][tier] pages, the planner's input.
struct two_tier_index {
  std::vector<std::int32_t> counts;
  device_array<std::int32_t> indptr[2], slot[2], logical[2];

  two_tier_index() = default;
  two_tier_index(const std::vector<int>& tier, int B, bool shared = false) {
    int per_seq[2] = {0, 0};
    for (int t : tier) ++per_seq[t];
    std::vector<std::int32_t> ip[2], sl[2], lg[2];
    int next[2] = {0, 0};
    for (int b = 0; b < B; ++b) {
      counts.push_back(per_seq[0]);
      counts.push_back(per_seq[1]);
      if (shared) next[0] = next[1] = 0;
      for (std::size_t i = 0; i < tier.size(); ++i) {
        const int f = tier[i];
        sl[f].push_back(next[f]++);
        lg[f].push_back(std::int32_t(i));
      }
    }
    for (int f = 0; f < 2; ++f) {
      for (int b = 0; b <= B; ++b) ip[f].push_back(b * per_seq[f]);
      indptr[f] = device_array<std::int32_t>(ip[f]);
      slot[f] = device_array<std::int32_t>(sl[f]);
      logical[f] = device_array<std::int32_t>(lg[f]);
    }
  }
};

// An instantiated CUDA graph of what `enqueue` puts on the stream.
class graph_exec {
 public:
  graph_exec() = default;
  template <class F>
  static graph_exec capture(cudaStream_t s, F&& enqueue) {
    cudaGraph_t g = nullptr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CK(cudaStreamEndCapture(s, &g));
    graph_exec e;
    CK(cudaGraphInstantiate(&e.exec_, g, 0));
    CK(cudaGraphDestroy(g));
    return e;
  }
  graph_exec(graph_exec&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
  graph_exec& operator=(graph_exec&& o) noexcept {
    std::swap(exec_, o.exec_);
    return *this;
  }
  graph_exec(const graph_exec&) = delete;
  graph_exec& operator=(const graph_exec&) = delete;
  ~graph_exec() {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  explicit operator bool() const { return exec_ != nullptr; }
  void launch(cudaStream_t s) const { CK(cudaGraphLaunch(exec_, s)); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// Reads n 16-byte words through the L2 (ld.global.cg: cached in L2, not L1). The buffer is
// zeros, so the store never happens; it keeps the loads.
__global__ void l2_flush_kernel(const uint4* p, std::size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// Evicts the L2 between timed calls: reads 2 x the L2's size (at least 64 MiB) of a scratch
// buffer (H100 / H200: 50 / 60 MB of L2, 100 / 120 MB read, ~30 us), enqueued before the
// spin kernel, so outside the timed region.
class l2_flusher {
 public:
  explicit l2_flusher(std::size_t l2_bytes)
      : words_(std::max<std::size_t>(2 * l2_bytes, std::size_t(64) << 20) / 16), sink_(1) {
    CK(cudaMemset(words_.get(), 0, words_.bytes()));
  }
  void run(cudaStream_t s) const {
    l2_flush_kernel<<<1024, 256, 0, s>>>(words_.get(), words_.size(), sink_.get());
  }
  std::size_t bytes() const { return words_.bytes(); }

 private:
  device_array<uint4> words_;
  device_array<unsigned> sink_;
};

// One timed call: the L2 flushed (when a flusher is given), the spin kernel, then `enqueue`'s
// work between two events on stream s. Returns its GPU time in microseconds.
class gpu_timer {
 public:
  gpu_timer(cudaStream_t s, const l2_flusher* flush) : s_(s), flush_(flush) {
    CK(cudaEventCreate(&a_));
    CK(cudaEventCreate(&b_));
  }
  ~gpu_timer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  gpu_timer(const gpu_timer&) = delete;
  gpu_timer& operator=(const gpu_timer&) = delete;
  template <class F>
  double us(F&& enqueue) {
    if (flush_) flush_->run(s_);
    spin(s_);
    CK(cudaEventRecord(a_, s_));
    enqueue();
    CK(cudaEventRecord(b_, s_));
    CK(cudaEventSynchronize(b_));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a_, b_));
    return double(ms) * 1e3;
  }

 private:
  cudaStream_t s_;
  const l2_flusher* flush_;
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

// The benchmark loop: one timed call per iteration, its GPU time the manual time. Returns the
// mean of the iterations' microseconds (gpu_bench: one iteration, so that call's time).
template <class F>
double timed_iterations(benchmark::State& st, gpu_timer& t, F&& enqueue) {
  double sum = 0;
  std::int64_t n = 0;
  for (auto _ : st) {
    const double us = t.us(enqueue);
    st.SetIterationTime(us * 1e-6);
    sum += us;
    ++n;
  }
  return n > 0 ? sum / double(n) : 0.0;
}

// `calls` untimed calls, then a synchronize: before a benchmark's first timed call (module
// loading, first touch of the buffers, clocks ramping up).
template <class F>
void warm_up(cudaStream_t s, int calls, F&& enqueue) {
  for (int i = 0; i < calls; ++i) enqueue();
  CK(cudaStreamSynchronize(s));
}

// True the first time it is asked (a benchmark's first repetition warms up); copies share it.
class first_time {
 public:
  bool operator()() const { return !std::exchange(*done_, true); }

 private:
  std::shared_ptr<bool> done_ = std::make_shared<bool>(false);
};

// Median of `reps` timed calls after `warm` untimed ones: the calibrations a program makes once
// (copy roofline, launch floor) before its benchmarks, for their counters and the context.
template <class F>
double median_us(gpu_timer& t, cudaStream_t s, int warm, int reps, F&& enqueue) {
  warm_up(s, warm, enqueue);
  std::vector<double> v;
  for (int i = 0; i < reps; ++i) v.push_back(t.us(enqueue));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

inline double min_of(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

// A timed GPU benchmark: manual time in microseconds, 1 iteration (one timed call) x
// `repetitions`, only the aggregates reported (mean, median, stddev, cv and min).
template <class B>
B* gpu_bench(B* b, int repetitions) {
  return b->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->Iterations(1)
      ->Repetitions(repetitions)
      ->ReportAggregatesOnly(true)
      ->ComputeStatistics("min", &min_of);
}

// The device state of one benchmark case, kept while consecutive benchmarks (a case's
// repetitions, the paths timed on the same inputs) ask for the same key and freed before
// another key's is built, so one case's buffers are alive at a time.
class case_cache {
 public:
  template <class T, class Make>
  T& get(const std::string& key, Make&& make) {
    if (key != key_ || !obj_) {
      obj_.reset();
      key_.clear();
      std::shared_ptr<T> made = make();
      obj_ = made;
      key_ = key;
    }
    return *static_cast<T*>(obj_.get());
  }
  void clear() {
    obj_.reset();
    key_.clear();
  }

 private:
  std::string key_;
  std::shared_ptr<void> obj_;
};

}  // namespace tierkv::bench
