// SPDX-License-Identifier: Apache-2.0
// The online-softmax partial state {m, l, acc} of one query head over a subset of
// keys, and its log-sum-exp merge.
#pragma once

#include <cmath>
#include <limits>

#include "tierkv/core/config.hpp"

namespace tierkv {

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
  /// because exp(m - m) = 1.
  TIERKV_HD bool empty() const { return !(l > 0.f); }

  /// Rescales this state to the running max `new_m` >= m (keeps empty states empty).
  TIERKV_HD void rescale_to(float new_m) {
    if (empty()) {
      m = new_m;
      return;
    }
    if (new_m == m) return;
    const float f = std::exp(m - new_m);
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
    const float fa = std::exp(m - new_m);
    const float fb = std::exp(o.m - new_m);
    l = l * fa + o.l * fb;
    for (int i = 0; i < HeadDim; ++i) acc[i] = acc[i] * fa + o.acc[i] * fb;
    m = new_m;
  }

  /// Natural-log log-sum-exp of the logits: m + ln(l); -inf for an empty state.
  TIERKV_HD float lse() const {
    if (empty()) return -std::numeric_limits<float>::infinity();
    return m + std::log(l);
  }

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
  if (!(l_part > 0.f) || lse == -std::numeric_limits<float>::infinity()) return 0.f;
  return l_part * std::exp(m_part - lse);
}

}  // namespace tierkv
