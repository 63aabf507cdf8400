// SPDX-License-Identifier: Apache-2.0
// The task runner (quick and full profiles) and the demo.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.hpp"
#include "tasks.hpp"

namespace smollm {

struct run_options {
  bool quick = false;
  std::string arms = "dense,tiered,tiered_k4,tiered_int8r,tq3,fp8,int8r";
  std::string out;         // JSON with per-arm results
  std::string dump_items;  // prompts for the llama.cpp peer (peer_llamacpp.py)
  int items = 0;           // items per (task, length); 0 = the profile's default
  int first_item = 0;      // index of the first item (extend an earlier run with new items)
  bool ppl = true;         // false: needle items only (ppl fields stay 0)
  std::string lengths;     // e.g. "1024,4096"; empty = the profile's
  std::string tasks;       // e.g. "multivalue,multiquery"; empty = the profile's
  std::string ppl_text = "/usr/share/common-licenses/GPL-3";
  std::uint64_t seed = 20261129;
};

struct gen_result {
  std::vector<std::int32_t> tokens;
  double prefill_s = 0, decode_s = 0;
  kv_memory mem;
};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Greedy: prefill in chunks, then up to max_new tokens, stopping after <|im_end|> / EOS.
inline gen_result run_generation(engine& eng, kv_backend& kv,
                                 const std::vector<std::int32_t>& prompt, int max_new, int chunk,
                                 bool stop_at_end = true) {
  gen_result r;
  std::vector<float> logits;
  auto t0 = std::chrono::steady_clock::now();
  eng.prefill(prompt, kv, logits, chunk);
  r.prefill_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  const std::int32_t im_end = eng.tok.id_of("<|im_end|>");
  for (int i = 0; i < max_new; ++i) {
    const std::int32_t next = engine::argmax(logits.data(), eng.net.config().vocab);
    r.tokens.push_back(next);
    if ((stop_at_end && (next == eng.tok.eos() || next == im_end)) || i + 1 == max_new) break;
    eng.net.forward(&next, 1, kv, logits, false);
  }
  r.decode_s = seconds_since(t0);
  r.mem = kv.memory();
  return r;
}

// Common prefix of two greedy outputs over the longer one's length (1 = identical).
inline double agreement(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b) {
  const std::size_t n = std::max(a.size(), b.size());
  if (n == 0) return 1.0;
  std::size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return double(k) / double(n);
}

struct ppl_result {
  double ppl = 0;
  int scored = 0;
  double seconds = 0;
  kv_memory mem;
  std::vector<std::int32_t> continuation;  // 64 greedy tokens after the text
  std::vector<float> nll;                  // per scored token (paired intervals across arms)
};

// Chunked perplexity: the text is prefilled `chunk` tokens at a time, and every token after
// the first chunk is scored, i.e. predicted from a cache whose older chunks are stored in
// the arm's formats (and retiered after every chunk).
inline ppl_result run_ppl(engine& eng, kv_backend& kv, const std::vector<std::int32_t>& toks,
                          int chunk, int continue_tokens) {
  ppl_result r;
  std::vector<float> logits;
  const int V = eng.net.config().vocab;
  const int N = int(toks.size());
  double nll = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int start = 0; start < N; start += chunk) {
    const int n = std::min(chunk, N - start);
    eng.net.forward(toks.data() + start, n, kv, logits, true);
    for (int j = 0; j < n; ++j) {
      const int p = start + j;
      if (p + 1 >= N || p + 1 < chunk) continue;
      const float* row = logits.data() + std::size_t(j) * std::size_t(V);
      float m = row[0];
      for (int v = 1; v < V; ++v) m = std::max(m, row[v]);
      float s = 0;
      for (int v = 0; v < V; ++v) s += detail::exp_nonpositive(row[v] - m);
      const double token_nll =
          double(m) + std::log(double(s)) - double(row[toks[std::size_t(p + 1)]]);
      nll += token_nll;
      r.nll.push_back(float(token_nll));
      ++r.scored;
    }
  }
  r.seconds = seconds_since(t0);
  r.ppl = std::exp(nll / std::max(1, r.scored));
  // Greedy continuation from the last position (for agreement with the dense arm).
  const float* last = logits.data() + std::size_t((N - 1) % chunk) * std::size_t(V);
  std::vector<float> step;
  std::int32_t next = engine::argmax(last, V);
  for (int i = 0; i < continue_tokens; ++i) {
    r.continuation.push_back(next);
    if (i + 1 == continue_tokens) break;
    eng.net.forward(&next, 1, kv, step, false);
    next = engine::argmax(step.data(), V);
  }
  r.mem = kv.memory();
  return r;
}

