// SPDX-License-Identifier: Apache-2.0
// `smollm compaction`: Attention Matching compaction of real SmolLM2-135M caches (issue 27,
// docs/compaction.md; driven by scripts/measure compaction-model).
//
// Per document (a >= 4K-token text window, or a needle prompt of tasks.hpp):
//   1. the float32 model reads the document (chunked prefill through capture_backend), which
//      records every (layer, head)'s post-RoPE keys, values and queries;
//   2. per (layer, KV head), Attention Matching over reference queries (every query head of
//      the GQA group, every ref_stride-th position; by default those of a second read of the
//      document, which attend all of it, else its own) at each budget gives the arms
//        keep   the selected keys with their original values, no bias
//        drop   the selected keys, values refit without a bias
//        am     the selected keys, NNLS bias beta, refit values: the biased read path
//               (compacted_backend adds beta to the prefix's logits)
//        fold   AM's bias folded into the keys (k + beta sqrt(d) u), plain attention
//        fold_fp8 / fold_tq3  the folded prefix written into a tierkv::tiered_cache of FP8 /
//               TQ3 pages (write_prefix) and read by the cache's own attend
//      and, with remedies, fold_mean (u = mu / |mu|^2), fold_r01 (ridge 0.1 on u), am_b1 and
//      fold_b1 (|beta| <= 1, values refit for it), am_nv and fold_nv (AM's bias over the kept
//      tokens' original values, no refit), fold_sel (per head the fold or drop, whichever
//      matches the full output better on the reference queries; also on FP8 / TQ3 pages as
//      fold_sel_fp8 / fold_sel_tq3); full_fp8 / full_tq3 put the whole
//      uncompacted document through the same pages (the codecs' own error);
//   3. each arm and the full float32 cache read the continuation, teacher-forced: per position
//      KL(full || arm) of the next-token distribution, the arm's log-loss and top-1 hit on the
//      true next token, and agreement of its top-1 with the full cache's; then a free-running
//      greedy continuation (after the question, for a needle prompt) whose common prefix with
//      the full cache's is the greedy agreement, and for needles whether the answer appears.
// One JSON file per document in out_dir (doc-<index>.json, written whole and renamed), which a
// later run with the same settings skips: the run is resumable document by document.
// examples/smollm/summarize_compaction.py turns the files into the record and its intervals.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "compacted_backend.hpp"
#include "engine.hpp"
#include "runner.hpp"
#include "tasks.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/compaction/attention_matching.hpp"
#include "tierkv/compaction/biased_attention.hpp"
#include "tierkv/compaction/fold.hpp"
#include "tierkv/compaction/write_prefix.hpp"

