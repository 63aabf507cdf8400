// SPDX-License-Identifier: Apache-2.0
// A Llama-architecture forward pass on the CPU (SmolLM2-135M): RMSNorm, RoPE
// (GGUF "normal" mode: adjacent pairs), grouped-query attention through a
// kv_backend, SwiGLU; matrix products through BLAS (sgemm), weights dequantized
// to float32 once at load.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "kv_backend.hpp"

namespace smollm {

struct model_config {
  int layers = 0, embd = 0, ff = 0, q_heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, context = 0;
  float rope_base = 10000.f, eps = 1e-5f;
  kv_shape kv() const { return {layers, kv_heads, q_heads, head_dim}; }
};

class model {
 public:
  static tierkv::result<model> load(const gguf_file& f) {
    if (f.get_string("general.architecture") != "llama")
      return tierkv::status::make(tierkv::errc::invalid_argument, "model: architecture '",
                                  f.get_string("general.architecture"), "' is not llama");
    model m;
    model_config& c = m.cfg_;
    c.layers = int(f.get_int("llama.block_count", 0));
    c.embd = int(f.get_int("llama.embedding_length", 0));
    c.ff = int(f.get_int("llama.feed_forward_length", 0));
    c.q_heads = int(f.get_int("llama.attention.head_count", 0));
    c.kv_heads = int(f.get_int("llama.attention.head_count_kv", c.q_heads));
    c.context = int(f.get_int("llama.context_length", 0));
    c.rope_base = float(f.get_float("llama.rope.freq_base", 10000.0));
    c.eps = float(f.get_float("llama.attention.layer_norm_rms_epsilon", 1e-5));
    if (c.layers <= 0 || c.embd <= 0 || c.q_heads <= 0 || c.kv_heads <= 0 ||
        c.q_heads % c.kv_heads || c.embd % c.q_heads)
      return tierkv::status::make(tierkv::errc::invalid_argument,
                                  "model: implausible hyperparameters");
    c.head_dim = c.embd / c.q_heads;
    if (f.get_int("llama.rope.dimension_count", c.head_dim) != c.head_dim)
      return tierkv::status::make(
          tierkv::errc::invalid_argument,
          "model: partial RoPE (rope.dimension_count != head_dim) is not supported");
    auto get = [&](const std::string& name, std::vector<float>& dst) -> tierkv::status {
      auto r = f.load(name);
      if (!r) return r.error_status();
      dst = std::move(*r);
      return tierkv::status::ok();
    };
    if (auto s = get("token_embd.weight", m.embd_); !s) return s;
    c.vocab = int(m.embd_.size() / std::size_t(c.embd));
    if (auto s = get("output_norm.weight", m.out_norm_); !s) return s;
    if (f.tensor("output.weight")) {
      if (auto s = get("output.weight", m.output_); !s) return s;
    }
    m.layers_.resize(std::size_t(c.layers));
    for (int l = 0; l < c.layers; ++l) {
      auto& L = m.layers_[std::size_t(l)];
      const std::string p = "blk." + std::to_string(l) + ".";
      for (auto [name, dst] :
           {std::pair<const char*, std::vector<float>*>{"attn_norm.weight", &L.attn_norm},
            {"attn_q.weight", &L.wq},
            {"attn_k.weight", &L.wk},
            {"attn_v.weight", &L.wv},
            {"attn_output.weight", &L.wo},
            {"ffn_norm.weight", &L.ffn_norm},
            {"ffn_gate.weight", &L.wg},
            {"ffn_up.weight", &L.wu},
            {"ffn_down.weight", &L.wd}})
        if (auto s = get(p + name, *dst); !s) return s;
    }
    // Inverse frequencies of RoPE, as ggml computes them: base^(-2i/d).
    m.inv_freq_.resize(std::size_t(c.head_dim / 2));
    m.rope_tmp_.resize(std::size_t(c.head_dim));
    for (int i = 0; i < c.head_dim / 2; ++i)
      m.inv_freq_[std::size_t(i)] = std::pow(double(c.rope_base), -2.0 * i / c.head_dim);
    return m;
  }