inline std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ','))
    if (!x.empty()) out.push_back(x);
  return out;
}

inline std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      o += '\\';
      o += char(c);
    } else if (c == '\n')
      o += "\\n";
    else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else
      o += char(c);
  }
  return o;
}

inline std::string len_label(int t) { return std::to_string(t / 1024) + "k"; }

inline int run_tasks(engine& eng, const run_options& o) {
  const std::vector<std::string>& all_tasks = niah_task_names();
  std::vector<std::string> task_names = split_csv(o.tasks);
  for (const auto& t : task_names)
    if (std::find(all_tasks.begin(), all_tasks.end(), t) == all_tasks.end()) {
      std::string known;
      for (const auto& k : all_tasks) known += (known.empty() ? "" : ", ") + k;
      throw std::invalid_argument("--tasks: unknown task '" + t + "' (" + known + ")");
    }
  if (task_names.empty())
    task_names = o.quick ? std::vector<std::string>{"single", "multikey"}
                         : std::vector<std::string>(all_tasks.begin(),
                                                    all_tasks.begin() + niah_default_tasks);
  std::vector<int> lengths;
  for (const auto& s : split_csv(o.lengths)) lengths.push_back(std::stoi(s));
  if (lengths.empty())
    lengths = o.quick ? std::vector<int>{1024} : std::vector<int>{1024, 2048, 4096, 8192};
  const int per = o.items > 0 ? o.items : (o.quick ? 1 : 3);
  const int chunk = o.quick ? 256 : 512;
  const int max_new = o.quick ? 24 : 64;  // quick: answers are 7 digits; a task may ask more

  std::vector<niah_item> items;
  for (int L : lengths)
    for (const auto& t : task_names)
      for (int i = o.first_item; i < o.first_item + per; ++i) {
        items.push_back(make_niah_item(eng.tok, t, L, i, o.seed));
        items.back().max_new = std::max(items.back().max_new, max_new);
      }
  std::vector<std::int32_t> ppl_toks = eng.tok.encode(read_text_file(o.ppl_text), false);
  const int ppl_len = o.quick ? 512 : 8192 - 64;
  if (int(ppl_toks.size()) > ppl_len) ppl_toks.resize(std::size_t(ppl_len));
  const int ppl_chunk = o.quick ? 128 : 512;

  if (!o.dump_items.empty()) {
    std::ofstream d(o.dump_items);
    auto ids = [&](const std::vector<std::int32_t>& v) {
      std::string s = "[";
      for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
      return s + "]";
    };
    d << "{\"kind\":\"ppl\",\"tokens\":" << ids(ppl_toks) << ",\"chunk\":" << ppl_chunk
      << ",\"continue\":64}\n";
    for (const auto& it : items) {
      d << "{\"kind\":\"niah\",\"task\":\"" << it.task << "\",\"target\":" << it.target
        << ",\"index\":" << it.index << ",\"max_new\":" << it.max_new << ",\"chunk\":" << chunk
        << ",\"stop\":[" << eng.tok.eos() << "," << eng.tok.id_of("<|im_end|>")
        << "],\"answers\":[";
      for (std::size_t a = 0; a < it.answers.size(); ++a)
        d << (a ? "," : "") << '"' << it.answers[a] << '"';
      d << "],\"user\":\"" << json_escape(it.user) << "\",\"answer_prefix\":\""
        << json_escape(it.answer_prefix) << "\",\"prompt\":" << ids(it.prompt) << "}\n";
    }
    std::fprintf(stderr, "wrote %zu items to %s\n", items.size() + 1, o.dump_items.c_str());
  }

  std::ostringstream head;
  head << "{\"profile\":\"" << (o.quick ? "quick" : "full") << "\",\"seed\":" << o.seed
       << ",\"ppl_text\":\"" << o.ppl_text << "\",\"ppl_tokens\":" << ppl_toks.size()
       << ",\"ppl_chunk\":" << ppl_chunk << ",\"prefill_chunk\":" << chunk
       << ",\"policy\":{\"name\":\"tierkv::policy::recency_anchor\",\"page_tokens\":16,\"recent_"
          "pages\":"
       << eng.tiering.policy.recent_pages << ",\"sink_pages\":" << eng.tiering.policy.sink_pages
       << ",\"keep_first_layers\":" << eng.tiering.policy.keep_first_layers
       << ",\"keep_last_layers\":" << eng.tiering.policy.keep_last_layers
       << ",\"use_mass\":" << eng.tiering.use_mass << ",\"center\":" << eng.tiering.center
       << ",\"retier_in_prefill\":" << eng.tiering.retier_in_prefill
       << ",\"enter_mass\":" << eng.tiering.policy.enter_mass
       << ",\"leave_mass\":" << eng.tiering.policy.leave_mass << "},\"arms\":{";

  // Per-arm running totals; the JSON is rewritten after every item, so a long run that
  // stops keeps everything it measured, for every arm on the same items.
  struct arm_totals {
    std::map<int, std::pair<double, int>> acc, all_right;  // length -> (sum, items)
    std::map<int, double> bits_at;
    double agree = 0, prefill_tok = 0, prefill_s = 0, dec_tok = 0, dec_s = 0, agree_text = -1;
    int agree_n = 0;
    ppl_result ppl;
    std::vector<std::string> items;
  };
  const std::vector<std::string> arms = split_csv(o.arms);
  std::map<std::string, arm_totals> A;
  auto write_json = [&] {
    if (o.out.empty()) return;
    std::ostringstream js;
    js << head.str();
    bool first_arm = true;
    for (const auto& arm : arms) {
      const arm_totals& t = A[arm];
      const ppl_result& p = t.ppl;
      js << (first_arm ? "" : ",") << "\"" << arm << "\":{\"ppl\":" << p.ppl
         << ",\"ppl_scored\":" << p.scored << ",\"ppl_bits_per_scalar\":" << p.mem.bits_per_scalar()
         << ",\"ppl_kib_per_token\":" << p.mem.kib_per_token()
         << ",\"ppl_fp8_fraction\":" << p.mem.fp8_fraction << ",\"ppl_seconds\":" << p.seconds
         << ",\"agree_text64\":" << t.agree_text
         << ",\"agree64\":" << (t.agree_n ? t.agree / t.agree_n : -1.0)
         << ",\"prefill_tokens_per_s\":" << (t.prefill_s > 0 ? t.prefill_tok / t.prefill_s : 0)
         << ",\"decode_tokens_per_s\":" << (t.dec_s > 0 ? t.dec_tok / t.dec_s : 0) << ",\"niah\":{";
      bool first_len = true;
      for (const auto& [L, sc] : t.acc) {
        js << (first_len ? "" : ",") << "\"" << len_label(L)
           << "\":{\"acc\":" << sc.first / sc.second
           << ",\"all_correct\":" << t.all_right.at(L).first / t.all_right.at(L).second
           << ",\"items\":" << sc.second << ",\"max_bits_per_scalar\":" << t.bits_at.at(L) << "}";
        first_len = false;
      }
      js << "},\"items\":[";
      for (std::size_t i = 0; i < t.items.size(); ++i) js << (i ? "," : "") << t.items[i];
      js << "]}";
      first_arm = false;
    }
    js << "}}";
    std::ofstream f(o.out);
    f << js.str() << "\n";
  };

  std::printf("%-8s %-10s %6s %5s %6s %8s %7s  %s\n", "arm", "task", "len", "item", "score", "bits",
              "KiB/tok", "output");
  // Perplexity first (one long prefill per arm), then the needle items, every arm per item.
  for (const std::string& arm : arms) {
    if (!o.ppl) break;
    auto kv = eng.make_backend(arm, int(ppl_toks.size()) + 80);
    arm_totals& t = A[arm];
    t.ppl = run_ppl(eng, *kv, ppl_toks, ppl_chunk, 64);
    if (arm != "dense" && !A["dense"].ppl.continuation.empty())
      t.agree_text = agreement(A["dense"].ppl.continuation, t.ppl.continuation);
    std::printf("%-8s %-10s %6zu %5s %6s %8.3f %7.2f  ppl %.4f over %d tokens (%.1f s)\n",
                arm.c_str(), "ppl", ppl_toks.size(), "-", "-", t.ppl.mem.bits_per_scalar(),
                t.ppl.mem.kib_per_token(), t.ppl.ppl, t.ppl.scored, t.ppl.seconds);
    std::fflush(stdout);
    write_json();
  }
  for (const auto& it : items) {
    std::vector<std::int32_t> dense_tokens;
    bool have_dense = false;
    for (const std::string& arm : arms) {
      arm_totals& t = A[arm];
      auto kv = eng.make_backend(arm, int(it.prompt.size()) + it.max_new + 16);
      const gen_result g = run_generation(eng, *kv, it.prompt, it.max_new, chunk);
      const std::string text = eng.tok.decode(g.tokens);
      const double score = niah_score(it, text);
      t.acc[it.target].first += score;
      t.acc[it.target].second += 1;
      t.all_right[it.target].first += score == 1.0 ? 1 : 0;
      t.all_right[it.target].second += 1;
      t.bits_at[it.target] = std::max(t.bits_at[it.target], g.mem.bits_per_scalar());
      t.prefill_tok += double(it.prompt.size());
      t.prefill_s += g.prefill_s;
      t.dec_tok += double(g.tokens.size());
      t.dec_s += g.decode_s;
      double ag = -1;
      if (arm == "dense") {
        dense_tokens = g.tokens;
        have_dense = true;
      } else if (have_dense) {
        ag = agreement(dense_tokens, g.tokens);
        t.agree += ag;
        ++t.agree_n;
      }
      std::string shown = text;
      for (auto& c : shown)
        if (c == '\n') c = ' ';
      std::printf("%-8s %-10s %6zu %5d %6.2f %8.3f %7.2f  %s\n", arm.c_str(), it.task.c_str(),
                  it.prompt.size(), it.index, score, g.mem.bits_per_scalar(), g.mem.kib_per_token(),
                  shown.substr(0, 60).c_str());
      std::fflush(stdout);
      std::ostringstream ij;
      ij << "{\"task\":\"" << it.task << "\",\"target\":" << it.target << ",\"index\":" << it.index
         << ",\"prompt_tokens\":" << it.prompt.size() << ",\"score\":" << score
         << ",\"agree\":" << ag << ",\"bits_per_scalar\":" << g.mem.bits_per_scalar()
         << ",\"prefill_s\":" << g.prefill_s << ",\"decode_s\":" << g.decode_s << ",\"tokens\":[";
      for (std::size_t k = 0; k < g.tokens.size(); ++k) ij << (k ? "," : "") << g.tokens[k];
      ij << "],\"output\":\"" << json_escape(text) << "\"}";
      t.items.push_back(ij.str());
    }
    write_json();
  }
  if (!o.out.empty()) std::fprintf(stderr, "wrote %s\n", o.out.c_str());
  return 0;
}

