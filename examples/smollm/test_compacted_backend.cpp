// SPDX-License-Identifier: Apache-2.0
// Tests of the compaction backends (compacted_backend.hpp): AM's biased read path and the
// prefix read through tiered_cache pages against float64 attention over the prefix (with its
// bias) and the causal tokens after it; the RoPE position after a compacted prefix; and, on
// the real model, a "compacted" prefix that keeps every token reproducing the dense cache.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "compacted_backend.hpp"
#include "engine.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/compaction/write_prefix.hpp"

using namespace smollm;

namespace {

// A prefix of t tokens per (layer, KV head) with random keys, values and (optionally) bias;
// keys of head h carry a common offset so that the logits spread over a few nats.
std::vector<prefix_head> random_prefix(const kv_shape& s, int t, bool bias, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g;
  std::uniform_real_distribution<float> b(-3.f, 3.f);
  std::vector<prefix_head> heads(std::size_t(s.layers) * std::size_t(s.kv_heads));
  for (auto& p : heads) {
    p.keys.resize(std::size_t(t) * std::size_t(s.head_dim));
    p.values.resize(p.keys.size());
    for (auto& x : p.keys) x = 1.5f * g(rng);
    for (auto& x : p.values) x = g(rng);
    if (bias) {
      p.beta.resize(std::size_t(t));
      for (auto& x : p.beta) x = b(rng);
    }
  }
  return heads;
}

// Float64 reference of one layer: query i of the chunk (query head h, kv head g = h / group)
// attends the prefix (logit scale q.k + beta) and the tokens after it at positions
// [0, after + i] (scale q.k). after_k / after_v: [token][kv_head][dim] of every token after the
// prefix so far, this chunk's included. Returns [n][q_heads][dim]; lse_out [n][q_heads].
std::vector<double> reference(const kv_shape& s, const std::vector<prefix_head>& heads, int layer,
                              const std::vector<float>& after_k, const std::vector<float>& after_v,
                              int after, int n, const std::vector<float>& q,
                              std::vector<double>* lse_out = nullptr) {
  const int D = s.head_dim, group = s.q_heads / s.kv_heads;
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> out(std::size_t(n) * std::size_t(s.q_heads) * std::size_t(D), 0.0);
  if (lse_out) lse_out->assign(std::size_t(n) * std::size_t(s.q_heads), 0.0);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < s.q_heads; ++h) {
      const int g = h / group;
      const auto& p = heads[std::size_t(layer * s.kv_heads + g)];
      const int t = int(p.keys.size()) / D;
      const float* qi =
          q.data() + (std::size_t(i) * std::size_t(s.q_heads) + std::size_t(h)) * std::size_t(D);
      std::vector<double> logit;
      std::vector<const float*> vals;
      for (int j = 0; j < t; ++j) {
        double dot = 0;
        for (int k = 0; k < D; ++k) dot += double(qi[k]) * p.keys[std::size_t(j * D + k)];
        logit.push_back(scale * dot + (p.beta.empty() ? 0.0 : double(p.beta[std::size_t(j)])));
        vals.push_back(p.values.data() + std::size_t(j * D));
      }
      for (int j = 0; j <= after + i; ++j) {
        const std::size_t at =
            (std::size_t(j) * std::size_t(s.kv_heads) + std::size_t(g)) * std::size_t(D);
        double dot = 0;
        for (int k = 0; k < D; ++k) dot += double(qi[k]) * after_k[at + std::size_t(k)];
        logit.push_back(scale * dot);
        vals.push_back(after_v.data() + at);
      }
      double m = -1e300, z = 0;
      for (double x : logit) m = std::max(m, x);
      for (double x : logit) z += std::exp(x - m);
      double* o =
          out.data() + (std::size_t(i) * std::size_t(s.q_heads) + std::size_t(h)) * std::size_t(D);
      for (std::size_t j = 0; j < logit.size(); ++j)
        for (int k = 0; k < D; ++k) o[k] += std::exp(logit[j] - m) / z * double(vals[j][k]);
      if (lse_out)
        (*lse_out)[std::size_t(i) * std::size_t(s.q_heads) + std::size_t(h)] = m + std::log(z);
    }
  return out;
}