  const model_config& config() const { return cfg_; }

  // llama.cpp's CPU path multiplies quantized weights with activations quantized to 8 bits
  // per 32-block (q8_0 / q8_1: q = round(x / d), d = amax / 127 stored as fp16). Off by
  // default (this engine multiplies in float32); on, it reproduces that rounding, which is
  // how the golden test tells that rounding apart from an engine error.
  bool quantize_activations = false;

  // Runs tokens[0..n) at RoPE positions [kv.position(), kv.position() + n) and commits them
  // to kv.
  // logits: n x vocab when all_logits, else the last position's vocab floats.
  void forward(const std::int32_t* tokens, int n, kv_backend& kv, std::vector<float>& logits,
               bool all_logits) {
    const model_config& c = cfg_;
    const int E = c.embd, Q = c.q_heads * c.head_dim, KV = c.kv_heads * c.head_dim;
    const int pos0 = kv.position();
    const std::size_t sE = std::size_t(E), sQ = std::size_t(Q), sKV = std::size_t(KV);
    x_.resize(std::size_t(n) * sE);
    h_.resize(x_.size());
    q_.resize(std::size_t(n) * sQ);
    att_.resize(q_.size());
    k_.resize(std::size_t(n) * sKV);
    v_.resize(k_.size());
    g_.resize(std::size_t(n) * std::size_t(c.ff));
    u_.resize(g_.size());
    for (int i = 0; i < n; ++i) {
      const std::int32_t t = tokens[i];
      if (t < 0 || t >= c.vocab)
        throw std::runtime_error("model: token id " + std::to_string(t) + " out of range");
      std::copy_n(embd_.data() + std::size_t(t) * sE, E, x_.data() + std::size_t(i) * sE);
    }
    for (int l = 0; l < c.layers; ++l) {
      const auto& L = layers_[std::size_t(l)];
      rms_norm(x_.data(), L.attn_norm.data(), h_.data(), n, E);
      matmul(h_.data(), L.wq.data(), q_.data(), n, E, Q);
      matmul(h_.data(), L.wk.data(), k_.data(), n, E, KV);
      matmul(h_.data(), L.wv.data(), v_.data(), n, E, KV);
      for (int i = 0; i < n; ++i) {
        rope(q_.data() + std::size_t(i) * sQ, c.q_heads, pos0 + i);
        rope(k_.data() + std::size_t(i) * sKV, c.kv_heads, pos0 + i);
      }
      kv.append(l, n, k_.data(), v_.data());
      kv.attend(l, n, q_.data(), att_.data());
      // x += att · Wo^T
      const float* att = quantize_activations ? quantize_q8(att_.data(), att_.size()) : att_.data();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, E, Q, 1.0f, att, Q, L.wo.data(), Q,
                  1.0f, x_.data(), E);
      rms_norm(x_.data(), L.ffn_norm.data(), h_.data(), n, E);
      matmul(h_.data(), L.wg.data(), g_.data(), n, E, c.ff);
      matmul(h_.data(), L.wu.data(), u_.data(), n, E, c.ff);
      for (std::size_t i = 0; i < g_.size(); ++i) {
        const float a = g_[i];
        g_[i] = a / (1.0f + std::exp(-a)) * u_[i];
      }
      const float* gu = quantize_activations ? quantize_q8(g_.data(), g_.size()) : g_.data();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, E, c.ff, 1.0f, gu, c.ff, L.wd.data(),
                  c.ff, 1.0f, x_.data(), E);
    }
    kv.commit(n);
    const int rows = all_logits ? n : 1;
    const float* src = x_.data() + std::size_t(all_logits ? 0 : n - 1) * sE;
    rms_norm(src, out_norm_.data(), h_.data(), rows, E);
    logits.resize(std::size_t(rows) * std::size_t(c.vocab));
    const std::vector<float>& w = output_.empty() ? embd_ : output_;
    matmul(h_.data(), w.data(), logits.data(), rows, E, c.vocab);
  }

 private:
  struct layer_weights {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd;
  };

  // y (n x out) = x (n x in) · W^T, W stored as out rows of in floats (ggml order).
  void matmul(const float* x, const float* w, float* y, int n, int in, int out) {
    if (quantize_activations) x = quantize_q8(x, std::size_t(n) * std::size_t(in));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, out, in, 1.0f, x, in, w, in, 0.0f, y,
                out);
  }
  const float* quantize_q8(const float* x, std::size_t count) {
    qx_.resize(count);
    for (std::size_t b = 0; b + 32 <= count; b += 32) {
      float amax = 0;
      for (std::size_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(x[b + j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const float d16 = half_to_float(float_to_half(d));
      for (std::size_t j = 0; j < 32; ++j) qx_[b + j] = std::round(x[b + j] * id) * d16;
    }
    return qx_.data();
  }
  static std::uint16_t float_to_half(float f) {  // round to nearest even, finite positive inputs
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const int e = int((bits >> 23) & 0xff) - 127 + 15;
    if (e >= 31) return 0x7c00;
    if (e <= 0) {                            // subnormal half
      const float scaled = f * 16777216.0f;  // 2^24
      return std::uint16_t(std::nearbyint(scaled));
    }
    const std::uint32_t mant = bits & 0x7fffff;
    std::uint32_t h = (std::uint32_t(e) << 10) | (mant >> 13);
    const std::uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
    return std::uint16_t(h);
  }
  void rms_norm(const float* x, const float* w, float* y, int n, int d) const {
    for (int i = 0; i < n; ++i) {
      const float* xi = x + std::size_t(i) * std::size_t(d);
      float* yi = y + std::size_t(i) * std::size_t(d);
      double ss = 0;
      for (int j = 0; j < d; ++j) ss += double(xi[j]) * xi[j];
      const float r = float(1.0 / std::sqrt(ss / d + double(cfg_.eps)));
      for (int j = 0; j < d; ++j) yi[j] = xi[j] * r * w[j];
    }
  }
  // GGUF llama rope ("normal" mode): rotates adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/d).
  // It runs on the GGUF's interleaved pairs (2i, 2i + 1); each head's result is stored in the
  // half-split order transformers uses (i, i + d/2): the same permutation of queries and keys
  // leaves every score as it was, and the cache sees the coordinates the Python paths give it.
  // The rotation-based codecs (TQ3, TQ4, int8_rotated) are not permutation-invariant: in the
  // GGUF's order their codes were another draw than the Python paths' for the same codec seed
  // (bench/results/quality/paths-seed-gap-2026-12-07.json).
  void rope(float* v, int heads, int pos) const {
    const int hd = cfg_.head_dim, half = hd / 2;
    float* rotated = rope_tmp_.data();
    for (int h = 0; h < heads; ++h) {
      float* p = v + h * hd;
      for (int i = 0; i < half; ++i) {
        const double theta = double(pos) * inv_freq_[std::size_t(i)];
        const float cs = float(std::cos(theta)), sn = float(std::sin(theta));
        const float a = p[2 * i], b = p[2 * i + 1];
        rotated[i] = a * cs - b * sn;
        rotated[i + half] = a * sn + b * cs;
      }
      std::copy(rotated, rotated + hd, p);
    }
  }

  model_config cfg_;
  std::vector<float> embd_, out_norm_, output_;
  std::vector<layer_weights> layers_;
  std::vector<double> inv_freq_;
  mutable std::vector<float> rope_tmp_;  // one head (rope)
  std::vector<float> x_, h_, q_, att_, k_, v_, g_, u_, qx_;
};

}  // namespace smollm
