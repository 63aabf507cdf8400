// SPDX-License-Identifier: Apache-2.0
// KV backends for compaction of a completed prefix (issue 27; docs/compaction.md):
//
//   capture_backend       the float32 control that also records every query it attends
//                         with: the post-RoPE keys, values and queries of a document, per
//                         (layer, head), for Attention Matching's reference queries.
//   compacted_backend     a compacted prefix held in float32 (t kept tokens per (layer,
//                         KV head), each with its original RoPE position) plus an optional
//                         per-key logit bias beta: AM's biased read path (logit = scale q.k +
//                         beta for the prefix's keys, no bias on the tokens after it).
//   cache_prefix_backend  a prefix written into a tierkv::tiered_cache (write_prefix: FP8 /
//                         TQ3 / ... pages of the cache's codecs), read by the cache's own
//                         attend (no bias input); the tokens after it in float32, merged with
//                         the prefix's partial result by log-sum-exp.
//
// A compacted prefix holds t < n tokens whose keys carry RoPE positions 0..n-1, so length()
// is t + the tokens after it while position() (the next token's RoPE position) is n + them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kv_backend.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"

namespace smollm {

// Float32 cache [layer][kv_head][capacity][dim] that records, while capturing, the queries of
// every attend call ([layer][q_head][position][dim]).
class capture_backend final : public kv_backend {
 public:
  capture_backend(kv_shape s, int capacity) : s_(s), cap_(capacity) {
    const std::size_t per_layer =
        std::size_t(s.kv_heads) * std::size_t(cap_) * std::size_t(s.head_dim);
    k_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
    v_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
    q_.assign(std::size_t(s.layers), std::vector<float>(std::size_t(s.q_heads) * std::size_t(cap_) *
                                                        std::size_t(s.head_dim)));
  }
  std::string name() const override { return "dense"; }
  void reset() override { len_ = 0; }
  int length() const override { return len_; }
  // Drops every token from `len` on (the cache as it was after len tokens).
  void truncate(int len) { len_ = std::min(len_, std::max(0, len)); }
  // Queries are recorded while on (from position length()).
  bool capturing = true;

  void append(int layer, int n, const float* k, const float* v) override {
    if (len_ + n > cap_) throw std::runtime_error("capture_backend: capacity exceeded");
    const int hd = s_.head_dim;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < s_.kv_heads; ++h) {
        const std::size_t src =
            (std::size_t(i) * std::size_t(s_.kv_heads) + std::size_t(h)) * std::size_t(hd);
        std::copy_n(k + src, hd, key_rows(layer, h) + std::size_t(len_ + i) * std::size_t(hd));
        std::copy_n(v + src, hd, value_rows(layer, h) + std::size_t(len_ + i) * std::size_t(hd));
      }
  }
  void attend(int layer, int n, const float* q, float* out) override {
    const int hd = s_.head_dim;
    if (capturing)
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < s_.q_heads; ++h)
          std::copy_n(q + (std::size_t(i) * std::size_t(s_.q_heads) + std::size_t(h)) * hd, hd,
                      query_rows(layer, h) + std::size_t(len_ + i) * std::size_t(hd));
    detail::attend_float(
        s_, len_, n, q, out, [&](int g) { return key_rows(layer, g); },
        [&](int g) { return value_rows(layer, g); }, hd, scores_);
  }
  void commit(int n) override { len_ += n; }
  kv_memory memory() const override {
    kv_memory m;
    m.tokens = len_;
    m.scalars = 2.0 * len_ * s_.layers * s_.kv_heads * s_.head_dim;
    m.bytes = 4.0 * m.scalars;
    return m;
  }

  // Rows [position][dim] of one (layer, head): post-RoPE keys, values, queries.
  float* key_rows(int layer, int kv_head) {
    return k_[std::size_t(layer)].data() + head_at(kv_head);
  }
  float* value_rows(int layer, int kv_head) {
    return v_[std::size_t(layer)].data() + head_at(kv_head);
  }
  float* query_rows(int layer, int q_head) {
    return q_[std::size_t(layer)].data() + head_at(q_head);
  }
  const kv_shape& shape() const { return s_; }

 private:
  std::size_t head_at(int h) const {
    return std::size_t(h) * std::size_t(cap_) * std::size_t(s_.head_dim);
  }
  kv_shape s_;
  int cap_;
  int len_ = 0;
  std::vector<std::vector<float>> k_, v_, q_;
  std::vector<float> scores_;
};

// One (layer, KV head) of a compacted prefix: t tokens' post-RoPE keys and values
// ([t][head_dim]) and, for AM's explicit bias, beta [t] (empty: no bias).
struct prefix_head {
  std::vector<float> keys, values, beta;
};

