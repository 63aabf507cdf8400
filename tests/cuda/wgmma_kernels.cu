// SPDX-License-Identifier: Apache-2.0
#include "wgmma_kernels.hpp"

#include <cuda_runtime.h>

#include "cuda_test.hpp"
#include "tierkv/cuda/arch/wgmma.cuh"

namespace cuda_test {
namespace {

using namespace tierkv::cuda::detail;

constexpr int M = 64, N = 32, D = 256;  // rows, tokens, head_dim

__device__ std::uint64_t descriptor(const std::uint8_t* at, std::uint32_t lbo, std::uint32_t sbo,
                                    bool swapped) {
  return swapped ? wgmma_descriptor(at, sbo, lbo) : wgmma_descriptor(at, lbo, sbo);
}

__global__ void __launch_bounds__(128)
    scores_kernel(const std::uint16_t* q, const std::uint16_t* k, float* s, bool swapped) {
  extern __shared__ __align__(128) std::uint8_t smem[];
  std::uint8_t* qs = smem;
  std::uint8_t* ks = smem + M * D * 2;
  const int t = int(threadIdx.x);
  for (int i = t; i < M * D; i += 128)
    *reinterpret_cast<std::uint16_t*>(qs + kmajor_offset(i / D, i % D, D)) = q[i];
  for (int i = t; i < N * D; i += 128)
    *reinterpret_cast<std::uint16_t*>(ks + kmajor_offset(i / D, i % D, D)) = k[i];
  fence_proxy_async_shared();
  __syncthreads();
  float d[16];
  wgmma_fence();
  constexpr std::uint32_t lbo = wgmma_core_bytes, sbo = D / 8 * wgmma_core_bytes;
#pragma unroll
  for (int step = 0; step < D / 16; ++step) {
    const int at = step * 2 * wgmma_core_bytes;  // two K-adjacent core matrices a k-step
    wgmma_m64n32k16_f16(d, descriptor(qs + at, lbo, sbo, swapped),
                        descriptor(ks + at, lbo, sbo, swapped), step > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  const int warp = t / 32, lane = t % 32, row = 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int col = 8 * j + 2 * (lane % 4);
    s[row * N + col] = d[4 * j];
    s[row * N + col + 1] = d[4 * j + 1];
    s[(row + 8) * N + col] = d[4 * j + 2];
    s[(row + 8) * N + col + 1] = d[4 * j + 3];
  }
}

template <bool MnMajor>
__global__ void __launch_bounds__(128)
    values_kernel(const std::uint16_t* p, const std::uint16_t* v, float* o, bool swapped) {
  extern __shared__ __align__(128) std::uint8_t smem[];
  const int t = int(threadIdx.x);
  // B = V (K = tokens, N = dims): K-major, V^T's rows are the dims with the tokens contiguous;
  // MN-major, V's token rows with 8 dims contiguous (the transpose flag)
  for (int i = t; i < N * D; i += 128)
    *reinterpret_cast<std::uint16_t*>(
        smem + (MnMajor ? mnmajor_offset(i / D, i % D, N) : kmajor_offset(i % D, i / D, N))) = v[i];
  fence_proxy_async_shared();
  __syncthreads();
  const int warp = t / 32, lane = t % 32, g = lane / 4, c = lane % 4, row = 16 * warp + g;
  auto pair = [&](int r, int col) {
    return std::uint32_t(p[r * N + col]) | (std::uint32_t(p[r * N + col + 1]) << 16);
  };
  float d[128];
  constexpr std::uint32_t lbo = wgmma_core_bytes, sbo = N / 8 * wgmma_core_bytes;
#pragma unroll
  for (int step = 0; step < N / 16; ++step) {
    const int k0 = 16 * step;
    const std::uint32_t a[4] = {pair(row, k0 + 2 * c), pair(row + 8, k0 + 2 * c),
                                pair(row, k0 + 2 * c + 8), pair(row + 8, k0 + 2 * c + 8)};
    wgmma_fence();
    wgmma_m64n256k16_bf16_rs<MnMajor>(
        d, a, descriptor(smem + step * 2 * wgmma_core_bytes, lbo, sbo, swapped), step > 0);
    wgmma_commit();
    wgmma_wait<0>();
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int col = 8 * j + 2 * c;
    o[row * D + col] = d[4 * j];
    o[row * D + col + 1] = d[4 * j + 1];
    o[(row + 8) * D + col] = d[4 * j + 2];
    o[(row + 8) * D + col + 1] = d[4 * j + 3];
  }
}

__global__ void probe_kernel(int* built) { *built = TIERKV_HAS_WGMMA; }

template <class Kernel>
void launch(Kernel kernel, int smem_bytes, const std::uint16_t* a, const std::uint16_t* b,
            float* out, bool swapped) {
  CUDA_OK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  kernel<<<1, 128, smem_bytes>>>(a, b, out, swapped);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace

bool wgmma_built() {
  device_buffer<int> flag(1);
  probe_kernel<<<1, 1>>>(flag.p);
  CUDA_OK(cudaGetLastError());
  return flag.get()[0] == 1;
}

void wgmma_scores(const std::uint16_t* q, const std::uint16_t* k, float* s, bool swapped) {
  launch(scores_kernel, (M + N) * D * 2, q, k, s, swapped);
}

void wgmma_values(const std::uint16_t* p, const std::uint16_t* v, float* o, bool swapped,
                  bool mn_major) {
  if (mn_major)
    launch(values_kernel<true>, N * D * 2, p, v, o, swapped);
  else
    launch(values_kernel<false>, N * D * 2, p, v, o, swapped);
}

}  // namespace cuda_test
