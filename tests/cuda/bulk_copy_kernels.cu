// SPDX-License-Identifier: Apache-2.0
#include "bulk_copy_kernels.hpp"

#include <cuda_runtime.h>

#include "cuda_test.hpp"
#include "tierkv/cuda/arch/bulk_copy.cuh"

namespace cuda_test {
namespace {

using namespace tierkv::cuda::detail;

constexpr int threads = 128;

__global__ void __launch_bounds__(threads)
    stream_kernel(const std::uint8_t* src, const std::int32_t* src_off, const std::int32_t* dst_off,
                  const std::int32_t* bytes, int ranges, const std::int32_t* cuts, int passes,
                  int stages, int area_bytes, std::uint8_t* out) {
  extern __shared__ __align__(128) std::uint8_t smem[];
  auto area = [&](int s) { return smem + std::size_t(s) * area_bytes; };
  auto bar = [&](int s) {
    return reinterpret_cast<std::uint64_t*>(smem + std::size_t(stages) * area_bytes) + s;
  };
  out += std::size_t(blockIdx.x) * cuts[passes] * area_bytes;
  const int t0 = int(threadIdx.x);
  for (int i = t0; i < stages * area_bytes; i += threads) smem[i] = 0;
  if (t0 == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(bar(s), 1);
    fence_mbarrier_init();
  }
  auto issue = [&](int t, int s) {  // warp 0: tile t into area s
    const int lane = t0;
    if (lane >= 32) return;
    const int i = t * ranges + lane;
    const unsigned b = lane < ranges ? unsigned(bytes[i]) : 0u;
    warp_expect_bytes(bar(s), b, lane);
    if (b != 0) cp_async_bulk(area(s) + dst_off[i], src + src_off[i], b, bar(s));
  };
  unsigned phases = 0;  // bit s: the parity of area s's next phase, carried across passes
  for (int pass = 0; pass < passes; ++pass) {  // tiles [a, b), area (t - a) % stages
    const int a = cuts[pass], b = cuts[pass + 1];
    fence_proxy_async_shared();  // the areas' generic accesses before the bulk copies
    __syncthreads();
    for (int t = a; t < a + stages && t < b; ++t) issue(t, (t - a) % stages);
    for (int t = a; t < b; ++t) {
      const int s = (t - a) % stages;
      mbarrier_wait_parity(bar(s), ((phases >> s) ^ unsigned((t - a) / stages)) & 1u);
      for (int i = t0; i < area_bytes; i += threads) {
        out[std::size_t(t) * area_bytes + i] = area(s)[i];
        area(s)[i] = 0;  // so a stray or missing copy of a later tile shows
      }
      fence_proxy_async_shared();  // the area's generic reads and writes before its refill
      __syncthreads();
      if (t + stages < b) issue(t + stages, s);
    }
    for (int s = 0; s < stages; ++s)
      if (b - a > s) phases ^= unsigned(((b - a - s + stages - 1) / stages) & 1) << s;
  }
  __syncthreads();
  if (t0 == 0)
    for (int s = 0; s < stages; ++s) mbarrier_inval(bar(s));
}

}  // namespace

void bulk_copy_stream(const std::uint8_t* src, const std::int32_t* src_off,
                      const std::int32_t* dst_off, const std::int32_t* bytes, int ranges,
                      const std::int32_t* cuts, int passes, int stages, int area_bytes, int blocks,
                      std::uint8_t* out) {
  const int smem = stages * area_bytes + stages * 8;
  CUDA_OK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  stream_kernel<<<blocks, threads, smem>>>(src, src_off, dst_off, bytes, ranges, cuts, passes,
                                           stages, area_bytes, out);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace cuda_test
