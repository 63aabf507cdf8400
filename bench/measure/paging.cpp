// SPDX-License-Identifier: Apache-2.0
// scripts/measure paging: CPU rates of append and fork, and the storage's own exact
// accounting for real geometries and tier mixes (FP8 everywhere, TQ3 everywhere, 27%
// of pages FP8), every page encoded with the real codecs. Last line: JSON.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "measure_common.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/report.hpp"

using namespace tierkv;

namespace {

using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using tq3_tier = tier<tq3_key, tq3_value>;
using bf16_tier = tier<dense_bf16, dense_bf16>;

// Process CPU time, not wall time: the development machines are shared (2 cores, many
// jobs), and CPU time is what a dedicated scheduler thread would spend.
double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
double seconds_since(double t0) { return cpu_now() - t0; }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class S>
std::unique_ptr<S> make(int layers, std::uint32_t pages0, std::uint32_t pages1,
                        std::uint32_t seqs) {
  typename S::options o;
  o.num_layers = layers;
  o.max_sequences = seqs;
  o.pages_per_tier.fill(pages1);
  o.pages_per_tier[0] = pages0;
  o.codec_seed = 2026;
  auto s = S::create(o);
  if (!s) {
    std::fprintf(stderr, "storage: %s\n", s.error_status().message().c_str());
    std::exit(1);
  }
  return std::move(*s);
}

template <class S>
void random_kv(int layers, std::int64_t n, std::mt19937& rng, std::vector<float>& k,
               std::vector<float>& v) {
  std::normal_distribution<float> g;
  k.resize(std::size_t(layers) * std::size_t(n) * S::kv_heads * S::head_dim);
  v.resize(k.size());
  for (auto& x : k) x = g(rng);
  for (auto& x : v) x = g(rng);
}

// Converts one sealed page from tier 0 to tier 1 with the real codecs: decode each
// vector, re-encode, publish, release (what the tiering engine does in batch).
template <class S>
void convert_page(S& s, seq_id id, int layer, std::int64_t lp, std::uint64_t seed) {
  using L0 = typename S::template layout<0>;
  using L1 = typename S::template layout<1>;
  const page_id old = *s.page(id, layer, lp);
  const page_id fresh = *s.allocate_page(1);
  const std::uint8_t* src = s.page_bytes(old)->data();
  std::uint8_t* dst = s.page_bytes(fresh)->data();
  float x[S::head_dim];
  auto recode = [&](auto from_codec, auto to_codec, const std::uint8_t* sp, const std::uint8_t* sm,
                    std::uint8_t* dp, std::uint8_t* dm, const codec_context& ctx) {
    using F = decltype(from_codec);
    using T = decltype(to_codec);
    typename F::meta_type m{};
    std::memcpy(&m, sm, F::meta_bytes);
    F::decode(sp, m, x, ctx);
    typename T::meta_type out{};
    (void)T::encode(x, dp, out, ctx, nullptr);
    std::memcpy(dm, &out, T::meta_bytes);
  };
  for (int h = 0; h < S::kv_heads; ++h)
    for (int t = 0; t < S::page_tokens; ++t) {
      const auto kctx = make_codec_context(seed, layer, h, kv_role::key);
      const auto vctx = make_codec_context(seed, layer, h, kv_role::value);
      recode(typename L0::key_codec{}, typename L1::key_codec{}, src + L0::key_payload(h, t),
             src + L0::key_meta(h, t), dst + L1::key_payload(h, t), dst + L1::key_meta(h, t), kctx);
      recode(typename L0::value_codec{}, typename L1::value_codec{}, src + L0::value_payload(h, t),
             src + L0::value_meta(h, t), dst + L1::value_payload(h, t), dst + L1::value_meta(h, t),
             vctx);
    }
  if (auto st = s.replace_page(id, layer, lp, old, fresh); !st) {
    std::fprintf(stderr, "replace_page: %s\n", st.message().c_str());
    std::exit(1);
  }
}

// One sequence of `pages` full logical pages; `fp8_pages` of them stay FP8 (the first
// one, an attention sink, and the most recent ones), the rest move to TQ3.
template <class Geometry>
memory_report accounting(int layers, int pages, int fp8_pages, const char* label) {
  using S = paged_storage<Geometry, tiers<fp8_tier, tq3_tier>>;
  auto s = make<S>(layers, std::uint32_t(layers * pages), std::uint32_t(layers * pages), 1);
  std::mt19937 rng(1);
  std::vector<float> k, v;
  const std::int64_t n = std::int64_t(pages) * S::page_tokens;
  random_kv<S>(layers, n, rng, k, v);
  const seq_id id = *s->create_sequence();
  if (auto st = s->append(id, n, k, v); !st) {
    std::fprintf(stderr, "append: %s\n", st.message().c_str());
    std::exit(1);
  }
  std::vector<bool> keep(std::size_t(pages), false);
  if (fp8_pages > 0) {
    keep[0] = true;
    for (int lp = pages - (fp8_pages - 1); lp < pages; ++lp) keep[std::size_t(lp)] = true;
  }
  for (int lp = 0; lp < pages; ++lp)
    if (!keep[std::size_t(lp)])
      for (int l = 0; l < layers; ++l) convert_page(*s, id, l, lp, s->config().codec_seed);
  const memory_report r = make_report(*s);
  std::printf(
      "\n== %s: %d layers, %d KV heads, head_dim %d, %d logical pages of %d tokens, %d FP8 ==\n",
      label, layers, S::kv_heads, S::head_dim, pages, S::page_tokens, fp8_pages);
  std::cout << r;
  if (!r.reconciles()) {
    std::fprintf(stderr, "accounting does not reconcile\n");
    std::exit(1);
  }
  return r;
}

template <class Geometry>
memory_report bf16_control(int layers, int pages) {
  using S = paged_storage<Geometry, tiers<bf16_tier>>;
  auto s = make<S>(layers, std::uint32_t(layers * pages), 1, 1);
  std::mt19937 rng(1);
  std::vector<float> k, v;
  const std::int64_t n = std::int64_t(pages) * S::page_tokens;
  random_kv<S>(layers, n, rng, k, v);
  const seq_id id = *s->create_sequence();
  (void)s->append(id, n, k, v);
  return make_report(*s);
}

// Append: `batch` sequences, one token (all layers) per call, as in decode. One
// storage for all repetitions (the first one also pays the first touch of the pages).
template <class Geometry, class Tier0 = fp8_tier>
double append_tokens_per_s(int layers, int batch, int steps) {
  using S = paged_storage<Geometry, tiers<Tier0>>;
  const std::uint32_t pages =
      std::uint32_t(layers * batch * ((steps + S::page_tokens - 1) / S::page_tokens));
  auto s = make<S>(layers, pages, 1, std::uint32_t(batch));
  std::mt19937 rng(3);
  std::vector<float> k, v;
  random_kv<S>(layers, 1, rng, k, v);
  std::vector<double> rates;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<seq_id> ids;
    for (int b = 0; b < batch; ++b) ids.push_back(*s->create_sequence());
    const double t0 = cpu_now();
    for (int i = 0; i < steps; ++i)
      for (const seq_id id : ids)
        if (!s->append(id, 1, k, v)) std::exit(1);
    rates.push_back(double(steps) * batch / seconds_since(t0));
    for (const seq_id id : ids) (void)s->release(id);
  }
  return median(rates);
}

