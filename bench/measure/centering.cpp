// SPDX-License-Identifier: Apache-2.0
// scripts/measure centering: the host façade's decode (tiered_cache::attend) against float64
// attention over the ORIGINAL vectors, with options.center off and on, on synthetic hard data:
// Gaussian tokens, a per-channel offset 5x the per-token spread (QK biases, massive
// activations) on the keys and on keys and values, 4 outlier key channels with 8x the spread,
// and large-norm tokens (1 in 10 at 8x). With value offsets the output is mostly the value mean,
// so its relative error is small either way; key offsets alone show what the offset costs the
// routing.
// Caches: the seed paper's FP8 + TQ3 and the recommended int8_rotated + TQ4 keys / TQ3 values,
// (8, 2, 128) heads, 64-token pages, 4096 tokens, every page but the newest Stale after one
// retier; decode of 4 random query sets; relative L2 of the outputs averaged over 3 seeds.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "measure_common.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

using namespace tierkv;

namespace {

using G = geometry<head_dim<128>, kv_heads<2>, group_size<4>, page_tokens<64>>;
constexpr int D = G::head_dim, H = G::kv_heads, QH = G::q_heads, N = 4096;
using seed_tiers = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>;
using rec_tiers = tiers<tier<int8_rotated, int8_rotated>, tier<tq4_key, tq3_value>>;

enum data_kind { gauss, key_offsets, kv_offsets, outliers, large_norms };
const char* kind_name[] = {"gauss", "key_offsets", "kv_offsets", "outliers", "large_norms"};

// [token][kv_head][dim] keys and values of one layer.
void make_data(data_kind kind, std::uint64_t seed, std::vector<float>& k, std::vector<float>& v) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> ok(std::size_t(H) * D, 0.f), ov(ok.size(), 0.f);
  for (std::size_t i = 0; i < ok.size(); ++i) {
    if (kind == key_offsets || kind == kv_offsets) ok[i] = 5.f * g(rng);
    if (kind == kv_offsets) ov[i] = 5.f * g(rng);
  }
  k.resize(std::size_t(N) * H * D);
  v.resize(k.size());
  for (int t = 0; t < N; ++t) {
    const float norm = kind == large_norms && t % 10 == 3 ? 8.f : 1.f;
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < D; ++d) {
        const std::size_t i = (std::size_t(t) * H + std::size_t(h)) * D + std::size_t(d);
        const float spread = kind == outliers && d < 4 ? 8.f : 1.f;
        k[i] = ok[std::size_t(h) * D + std::size_t(d)] + norm * spread * g(rng);
        v[i] = ov[std::size_t(h) * D + std::size_t(d)] + norm * g(rng);
      }
  }
}

// float64 decode of queries q [q_heads][dim] over the original vectors.
std::vector<double> reference(const std::vector<float>& k, const std::vector<float>& v,
                              const float* q) {
  std::vector<double> out(std::size_t(QH) * D, 0.0), logit(N);
  const double scale = 1.0 / std::sqrt(double(D));
  for (int qh = 0; qh < QH; ++qh) {
    const int h = qh / G::group_size;
    double mx = -1e300;
    for (int t = 0; t < N; ++t) {
      double s = 0;
      for (int d = 0; d < D; ++d)
        s += double(q[qh * D + d]) * k[(std::size_t(t) * H + std::size_t(h)) * D + std::size_t(d)];
      logit[std::size_t(t)] = s * scale;
      mx = std::max(mx, logit[std::size_t(t)]);
    }
    double sum = 0;
    for (auto& l : logit) sum += (l = std::exp(l - mx));
    for (int t = 0; t < N; ++t)
      for (int d = 0; d < D; ++d)
        out[std::size_t(qh) * D + std::size_t(d)] +=
            logit[std::size_t(t)] / sum *
            v[(std::size_t(t) * H + std::size_t(h)) * D + std::size_t(d)];
  }
  return out;
}

template <class Tiers>
double decode_error(data_kind kind, bool center, std::uint64_t seed) {
  using cache = tiered_cache<G, Tiers>;
  typename cache::options o;
  o.storage.num_layers = 1;
  o.storage.max_sequences = 1;
  o.storage.pages_per_tier = {N / G::page_tokens, N / G::page_tokens};
  o.policy = policy::recency_anchor({.recent_pages = 1,
                                     .sink_pages = 0,
                                     .min_dwell_steps = 0,
                                     .keep_first_layers = 0,
                                     .keep_last_layers = 0});
  o.max_batch = 1;
  o.max_pages = N / G::page_tokens;
  o.center = center;
  auto c = cache::create(o).value();
  std::vector<float> k, v;
  make_data(kind, seed, k, v);
  const seq_id s = c->create_sequence().value();
  c->append(s, N, k, v).throw_if_error();
  (void)c->retier(1);
  std::mt19937_64 rng(seed + 1000);
  std::normal_distribution<float> g(0.f, 1.f);
  double err = 0;
  const int sets = 4;
  for (int r = 0; r < sets; ++r) {
    std::vector<float> q(std::size_t(QH) * D), out(q.size());
    for (auto& x : q) x = g(rng);
    c->attend(0, std::span(&s, 1), q, out).throw_if_error();
    const auto ref = reference(k, v, q.data());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      num += (out[i] - ref[i]) * (out[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    err += std::sqrt(num / den) / sets;
  }
  return err;
}

}  // namespace

int main() {
  measure::report rep("centering");
  std::printf(
      "Host decode (tiered_cache::attend) vs float64 over the original vectors: relative L2, "
      "(8,2,128), %d tokens, 63 of 64 pages Stale, 3 seeds x 4 query sets\n\n",
      N);
  std::printf("%-12s %-6s %12s %12s %8s\n", "data", "cache", "uncentred", "centred", "ratio");
  for (int kind = 0; kind < 5; ++kind)
    for (int arm = 0; arm < 2; ++arm) {
      double e[2] = {0, 0};
      for (int center = 0; center < 2; ++center)
        for (std::uint64_t seed = 1; seed <= 3; ++seed)
          e[center] += (arm == 0 ? decode_error<seed_tiers>(data_kind(kind), center, seed)
                                 : decode_error<rec_tiers>(data_kind(kind), center, seed)) /
                       3;
      const char* a = arm == 0 ? "seed" : "rec";
      std::printf("%-12s %-6s %12.4f %12.4f %8.3f\n", kind_name[kind], a, e[0], e[1], e[1] / e[0]);
      rep.metric(std::string("rel_err_") + a + "_" + kind_name[kind] + "_uncentred", e[0]);
      rep.metric(std::string("rel_err_") + a + "_" + kind_name[kind] + "_centred", e[1]);
    }
  std::printf("\n(seed: FP8 + TQ3 pages; rec: int8_rotated + TQ4 keys / TQ3 values)\n");
  rep.emit();
  return 0;
}
