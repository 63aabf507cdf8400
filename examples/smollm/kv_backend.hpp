// SPDX-License-Identifier: Apache-2.0
// The engine's one narrow interface to its KV cache: append a chunk's keys and
// values for a layer, attend a chunk's queries over everything cached so far
// (causal), commit the chunk once every layer has it. Arms implement it: the
// float32 control here, the tierkv-backed arms in tierkv_backend.hpp.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace smollm {

struct kv_shape {
  int layers = 0;
  int kv_heads = 0;
  int q_heads = 0;
  int head_dim = 0;
};

// Memory of a cache from its own accounting.
struct kv_memory {
  double bytes = 0;         // bytes held for the live tokens (pages, metadata)
  double tokens = 0;        // live tokens
  double scalars = 0;       // K and V scalars those tokens represent (all layers and heads)
  double fp8_fraction = 0;  // share of (layer, page) pairs in an FP8 tier, when tiered
  std::string tier_shares;  // "t0 0.123 t1 0.877": share of (layer, page) pairs per tier
  std::vector<std::string> layer_tiers;  // per layer, each logical page's tier as a digit
  double kib_per_token() const { return tokens > 0 ? bytes / tokens / 1024.0 : 0.0; }
  double bits_per_scalar() const { return scalars > 0 ? 8.0 * bytes / scalars : 0.0; }
};

class kv_backend {
 public:
  virtual ~kv_backend() = default;
  virtual std::string name() const = 0;
  virtual void reset() = 0;
  // Tokens committed so far.
  virtual int length() const = 0;
  // RoPE position of the next chunk's first token: length() for a cache that holds every
  // token, original tokens + continuation for a compacted prefix (compacted_backend.hpp).
  virtual int position() const { return length(); }
  // k, v: n rows of kv_heads*head_dim floats (post-RoPE keys) for positions [length, length+n).
  virtual void append(int layer, int n, const float* k, const float* v) = 0;
  // q: n rows of q_heads*head_dim; query i sees positions [0, length + i]. out: same shape as q.
  virtual void attend(int layer, int n, const float* q, float* out) = 0;
  // Every layer has the chunk: advance the length and apply the cache's policy.
  virtual void commit(int n) = 0;
  virtual kv_memory memory() const = 0;
};

