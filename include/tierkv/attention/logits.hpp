// SPDX-License-Identifier: Apache-2.0
// What happens to a raw score q·k before the softmax, written once for every path (the host
// tiles, the GPU decode kernels, the GPU prefill): the softmax scale, then the soft cap.
#pragma once

#include "tierkv/core/config.hpp"

#include <cmath>

#include "tierkv/attention/partial_state.hpp"

namespace tierkv {

/// The soft cap s -> cap tanh(s / cap) (Gemma 2), in the logits' own units: natural, or base 2
/// inside kernels (a logit times log2 e), where it is z -> c tanh(z / c) with c = cap log2 e.
/// Written c - 2 c / (2^(k z) + 1) (tanh y = 1 - 2 / (e^(2y) + 1), 2^(k z) = e^(2 s / cap)):
/// one exp2 and one reciprocal, so a kernel evaluates it on the MUFU unit (tanhf, or the cap
/// before the mask, spilled registers in the tensor-core decode's step loop at its launch
/// bounds, ptxas -v). Absolute error ~2^-21 c with MUFU's exp2 and rcp, under the f16
/// probabilities' 2^-11; it saturates to ±c as 2^(k z) overflows or vanishes.
struct soft_cap {
  float c = 0.f;  ///< the cap in the logits' units (0: off)
  float k = 0.f;  ///< 2 / c in natural units, 2 / cap in base 2

  /// The cap `cap` (natural units, > 0; 0 = off) for logits in base B.
  template <log_base B>
  TIERKV_HD_INLINE static soft_cap make(float cap) {
    if (!(cap > 0.f)) return {};
    if constexpr (B == log_base::two)
      return {cap * log2e, 2.f / cap};
    else
      return {cap, 2.f * log2e / cap};
  }
  /// Whether the cap is on.
  TIERKV_HD_INLINE bool on() const { return c > 0.f; }
  /// The capped logit; Exp2 and Rcp evaluate 2^x and 1 / x (a kernel passes its MUFU forms).
  template <class Exp2, class Rcp>
  TIERKV_HD_INLINE float apply(float z, Exp2 exp2_fn, Rcp rcp_fn) const {
    return fmaf(-2.f * c, rcp_fn(exp2_fn(z * k) + 1.f), c);
  }
  /// The capped logit with the precise exp2f and division.
  TIERKV_HD_INLINE float apply(float z) const {
    return apply(
        z, [](float x) { return exp2f(x); }, [](float x) { return 1.f / x; });
  }
};

/// How a raw dot product becomes a (natural-log) logit: s = softmax_scale * (q . k), then,
/// when soft_cap > 0, s = soft_cap * tanh(s / soft_cap) (Gemma-2-style logit capping, as
/// tierkv::soft_cap evaluates it).
struct logit_params {
  float softmax_scale = 1.f;  ///< multiplies q . k
  float soft_cap = 0.f;       ///< logit soft cap (0 = off)

  /// The logit of a raw dot product.
  TIERKV_HD float apply(float dot) const {
    const float s = softmax_scale * dot;
    return soft_cap > 0.f ? tierkv::soft_cap::make<log_base::natural>(soft_cap).apply(s) : s;
  }
};

}  // namespace tierkv