double rel_l2(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// Appends chunks of the given sizes after the prefix and attends each; returns the worst
// relative L2 error against the float64 reference over every layer and chunk.
double continuation_error(kv_backend& kv, const kv_shape& s, const std::vector<prefix_head>& ref,
                          const std::vector<int>& chunks, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g;
  const std::size_t row_kv = std::size_t(s.kv_heads) * std::size_t(s.head_dim);
  const std::size_t row_q = std::size_t(s.q_heads) * std::size_t(s.head_dim);
  std::vector<std::vector<float>> ak(std::size_t(s.layers)), av(std::size_t(s.layers));
  int after = 0;
  double worst = 0;
  for (int n : chunks) {
    for (int l = 0; l < s.layers; ++l) {
      std::vector<float> k(std::size_t(n) * row_kv), v(k.size()), q(std::size_t(n) * row_q),
          out(q.size());
      for (auto& x : k) x = 1.5f * g(rng);
      for (auto& x : v) x = g(rng);
      for (auto& x : q) x = g(rng);
      ak[std::size_t(l)].insert(ak[std::size_t(l)].end(), k.begin(), k.end());
      av[std::size_t(l)].insert(av[std::size_t(l)].end(), v.begin(), v.end());
      kv.append(l, n, k.data(), v.data());
      kv.attend(l, n, q.data(), out.data());
      const auto want = reference(s, ref, l, ak[std::size_t(l)], av[std::size_t(l)], after, n, q);
      worst = std::max(worst, rel_l2(out, want));
    }
    kv.commit(n);
    after += n;
  }
  return worst;
}

}  // namespace

TEST_CASE("attend_float: per-key bias and log-sum-exp against float64") {
  const kv_shape s{1, 3, 9, 64};
  const auto heads = random_prefix(s, 50, true, 3);
  // The 50 biased keys are the "past"; 4 new tokens attend causally after them.
  std::mt19937_64 rng(4);
  std::normal_distribution<float> g;
  const int past = 50, n = 4, cap = past + n, D = s.head_dim;
  std::vector<float> K(std::size_t(s.kv_heads) * cap * D), V(K.size()),
      bias(std::size_t(s.kv_heads) * cap, 0.f), q(std::size_t(n) * s.q_heads * D), out(q.size()),
      lse(std::size_t(n) * s.q_heads), after_k, after_v;
  for (int h = 0; h < s.kv_heads; ++h) {
    std::copy(heads[std::size_t(h)].keys.begin(), heads[std::size_t(h)].keys.end(),
              K.begin() + std::ptrdiff_t(h * cap * D));
    std::copy(heads[std::size_t(h)].values.begin(), heads[std::size_t(h)].values.end(),
              V.begin() + std::ptrdiff_t(h * cap * D));
    std::copy(heads[std::size_t(h)].beta.begin(), heads[std::size_t(h)].beta.end(),
              bias.begin() + std::ptrdiff_t(h * cap));
  }
  after_k.resize(std::size_t(n) * s.kv_heads * D);
  after_v.resize(after_k.size());
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < s.kv_heads; ++h)
      for (int k = 0; k < D; ++k) {
        const float x = 1.5f * g(rng), y = g(rng);
        K[std::size_t((h * cap + past + i) * D + k)] =
            after_k[std::size_t((i * s.kv_heads + h) * D + k)] = x;
        V[std::size_t((h * cap + past + i) * D + k)] =
            after_v[std::size_t((i * s.kv_heads + h) * D + k)] = y;
      }
  for (auto& x : q) x = g(rng);
  std::vector<float> scores;
  detail::attend_float(
      s, past, n, q.data(), out.data(), [&](int h) { return K.data() + std::size_t(h * cap * D); },
      [&](int h) { return V.data() + std::size_t(h * cap * D); }, D, scores, nullptr, 16,
      detail::key_bias{bias.data(), std::size_t(cap), past}, lse.data());
  std::vector<double> want_lse;
  const auto want = reference(s, heads, 0, after_k, after_v, 0, n, q, &want_lse);
  CHECK(rel_l2(out, want) < 1e-5);
  for (std::size_t i = 0; i < lse.size(); ++i) CHECK(std::abs(double(lse[i]) - want_lse[i]) < 1e-4);
  // Without the bias the result is far from the biased reference (the check can fail).
  detail::attend_float(
      s, past, n, q.data(), out.data(), [&](int h) { return K.data() + std::size_t(h * cap * D); },
      [&](int h) { return V.data() + std::size_t(h * cap * D); }, D, scores);
  CHECK(rel_l2(out, want) > 0.1);
}