// A compacted prefix in float32 with an optional per-key logit bias, then up to `capacity`
// tokens after it. heads[l * kv_heads + h] is (layer l, KV head h); every head holds the same
// t tokens; original_tokens = n is the RoPE position of the first token after the prefix.
class compacted_backend final : public kv_backend {
 public:
  compacted_backend(kv_shape s, const std::vector<prefix_head>& heads, int original_tokens,
                    int capacity, std::string name = "compacted")
      : s_(s), n0_(original_tokens), name_(std::move(name)) {
    if (heads.size() != std::size_t(s.layers) * std::size_t(s.kv_heads))
      throw std::runtime_error("compacted_backend: " + std::to_string(heads.size()) +
                               " heads for " + std::to_string(s.layers) + " layers x " +
                               std::to_string(s.kv_heads) + " kv heads");
    const std::size_t hd = std::size_t(s.head_dim);
    t_ = int(heads[0].keys.size() / hd);
    if (t_ > original_tokens)
      throw std::runtime_error("compacted_backend: " + std::to_string(t_) + " tokens kept of " +
                               std::to_string(original_tokens));
    cap_ = t_ + capacity;
    biased_ = std::any_of(heads.begin(), heads.end(),
                          [](const prefix_head& p) { return !p.beta.empty(); });
    const std::size_t per_layer = std::size_t(s.kv_heads) * std::size_t(cap_) * hd;
    k_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
    v_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
    if (biased_)
      b_.assign(std::size_t(s.layers),
                std::vector<float>(std::size_t(s.kv_heads) * std::size_t(cap_), 0.f));
    for (int l = 0; l < s.layers; ++l)
      for (int h = 0; h < s.kv_heads; ++h) {
        const prefix_head& p = heads[std::size_t(l) * std::size_t(s.kv_heads) + std::size_t(h)];
        if (p.keys.size() != std::size_t(t_) * hd || p.values.size() != p.keys.size() ||
            !(p.beta.empty() || p.beta.size() == std::size_t(t_)))
          throw std::runtime_error("compacted_backend: head (" + std::to_string(l) + ", " +
                                   std::to_string(h) + ") holds " +
                                   std::to_string(p.keys.size() / hd) + " keys, " +
                                   std::to_string(p.values.size() / hd) + " values and " +
                                   std::to_string(p.beta.size()) + " biases; head 0 holds " +
                                   std::to_string(t_) + " tokens");
        std::copy(p.keys.begin(), p.keys.end(), k_[std::size_t(l)].begin() + std::ptrdiff_t(at(h)));
        std::copy(p.values.begin(), p.values.end(),
                  v_[std::size_t(l)].begin() + std::ptrdiff_t(at(h)));
        if (biased_ && !p.beta.empty())
          std::copy(
              p.beta.begin(), p.beta.end(),
              b_[std::size_t(l)].begin() + std::ptrdiff_t(std::size_t(h) * std::size_t(cap_)));
      }
  }
  std::string name() const override { return name_; }
  void reset() override { after_ = 0; }  // back to the prefix alone
  int length() const override { return t_ + after_; }
  int position() const override { return n0_ + after_; }
  int prefix_tokens() const { return t_; }

  void append(int layer, int n, const float* k, const float* v) override {
    if (t_ + after_ + n > cap_) throw std::runtime_error("compacted_backend: capacity exceeded");
    const int hd = s_.head_dim;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < s_.kv_heads; ++h) {
        const std::size_t dst = at(h) + std::size_t(t_ + after_ + i) * std::size_t(hd);
        const std::size_t src =
            (std::size_t(i) * std::size_t(s_.kv_heads) + std::size_t(h)) * std::size_t(hd);
        std::copy_n(k + src, hd, k_[std::size_t(layer)].data() + dst);
        std::copy_n(v + src, hd, v_[std::size_t(layer)].data() + dst);
      }
  }
  void attend(int layer, int n, const float* q, float* out) override {
    const float* K = k_[std::size_t(layer)].data();
    const float* V = v_[std::size_t(layer)].data();
    detail::key_bias bias;
    if (biased_) bias = {b_[std::size_t(layer)].data(), std::size_t(cap_), t_};
    detail::attend_float(
        s_, t_ + after_, n, q, out, [&](int g) { return K + at(g); },
        [&](int g) { return V + at(g); }, s_.head_dim, scores_, nullptr, 16, bias);
  }
  void commit(int n) override { after_ += n; }
  kv_memory memory() const override {
    kv_memory m;
    m.tokens = length();
    m.scalars = 2.0 * length() * s_.layers * s_.kv_heads * s_.head_dim;
    m.bytes = 4.0 * m.scalars + (biased_ ? 4.0 * t_ * s_.layers * s_.kv_heads : 0.0);
    return m;
  }

 private:
  std::size_t at(int h) const {
    return std::size_t(h) * std::size_t(cap_) * std::size_t(s_.head_dim);
  }
  kv_shape s_;
  int n0_, t_ = 0, cap_ = 0, after_ = 0;
  std::string name_;
  bool biased_ = false;
  std::vector<std::vector<float>> k_, v_, b_;
  std::vector<float> scores_;
};

