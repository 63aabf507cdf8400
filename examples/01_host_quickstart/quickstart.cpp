// SPDX-License-Identifier: Apache-2.0
// 01_host_quickstart: what an engine writes to keep its KV cache in tierkv. A tiered cache
// (Recent + Anchor pages in FP8, Stale pages in TQ3) takes random post-RoPE keys and values
// for two sequences, decodes a few steps with retiering between them, and prints the
// attention error against float64 attention over the original vectors plus the accounting.
// Exits 1 unless the error is within all-TQ3 pages' (kMaxError) and the report reconciles.
//
//   tierkv_example_01_host_quickstart [--tokens N] [--steps S]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <vector>

#include <tierkv/tierkv.hpp>

namespace {

using geometry = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<2>, tierkv::group_size<4>,
                                  tierkv::page_tokens<16>>;
using fp8 = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using tq3 = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using cache_t = tierkv::tiered_cache<geometry, tierkv::tiers<fp8, tq3>>;

// Decode error bound: pages are FP8 (about 0.04 relative L2 from float64) or TQ3 (about 0.27
// with all pages TQ3, docs/attention.md), so the mix must not be worse than all-TQ3 pages.
constexpr double kMaxError = 0.30;

constexpr int kLayers = 4, D = geometry::head_dim, KV = geometry::kv_heads, QH = geometry::q_heads,
              G = geometry::group_size;

// float64 decode of one sequence's query heads over the original tokens.
std::vector<double> reference(const float* q, const std::vector<float>& k,
                              const std::vector<float>& v, int layer, long len) {
  std::vector<double> out(std::size_t(QH) * D, 0.0);
  std::vector<double> logit(static_cast<std::size_t>(len));
  auto at = [&](const std::vector<float>& x, long t, int h, int d) {
    return double(
        x[((std::size_t(layer) * std::size_t(len) + std::size_t(t)) * KV + std::size_t(h)) * D +
          std::size_t(d)]);
  };
  for (int h = 0; h < QH; ++h) {
    double mx = -INFINITY, sum = 0;
    for (long t = 0; t < len; ++t) {
      double s = 0;
      for (int d = 0; d < D; ++d) s += double(q[h * D + d]) * at(k, t, h / G, d);
      logit[std::size_t(t)] = s / std::sqrt(double(D));
      mx = std::max(mx, logit[std::size_t(t)]);
    }
    for (auto& l : logit) sum += (l = std::exp(l - mx));
    for (long t = 0; t < len; ++t)
      for (int d = 0; d < D; ++d)
        out[std::size_t(h * D + d)] += logit[std::size_t(t)] / sum * at(v, t, h / G, d);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  long tokens = 2000;
  int steps = 50;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tokens"))
      tokens = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps"))
      steps = std::atoi(argv[i + 1]);
  }

  cache_t::options opt;
  opt.storage.num_layers = kLayers;
  opt.storage.max_sequences = 8;
  const auto pages = std::uint32_t(2 * kLayers * (tokens + steps) / geometry::page_tokens + 16);
  opt.storage.pages_per_tier = {pages, pages};
  opt.storage.codec_seed = 2026;
  opt.max_batch = 2;
  opt.max_pages = int(pages);
  auto cache = cache_t::create(opt).value();  // throws tierkv::error with a message on bad options

  // Keys and values of all layers, [layer][token][kv_head][dim], as an engine produces them.
  std::mt19937 rng(7);
  std::normal_distribution<float> gauss;
  const std::vector<tierkv::seq_id> batch{cache->create_sequence().value(),
                                          cache->create_sequence().value()};
  std::vector<std::vector<float>> keys(2), values(2);
  auto append = [&](std::size_t b, long n) {
    const long old_len = cache->length(batch[b]).value();
    std::vector<float> k(std::size_t(kLayers * n * KV * D)), v(k.size());
    for (auto& x : k) x = gauss(rng);
    for (auto& x : v) x = gauss(rng);
    cache->append(batch[b], n, k, v).throw_if_error();
    // Keep originals (re-laid out per layer) for the float64 check.
    auto grow = [&](std::vector<float>& all, const std::vector<float>& add) {
      std::vector<float> next(std::size_t(kLayers) * std::size_t(old_len + n) * KV * D);
      const std::size_t row = std::size_t(KV) * D;
      // std::copy_n, not memcpy: the first append copies 0 floats from an empty vector (a null
      // pointer, which memcpy may not be given: UBSan, CI's sanitized example run).
      for (int l = 0; l < kLayers; ++l) {
        std::copy_n(all.data() + std::size_t(l) * std::size_t(old_len) * row,
                    std::size_t(old_len) * row,
                    next.data() + std::size_t(l) * std::size_t(old_len + n) * row);
        std::copy_n(
            add.data() + std::size_t(l) * std::size_t(n) * row, std::size_t(n) * row,
            next.data() + (std::size_t(l) * std::size_t(old_len + n) + std::size_t(old_len)) * row);
      }
      all.swap(next);
    };
    grow(keys[b], k);
    grow(values[b], v);
  };
  append(0, tokens);
  append(1, tokens / 2);

  std::vector<float> q(batch.size() * QH * D), out(q.size());
  double err_sum = 0;
  int err_n = 0;
  for (int step = 1; step <= steps; ++step) {
    for (std::size_t b = 0; b < batch.size(); ++b) append(b, 1);
    for (int layer = 0; layer < kLayers; ++layer) {
      for (auto& x : q) x = gauss(rng);
      cache->attend(layer, batch, q, out).throw_if_error();  // decode over FP8 + TQ3 pages
      if (step == steps) {
        for (std::size_t b = 0; b < batch.size(); ++b) {
          const auto ref = reference(q.data() + b * QH * D, keys[b], values[b], layer,
                                     cache->length(batch[b]).value());
          double num = 0, den = 0;
          for (std::size_t i = 0; i < ref.size(); ++i) {
            num += (out[b * QH * D + i] - ref[i]) * (out[b * QH * D + i] - ref[i]);
            den += ref[i] * ref[i];
          }
          err_sum += std::sqrt(num / den);
          ++err_n;
        }
      }
    }
    cache->retier(std::uint64_t(step));  // Recent -> Stale as pages age; anchors stay FP8
  }

  const tierkv::memory_report report = cache->report();
  std::printf(
      "tierkv quickstart: 2 sequences (%ld and %ld tokens), %d layers, head_dim %d, %d KV heads, "
      "group %d, %d decode steps\n",
      cache->length(batch[0]).value(), cache->length(batch[1]).value(), kLayers, D, KV, G, steps);
  const double err = err_sum / err_n;
  std::printf(
      "decode output vs float64 attention over the original vectors: mean relative L2 error %.4f "
      "(bound %.2f)\n",
      err, kMaxError);
  std::cout << report << "\n";
  if (!(err <= kMaxError)) std::printf("FAILED: decode error above the bound\n");
  if (!report.reconciles()) std::printf("FAILED: the report does not reconcile\n");
  return err <= kMaxError && report.reconciles() ? 0 : 1;
}