namespace detail {

// exp(x) for x <= 0 in plain float arithmetic that compilers vectorize (libm's expf in a
// loop does not vectorize without -ffast-math); relative error about 2e-7 on [-87, 0],
// and x < -87 returns ~1e-38 (probabilities that small are zero for every purpose here).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float r = (t + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const float f = (x - r * 0.693145751953125f) - r * 1.428606765330187e-06f;  // Cody-Waite
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const auto n = std::int32_t(r);
  const std::uint32_t bits = std::uint32_t(n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// A per-key additive logit bias for the first `keys` cached keys of every kv head (AM's
// biased read path, compacted_backend.hpp): kv head g's biases at at + g * stride.
struct key_bias {
  const float* at = nullptr;
  std::size_t stride = 0;
  int keys = 0;
};

// Causal attention of n queries over T = past + n keys held as float rows.
// k_head(h) / v_head(h) point at kv head h's T x head_dim rows (row stride ld_kv).
// scores is scratch of n*T floats.
// When page_mass is given (ceil(T / page_tokens) floats, zeroed by the caller), the last
// query's softmax probability on each page, summed over query heads, is added to it.
// bias: logit = scale q.k_j + bias_j for the biased keys. lse (n x q_heads floats, if given):
// the log-sum-exp of each query row's logits (natural log).
template <class KHead, class VHead>
void attend_float(const kv_shape& s, int past, int n, const float* q, float* out, KHead k_head,
                  VHead v_head, int ld_kv, std::vector<float>& scores, float* page_mass = nullptr,
                  int page_tokens = 16, key_bias bias = {}, float* lse = nullptr) {
  const int T = past + n;
  const int hd = s.head_dim;
  const int group = s.q_heads / s.kv_heads;
  const int ldq = s.q_heads * hd;
  const float scale = 1.0f / std::sqrt(float(hd));
  scores.resize(std::size_t(n) * std::size_t(T));
  for (int h = 0; h < s.q_heads; ++h) {
    const int g = h / group;
    const float* K = k_head(g);
    const float* V = v_head(g);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, T, hd, scale, q + h * hd, ldq, K, ld_kv,
                0.0f, scores.data(), T);
    const float* b = bias.at ? bias.at + std::size_t(g) * bias.stride : nullptr;
    for (int i = 0; i < n; ++i) {
      float* row = scores.data() + std::size_t(i) * std::size_t(T);
      const int visible = past + i + 1;
      if (b)
        for (int j = 0, e = std::min(bias.keys, visible); j < e; ++j) row[j] += b[j];
      float m = -INFINITY;
      for (int j = 0; j < visible; ++j) m = std::max(m, row[j]);
      float sum = 0;
      for (int j = 0; j < visible; ++j) {
        row[j] = exp_nonpositive(row[j] - m);
        sum += row[j];
      }
      const float inv = 1.0f / sum;
      for (int j = 0; j < visible; ++j) row[j] *= inv;
      if (lse) lse[std::size_t(i) * std::size_t(s.q_heads) + std::size_t(h)] = m + std::log(sum);
      for (int j = visible; j < T; ++j) row[j] = 0.0f;
    }
    if (page_mass) {
      const float* last = scores.data() + std::size_t(n - 1) * std::size_t(T);
      for (int j = 0; j < T; ++j) page_mass[j / page_tokens] += last[j];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, hd, T, 1.0f, scores.data(), T, V,
                ld_kv, 0.0f, out + h * hd, ldq);
  }
}

}  // namespace detail

// The float32 control: every key and value kept exactly as computed.
class dense_backend final : public kv_backend {
 public:
  dense_backend(kv_shape s, int capacity) : s_(s), cap_(capacity) {
    const std::size_t per_layer =
        std::size_t(s.kv_heads) * std::size_t(cap_) * std::size_t(s.head_dim);
    k_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
    v_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
  }
  std::string name() const override { return "dense"; }
  void reset() override { len_ = 0; }
  int length() const override { return len_; }

  void append(int layer, int n, const float* k, const float* v) override {
    if (len_ + n > cap_) throw std::runtime_error("dense_backend: capacity exceeded");
    const int hd = s_.head_dim;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < s_.kv_heads; ++h) {
        const std::size_t dst =
            (std::size_t(h) * std::size_t(cap_) + std::size_t(len_ + i)) * std::size_t(hd);
        const std::size_t src =
            (std::size_t(i) * std::size_t(s_.kv_heads) + std::size_t(h)) * std::size_t(hd);
        std::copy_n(k + src, hd, k_[std::size_t(layer)].data() + dst);
        std::copy_n(v + src, hd, v_[std::size_t(layer)].data() + dst);
      }
  }
  void attend(int layer, int n, const float* q, float* out) override {
    const std::size_t head_stride = std::size_t(cap_) * std::size_t(s_.head_dim);
    const float* K = k_[std::size_t(layer)].data();
    const float* V = v_[std::size_t(layer)].data();
    detail::attend_float(
        s_, len_, n, q, out, [&](int g) { return K + std::size_t(g) * head_stride; },
        [&](int g) { return V + std::size_t(g) * head_stride; }, s_.head_dim, scores_);
  }
  void commit(int n) override { len_ += n; }
  kv_memory memory() const override {
    kv_memory m;
    m.tokens = len_;
    m.scalars = 2.0 * len_ * s_.layers * s_.kv_heads * s_.head_dim;
    m.bytes = 4.0 * m.scalars;
    return m;
  }

 private:
  kv_shape s_;
  int cap_;
  int len_ = 0;
  std::vector<std::vector<float>> k_, v_;
  std::vector<float> scores_;
};

}  // namespace smollm
