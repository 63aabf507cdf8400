// SPDX-License-Identifier: Apache-2.0
// CUDA consumer of the installed package: the umbrella header and a kernel header compile
// under nvcc with only what the exported target carries.
#include <cstdio>
#include <tierkv/cuda/codec_kernels.cuh>
#include <tierkv/tierkv.hpp>

__global__ void touch(int* out) {
  const tierkv::codec_context ctx = tierkv::make_codec_context(1, 2, 3, tierkv::kv_role::key);
  *out = static_cast<int>(ctx.seed & 0xff);
}

int main() {
  std::printf("tierkv CUDA consumer compiled (kernel %p)\n", reinterpret_cast<void*>(&touch));
  return 0;
}
