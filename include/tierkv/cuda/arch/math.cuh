// SPDX-License-Identifier: Apache-2.0
// Special functions on the MUFU unit alone (ex2.approx, lg2.approx).
#pragma once

#include "tierkv/core/config.hpp"

#include <cmath>
namespace tierkv::cuda::detail {

// The step's exponentials and logarithms on the MUFU unit alone: exp2f / log2f compile to ~8 /
// ~30 instructions of range handling each (SASS,
// bench/results/decode/ab/ab-h200-2026-11-30-staging.txt: 12 exp2 and 2 log2 per 16-token step,
// ~150 of a TQ3 step's ~1260 instructions at d = 256). ex2.approx: ~2 ulp, results below 2^-126
// flush to 0 (probabilities that small add nothing to an f32 sum); lg2.approx.ftz: ~2^-22 absolute,
// 0 and inputs below 2^-126 -> -inf (a value scale that small weighs its token's value by 0; the
// non-ftz form took 3 more instructions per meta). The f16 probabilities that consume them keep 11
// bits.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x on the MUFU unit (rcp.approx.ftz: ~1 ulp; 1 / inf = 0).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// The MUFU forms as function objects, for the shared math that takes its 2^x and 1 / x
// (attention/logits.hpp's soft_cap).
struct mufu_exp2 {
  __device__ __forceinline__ float operator()(float x) const { return fast_exp2(x); }
};
struct mufu_rcp {
  __device__ __forceinline__ float operator()(float x) const { return fast_rcp(x); }
};
// max(a, b), NaN if either is NaN (max.NaN: the same FMNMX instruction as fmaxf, which returns the
// other operand). The online softmax's running maxima use it, so that a NaN score or value scale
// (a poisoned slot: a non-finite key or value was appended) makes its head's state NaN even when
// it is the only live token, instead of being dropped as a masked one.
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
// 2^(x - ref) for ref >= x (a running max); 0 when ref is -inf (then x is too) or x is -inf.
__device__ __forceinline__ float exp2_rel(float x, float ref) {
  return ref == -INFINITY ? 0.f : fast_exp2(x - ref);
}

}  // namespace tierkv::cuda::detail