// A prefix held in sequence `prefix` of a tierkv::tiered_cache (written by
// tierkv::compaction::write_prefix or append; the cache is not owned and its prefix sequence
// is only read), then up to `capacity` float32 tokens after it. Every query reads the prefix
// through Cache::attend (the library's host decode over the stored pages, no bias input), one
// query row at a time, and the tokens after it causally in float32; the two partial results
// are merged by log-sum-exp. original_tokens = n: the RoPE position after the prefix.
template <class Cache>
class cache_prefix_backend final : public kv_backend {
 public:
  cache_prefix_backend(kv_shape s, Cache& cache, tierkv::seq_id prefix, int original_tokens,
                       int capacity, std::string name = "cache_prefix")
      : s_(s),
        cache_(cache),
        prefix_(prefix),
        n0_(original_tokens),
        cap_(capacity),
        name_(std::move(name)) {
    if (s.head_dim != Cache::head_dim || s.q_heads != Cache::q_heads)
      throw std::runtime_error("cache_prefix_backend: the cache's geometry differs from the model");
    auto len = cache.length(prefix);
    if (!len) throw tierkv::error(len.error_status());
    t_ = int(*len);
    const std::size_t per_layer =
        std::size_t(s.kv_heads) * std::size_t(cap_) * std::size_t(s.head_dim);
    k_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
    v_.assign(std::size_t(s.layers), std::vector<float>(per_layer));
  }
  std::string name() const override { return name_; }
  void reset() override { after_ = 0; }
  int length() const override { return t_ + after_; }
  int position() const override { return n0_ + after_; }

  void append(int layer, int n, const float* k, const float* v) override {
    if (after_ + n > cap_) throw std::runtime_error("cache_prefix_backend: capacity exceeded");
    const int hd = s_.head_dim;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < s_.kv_heads; ++h) {
        const std::size_t dst = at(h) + std::size_t(after_ + i) * std::size_t(hd);
        const std::size_t src =
            (std::size_t(i) * std::size_t(s_.kv_heads) + std::size_t(h)) * std::size_t(hd);
        std::copy_n(k + src, hd, k_[std::size_t(layer)].data() + dst);
        std::copy_n(v + src, hd, v_[std::size_t(layer)].data() + dst);
      }
  }
  void attend(int layer, int n, const float* q, float* out) override {
    const std::size_t row = std::size_t(s_.q_heads) * std::size_t(s_.head_dim);
    // The tokens after the prefix: causal float attention with its log-sum-exp.
    lse_after_.resize(std::size_t(n) * std::size_t(s_.q_heads));
    const float* K = k_[std::size_t(layer)].data();
    const float* V = v_[std::size_t(layer)].data();
    detail::attend_float(
        s_, after_, n, q, out, [&](int g) { return K + at(g); }, [&](int g) { return V + at(g); },
        s_.head_dim, scores_, nullptr, 16, {}, lse_after_.data());
    if (t_ == 0) return;
    // The prefix: the cache's attend, one query row at a time; merged by log-sum-exp.
    pout_.resize(row);
    plse_.resize(std::size_t(s_.q_heads));
    const tierkv::seq_id batch[] = {prefix_};
    for (int i = 0; i < n; ++i) {
      const std::span<const float> qi(q + std::size_t(i) * row, row);
      if (auto st = cache_.attend(layer, batch, qi, pout_, {}, plse_); !st) throw tierkv::error(st);
      for (int h = 0; h < s_.q_heads; ++h) {
        const double la = lse_after_[std::size_t(i) * std::size_t(s_.q_heads) + std::size_t(h)];
        const double lp = plse_[std::size_t(h)];
        const double L = std::max(la, lp) + std::log1p(std::exp(-std::abs(la - lp)));
        const float wa = float(std::exp(la - L)), wp = float(std::exp(lp - L));
        float* o = out + std::size_t(i) * row + std::size_t(h) * std::size_t(s_.head_dim);
        const float* po = pout_.data() + std::size_t(h) * std::size_t(s_.head_dim);
        for (int d = 0; d < s_.head_dim; ++d) o[d] = wa * o[d] + wp * po[d];
      }
    }
  }
  void commit(int n) override { after_ += n; }
  kv_memory memory() const override {
    kv_memory m;
    m.tokens = length();
    m.scalars = 2.0 * length() * s_.layers * s_.kv_heads * s_.head_dim;
    m.bytes = double(cache_.report().live_page_bytes()) +
              4.0 * 2.0 * after_ * s_.layers * s_.kv_heads * s_.head_dim;
    return m;
  }

 private:
  std::size_t at(int h) const {
    return std::size_t(h) * std::size_t(cap_) * std::size_t(s_.head_dim);
  }
  kv_shape s_;
  Cache& cache_;
  tierkv::seq_id prefix_;
  int n0_, cap_, t_ = 0, after_ = 0;
  std::string name_;
  std::vector<std::vector<float>> k_, v_;
  std::vector<float> scores_, lse_after_, pout_, plse_;
};

}  // namespace smollm