namespace smollm {

struct compaction_eval_options {
  std::string out_dir;  // per-document result files (required)
  // Comma-separated documents: FILE[+FILE...]@OFFSET (texts under text_dir joined by a blank
  // line, the window starting at token OFFSET), or needle:I (tasks.hpp's single-needle item I
  // at 4K tokens).
  std::string docs =
      "GPL-3@0,GPL-3@3285,LGPL-2.1@0,GFDL-1.3@0,MPL-1.1@0,Apache-2.0+GPL-2@0,needle:0,needle:1";
  std::string text_dir = "/usr/share/common-licenses";
  int doc_tokens = 4096;   // the compacted document
  int cont_tokens = 256;   // teacher-forced positions scored after it
  int greedy_tokens = 32;  // free-running greedy tokens compared with the full cache
  int ref_stride = 2;      // reference queries from every ref_stride-th document position
  // Where the reference queries come from: "repeat" = the queries of a second read of the
  // document right after it (positions n .. 2n-1, each attending the whole document: AM's
  // repeat-prefill), "self" = the document's own queries (positions 0 .. n-1; the fit lets
  // each of them attend all n keys, including the ones after it).
  std::string ref = "repeat";
  int chunk = 512;  // prefill chunk of the document
  std::string budgets = "0.1,0.05";
  bool remedies = true;           // fold_mean, fold_r01, am_b1, fold_b1, am_nv, fold_nv
  bool quant = true;              // fold_fp8, fold_tq3, full_fp8, full_tq3
  std::uint64_t seed = 20261129;  // needle items
};

namespace compaction_detail {

using fp8_prefix_cache =
    tierkv::tiered_cache<smol_geometry,
                         tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>>>;
using tq3_prefix_cache =
    tierkv::tiered_cache<smol_geometry,
                         tierkv::tiers<tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>>>;

struct eval_doc {
  std::string name;
  std::vector<std::int32_t> doc;     // compacted
  std::vector<std::int32_t> tf;      // teacher-forced: fed [0, C), targets [1, C]
  std::vector<std::int32_t> prompt;  // fed before the greedy continuation (may be empty)
  int greedy = 32;
  std::vector<std::string> answers;  // needle answers (empty for text)
};

// One arm's per-position figures on the continuation.
struct arm_result {
  std::vector<float> kl, nll;
  std::vector<std::uint8_t> top1, agree;
  std::vector<std::int32_t> greedy;
  double greedy_agree = 0, needle = -1, seconds = 0;
  std::int64_t tokens = 0;  // prefix tokens held (t, or n for the full and full_* arms)
};

// The full cache's log-probabilities on the continuation (the KL reference).
struct full_reference {
  std::vector<float> logprob;  // [C][vocab]
  std::vector<std::int32_t> argmax;
  arm_result r;
};

inline std::string budget_label(double b) {
  return std::to_string(int(std::lround(b * 100))) + "pct";
}

inline double log_sum_exp(const float* x, int n) {
  float m = x[0];
  for (int i = 1; i < n; ++i) m = std::max(m, x[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(x[i] - m));
  return double(m) + std::log(s);
}

inline std::vector<std::int32_t> greedy_run(engine& eng, kv_backend& kv, const eval_doc& d,
                                            const std::vector<float>& doc_last_logits) {
  const int V = eng.net.config().vocab;
  std::vector<float> logits = doc_last_logits;
  if (!d.prompt.empty()) eng.net.forward(d.prompt.data(), int(d.prompt.size()), kv, logits, false);
  std::vector<std::int32_t> out;
  for (int i = 0; i < d.greedy; ++i) {
    const std::int32_t next = engine::argmax(logits.data(), V);
    out.push_back(next);
    if (i + 1 == d.greedy) break;
    eng.net.forward(&next, 1, kv, logits, false);
  }
  return out;
}

inline std::size_t common_prefix(const std::vector<std::int32_t>& a,
                                 const std::vector<std::int32_t>& b) {
  std::size_t k = 0;
  while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
  return k;
}

// Teacher-forced continuation and greedy run of one arm over kv (which holds the document,
// compacted or not, and nothing after it); kv is reset to that state in between.
// logits_out (if given) receives the teacher-forced logits [C][vocab].
inline arm_result evaluate(engine& eng, kv_backend& kv, const eval_doc& d,
                           const full_reference* full, const std::vector<float>& doc_last_logits,
                           const std::function<void()>& rewind,
                           std::vector<float>* logits_out = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  const int V = eng.net.config().vocab;
  const int C = int(d.tf.size()) - 1;
  arm_result r;
  std::vector<float> logits;
  eng.net.forward(d.tf.data(), C, kv, logits, true);
  if (logits_out) *logits_out = logits;
  r.kl.resize(std::size_t(C));
  r.nll.resize(std::size_t(C));
  r.top1.resize(std::size_t(C));
  r.agree.resize(std::size_t(C));
  for (int j = 0; j < C; ++j) {
    const float* a = logits.data() + std::size_t(j) * std::size_t(V);
    const double lse = log_sum_exp(a, V);
    const std::int32_t target = d.tf[std::size_t(j + 1)];
    const std::int32_t best = engine::argmax(a, V);
    r.nll[std::size_t(j)] = float(lse - double(a[target]));
    r.top1[std::size_t(j)] = best == target;
    if (full) {
      const float* lp = full->logprob.data() + std::size_t(j) * std::size_t(V);
      double kl = 0;
      for (int v = 0; v < V; ++v) {
        const double p = double(lp[v]);
        kl += std::exp(p) * (p - (double(a[v]) - lse));
      }
      r.kl[std::size_t(j)] = float(std::max(0.0, kl));
      r.agree[std::size_t(j)] = best == full->argmax[std::size_t(j)];
    }
  }
  rewind();
  r.greedy = greedy_run(eng, kv, d, doc_last_logits);
  if (full) r.greedy_agree = double(common_prefix(r.greedy, full->r.greedy)) / double(d.greedy);
  if (!d.answers.empty()) {
    niah_item it;
    it.answers = d.answers;
    r.needle = niah_score(it, eng.tok.decode(r.greedy));
  }
  r.seconds = seconds_since(t0);
  return r;
}

template <class Cache>
std::unique_ptr<Cache> make_prefix_cache(int layers, std::int64_t tokens) {
  typename Cache::options opt;
  opt.storage.num_layers = layers;
  opt.storage.pages_per_tier = {std::uint32_t(std::int64_t(layers) * (tokens / 16 + 2))};
  opt.max_batch = 1;
  opt.max_pages = int(tokens / 16 + 2);
  auto c = Cache::create(opt);
  if (!c) throw tierkv::error(c.error_status());
  return std::move(*c);
}

// The arm through pages of Cache: the prefix written by write_prefix, read by Cache::attend.
template <class Cache>
arm_result through_cache(engine& eng, const tierkv::compaction::compacted_prefix& p,
                         const eval_doc& d, const full_reference& full,
                         const std::vector<float>& doc_last_logits, const std::string& name) {
  auto cache = make_prefix_cache<Cache>(p.layers, p.tokens);
  auto s = cache->create_sequence();
  if (!s) throw tierkv::error(s.error_status());
  if (auto st = tierkv::compaction::write_prefix(*cache, *s, p); !st) throw tierkv::error(st);
  const int after = int(d.tf.size() + d.prompt.size()) + d.greedy + 8;
  cache_prefix_backend<Cache> kv(eng.net.config().kv(), *cache, *s, int(p.original_tokens), after,
                                 name);
  auto r = evaluate(eng, kv, d, &full, doc_last_logits, [&] { kv.reset(); });
  r.tokens = p.tokens;
  return r;
}

inline void put_array(std::ostream& o, const std::vector<float>& v) {
  o << '[';
  char b[32];
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::snprintf(b, sizeof b, "%.6g", double(v[i]));
    o << (i ? "," : "") << b;
  }
  o << ']';
}
template <class T>
void put_ints(std::ostream& o, const std::vector<T>& v) {
  o << '[';
  for (std::size_t i = 0; i < v.size(); ++i) o << (i ? "," : "") << int(v[i]);
  o << ']';
}

inline std::vector<eval_doc> make_docs(engine& eng, const compaction_eval_options& o) {
  std::vector<eval_doc> docs;
  for (const std::string& spec : split_csv(o.docs)) {
    eval_doc d;
    d.name = spec;
    if (spec.rfind("needle:", 0) == 0) {
      // tasks.hpp's single-needle prompt at 4K: the document is everything before the
      // question; the question and answer prefix are fed before the greedy answer, and the
      // teacher-forced positions run over them and the answer's tokens.
      const int index = std::stoi(spec.substr(7));
      const niah_item it = make_niah_item(eng.tok, "single", 4096, index, o.seed);
      const auto q = eng.tok.encode("What is the special magic number for", false);
      std::size_t at = std::string::npos;
      for (std::size_t i = it.prompt.size() - q.size() + 1; i-- > 0;)
        if (std::equal(q.begin(), q.end(), it.prompt.begin() + std::ptrdiff_t(i))) {
          at = i;
          break;
        }
      if (at == std::string::npos) throw std::runtime_error(spec + ": no question in the prompt");
      d.doc.assign(it.prompt.begin(), it.prompt.begin() + std::ptrdiff_t(at));
      d.prompt.assign(it.prompt.begin() + std::ptrdiff_t(at), it.prompt.end());
      d.tf = d.prompt;
      for (std::int32_t t : eng.tok.encode(" " + it.answers[0] + ".", false)) d.tf.push_back(t);
      d.answers = it.answers;
      d.greedy = 16;
    } else {
      const auto at = spec.rfind('@');
      if (at == std::string::npos) throw std::runtime_error("document '" + spec + "': no @OFFSET");
      std::string text;
      std::stringstream files(spec.substr(0, at));
      for (std::string f; std::getline(files, f, '+');)
        text += (text.empty() ? "" : "\n\n") + read_text_file(o.text_dir + "/" + f);
      const auto toks = eng.tok.encode(text, false);
      const std::size_t off = std::size_t(std::stoll(spec.substr(at + 1)));
      const std::size_t need = off + std::size_t(o.doc_tokens) + std::size_t(o.cont_tokens) + 1;
      if (toks.size() < need)
        throw std::runtime_error("document '" + spec + "': " + std::to_string(toks.size()) +
                                 " tokens, " + std::to_string(need) + " needed");
      d.doc.assign(toks.begin() + std::ptrdiff_t(off),
                   toks.begin() + std::ptrdiff_t(off + std::size_t(o.doc_tokens)));
      d.tf.assign(toks.begin() + std::ptrdiff_t(off + std::size_t(o.doc_tokens)),
                  toks.begin() + std::ptrdiff_t(need));
      d.greedy = o.greedy_tokens;
    }
    docs.push_back(std::move(d));
  }
  return docs;
}

}  // namespace compaction_detail

inline std::string compaction_signature(const compaction_eval_options& o) {
  std::ostringstream s;
  s << "doc_tokens=" << o.doc_tokens << ";cont_tokens=" << o.cont_tokens
    << ";greedy=" << o.greedy_tokens << ";ref_stride=" << o.ref_stride << ";chunk=" << o.chunk
    << ";ref=" << o.ref << ";budgets=" << o.budgets << ";pages=fold"
    << (o.remedies ? ",fold_sel" : "") << ";remedies=" << o.remedies << ";quant=" << o.quant
    << ";seed=" << o.seed;
  return s.str();
}

inline int run_compaction_eval(engine& eng, const compaction_eval_options& o) {
  using namespace compaction_detail;
  namespace tc = tierkv::compaction;
  if (o.out_dir.empty()) throw std::runtime_error("compaction: --out-dir is required");
  std::filesystem::create_directories(o.out_dir);
  const auto docs = make_docs(eng, o);
  const kv_shape S = eng.net.config().kv();
  const int L = S.layers, H = S.kv_heads, G = S.q_heads / S.kv_heads, D = S.head_dim;
  const std::string sig = compaction_signature(o);
  std::vector<double> budgets;
  for (const auto& b : split_csv(o.budgets)) budgets.push_back(std::stod(b));
  {  // the manifest: which documents and settings this directory's files belong to
    std::ofstream m(o.out_dir + "/run.json");
    m << "{\"signature\": \"" << sig << "\", \"docs\": [";
    for (std::size_t i = 0; i < docs.size(); ++i)
      m << (i ? ", " : "") << '"' << json_escape(docs[i].name) << '"';
    m << "]}\n";
    if (!m) throw std::runtime_error("cannot write " + o.out_dir + "/run.json");
  }

  for (std::size_t di = 0; di < docs.size(); ++di) {
    const eval_doc& d = docs[di];
    const std::string path = o.out_dir + "/doc-" + std::to_string(di) + ".json";
    {
      std::ifstream in(path);
      std::stringstream ss;
      ss << in.rdbuf();
      if (in && ss.str().find("\"signature\": \"" + sig + "\"") != std::string::npos &&
          ss.str().find("\"doc\": \"" + d.name + "\"") != std::string::npos) {
        std::fprintf(stderr, "compaction: %s done (%s)\n", d.name.c_str(), path.c_str());
        continue;
      }
    }
    const auto t_doc = std::chrono::steady_clock::now();
    std::map<std::string, double> sec;
    const int n = int(d.doc.size());
    const int C = int(d.tf.size()) - 1;
    const int after = int(d.tf.size() + d.prompt.size()) + d.greedy + 8;

    // 1. The full float32 cache over the document, recording keys, values and queries.
    const bool repeat = o.ref == "repeat";
    if (!repeat && o.ref != "self")
      throw std::runtime_error("compaction: --ref " + o.ref + " is neither repeat nor self");
    capture_backend cap(S, n + std::max(after, repeat ? n : 0));
    std::vector<float> last;
    auto t0 = std::chrono::steady_clock::now();
    eng.prefill(d.doc, cap, last, o.chunk);
    const std::vector<float> doc_last(last.end() - eng.net.config().vocab, last.end());
    sec["prefill"] = seconds_since(t0);
    // Reference queries per (layer, KV head): [position][group head][dim], every ref_stride-th
    // position of the document (own queries) or of its second read.
    const std::size_t HD = std::size_t(D);
    std::vector<std::vector<float>> refqs(std::size_t(L) * std::size_t(H));
    {
      t0 = std::chrono::steady_clock::now();
      if (repeat) {
        std::vector<float> ignored;
        eng.prefill(d.doc, cap, ignored, o.chunk);
      }
      const int base = repeat ? n : 0;
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h) {
          auto& rq = refqs[std::size_t(l * H + h)];
          rq.reserve(std::size_t((n + o.ref_stride - 1) / o.ref_stride) * std::size_t(G) * HD);
          for (int p = 0; p < n; p += o.ref_stride)
            for (int r = 0; r < G; ++r) {
              const float* q = cap.query_rows(l, h * G + r) + std::size_t(base + p) * HD;
              rq.insert(rq.end(), q, q + HD);
            }
        }
      cap.truncate(n);
      sec["reference_queries"] = seconds_since(t0);
    }
    full_reference full;
    {
      cap.capturing = true;  // the continuation's queries: the held-out fold diagnostics
      std::vector<float> logits;
      full.r = evaluate(
          eng, cap, d, nullptr, doc_last,
          [&] {
            cap.truncate(n);
            cap.capturing = false;
          },
          &logits);
      cap.truncate(n);
      full.r.tokens = n;
      const int V = eng.net.config().vocab;
      full.logprob.resize(std::size_t(C) * std::size_t(V));
      full.argmax.resize(std::size_t(C));
      for (int j = 0; j < C; ++j) {
        const float* a = logits.data() + std::size_t(j) * std::size_t(V);
        const double lse = log_sum_exp(a, V);
        for (int v = 0; v < V; ++v)
          full.logprob[std::size_t(j) * std::size_t(V) + std::size_t(v)] =
              float(double(a[v]) - lse);
        full.argmax[std::size_t(j)] = engine::argmax(a, V);
      }
    }

    // 2. Compaction per (layer, KV head), every budget and arm.
    t0 = std::chrono::steady_clock::now();
    std::map<std::string, std::vector<prefix_head>> arms;  // name -> [l * H + h]
    // (arm, budget) -> the plain compacted heads that also go through FP8 / TQ3 pages: the
    // default fold, and fold_sel (a plain cache that works) with remedies.
    std::map<std::pair<std::string, std::string>, std::vector<tc::folded_head>> folded;
    std::map<std::string, double> diag, maxdiag;
    std::map<std::string, std::vector<double>> per_head;  // [l * H + h]
    for (double b : budgets)
      for (const char* k : {"fold_vs_am_output_error_cont_", "fold_vs_am_output_error_ref_"})
        per_head[k + budget_label(b)].assign(std::size_t(L) * std::size_t(H), 0.0);
    std::vector<float> heldq;
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        std::vector<float> refq = std::move(refqs[std::size_t(l * H + h)]);
        heldq.clear();
        for (int p = n; p < n + C; ++p)
          for (int r = 0; r < G; ++r) {
            const float* q = cap.query_rows(l, h * G + r) + std::size_t(p) * HD;
            heldq.insert(heldq.end(), q, q + HD);
          }
        // Samples for the fold's error: every 4th continuation query row, every 16th reference
        // query row.
        std::vector<float> heldq_sample, refq_sample;
        for (std::size_t i = 0; i < heldq.size() / HD; i += 4)
          heldq_sample.insert(heldq_sample.end(), heldq.begin() + std::ptrdiff_t(i * HD),
                              heldq.begin() + std::ptrdiff_t((i + 1) * HD));
        for (std::size_t i = 0; i < refq.size() / HD; i += 16)
          refq_sample.insert(refq_sample.end(), refq.begin() + std::ptrdiff_t(i * HD),
                             refq.begin() + std::ptrdiff_t((i + 1) * HD));
        const std::span<const float> K(cap.key_rows(l, h), std::size_t(n) * HD),
            Vv(cap.value_rows(l, h), std::size_t(n) * HD);
        const tc::head_data hd{K, Vv, refq, D};
        auto ref = tc::am_prepare(hd);
        if (!ref) throw tierkv::error(ref.error_status());
        for (double b : budgets) {
          const std::string bl = budget_label(b);
          auto put = [&](const std::string& arm, prefix_head ph) {
            auto& v = arms[arm + "_" + bl];
            v.resize(std::size_t(L) * std::size_t(H));
            v[std::size_t(l * H + h)] = std::move(ph);
          };
          auto match = [&](tc::am_options ao) {
            ao.budget = b;
            auto c = tc::attention_match(hd, *ref, ao);
            if (!c) throw tierkv::error(c.error_status());
            return std::move(*c);
          };
          auto fold = [&](const tc::head_compaction& c, tc::fold_options fo) {
            auto f = tc::fold(c, refq, fo);
            if (!f) throw tierkv::error(f.error_status());
            return std::move(*f);
          };
          // Per-head diagnostics, averaged over the L x H heads.
          auto add = [&](const std::string& key, double v) {
            diag[key + "_" + bl] += v / double(L * H);
          };
          auto fold_diag = [&](const std::string& arm, const tc::head_compaction& c,
                               const tc::folded_head& f) -> double {
            double bmax = 0, qu = 0;
            for (float x : c.beta) bmax = std::max(bmax, std::abs(double(x)));
            const std::size_t nh = heldq.size() / HD;
            for (std::size_t i = 0; i < nh; ++i) {
              double dot = 0;
              for (std::size_t k = 0; k < HD; ++k) dot += double(heldq[i * HD + k]) * f.u[k];
              qu += std::abs(dot - 1.0);
            }
            add(arm + "_abs_qu_minus_1_ref", f.mean_abs_qu_minus_1);
            add(arm + "_abs_qu_minus_1_cont", qu / double(nh));
            add(arm + "_logit_bound_ref", f.mean_logit_bound);
            add(arm + "_logit_bound_cont", bmax * qu / double(nh));
            // The fold's own error, isolated: plain attention over the folded prefix against
            // AM's biased attention over the same kept tokens, on the continuation's queries
            // (as the full cache computed them) and on a sample of the reference queries.
            auto fold_error = [&](const std::vector<float>& qs) {
              std::vector<double> biased(qs.size()), plain(qs.size());
              tc::biased_attention(qs, c.keys, c.values, c.beta, D, c.softmax_scale, biased)
                  .throw_if_error();
              tc::biased_attention(qs, f.keys, f.values, {}, D, c.softmax_scale, plain)
                  .throw_if_error();
              double num = 0, den = 0;
              for (std::size_t i = 0; i < qs.size(); ++i) {
                num += (plain[i] - biased[i]) * (plain[i] - biased[i]);
                den += biased[i] * biased[i];
              }
              return std::sqrt(num / den);
            };
            const double ec = fold_error(heldq_sample);
            add(arm + "_vs_am_output_error_cont", ec);
            maxdiag[arm + "_vs_am_output_error_cont_max_head_" + bl] =
                std::max(maxdiag[arm + "_vs_am_output_error_cont_max_head_" + bl], ec);
            const double er = fold_error(refq_sample);
            add(arm + "_vs_am_output_error_ref", er);
            if (arm == "fold") {
              per_head["fold_vs_am_output_error_cont_" + bl][std::size_t(l * H + h)] = ec;
              per_head["fold_vs_am_output_error_ref_" + bl][std::size_t(l * H + h)] = er;
            }
            return er;
          };
          // Relative L2 of plain attention over (keys, values) against the full attention
          // output on the reference-query sample (ref->Y rows of the sampled queries).
          auto error_vs_full_ref = [&](const std::vector<float>& keys,
                                       const std::vector<float>& values) {
            std::vector<double> out(refq_sample.size());
            tc::biased_attention(refq_sample, keys, values, {}, D, ref->softmax_scale, out)
                .throw_if_error();
            double num = 0, den = 0;
            for (std::size_t i = 0; i < out.size() / HD; ++i)
              for (std::size_t k = 0; k < HD; ++k) {
                const double y = ref->Y[i * 16 * HD + k];
                num += (out[i * HD + k] - y) * (out[i * HD + k] - y);
                den += y * y;
              }
            return std::sqrt(num / den);
          };
          tc::am_options ao;
          const tc::head_compaction am = match(ao);
          ao.fit_bias = false;
          const tc::head_compaction drop = match(ao);
          prefix_head keep{am.keys, {}, {}};
          keep.values.resize(am.keys.size());
          for (std::size_t a = 0; a < am.kept.size(); ++a)
            std::copy_n(Vv.begin() + std::ptrdiff_t(std::size_t(am.kept[a]) * HD), HD,
                        keep.values.begin() + std::ptrdiff_t(a * HD));
          put("keep", std::move(keep));
          put("drop", {drop.keys, drop.values, {}});
          put("am", {am.keys, am.values, am.beta});
          tc::folded_head f = fold(am, {});
          fold_diag("fold", am, f);
          put("fold", {f.keys, f.values, {}});
          if (o.remedies) {
            // fold_sel: per head the fold or drop (both plain caches), whichever reproduces the
            // full attention output better on the reference queries (no threshold, no
            // continuation data).
            const bool use_fold =
                error_vs_full_ref(f.keys, f.values) <= error_vs_full_ref(drop.keys, drop.values);
            add("fold_sel_fold_share", use_fold ? 1.0 : 0.0);
            tc::folded_head sel;
            sel.head_dim = D;
            sel.n = n;
            sel.softmax_scale = am.softmax_scale;
            sel.keys = use_fold ? f.keys : drop.keys;
            sel.values = use_fold ? f.values : drop.values;
            put("fold_sel", {sel.keys, sel.values, {}});
            auto& sv = folded[{"fold_sel", bl}];
            sv.resize(std::size_t(L) * std::size_t(H));
            sv[std::size_t(l * H + h)] = std::move(sel);
          }
          add("tokens", double(am.size()));
          add("beta_at_lower_bound_share", double(am.at_lower_bound) / double(am.size()));
          add("beta_clipped_high_share", double(am.clipped_high) / double(am.size()));
          add("am_mass_error", am.mass_error);
          add("am_mass_error_no_bias", am.mass_error_no_bias);
          add("am_output_error", am.output_error);
          add("drop_output_error", drop.output_error);
          add("keep_output_error", am.output_error_original);
          auto& fv = folded[{"fold", bl}];
          fv.resize(std::size_t(L) * std::size_t(H));
          fv[std::size_t(l * H + h)] = std::move(f);
          if (o.remedies) {
            const tc::folded_head fm = fold(am, {tc::fold_direction::mean, 1e-3});
            fold_diag("fold_mean", am, fm);
            put("fold_mean", {fm.keys, fm.values, {}});
            const tc::folded_head fr = fold(am, {tc::fold_direction::ridge, 0.1});
            fold_diag("fold_r01", am, fr);
            put("fold_r01", {fr.keys, fr.values, {}});
            tc::am_options a1;
            a1.beta_max = 1.0;
            const tc::head_compaction am1 = match(a1);
            put("am_b1", {am1.keys, am1.values, am1.beta});
            const tc::folded_head f1 = fold(am1, {});
            fold_diag("fold_b1", am1, f1);
            put("fold_b1", {f1.keys, f1.values, {}});
            tc::am_options anv;  // the paper's Table 9 ablation: the bias over original values
            anv.refit_values = false;
            const tc::head_compaction amnv = match(anv);
            put("am_nv", {amnv.keys, amnv.values, amnv.beta});
            const tc::folded_head fnv = fold(amnv, {});
            fold_diag("fold_nv", amnv, fnv);
            put("fold_nv", {fnv.keys, fnv.values, {}});
          }
        }
      }
    for (const auto& [k, v] : maxdiag) diag[k] = v;
    sec["compaction"] = seconds_since(t0);

