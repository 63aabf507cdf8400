// SPDX-License-Identifier: Apache-2.0
// A lane's P consecutive floats of shared memory, loaded and stored in the widest aligned vectors
// (the decode and prefill kernels' per-lane rows of a head).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <cstdint>

#include "tierkv/cuda/warp/payload.cuh"
namespace tierkv::cuda::detail {

// In the widest aligned vectors (warp/payload.cuh's load_words): lanes P words apart make scalar
// accesses P-way bank conflicted (d = 256: 8-way; ~0.7 us of a chunk for each of prepare_query
// and finalize at B = 1, per-CTA %clock64 trace, docs/history/gpu-runs.md, run 12).
template <int P>
inline constexpr int lane_float_alignment = P % 4 == 0   ? 16
                                            : P % 2 == 0 ? 8
                                                         : 4;
template <int P>
__device__ __forceinline__ void load_lane_floats(const float* p, float (&x)[P]) {
  std::uint32_t w[P];
  load_words<lane_float_alignment<P>, P>(reinterpret_cast<const std::uint8_t*>(p), w);
#pragma unroll
  for (int r = 0; r < P; ++r) x[r] = __uint_as_float(w[r]);
}
template <int P>
__device__ __forceinline__ void store_lane_floats(float* p, const float (&x)[P]) {
  std::uint32_t w[P];
#pragma unroll
  for (int r = 0; r < P; ++r) w[r] = __float_as_uint(x[r]);
  store_words<lane_float_alignment<P>, P>(reinterpret_cast<std::uint8_t*>(p), w);
}

}  // namespace tierkv::cuda::detail
