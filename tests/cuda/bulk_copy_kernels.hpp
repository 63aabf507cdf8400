// SPDX-License-Identifier: Apache-2.0
// test_cuda_bulk_copy's device side (bulk_copy_kernels.cu).
#pragma once

#include <cstdint>

namespace cuda_test {

// Tiles streamed through `stages` shared-memory staging areas of `area_bytes` each, as prefill
// fetches its KV tiles (cuda/prefill/tensor_core.cuh): in passes [cuts[p], cuts[p + 1]) for p <
// `passes`, each a pipeline of its own (tile t in area (t - cuts[p]) % stages) over barriers whose
// phases carry on from the passes before. Tile t's `ranges` ranges (range r: bytes[t * ranges + r]
// bytes from src + src_off[...] to the area's offset dst_off[...]; 0 bytes: none) are bulk copies
// by lanes of warp 0 completing on the area's mbarrier; the block waits on the phase's parity,
// copies the area to out + t * area_bytes, zeroes it and lets the area refill. Each of `blocks`
// blocks streams the same tiles to its own out (out + block * cuts[passes] * area_bytes).
// Offsets and sizes: multiples of 16; ranges <= 32.
void bulk_copy_stream(const std::uint8_t* src, const std::int32_t* src_off,
                      const std::int32_t* dst_off, const std::int32_t* bytes, int ranges,
                      const std::int32_t* cuts, int passes, int stages, int area_bytes, int blocks,
                      std::uint8_t* out);

}  // namespace cuda_test