    // 3. Every arm over the continuation.
    t0 = std::chrono::steady_clock::now();
    std::map<std::string, arm_result> res;
    for (const auto& [name, heads] : arms) {
      compacted_backend kv(S, heads, n, after, name);
      res[name] = evaluate(eng, kv, d, &full, doc_last, [&] { kv.reset(); });
      res[name].tokens = kv.prefix_tokens();
      std::fprintf(stderr, "  %-18s kl %.4f\n", name.c_str(), [&] {
        double s = 0;
        for (float x : res[name].kl) s += x;
        return s / double(res[name].kl.size());
      }());
    }
    if (o.quant) {
      for (const auto& [key, fv] : folded) {
        const auto& [arm, bl] = key;
        auto p = tc::assemble_prefix(fv, L, H);
        if (!p) throw tierkv::error(p.error_status());
        const std::string n8 = arm + "_fp8_" + bl, n3 = arm + "_tq3_" + bl;
        res[n8] = through_cache<fp8_prefix_cache>(eng, *p, d, full, doc_last, n8);
        res[n3] = through_cache<tq3_prefix_cache>(eng, *p, d, full, doc_last, n3);
      }
      tc::compacted_prefix whole;  // the uncompacted document through the same pages
      whole.layers = L;
      whole.kv_heads = H;
      whole.head_dim = D;
      whole.tokens = whole.original_tokens = n;
      whole.softmax_scale = 1.f / std::sqrt(float(D));
      whole.keys.resize(std::size_t(L) * std::size_t(n) * std::size_t(H) * HD);
      whole.values.resize(whole.keys.size());
      for (int l = 0; l < L; ++l)
        for (int p = 0; p < n; ++p)
          for (int h = 0; h < H; ++h) {
            const std::size_t at =
                ((std::size_t(l) * std::size_t(n) + std::size_t(p)) * H + h) * HD;
            std::copy_n(cap.key_rows(l, h) + std::size_t(p) * HD, HD,
                        whole.keys.begin() + std::ptrdiff_t(at));
            std::copy_n(cap.value_rows(l, h) + std::size_t(p) * HD, HD,
                        whole.values.begin() + std::ptrdiff_t(at));
          }
      res["full_fp8"] = through_cache<fp8_prefix_cache>(eng, whole, d, full, doc_last, "full_fp8");
      res["full_tq3"] = through_cache<tq3_prefix_cache>(eng, whole, d, full, doc_last, "full_tq3");
    }
    sec["evaluation"] = seconds_since(t0);
    sec["document"] = seconds_since(t_doc);

