// SPDX-License-Identifier: Apache-2.0
// gpubench_unpack [--out FILE.json] [--commit SHA] [--benchmark_* flags]: throughput of the
// code -> f16 operand conversions the tensor-core decode runs per 4 codes (docs/gpu.md), each in
// a dependent-free loop over many warps so the issue rate, not latency, decides:
//   tq3_table: TQ3 values (f16): 2 prmt table lookups (low / high bytes) + 2 prmt interleaves
//              (TQ3 keys take 1 prmt into int8 levels since the int8 key product);
//   tq3_e4m3:  TQ3 with E4M3-exact levels (a lead, not built): 1 prmt lookup of E4M3 bytes
//              + 2 cvt.f16x2.e4m3x2;
//   fp8_cvt:   FP8 E4M3 pages: 2 cvt.f16x2.e4m3x2;
//   tq4_lop3:  TQ4 nibbles: 2 lop3 (+ shifts);
//   int8_prmt: int8_rotated: 2 prmt + 2 hsub2.
// Each variant folds its 2 half2 results into an accumulator with one xor, and advances its
// input word with one integer multiply-add, the same in every variant (a baseline row times
// that loop alone). Google Benchmark: unpack/variant:<v>/iters:4096, 8 blocks of 256 threads per
// SM, 5 repetitions of one timed call after 1 warm-up call (bench_support.cuh's timing); the
// record takes the fastest (the "min" aggregate), as the hand-rolled loop took the best of 5.
// Counters: ns_per_4codes_per_sm (lower is better), groups_per_sm. bench/gpu/gbench_record.py
// turns the JSON into the unpack record (rows of variant, ms, ns_per_4codes_per_sm, net_ns).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bench_support.cuh"
#include "gbench_main.hpp"
#include "tierkv/codec/tq3.hpp"

namespace {

using namespace tierkv::bench;

enum variant : int { baseline = 0, tq3_table, tq3_e4m3, fp8_cvt, tq4_lop3, int8_prmt, variants };
const char* names[variants] = {"baseline", "tq3_table", "tq3_e4m3",
                               "fp8_cvt",  "tq4_lop3",  "int8_prmt"};

__device__ __forceinline__ std::uint32_t e4m3x2(std::uint32_t w) {
  const __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return std::uint32_t(r.x) | (std::uint32_t(r.y) << 16);
}

template <int V>
__global__ void __launch_bounds__(256)
    unpack_kernel(int iters, std::uint32_t seed, std::uint32_t* sink) {
  // 4 independent streams per thread so the loop is issue-bound, not latency-bound
  std::uint32_t w[4], acc[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    w[s] = seed ^ (threadIdx.x * 0x9e3779b9u) ^ (blockIdx.x * 0x85ebca6bu) ^ (s * 0xc2b2ae35u);
    acc[s] = 0u;
  }
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      std::uint32_t a = w[s], b = 0u;  // baseline: the loop's own multiply-add and xor
      if constexpr (V == tq3_table) {
        const std::uint32_t sel = w[s] & 0x7777u;
        const std::uint32_t lo =
            __byte_perm(tierkv::detail::tq3_f16_lo0, tierkv::detail::tq3_f16_lo1, sel);
        const std::uint32_t hi =
            __byte_perm(tierkv::detail::tq3_f16_hi0, tierkv::detail::tq3_f16_hi1, sel);
        a = __byte_perm(lo, hi, 0x5140);
        b = __byte_perm(lo, hi, 0x7362);
      } else if constexpr (V == tq3_e4m3) {
        // E4M3 bytes of -3.25, -2, -1.125, -0.375, 0.375, 1.125, 2, 3.25 (codes 0..7)
        const std::uint32_t bytes = __byte_perm(0xACB9C0C5u, 0x4540392Cu, w[s] & 0x7777u);
        a = e4m3x2(bytes);
        b = e4m3x2(bytes >> 16);
      } else if constexpr (V == fp8_cvt) {
        a = e4m3x2(w[s] & 0x7f7f7f7fu);
        b = e4m3x2((w[s] >> 16) & 0x7f7fu);
      } else if constexpr (V == tq4_lop3) {
        a = (w[s] & 0x000F000Fu) | 0x64006400u;
        b = ((w[s] >> 4) & 0x000F000Fu) | 0x64006400u;
      } else if constexpr (V == int8_prmt) {
        const std::uint32_t h0 = __byte_perm(w[s] ^ 0x8080u, 0x64646464u, 0x4140);
        const std::uint32_t h1 = __byte_perm((w[s] >> 16) ^ 0x8080u, 0x64646464u, 0x4140);
        const __half2 k = __half2(__half(1152.f), __half(1152.f));
        const __half2 r0 = __hsub2(*reinterpret_cast<const __half2*>(&h0), k);
        const __half2 r1 = __hsub2(*reinterpret_cast<const __half2*>(&h1), k);
        a = *reinterpret_cast<const std::uint32_t*>(&r0);
        b = *reinterpret_cast<const std::uint32_t*>(&r1);
      }
      acc[s] ^= a ^ b;
      w[s] = w[s] * 1664525u + 1013904223u;
    }
  }
  const std::uint32_t r = acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
  if (r == 0x12345678u) sink[0] = r;  // keeps the loop; practically never taken
}

