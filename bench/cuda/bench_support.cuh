// SPDX-License-Identifier: Apache-2.0
// Shared by the GPU benchmarks: fatal error checks and random page / query generators
// (FP8 codes never NaN, bf16 metadata positive and finite, floats never zero).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

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

// Random page bytes: FP8 codes never NaN; meta overwritten by fill_meta (positive, finite).
__global__ void fill_pages(std::uint8_t* p, std::size_t n, std::uint64_t seed, int fp8) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint8_t v = std::uint8_t(mix64(seed ^ (i * 0x9e3779b97f4a7c15ull)) >> 24);
    if (fp8 && (v & 0x7f) == 0x7f) v = 0x3c;
    p[i] = v;
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

}  // namespace tierkv::bench

#define CK(call) ::tierkv::bench::die_if((call), #call)
