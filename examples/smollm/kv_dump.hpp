// SPDX-License-Identifier: Apache-2.0
// `smollm dump`: the real post-RoPE keys, values and queries of every layer for a text, for
// offline codec studies (bench/research/kv_codec_sim.py simulates candidate KV codecs on them;
// bench/research/README.md describes the files). The text runs through the dense (float32)
// cache, prefilled in chunks as `ppl` does; a recording backend keeps a copy of every appended
// key / value row and every attending query row.
//
// Files written for --out PREFIX:
//   PREFIX.json   header: layers, kv_heads, q_heads, head_dim, tokens, rope base, chunk,
//                 the text path, the token ids, and the three file names with their layout
//   PREFIX.k.f32  float32 little-endian [layer][token][kv_head][head_dim]
//   PREFIX.v.f32  float32 [layer][token][kv_head][head_dim]
//   PREFIX.q.f32  float32 [layer][token][q_head][head_dim]  (query head h reads kv head
//                 h / (q_heads / kv_heads); attention scale 1/sqrt(head_dim))
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.hpp"
#include "kv_backend.hpp"
#include "runner.hpp"

namespace smollm {

// The dense control plus a copy of every key, value and query row it sees.
class recording_backend final : public kv_backend {
 public:
  recording_backend(kv_shape s, int capacity)
      : s_(s),
        cap_(capacity),
        dense_(s, capacity),
        k_(std::size_t(s.layers)),
        v_(std::size_t(s.layers)),
        q_(std::size_t(s.layers)) {}
  std::string name() const override { return "dense"; }
  void reset() override {
    dense_.reset();
    for (auto* rows : {&k_, &v_, &q_})
      for (auto& r : *rows) r.clear();
  }
  int length() const override { return dense_.length(); }
  void append(int layer, int n, const float* k, const float* v) override {
    const std::size_t row = std::size_t(s_.kv_heads) * std::size_t(s_.head_dim);
    auto& K = k_[std::size_t(layer)];
    auto& V = v_[std::size_t(layer)];
    K.insert(K.end(), k, k + std::size_t(n) * row);
    V.insert(V.end(), v, v + std::size_t(n) * row);
    dense_.append(layer, n, k, v);
  }
  void attend(int layer, int n, const float* q, float* out) override {
    const std::size_t row = std::size_t(s_.q_heads) * std::size_t(s_.head_dim);
    auto& Q = q_[std::size_t(layer)];
    Q.insert(Q.end(), q, q + std::size_t(n) * row);
    dense_.attend(layer, n, q, out);
  }
  void commit(int n) override { dense_.commit(n); }
  kv_memory memory() const override { return dense_.memory(); }

  // The three raw files, layer after layer (the layout in the file comment above).
  void write(const std::string& prefix) const {
    write_rows(prefix + ".k.f32", k_);
    write_rows(prefix + ".v.f32", v_);
    write_rows(prefix + ".q.f32", q_);
  }

 private:
  static void write_rows(const std::string& path, const std::vector<std::vector<float>>& layers) {
    std::ofstream o(path, std::ios::binary);
    for (const auto& l : layers)
      o.write(reinterpret_cast<const char*>(l.data()), std::streamsize(l.size() * sizeof(float)));
    if (!o) throw std::runtime_error("dump: cannot write " + path);
  }

  kv_shape s_;
  int cap_;
  dense_backend dense_;
  std::vector<std::vector<float>> k_, v_, q_;
};

// Runs `toks` through the dense cache in chunks of `chunk` and writes PREFIX.{json,k,v,q}.
inline void dump_kv(engine& eng, const std::vector<std::int32_t>& toks, int chunk,
                    const std::string& text_path, const std::string& prefix) {
  const kv_shape s = eng.net.config().kv();
  recording_backend kv(s, int(toks.size()));
  std::vector<float> logits;
  for (std::size_t i = 0; i < toks.size(); i += std::size_t(chunk)) {
    const int n = int(std::min<std::size_t>(std::size_t(chunk), toks.size() - i));
    eng.net.forward(toks.data() + i, n, kv, logits, false);
  }
  kv.write(prefix);
  auto base = [](const std::string& p) { return p.substr(p.find_last_of('/') + 1); };
  std::ofstream o(prefix + ".json");
  o << "{\"model\":\"SmolLM2-135M-Instruct Q4_1\",\"layers\":" << s.layers
    << ",\"kv_heads\":" << s.kv_heads << ",\"q_heads\":" << s.q_heads
    << ",\"head_dim\":" << s.head_dim << ",\"tokens\":" << toks.size()
    << ",\"rope_base\":" << eng.net.config().rope_base << ",\"chunk\":" << chunk << ",\"text\":\""
    << json_escape(text_path) << "\",\"dtype\":\"float32\""
    << ",\"k\":{\"file\":\"" << base(prefix) << ".k.f32\",\"shape\":[" << s.layers << ","
    << toks.size() << "," << s.kv_heads << "," << s.head_dim << "]}"
    << ",\"v\":{\"file\":\"" << base(prefix) << ".v.f32\",\"shape\":[" << s.layers << ","
    << toks.size() << "," << s.kv_heads << "," << s.head_dim << "]}"
    << ",\"q\":{\"file\":\"" << base(prefix) << ".q.f32\",\"shape\":[" << s.layers << ","
    << toks.size() << "," << s.q_heads << "," << s.head_dim << "]}"
    << ",\"note\":\"post-RoPE; layout [layer][token][head][dim]\",\"token_ids\":[";
  for (std::size_t i = 0; i < toks.size(); ++i) o << (i ? "," : "") << toks[i];
  o << "]}\n";
  if (!o) throw std::runtime_error("dump: cannot write " + prefix + ".json");
}

}  // namespace smollm
