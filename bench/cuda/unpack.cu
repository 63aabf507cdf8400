// SPDX-License-Identifier: Apache-2.0
// gpubench_unpack [--out FILE.json]: throughput of the code -> f16 operand conversions the
// tensor-core decode runs per 4 codes (docs/gpu.md), each in a dependent-free loop over many
// warps so the issue rate, not latency, decides:
//   tq3_table: TQ3 values (f16): 2 prmt table lookups (low / high bytes) + 2 prmt interleaves
//              (TQ3 keys take 1 prmt into int8 levels since the int8 key product);
//   tq3_e4m3:  TQ3 with E4M3-exact levels (a lead, not built): 1 prmt lookup of E4M3 bytes
//              + 2 cvt.f16x2.e4m3x2;
//   fp8_cvt:   FP8 E4M3 pages: 2 cvt.f16x2.e4m3x2;
//   tq4_lop3:  TQ4 nibbles: 2 lop3 (+ shifts);
//   int8_prmt: int8_rotated: 2 prmt + 2 hsub2.
// Each variant folds its 2 half2 results into an accumulator with one xor, and advances its
// input word with one integer multiply-add, the same in every variant (a baseline row times
// that loop alone). Reported: ns per 4 codes per SM (lower is better).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "bench_support.cuh"
#include "tierkv/codec/tq3.hpp"

namespace {

using tierkv::bench::die_if;

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

template <int V>
float time_variant(int blocks, int iters, std::uint32_t* sink) {
  cudaEvent_t a, b;
  die_if(cudaEventCreate(&a), "event");
  die_if(cudaEventCreate(&b), "event");
  unpack_kernel<V><<<blocks, 256>>>(iters, 1u, sink);  // warm-up
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    die_if(cudaEventRecord(a), "record");
    unpack_kernel<V><<<blocks, 256>>>(iters, 7u + unsigned(rep), sink);
    die_if(cudaEventRecord(b), "record");
    die_if(cudaEventSynchronize(b), "sync");
    float ms = 0.f;
    die_if(cudaEventElapsedTime(&ms, a, b), "elapsed");
    best = ms < best ? ms : best;
  }
  die_if(cudaGetLastError(), "unpack_kernel");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc)
      out = argv[++i];
    else {
      std::fprintf(stderr, "gpubench_unpack: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  die_if(cudaGetDeviceProperties(&prop, 0), "props");
  std::uint32_t* sink;
  die_if(cudaMalloc(&sink, 4), "malloc");
  const int blocks = prop.multiProcessorCount * 8;  // 8 x 256 threads = full occupancy
  const int iters = 4096;
  float ms[variants];
  ms[baseline] = time_variant<baseline>(blocks, iters, sink);
  ms[tq3_table] = time_variant<tq3_table>(blocks, iters, sink);
  ms[tq3_e4m3] = time_variant<tq3_e4m3>(blocks, iters, sink);
  ms[fp8_cvt] = time_variant<fp8_cvt>(blocks, iters, sink);
  ms[tq4_lop3] = time_variant<tq4_lop3>(blocks, iters, sink);
  ms[int8_prmt] = time_variant<int8_prmt>(blocks, iters, sink);
  // groups of 4 codes converted per SM: threads per SM x iterations x 4 streams
  const double groups_per_sm = 8.0 * 256 * iters * 4;
  std::printf("device %s, %d SMs; %d blocks x 256 threads, %d iterations x 4 streams\n", prop.name,
              prop.multiProcessorCount, blocks, iters);
  std::printf("%-10s %10s %16s %22s\n", "variant", "ms", "ns/4 codes/SM", "minus baseline");
  std::string js = "{\"name\":\"unpack\",\"device\":\"" + std::string(prop.name) + "\",\"rows\":[";
  for (int v = 0; v < variants; ++v) {
    const double ns = double(ms[v]) * 1e6 / groups_per_sm;
    const double net = double(ms[v] - ms[baseline]) * 1e6 / groups_per_sm;
    std::printf("%-10s %10.3f %16.4f %22.4f\n", names[v], ms[v], ns, net);
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "%s{\"variant\":\"%s\",\"ms\":%.4f,\"ns_per_4codes_per_sm\":%.5f,\"net_ns\":%.5f}",
        v ? "," : "", names[v], double(ms[v]), ns, net);
    js += buf;
  }
  js += "]}";
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (f) {
      std::fprintf(f, "%s\n", js.c_str());
      std::fclose(f);
    }
  }
  cudaFree(sink);
  return 0;
}