    // 4. The document's file, written whole, then renamed into place.
    std::ostringstream js;
    js << "{\"doc\": \"" << json_escape(d.name) << "\", \"signature\": \"" << sig
       << "\", \"index\": " << di << ", \"n\": " << n << ", \"positions\": " << C
       << ", \"greedy_tokens\": " << d.greedy << ",\n \"seconds\": {";
    bool first = true;
    for (const auto& [k, v] : sec) {
      js << (first ? "" : ", ") << '"' << k << "\": " << v;
      first = false;
    }
    js << "},\n \"diag\": {";
    first = true;
    for (const auto& [k, v] : diag) {
      js << (first ? "" : ", ") << '"' << k << "\": " << v;
      first = false;
    }
    js << "},\n \"per_head\": {";
    first = true;
    for (const auto& [k, v] : per_head) {
      js << (first ? "" : ", ") << '"' << k << "\": ";
      put_array(js, std::vector<float>(v.begin(), v.end()));
      first = false;
    }
    js << "},\n \"full\": {\"nll\": ";
    put_array(js, full.r.nll);
    js << ", \"top1\": ";
    put_ints(js, full.r.top1);
    js << ", \"greedy\": ";
    put_ints(js, full.r.greedy);
    js << ", \"needle\": " << full.r.needle << "},\n \"arms\": {";
    first = true;
    for (const auto& [name, r] : res) {
      js << (first ? "" : ",\n  ") << '"' << name << "\": {\"tokens\": " << r.tokens
         << ", \"greedy_agree\": " << r.greedy_agree << ", \"needle\": " << r.needle
         << ", \"seconds\": " << r.seconds << ", \"kl\": ";
      put_array(js, r.kl);
      js << ", \"nll\": ";
      put_array(js, r.nll);
      js << ", \"top1\": ";
      put_ints(js, r.top1);
      js << ", \"agree\": ";
      put_ints(js, r.agree);
      js << ", \"greedy\": ";
      put_ints(js, r.greedy);
      js << "}";
      first = false;
    }
    js << "}}\n";
    {
      std::ofstream out(path + ".tmp");
      out << js.str();
      if (!out) throw std::runtime_error("cannot write " + path + ".tmp");
    }
    std::filesystem::rename(path + ".tmp", path);
    std::fprintf(stderr,
                 "compaction: %s (%d tokens, %d positions) in %.0f s (prefill %.0f, compaction "
                 "%.0f, evaluation %.0f) -> %s\n",
                 d.name.c_str(), n, C, sec["document"], sec["prefill"], sec["compaction"],
                 sec["evaluation"], path.c_str());
  }
  return 0;
}

}  // namespace smollm
