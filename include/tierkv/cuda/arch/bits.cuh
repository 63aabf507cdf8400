// SPDX-License-Identifier: Apache-2.0
// Bit-level PTX the lookups need: and with an immediate, prmt (byte permute) and lop3 bit
// select, written as asm so the compiler neither masks nor narrows them.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>
namespace tierkv::cuda::detail {

// The TQ3 lookups' selectors: code words with bit 3 of each nibble cleared by one and (the
// lookup of the high 16 bits takes a shift), and the generic prmt, which reads the 4 nibbles
// of c[15:0]. __byte_perm masks its selector to 3-bit fields on every call, and the compiler
// then also narrowed the word's mask per 16-bit half: 3 and 1 ALU instructions more per 8
// codes than needed (d = 256 SASS: 64 ands and 32 shifts a step for 32 words).
template <std::uint32_t Mask>
__device__ __forceinline__ std::uint32_t mask_codes(std::uint32_t w) {
  std::uint32_t r;
  asm("and.b32 %0, %1, %2;" : "=r"(r) : "r"(w), "n"(Mask));
  return r;
}
__device__ __forceinline__ std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
  std::uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
// The bits of a where m is set, of b elsewhere (one lop3).
__device__ __forceinline__ std::uint32_t bit_select(std::uint32_t a, std::uint32_t b,
                                                    std::uint32_t m) {
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(m));
  return r;
}

}  // namespace tierkv::cuda::detail