inline int run_demo(engine& eng, int tokens) {
  const niah_item it = make_niah_item(eng.tok, "single", tokens, 0, 20261129);
  std::printf("Model: SmolLM2-135M-Instruct (Q4_1 GGUF), %d layers, %d KV heads x %d dims\n",
              eng.net.config().layers, eng.net.config().kv_heads, eng.net.config().head_dim);
  std::printf(
      "Prompt: %zu tokens of haystack with one hidden 'special magic number' (expected: %s)\n\n",
      it.prompt.size(), it.answers[0].c_str());
  const std::vector<std::string> arms{"dense", "tiered", "tiered_k4"};
  double dense_kib = 0;
  for (const auto& arm : arms) {
    auto kv = eng.make_backend(arm, int(it.prompt.size()) + 80);
    const gen_result g = run_generation(eng, *kv, it.prompt, 24, 512);
    std::string text = eng.tok.decode(g.tokens);
    const auto e = text.find("<|im_end|>");
    if (e != std::string::npos) text.resize(e);
    const double kib = g.mem.kib_per_token();
    if (arm == "dense") dense_kib = kib;
    std::printf(
        "[%s KV cache]%s\n  answer: ...is%s  %s\n", arm.c_str(),
        arm == "dense" ? " float32, the control"
        : arm == "tiered"
            ? " Recent + Anchor pages FP8 E4M3, Stale pages TQ3 (tierkv)"
            : " Recent + Anchor pages int8_rotated, Stale pages TQ4 keys + TQ3 values (tierkv)",
        text.c_str(), niah_score(it, text) == 1.0 ? "(correct)" : "(wrong)");
    std::printf("  memory: %.2f KiB per token (all %d layers), %.2f bits per stored scalar", kib,
                eng.net.config().layers, g.mem.bits_per_scalar());
    if (arm != "dense" && kib > 0)
      std::printf(", %.1fx smaller than float32, %.1fx than bf16", dense_kib / kib,
                  dense_kib / 2 / kib);
    std::printf("\n  speed: prefill %.0f tokens/s, decode %.1f tokens/s (CPU)\n\n",
                double(it.prompt.size()) / g.prefill_s, double(g.tokens.size()) / g.decode_s);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace smollm
