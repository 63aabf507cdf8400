// SPDX-License-Identifier: Apache-2.0
// Centring (docs/codecs.md "Centring"): per (layer, KV head) channel means of keys and values,
// subtracted before encoding. Real models' keys carry a constant per-channel offset (QK biases,
// massive activations) that can be several times the per-token variation; a codec that spends its
// range or its norm on the offset leaves little for the part that routes attention. Subtracting
// a constant mu_k from every key of a head is exact for attention: every logit of a query head
// loses scale * q.mu_k, softmax is invariant to that shift (the weights and page masses do not
// change), and only the log-sum-exp is short by it. Subtracting mu_v from every value makes the
// output, a convex combination of the values, short by exactly mu_v. The façade adds both back.
// Not exact under a logit soft-cap (tanh is not shift invariant): the façade refuses that pair.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/counted_allocator.hpp"

namespace tierkv {

/// Refuses new means (invalid_argument, naming the tier and its pages) while any pool of
/// `storage` holds a page: every page was encoded against the present means.
template <class Storage>
status check_no_pages_for_centering(const Storage& storage) {
  for (int t = 0; t < Storage::num_tiers; ++t) {
    const std::uint32_t cap = storage.config().pages_per_tier[std::size_t(t)];
    if (storage.free_pages(t) != cap)
      return status::make(errc::invalid_argument, "set_centering: tier ", t, " holds ",
                          cap - storage.free_pages(t),
                          " pages encoded against the present means; release every sequence "
                          "and prefix entry first");
  }
  return {};
}

/// The channel means of one cache: [layer][kv_head][head_dim] floats for keys and for values,
/// each layer's set once (given, or estimated from the first tokens written to the layer) and
/// fixed while the cache holds pages (the pages were encoded against them).
template <int HeadDim, int KvHeads, host_allocator_policy A>
class channel_means {
 public:
  using vector_type = std::vector<float, counted_allocator<float, A>>;      ///< accounted floats
  static constexpr std::size_t per_layer = std::size_t(KvHeads) * HeadDim;  ///< floats a layer

  /// Means for `layers` layers, charged to `line` of `alloc` (throws allocation_failure).
  channel_means(int layers, A& alloc, std::size_t& line)
      : mu_k_(std::size_t(layers) * per_layer, 0.f, counted_allocator<float, A>(alloc, line)),
        mu_v_(std::size_t(layers) * per_layer, 0.f, counted_allocator<float, A>(alloc, line)),
        known_(std::size_t(layers), 0, counted_allocator<std::uint8_t, A>(alloc, line)) {}

  /// Layers.
  int layers() const noexcept { return int(known_.size()); }
  /// Whether layer's means are set.
  bool known(int layer) const noexcept { return known_[std::size_t(layer)] != 0; }
  /// Layer's key means, [kv_heads][head_dim].
  std::span<const float> keys(int layer) const noexcept {
    return {mu_k_.data() + std::size_t(layer) * per_layer, per_layer};
  }
  /// Layer's value means, [kv_heads][head_dim].
  std::span<const float> values(int layer) const noexcept {
    return {mu_v_.data() + std::size_t(layer) * per_layer, per_layer};
  }

  /// Whether means for layer of a cache of `layers` layers could be set: the layer, the sizes
  /// ([kv_heads][head_dim] each) and finite values (the GPU façade checks with it too).
  static status check(int layer, int layers, std::span<const float> mu_k,
                      std::span<const float> mu_v) {
    if (layer < 0 || layer >= layers) return status::out_of_range("centring layer", layer, layers);
    if (mu_k.size() != per_layer || mu_v.size() != per_layer)
      return status::make(errc::invalid_argument, "centring means of layer ", layer, " need ",
                          per_layer, " floats each ([kv_head][head_dim]), got ", mu_k.size(),
                          " and ", mu_v.size());
    for (std::size_t i = 0; i < per_layer; ++i)
      if (!std::isfinite(mu_k[i]) || !std::isfinite(mu_v[i]))
        return status::make(errc::non_finite_input, "centring means of layer ", layer, ": element ",
                            i, " is not finite");
    return {};
  }