TEST_CASE("compacted_backend: biased prefix and causal continuation against float64") {
  const kv_shape s{2, 3, 9, 64};
  for (bool bias : {true, false}) {
    INFO("bias " << bias);
    const auto heads = random_prefix(s, 37, bias, bias ? 11 : 12);
    compacted_backend kv(s, heads, 500, 64);
    CHECK(kv.length() == 37);
    CHECK(kv.position() == 500);
    CHECK(continuation_error(kv, s, heads, {5, 1, 7, 1}, 13) < 1e-5);
    CHECK(kv.length() == 37 + 14);
    CHECK(kv.position() == 514);
    kv.reset();  // back to the prefix alone: the same again
    CHECK(kv.position() == 500);
    CHECK(continuation_error(kv, s, heads, {9, 1}, 14) < 1e-5);
  }
  // Refusals: head count, unequal token counts, a bias of the wrong length.
  auto heads = random_prefix(s, 10, true, 15);
  CHECK_THROWS(
      compacted_backend(s, std::vector<prefix_head>(heads.begin(), heads.end() - 1), 20, 8));
  auto uneven = heads;
  uneven[3].keys.resize(9 * 64);
  CHECK_THROWS(compacted_backend(s, uneven, 20, 8));
  auto bad_beta = heads;
  bad_beta[1].beta.pop_back();
  CHECK_THROWS(compacted_backend(s, bad_beta, 20, 8));
  CHECK_THROWS(compacted_backend(s, heads, 9, 8));  // more tokens kept than the original
  compacted_backend small(s, heads, 20, 2);
  std::vector<float> k(3 * 3 * 64);
  CHECK_THROWS(small.append(0, 3, k.data(), k.data()));  // capacity
}

namespace {

// The prefix heads as write_prefix's layout ([layer][token][kv_head][dim]).
tierkv::compaction::compacted_prefix as_prefix(const kv_shape& s,
                                               const std::vector<prefix_head>& heads, int n0) {
  tierkv::compaction::compacted_prefix p;
  const std::size_t D = std::size_t(s.head_dim), H = std::size_t(s.kv_heads),
                    t = heads[0].keys.size() / D;
  p.layers = s.layers;
  p.kv_heads = s.kv_heads;
  p.head_dim = s.head_dim;
  p.tokens = std::int64_t(t);
  p.original_tokens = n0;
  p.softmax_scale = 1.f / std::sqrt(float(s.head_dim));
  p.keys.resize(std::size_t(s.layers) * t * H * D);
  p.values.resize(p.keys.size());
  for (std::size_t l = 0; l < std::size_t(s.layers); ++l)
    for (std::size_t a = 0; a < t; ++a)
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t k = 0; k < D; ++k) {
          p.keys[((l * t + a) * H + h) * D + k] = heads[l * H + h].keys[a * D + k];
          p.values[((l * t + a) * H + h) * D + k] = heads[l * H + h].values[a * D + k];
        }
  return p;
}

// The prefix written into a Cache, read through cache_prefix_backend with a continuation.
template <class Cache>
double through_cache_error(const kv_shape& s, const std::vector<prefix_head>& heads, int n0,
                           std::uint64_t seed) {
  typename Cache::options opt;
  opt.storage.num_layers = s.layers;
  opt.storage.pages_per_tier = {16};
  opt.max_batch = 1;
  opt.max_pages = 8;
  auto c = Cache::create(opt);
  REQUIRE(c);
  auto seq = (*c)->create_sequence();
  REQUIRE(seq);
  REQUIRE(tierkv::compaction::write_prefix(**c, *seq, as_prefix(s, heads, n0)));
  const int t = int(heads[0].keys.size()) / s.head_dim;
  cache_prefix_backend<Cache> kv(s, **c, *seq, n0, 32);
  CHECK(kv.length() == t);
  CHECK(kv.position() == n0);
  const double e = continuation_error(kv, s, heads, {6, 1, 3}, seed);
  CHECK(kv.length() == t + 10);
  CHECK(kv.position() == n0 + 10);
  CHECK(*(*c)->length(*seq) == t);  // the prefix sequence is only read
  kv.reset();
  CHECK(continuation_error(kv, s, heads, {4}, seed + 1) < 2 * e + 1e-5);
  return e;
}

}  // namespace

