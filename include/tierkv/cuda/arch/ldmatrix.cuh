// SPDX-License-Identifier: Apache-2.0
// ldmatrix (shared memory -> mma fragments, sm_75+) as thin PTX wrappers. Lanes 8i..8i+7 give
// the row addresses (16 bytes each) of 8x8 b16 matrix i; register i of lane l receives matrix
// i's row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 (trans: that column's rows, i.e. the
// transposed matrix's element pair).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>
namespace tierkv::cuda::detail {

__device__ __forceinline__ std::uint32_t shared_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

}  // namespace tierkv::cuda::detail