  /// Sets layer's means ([kv_heads][head_dim] each); refuses sizes and non-finite means.
  status set(int layer, std::span<const float> mu_k, std::span<const float> mu_v) {
    if (auto st = check(layer, layers(), mu_k, mu_v); !st) return st;
    std::copy(mu_k.begin(), mu_k.end(), mu_k_.begin() + std::ptrdiff_t(layer * per_layer));
    std::copy(mu_v.begin(), mu_v.end(), mu_v_.begin() + std::ptrdiff_t(layer * per_layer));
    known_[std::size_t(layer)] = 1;
    return {};
  }
  /// Forgets layer's means (a refused first write that estimated them).
  void unset(int layer) noexcept { known_[std::size_t(layer)] = 0; }

  /// Sets layer's means to those of n tokens' keys and values ([token][kv_head][head_dim]),
  /// summed in float64. False (nothing set) when a mean is not finite.
  bool estimate(int layer, std::int64_t n, const float* k, const float* v) {
    if (n <= 0) return false;
    std::vector<float> mk(per_layer), mv(per_layer);
    for (std::size_t i = 0; i < per_layer; ++i) {
      double sk = 0, sv = 0;
      for (std::int64_t t = 0; t < n; ++t) {
        sk += double(k[std::size_t(t) * per_layer + i]);
        sv += double(v[std::size_t(t) * per_layer + i]);
      }
      mk[i] = float(sk / double(n));
      mv[i] = float(sv / double(n));
    }
    return set(layer, mk, mv).is_ok();
  }

  /// out = x - layer's means for n token rows of keys (value = false) or values (true),
  /// [token][kv_head][head_dim].
  void subtract(int layer, bool value, std::int64_t n, const float* x, float* out) const {
    const float* mu = (value ? mu_v_.data() : mu_k_.data()) + std::size_t(layer) * per_layer;
    for (std::int64_t t = 0; t < n; ++t)
      for (std::size_t i = 0; i < per_layer; ++i)
        out[std::size_t(t) * per_layer + i] = x[std::size_t(t) * per_layer + i] - mu[i];
  }

  /// x += layer's means for n token rows of keys (value = false) or values (true),
  /// [token][kv_head][head_dim]: subtract's inverse (a centred page's decoded rows back to the
  /// vectors written).
  void add(int layer, bool value, std::int64_t n, float* x) const {
    const float* mu = (value ? mu_v_.data() : mu_k_.data()) + std::size_t(layer) * per_layer;
    for (std::int64_t t = 0; t < n; ++t)
      for (std::size_t i = 0; i < per_layer; ++i) x[std::size_t(t) * per_layer + i] += mu[i];
  }

  /// Undoes the centring on one sequence's decode outputs: out [q_heads][head_dim] += mu_v of
  /// the query head's KV head; lse [q_heads] (if given) += scale * q.mu_k.
  void restore(int layer, int group_size, float scale, const float* q, float* out,
               float* lse) const {
    for (int h = 0; h < KvHeads * group_size; ++h) {
      const std::size_t at = std::size_t(layer) * per_layer + std::size_t(h / group_size) * HeadDim;
      const float* mk = mu_k_.data() + at;
      const float* mv = mu_v_.data() + at;
      float* o = out + std::size_t(h) * HeadDim;
      for (int d = 0; d < HeadDim; ++d) o[d] += mv[d];
      if (lse != nullptr) {
        double qm = 0;
        for (int d = 0; d < HeadDim; ++d) qm += double(q[std::size_t(h) * HeadDim + d]) * mk[d];
        lse[h] += float(double(scale) * qm);
      }
    }
  }

 private:
  vector_type mu_k_, mu_v_;
  std::vector<std::uint8_t, counted_allocator<std::uint8_t, A>> known_;
};

}  // namespace tierkv