TEST_CASE("cache_prefix_backend: tiered_cache prefix pages merged with float continuation") {
  const kv_shape s{2, 3, 9, 64};
  const auto heads = random_prefix(s, 40, false, 21);
  using dense_cache =
      tierkv::tiered_cache<smol_geometry,
                           tierkv::tiers<tierkv::tier<tierkv::dense_f32, tierkv::dense_f32>>>;
  using fp8_cache =
      tierkv::tiered_cache<smol_geometry,
                           tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>>>;
  CHECK(through_cache_error<dense_cache>(s, heads, 300, 22) < 1e-5);
  const double e8 = through_cache_error<fp8_cache>(s, heads, 300, 22);
  CHECK(e8 < 0.05);
  CHECK(e8 > 1e-4);  // FP8 pages are read as FP8
}

namespace {
engine& compaction_engine() {
  static engine e = engine::open("");
  return e;
}
}  // namespace

TEST_CASE("a compacted prefix that keeps every token reproduces the dense cache", "[model]") {
  engine& e = compaction_engine();
  const kv_shape s = e.net.config().kv();
  const int V = e.net.config().vocab;
  const auto doc = e.tok.encode(
      "The committee described the narrow bridge before the first snow arrived. A traveller "
      "remembered an unusual clock while the bells were ringing. The old gardener questioned "
      "the winter market after a long and dusty journey.",
      false);
  const auto cont =
      e.tok.encode(" Our neighbour repaired a field of barley because nobody else", false);
  const int n = int(doc.size()), C = int(cont.size());
  // Dense: the document, then the continuation (all logits).
  dense_backend dense(s, n + C);
  std::vector<float> last, want, got;
  e.prefill(doc, dense, last, 16);
  e.net.forward(cont.data(), C, dense, want, true);
  // The same document through capture_backend: its keys and values, every token kept.
  capture_backend cap(s, n + C);
  e.prefill(doc, cap, last, 16);
  std::vector<prefix_head> heads;
  for (int l = 0; l < s.layers; ++l)
    for (int h = 0; h < s.kv_heads; ++h) {
      prefix_head p;
      p.keys.assign(cap.key_rows(l, h), cap.key_rows(l, h) + std::size_t(n) * 64);
      p.values.assign(cap.value_rows(l, h), cap.value_rows(l, h) + std::size_t(n) * 64);
      p.beta.assign(std::size_t(n), 0.f);  // the biased path with beta = 0
      heads.push_back(std::move(p));
    }
  // Captured queries: a document query re-derived through the model is what attend saw; check
  // the rows are filled (non-zero) for every position.
  for (int pos : {0, n / 2, n - 1}) {
    double nn = 0;
    for (int k = 0; k < 64; ++k) nn += std::abs(cap.query_rows(s.layers - 1, 8)[pos * 64 + k]);
    CHECK(nn > 0);
  }
  auto max_diff = [&](const std::vector<float>& a, const std::vector<float>& b) {
    double w = 0;
    for (std::size_t i = 0; i < a.size(); ++i) w = std::max(w, double(std::abs(a[i] - b[i])));
    return w;
  };
  compacted_backend all(s, heads, n, C);
  e.net.forward(cont.data(), C, all, got, true);
  REQUIRE(got.size() == std::size_t(C) * std::size_t(V));
  CHECK(max_diff(got, want) < 2e-3);
  // The RoPE position matters: the same keys with the continuation placed 7 positions later
  // give other logits (this is what the test would catch if position() were ignored).
  compacted_backend shifted(s, heads, n + 7, C);
  e.net.forward(cont.data(), C, shifted, got, true);
  CHECK(max_diff(got, want) > 0.05);
}
