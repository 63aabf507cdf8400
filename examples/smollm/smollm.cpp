// SPDX-License-Identifier: Apache-2.0
// smollm: SmolLM2-135M on tierkv. Subcommands:
//   generate  --prompt TEXT [--chat] [--arm A] [--max-new N]
//   logits    --prompt TEXT            (top logits of the last position, for checks)
//   tokenize  --prompt TEXT
//   tasks     [--quick] [--arms a,b,..] [--out FILE.json]   needle + perplexity + agreement
//   demo      [--tokens N]                                   2K needle, dense vs tiered
//   compaction --out-dir DIR [...]                           AM compaction arms (issue 27)
//   dump      --out PREFIX [--ppl-text FILE] [--tokens N]     real K/V/Q for codec studies
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "compaction_eval.hpp"
#include "kv_dump.hpp"
#include "runner.hpp"

using namespace smollm;

namespace {

struct args {
  std::map<std::string, std::string> kv;
  std::vector<std::string> flags;
  bool has(const std::string& f) const {
    return std::find(flags.begin(), flags.end(), f) != flags.end();
  }
  std::string get(const std::string& k, const std::string& d = "") const {
    auto it = kv.find(k);
    return it == kv.end() ? d : it->second;
  }
  int get_int(const std::string& k, int d) const {
    auto it = kv.find(k);
    return it == kv.end() ? d : std::atoi(it->second.c_str());
  }
};

args parse(int argc, char** argv, int from) {
  args a;
  static const char* boolean[] = {"--quick", "--chat", "--help", "--no-llamacpp-check", "--no-ppl"};
  for (int i = from; i < argc; ++i) {
    std::string s = argv[i];
    bool is_flag = false;
    for (const char* b : boolean) is_flag |= (s == b);
    if (is_flag || i + 1 >= argc)
      a.flags.push_back(s);
    else
      a.kv[s] = argv[++i];
  }
  return a;
}

void usage() {
  std::fprintf(
      stderr,
      "usage: smollm COMMAND [--model FILE.gguf] [--threads N] ...\n"
      "  generate --prompt TEXT [--chat] [--arm dense|rec|seed|fp8|tq3|int8r|tiered|tiered_int8r|"
      "tiered_k4|tiered_k8] "
      "[--max-new N]\n"
      "           issue 52's arms: "
      "stale_k4v2|stale_k3v2|stale_k2v2|stale_k3v2u|stale_k3v3u|rec_u|cold_k3v2u|"
      "cold_u4_k3v2u|cold_u3_k3v2u|"
      "uniform_k4v4|uniform_k3v3|"
      "uniform_k4v2|uniform_k3v2|uniform_k3v4|uniform_k2v2|uniform_k8v4|cold_k4v2|cold_k3v2|cold_"
      "k2v2|"
      "a4_k3v2_k2v2|a4_k4v2_k3v2|a4_k3v2|a44_k3v2|a84_k3v2|a48_k3v2|a4_cold_k3v2,\n"
      "           each with optional knobs ARM+rp=4+cm=0.5 (tierkv_backend.hpp)\n"
      "  logits   --prompt TEXT [--arm A]\n"
      "  tokenize --prompt TEXT\n"
      "  tasks    [--quick] [--arms dense,tiered,tiered_k4,tiered_int8r,tq3,fp8,int8r] [--lengths "
      "1024,4096] [--tasks single,multikey,multivalue,multiquery,vartrack,cwe,qa] [--items N]\n"
      "           [--first-item I] [--no-ppl] [--out FILE.json] [--dump-items FILE.jsonl] "
      "[--ppl-text FILE]\n"
      "  tiered policy (tierkv::policy::recency_anchor; defaults are tierkv's):\n"
      "           [--recent-pages 4] [--sink-pages 1] [--keep-first-layers 1] [--keep-last-layers "
      "1]\n"
      "           [--use-mass 1] [--enter-mass 4] [--leave-mass 2] [--center 1] "
      "[--retier-in-prefill 1] "
      "[--codec-seed N]\n"
      "           Cold arms: [--cold-mass 0.5] [--cold-leave-mass 1] [--cold-after-pages 8]\n"
      "  ppl      [--arm A] [--tokens 2048] [--chunk 512] [--ppl-text FILE | --ppl-ids FILE] "
      "[--nll-out FILE.json]\n"
      "  demo     [--tokens 2048]\n"
      "  compaction --out-dir DIR [--docs FILE[+FILE]@OFFSET,...,needle:I] [--doc-tokens 4096]\n"
      "           [--cont-tokens 256] [--greedy 32] [--ref repeat|self] [--ref-stride 2]\n"
      "           [--budgets 0.1,0.05]"
      " [--remedies 1] [--quant 1] [--text-dir /usr/share/common-licenses]\n"
      "  dump     --out PREFIX [--ppl-text FILE] [--tokens 4096] [--chunk 512]   (kv_dump.hpp)\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage();
    return 2;
  }
  const std::string cmd = argv[1];
  const args a = parse(argc, argv, 2);
  if (a.has("--help")) {
    usage();
    return 0;
  }
  openblas_set_num_threads(a.get_int("--threads", 2));
  try {
    engine eng = engine::open(a.get("--model", ""));
    auto& pol = eng.tiering.policy;
    pol.sink_pages = a.get_int("--sink-pages", pol.sink_pages);
    pol.recent_pages = a.get_int("--recent-pages", pol.recent_pages);
    pol.keep_first_layers = a.get_int("--keep-first-layers", pol.keep_first_layers);
    pol.keep_last_layers = a.get_int("--keep-last-layers", pol.keep_last_layers);
    pol.enter_mass =
        float(std::atof(a.get("--enter-mass", std::to_string(pol.enter_mass)).c_str()));
    pol.leave_mass =
        float(std::atof(a.get("--leave-mass", std::to_string(pol.leave_mass)).c_str()));
    eng.tiering.use_mass = a.get_int("--use-mass", 1) != 0;
    if (a.kv.count("--cold-mass"))
      eng.tiering.cold_enter_mass = float(std::atof(a.get("--cold-mass").c_str()));
    if (a.kv.count("--cold-leave-mass"))
      eng.tiering.cold_leave_mass = float(std::atof(a.get("--cold-leave-mass").c_str()));
    eng.tiering.cold_after_pages = a.get_int("--cold-after-pages", -1);
    eng.tiering.center = a.get_int("--center", 1) != 0;
    eng.tiering.retier_in_prefill = a.get_int("--retier-in-prefill", 1) != 0;
    eng.tiering.threads = unsigned(a.get_int("--threads", 2));
    if (a.kv.count("--codec-seed")) eng.tiering.seed = std::stoull(a.get("--codec-seed"));
    if (cmd == "tokenize") {
      for (auto id : eng.tok.encode(a.get("--prompt"))) std::printf("%d ", id);
      std::printf("\n");
      return 0;
    }
    if (cmd == "generate" || cmd == "logits") {
      std::string text = a.get("--prompt", "The capital of France is");
      if (a.has("--chat")) text = chat_prompt(text);
      const auto ids = eng.tok.encode(text);
      auto kv = eng.make_backend(a.get("--arm", "dense"), int(ids.size()) + 512);
      if (cmd == "logits") {
        std::vector<float> logits;
        eng.prefill(ids, *kv, logits, 256);
        std::vector<int> order(logits.size());
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + 10, order.end(), [&](int x, int y) {
          return logits[std::size_t(x)] > logits[std::size_t(y)];
        });
        for (int i = 0; i < 10; ++i)
          std::printf("%6d %10.5f %s\n", order[std::size_t(i)],
                      double(logits[std::size_t(order[std::size_t(i)])]),
                      eng.tok.piece(order[std::size_t(i)]).c_str());
        return 0;
      }
      const auto t0 = std::chrono::steady_clock::now();
      const auto out = eng.generate(ids, *kv, a.get_int("--max-new", 32), 256);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s\n", eng.tok.decode(out).c_str());
      std::fprintf(stderr, "[%zu prompt tokens, %zu generated, %.2f s]\n", ids.size(), out.size(),
                   s);
      return 0;
    }
    if (cmd == "tasks") {
      run_options o;
      o.quick = a.has("--quick");
      o.arms = a.get("--arms", o.arms);
      o.out = a.get("--out", "");
      o.dump_items = a.get("--dump-items", "");
      o.items = a.get_int("--items", 0);
      o.first_item = a.get_int("--first-item", 0);
      o.ppl = !a.has("--no-ppl");
      o.lengths = a.get("--lengths", "");
      o.tasks = a.get("--tasks", "");
      o.ppl_text = a.get("--ppl-text", o.ppl_text);
      return run_tasks(eng, o);
    }
    if (cmd == "ppl") {  // one arm's chunked perplexity (policy sweeps)
      const std::string ids = a.get("--ppl-ids", "");
      auto toks =
          !ids.empty()
              ? read_token_ids(ids, eng.net.config().vocab)
              : eng.tok.encode(
                    read_text_file(a.get("--ppl-text", "/usr/share/common-licenses/GPL-3")), false);
      toks.resize(std::min<std::size_t>(toks.size(), std::size_t(a.get_int("--tokens", 2048))));
      auto kv = eng.make_backend(a.get("--arm", "dense"), int(toks.size()) + 80);
      const ppl_result p = run_ppl(eng, *kv, toks, a.get_int("--chunk", 512), 0);
      std::printf(
          "%s ppl %.4f over %d tokens, %.3f bits per scalar, %.2f KiB/token, fp8 share %.3f%s%s\n",
          a.get("--arm", "dense").c_str(), p.ppl, p.scored, p.mem.bits_per_scalar(),
          p.mem.kib_per_token(), p.mem.fp8_fraction, p.mem.tier_shares.empty() ? "" : ", pages ",
          p.mem.tier_shares.c_str());
      if (const std::string f = a.get("--nll-out", ""); !f.empty()) {
        // per-token NLL for paired intervals (scripts/measure ppl-texts)
        std::ofstream o(f);
        o << "{\"arm\":\"" << a.get("--arm", "dense") << "\",\"tokens\":" << toks.size()
          << ",\"scored\":" << p.scored << ",\"ppl\":" << p.ppl
          << ",\"bits_per_scalar\":" << p.mem.bits_per_scalar() << ",\"tier_shares\":\""
          << p.mem.tier_shares << "\",\"seconds\":" << p.seconds << ",\"layer_tiers\":[";
        for (std::size_t l = 0; l < p.mem.layer_tiers.size(); ++l)
          o << (l ? "," : "") << '"' << p.mem.layer_tiers[l] << '"';
        o << "],\"nll\":[";
        o.precision(9);
        for (std::size_t i = 0; i < p.nll.size(); ++i) o << (i ? "," : "") << p.nll[i];
        o << "]}\n";
        if (!o) throw std::runtime_error("ppl: cannot write " + f);
      }
      return 0;
    }
    if (cmd == "dump") {  // dense-cache K/V/Q of every layer for offline codec studies
      const std::string text = a.get("--ppl-text", "/usr/share/common-licenses/GPL-3");
      const std::string out = a.get("--out", "");
      if (out.empty()) {
        usage();
        return 2;
      }
      auto toks = eng.tok.encode(read_text_file(text), false);
      toks.resize(std::min<std::size_t>(toks.size(), std::size_t(a.get_int("--tokens", 4096))));
      dump_kv(eng, toks, a.get_int("--chunk", 512), text, out);
      std::printf("dump: %zu tokens of %s -> %s.{json,k.f32,v.f32,q.f32}\n", toks.size(),
                  text.c_str(), out.c_str());
      return 0;
    }
    if (cmd == "demo") return run_demo(eng, a.get_int("--tokens", 2048));
    if (cmd == "compaction") {  // docs/compaction.md; scripts/measure compaction-model
      compaction_eval_options o;
      o.out_dir = a.get("--out-dir", "");
      o.docs = a.get("--docs", o.docs);
      o.text_dir = a.get("--text-dir", o.text_dir);
      o.doc_tokens = a.get_int("--doc-tokens", o.doc_tokens);
      o.cont_tokens = a.get_int("--cont-tokens", o.cont_tokens);
      o.greedy_tokens = a.get_int("--greedy", o.greedy_tokens);
      o.ref_stride = a.get_int("--ref-stride", o.ref_stride);
      o.ref = a.get("--ref", o.ref);
      o.chunk = a.get_int("--chunk", o.chunk);
      o.budgets = a.get("--budgets", o.budgets);
      o.remedies = a.get_int("--remedies", 1) != 0;
      o.quant = a.get_int("--quant", 1) != 0;
      if (o.doc_tokens < 64 || o.cont_tokens < 1 || o.greedy_tokens < 1 || o.ref_stride < 1 ||
          o.chunk < 1) {
        usage();
        return 2;
      }
      return run_compaction_eval(eng, o);
    }
    usage();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "smollm: %s\n", e.what());
    return 1;
  }
}
