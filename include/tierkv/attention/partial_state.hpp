// SPDX-License-Identifier: Apache-2.0
// The online-softmax partial state {m, l, acc} of one query head over a subset of
// keys, and its log-sum-exp merge.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "tierkv/core/config.hpp"

namespace tierkv {

/// The log base of a state's m and lse. Natural at the API; kernels keep logits pre-scaled by
/// log2(e) and run base 2 (exp2 is one MUFU instruction) until a state leaves them.
enum class log_base : std::uint8_t { natural, two };

/// log2(e): a natural-log logit times this is the base-2 logit.
inline constexpr float log2e = 1.4426950408889634f;

/// The merge arithmetic every path shares (the host tiles' partial_state, the GPU decode's
/// chunk merge, the GPU prefill's split merge): a state {m, l, acc} over a set of tokens, or a
/// normalized one {lse, acc / l}, joins others under their common maximum mx by a weight
/// b^(m - mx); empty states (l = 0) weigh 0 and never evaluate -inf - -inf. A NaN l (a NaN
/// logit: a non-finite key or query) is not empty: it makes the merged l, lse and output NaN,
/// never a silent zero.
namespace softmax_merge {

/// b^x.
template <log_base B>
TIERKV_HD_INLINE float exp_b(float x) {
  if constexpr (B == log_base::two)
    return exp2f(x);
  else
    return std::exp(x);
}

/// The weight of state {m, l} under the merge maximum mx >= m: b^(m - mx), 0 when empty (l = 0).
template <log_base B>
TIERKV_HD_INLINE float state_weight(float m, float l, float mx) {
  return l != 0.f ? exp_b<B>(m - mx) : 0.f;
}

/// The weight of a normalized state known by its lse under the merge maximum mx >= lse:
/// b^(lse - mx), 0 when empty (lse = -inf).
template <log_base B>
TIERKV_HD_INLINE float lse_weight(float lse, float mx) {
  return lse > -std::numeric_limits<float>::infinity() ? exp_b<B>(lse - mx) : 0.f;
}

/// The log-sum-exp of a state {m, l} in base-B units: m + log_b(l); -inf when empty; NaN for a
/// NaN l.
template <log_base B>
TIERKV_HD_INLINE float state_lse(float m, float l) {
  if (l == 0.f) return -std::numeric_limits<float>::infinity();
  if constexpr (B == log_base::two)
    return m + log2f(l);
  else
    return m + std::log(l);
}

/// A base-B logit or lse in natural-log units.
template <log_base B>
TIERKV_HD_INLINE float to_natural(float x) {
  if constexpr (B == log_base::two)
    return x / log2e;
  else
    return x;
}

}  // namespace softmax_merge

/// Over a set S of tokens with logits s_t and values v_t (one query head):
///   m   = max_{t in S} s_t                  (-inf when S is empty)
///   l   = sum_{t in S} exp(s_t - m)         (0 when S is empty)
///   acc = sum_{t in S} exp(s_t - m) * v_t   (in the value codec's domain until finalized)
/// Log base: natural everywhere at the API (m, lse and logits are natural-log units; exp
/// is std::exp). A device kernel may evaluate exp2 on logits pre-scaled by log2(e)
/// internally, but converts back before a state leaves it.
///
/// The merge of two states over disjoint sets is exact in real arithmetic, so it is
/// commutative and associative up to float rounding, and any split of a sequence into
/// chunks merged in any order gives the unsplit result within rounding. Empty states
/// are the identity of the merge: merging with one changes nothing bit for bit, and no
/// -inf - -inf (NaN) is ever evaluated.
///
/// A trivial type (no default member initializers) so a kernel can keep it in shared
/// memory or registers: call clear() (or use partial_state::empty_state()) before use.
template <int HeadDim>
struct partial_state {
  static constexpr int head_dim = HeadDim;  ///< length of acc

  float m;             ///< running maximum logit (-inf when empty)
  float l;             ///< sum of exp(logit - m)
  float acc[HeadDim];  ///< sum of exp(logit - m) x value, in the value codec's domain

  /// An empty state (the identity of the merge).
  TIERKV_HD static partial_state empty_state() {
    partial_state s;
    s.clear();
    return s;
  }

  /// Makes the state empty.
  TIERKV_HD void clear() {
    m = -std::numeric_limits<float>::infinity();
    l = 0.f;
    for (int i = 0; i < HeadDim; ++i) acc[i] = 0.f;
  }

  /// Empty means "no token contributed". l > 0 whenever a finite logit was seen,
  /// because exp(m - m) = 1; a NaN l (a NaN logit) is not empty: it poisons what it merges into.
  TIERKV_HD bool empty() const { return l == 0.f; }

  /// Rescales this state to the running max `new_m` >= m (keeps empty states empty).
  TIERKV_HD void rescale_to(float new_m) {
    if (empty()) {
      m = new_m;
      return;
    }
    if (new_m == m) return;
    const float f = softmax_merge::state_weight<log_base::natural>(m, l, new_m);
    l *= f;
    for (int i = 0; i < HeadDim; ++i) acc[i] *= f;
    m = new_m;
  }

  /// this <- this (+) other.
  TIERKV_HD void merge(const partial_state& o) {
    if (o.empty()) return;
    if (empty()) {
      *this = o;
      return;
    }
    const float new_m = m > o.m ? m : o.m;
    const float fa = softmax_merge::state_weight<log_base::natural>(m, l, new_m);
    const float fb = softmax_merge::state_weight<log_base::natural>(o.m, o.l, new_m);
    l = l * fa + o.l * fb;
    for (int i = 0; i < HeadDim; ++i) acc[i] = acc[i] * fa + o.acc[i] * fb;
    m = new_m;
  }

  /// Natural-log log-sum-exp of the logits: m + ln(l); -inf for an empty state.
  TIERKV_HD float lse() const { return softmax_merge::state_lse<log_base::natural>(m, l); }

  /// out = acc / l, the attention output; zeros for an empty state (attention over no
  /// tokens contributes nothing, and a zero vector is what a residual add expects).
  TIERKV_HD void normalize(float* out) const {
    if (empty()) {
      for (int i = 0; i < HeadDim; ++i) out[i] = 0.f;
      return;
    }
    const float inv = 1.f / l;
    for (int i = 0; i < HeadDim; ++i) out[i] = acc[i] * inv;
  }
};

/// Mass of a sub-state (e.g. one page's {m_page, l_page}) inside a total with log-sum-exp
/// `lse`: l_page * exp(m_page - lse), the share of softmax probability on that subset.
TIERKV_HD inline float softmax_mass(float m_part, float l_part, float lse) {
  if (lse == -std::numeric_limits<float>::infinity()) return 0.f;
  return l_part * softmax_merge::state_weight<log_base::natural>(m_part, l_part, lse);
}

}  // namespace tierkv
