// SPDX-License-Identifier: Apache-2.0
// test_cuda_wgmma's device side (wgmma_kernels.cu, built for sm_90a alone: tests/CMakeLists.txt).
#pragma once

#include <cstdint>

namespace cuda_test {

// Whether wgmma_kernels.cu was compiled with the wgmma instructions (TIERKV_HAS_WGMMA).
bool wgmma_built();
// One warpgroup: s (64 x 32, f32) = q (64 x 256) k^T (k: 32 x 256), f16 bit patterns, row-major,
// by 16 k-steps of m64n32k16 over the no-swizzle K-major layout. swapped: the descriptors'
// leading and stride byte offsets exchanged (a diagnostic of the layout reading).
void wgmma_scores(const std::uint16_t* q, const std::uint16_t* k, float* s, bool swapped);
// One warpgroup: o (64 x 256, f32) = p (64 x 32) v (32 x 256), bf16 bit patterns, row-major; p
// as register fragments, v in shared memory transposed into the K-major layout or, mn_major, as
// token rows in the MN-major layout (the transpose flag), 2 k-steps of m64n256k16.
void wgmma_values(const std::uint16_t* p, const std::uint16_t* v, float* o, bool swapped,
                  bool mn_major);

}  // namespace cuda_test