// Fork of a sequence with an open tail (shares sealed pages, copies the tail) + release.
template <class Geometry>
double forks_per_s(int layers, int tokens) {
  using S = paged_storage<Geometry, tiers<fp8_tier, tq3_tier>>;
  const std::uint32_t pages = std::uint32_t(layers * (tokens / S::page_tokens + 3));
  auto s = make<S>(layers, pages, 1, 4);
  std::mt19937 rng(5);
  std::vector<float> k, v;
  random_kv<S>(layers, tokens, rng, k, v);
  const seq_id id = *s->create_sequence();
  (void)s->append(id, tokens, k, v);
  std::vector<double> rates;
  for (int rep = 0; rep < 5; ++rep) {
    const int n = 2000;
    const double t0 = cpu_now();
    for (int i = 0; i < n; ++i) {
      auto c = s->fork(id);
      (void)s->release(*c);
    }
    rates.push_back(n / seconds_since(t0));
  }
  return median(rates);
}

}  // namespace

int main() {
  // Qwen3.6-27B-like full-attention layers: 24 q heads, 4 KV heads, head_dim 256, 16 layers.
  using g256 = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<16>>;
  // SmolLM2-135M: 9 q heads, 3 KV heads, head_dim 64, 30 layers.
  using g64 = geometry<head_dim<64>, kv_heads<3>, group_size<3>, page_tokens<16>>;
  using g256_p64 = geometry<head_dim<256>, kv_heads<4>, group_size<6>, page_tokens<64>>;

  measure::report out("paging");
  std::printf(
      "paging: accounting from the storage's own report (100 logical pages, every page full)\n");
  const auto fp8 = accounting<g256>(16, 100, 100, "d256 FP8 everywhere");
  const auto tq3 = accounting<g256>(16, 100, 0, "d256 TQ3 everywhere");
  const auto mix = accounting<g256>(16, 100, 27, "d256 tiered, 27% of pages FP8");
  const auto bf16 = bf16_control<g256>(16, 100);
  const auto s_fp8 = accounting<g64>(30, 100, 100, "SmolLM2-135M FP8 everywhere");
  const auto s_tq3 = accounting<g64>(30, 100, 0, "SmolLM2-135M TQ3 everywhere");
  const auto s_mix = accounting<g64>(30, 100, 27, "SmolLM2-135M tiered, 27% of pages FP8");
  const auto s_bf16 = bf16_control<g64>(30, 100);

  std::printf("\n%-34s %12s %14s\n", "configuration", "KiB/token", "bits/scalar");
  auto row = [](const char* name, const memory_report& r) {
    std::printf("%-34s %12.3f %14.4f\n", name, r.kib_per_token, r.bits_per_scalar);
  };
  row("d256 x4 KV x16 layers, BF16", bf16);
  row("d256 x4 KV x16 layers, FP8", fp8);
  row("d256 x4 KV x16 layers, TQ3", tq3);
  row("d256 x4 KV x16 layers, 27% FP8", mix);
  row("SmolLM2-135M, BF16", s_bf16);
  row("SmolLM2-135M, FP8", s_fp8);
  row("SmolLM2-135M, TQ3", s_tq3);
  row("SmolLM2-135M, 27% FP8", s_mix);

  std::printf(
      "\nCPU rates (median of 5, process CPU time; host encode into FP8 pages, all layers per "
      "token)\n");
  const double app256 = append_tokens_per_s<g256_p64>(16, 64, 64);
  const double app64 = append_tokens_per_s<g64>(30, 64, 64);
  // The same with the lossless dense_f32 format (a copy per vector): the paging cost alone.
  const double app256_dense = append_tokens_per_s<g256_p64, tier<dense_f32, dense_f32>>(16, 64, 64);
  const double fork256 = forks_per_s<g256_p64>(16, 1000);
  const double fork64 = forks_per_s<g64>(30, 1000);
  std::printf(
      "append d256 (16 layers, 64 tokens/page), B=64, 1 token/call: %.0f tokens/s (%.2f us per "
      "token)\n",
      app256, 1e6 / app256);
  std::printf(
      "append SmolLM2 (30 layers), B=64, 1 token/call:              %.0f tokens/s (%.2f us per "
      "token)\n",
      app64, 1e6 / app64);
  std::printf(
      "append d256 in dense_f32 (copy, no encode), B=64:             %.0f tokens/s (%.2f us per "
      "token)\n",
      app256_dense, 1e6 / app256_dense);
  std::printf("fork+release d256, 1000 tokens (open tail copied):         %.0f ops/s\n", fork256);
  std::printf("fork+release SmolLM2, 1000 tokens (open tail copied):      %.0f ops/s\n", fork64);

  out.metric("kib_per_token_fp8_d256", fp8.kib_per_token);
  out.metric("kib_per_token_tq3_d256", tq3.kib_per_token);
  out.metric("kib_per_token_tiered_27pct_fp8_d256", mix.kib_per_token);
  out.metric("kib_per_token_bf16_d256", bf16.kib_per_token);
  out.metric("bits_per_scalar_fp8_d256", fp8.bits_per_scalar);
  out.metric("bits_per_scalar_tq3_d256", tq3.bits_per_scalar);
  out.metric("bits_per_scalar_tiered_27pct_fp8_d256", mix.bits_per_scalar);
  out.metric("kib_per_token_fp8_smollm2", s_fp8.kib_per_token);
  out.metric("kib_per_token_tq3_smollm2", s_tq3.kib_per_token);
  out.metric("kib_per_token_tiered_27pct_fp8_smollm2", s_mix.kib_per_token);
  out.metric("bits_per_scalar_tiered_27pct_fp8_smollm2", s_mix.bits_per_scalar);
  out.metric("append_tokens_per_s_d256_b64", app256);
  out.metric("append_tokens_per_s_smollm2_b64", app64);
  out.metric("append_tokens_per_s_dense_f32_d256_b64", app256_dense);
  out.metric("fork_per_s_d256_1000tok", fork256);
  out.metric("fork_per_s_smollm2_1000tok", fork64);
  out.metric("accounting_reconciles",
             (fp8.reconciles() && tq3.reconciles() && mix.reconciles()) ? 1 : 0);
  out.emit();
  return 0;
}