struct device_state {
  cudaStream_t stream = nullptr;
  int sms = 0;
  std::unique_ptr<l2_flusher> flush;
  device_array<std::uint32_t> sink;
};
std::unique_ptr<device_state> dev;

constexpr int iters = 4096, reps = 5;

template <int V>
void register_variant() {
  auto* b = benchmark::RegisterBenchmark(
      bench_name("unpack").add("variant", names[V]).c_str(),
      [first = first_time(), seed = std::make_shared<unsigned>(7u)](benchmark::State& st) {
        const int it = int(st.range(0));
        const int blocks = dev->sms * 8;  // 8 x 256 threads = full occupancy
        cudaStream_t s = dev->stream;
        if (first()) {
          unpack_kernel<V><<<blocks, 256, 0, s>>>(it, 1u, dev->sink.get());
          CK(cudaStreamSynchronize(s));
        }
        gpu_timer t(s, dev->flush.get());
        const double us = timed_iterations(st, t, [&] {
          unpack_kernel<V><<<blocks, 256, 0, s>>>(it, (*seed)++, dev->sink.get());
        });
        CK(cudaGetLastError());
        // groups of 4 codes converted per SM: threads per SM x iterations x 4 streams
        const double groups_per_sm = 8.0 * 256 * it * 4;
        st.counters["groups_per_sm"] = groups_per_sm;
        st.counters["ns_per_4codes_per_sm"] = us * 1e3 / groups_per_sm;
      });
  gpu_bench(b, reps)->Args({iters})->ArgNames({"iters"});
}

void register_all() {
  register_variant<baseline>();
  register_variant<tq3_table>();
  register_variant<tq3_e4m3>();
  register_variant<fp8_cvt>();
  register_variant<tq4_lop3>();
  register_variant<int8_prmt>();
}

void setup(const device_facts& f) {
  dev = std::make_unique<device_state>();
  CK(cudaStreamCreate(&dev->stream));
  dev->sms = f.sms;
  dev->flush = std::make_unique<l2_flusher>(f.l2_bytes);
  dev->sink = device_array<std::uint32_t>(1);
}

void teardown() {
  if (!dev) return;
  cudaStream_t s = dev->stream;
  dev.reset();
  if (s) cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  program p;
  p.name = "gpubench_unpack";
  p.summary =
      "Code -> f16 operand conversion cost per format (ns per 4 codes per SM), on Google "
      "Benchmark.";
  p.setup = setup;
  p.register_benchmarks = register_all;
  p.teardown = teardown;
  return run(argc, argv, p);
}
