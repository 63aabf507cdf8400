// SPDX-License-Identifier: Apache-2.0
// scripts/measure attention: host decode over FP8, TQ3 and mixed pages against a float64
// dense reference on the ORIGINAL vectors (relative L2 of outputs, LSE error), per-page
// attention mass fidelity (Spearman, top-8 overlap), and host decode throughput.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "measure_common.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"

using namespace tierkv;

namespace {

using tierkv::measure::spearman;
using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using tq3_tier = tier<tq3_key, tq3_value>;
using mixed = tiers<fp8_tier, tq3_tier>;
enum arm { arm_fp8 = 0, arm_tq3 = 1, arm_mixed = 2 };
const char* arm_name[] = {"fp8", "tq3", "mixed"};

// One sequence's pages of one layer, all KV heads, encoded in host memory.
template <class Geo>
struct cache {
  static constexpr int D = Geo::head_dim, P = Geo::page_tokens, KVH = Geo::kv_heads;
  std::vector<std::uint8_t> store[2];
  std::vector<std::int32_t> indptr[2], slot[2], logical[2], lens;
  pool_view pools[2];
  batch_index_view<2> index{};

  // k, v: [batch][len][KVH][D]. tier_of(page, pages) -> 0 FP8 / 1 TQ3.
  template <class F>
  void build(const std::vector<float>& k, const std::vector<float>& v, int batch, int len,
             F tier_of, std::uint64_t seed) {
    lens.assign(std::size_t(batch), len);
    const int pages = (len + P - 1) / P;
    build_tier<0>(k, v, batch, len, pages, tier_of, seed);
    build_tier<1>(k, v, batch, len, pages, tier_of, seed);
    index.batch = batch;
    index.seq_len = lens.data();
    for (int f = 0; f < 2; ++f)
      index.formats[f] = {indptr[f].data(), slot[f].data(), logical[f].data()};
  }
  template <int I, class F>
  void build_tier(const std::vector<float>& k, const std::vector<float>& v, int batch, int len,
                  int pages, F tier_of, std::uint64_t seed) {
    using T = tier_at_t<mixed, I>;
    using KC = typename T::template key_codec<D>;
    using VC = typename T::template value_codec<D>;
    using layout = page_layout<Geo, KC, VC>;
    indptr[I].assign(std::size_t(batch) + 1, 0);
    slot[I].clear();
    logical[I].clear();
    for (int b = 0; b < batch; ++b) {
      for (int p = 0; p < pages; ++p)
        if (tier_of(p, pages) == I) {
          slot[I].push_back(std::int32_t(slot[I].size()));
          logical[I].push_back(p);
        }
      indptr[I][std::size_t(b) + 1] = std::int32_t(slot[I].size());
    }
    store[I].assign(std::max<std::size_t>(1, slot[I].size()) * layout::page_bytes, 0xFF);
    for (int b = 0; b < batch; ++b)
      for (int e = indptr[I][std::size_t(b)]; e < indptr[I][std::size_t(b) + 1]; ++e) {
        std::uint8_t* page =
            store[I].data() + std::size_t(slot[I][std::size_t(e)]) * layout::page_bytes;
        const int p = logical[I][std::size_t(e)];
        for (int h = 0; h < KVH; ++h) {
          const auto kc = make_codec_context(seed, 0, h, kv_role::key);
          const auto vc = make_codec_context(seed, 0, h, kv_role::value);
          for (int t = 0; t < P && p * P + t < len; ++t) {
            const std::size_t off =
                ((std::size_t(b) * len + std::size_t(p * P + t)) * KVH + std::size_t(h)) * D;
            typename KC::meta_type km{};
            typename VC::meta_type vm{};
            (void)KC::encode(k.data() + off, page + layout::key_payload(h, t), km, kc, nullptr);
            (void)VC::encode(v.data() + off, page + layout::value_payload(h, t), vm, vc, nullptr);
            std::memcpy(page + layout::key_meta(h, t), &km, KC::meta_bytes);
            std::memcpy(page + layout::value_meta(h, t), &vm, VC::meta_bytes);
          }
        }
      }
    pools[I] = pool_view{store[I].data(), layout::page_bytes,
                         std::uint32_t(std::max<std::size_t>(1, slot[I].size()))};
  }
};

double topk_overlap(const std::vector<double>& a, const std::vector<double>& b, std::size_t k) {
  auto top = [&](const std::vector<double>& x) {
    std::vector<std::size_t> idx(x.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + std::ptrdiff_t(k), idx.end(),
                      [&](std::size_t i, std::size_t j) { return x[i] > x[j]; });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    return idx;
  };
  const auto ta = top(a), tb = top(b);
  std::vector<std::size_t> both;
  std::set_intersection(ta.begin(), ta.end(), tb.begin(), tb.end(), std::back_inserter(both));
  return double(both.size()) / double(k);
}

struct fidelity {
  double rel_err = 0, lse_err = 0, spearman = 0, top8 = 0;
};

// One sequence (batch 1), one KV head group; errors averaged over the group's query heads.
template <int D, int G>
fidelity measure_fidelity(arm which, int len, bool outliers, std::uint64_t seed,
                          double anchor_tokens = 64) {
  using Geo = geometry<head_dim<D>, kv_heads<1>, group_size<G>, page_tokens<64>>;
  constexpr int P = 64;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  const std::size_t n = static_cast<std::size_t>(len) * D;
  std::vector<float> k(n), v(n), q(static_cast<std::size_t>(G * D));
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = nd(rng);
    if (outliers && int(i % D) < 4) k[i] = k[i] * 8.f;  // 4 high-variance key channels
  }
  for (auto& x : v) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  const int anchor_pages = int(anchor_tokens) / P;
  auto tier_of = [&](int p, int pages) {
    if (which == arm_fp8) return 0;
    if (which == arm_tq3) return 1;
    const int fp8_pages = int(std::lround(0.27 * pages));
    return p < anchor_pages || p >= pages - (fp8_pages - anchor_pages) ? 0 : 1;
  };
  cache<Geo> c;
  c.build(k, v, 1, len, tier_of, seed);
  const int pages = (len + P - 1) / P;
  std::vector<float> out(static_cast<std::size_t>(G * D)), lse(static_cast<std::size_t>(G)),
      mass(static_cast<std::size_t>(pages));
  host_attention_workspace ws(1);
  host_decode_args<2> a;
  a.queries = q.data();
  a.index = c.index;
  a.pools = c.pools;
  a.source = {seed, 0};
  a.logits = {1.f / std::sqrt(float(D)), 0.f};
  a.out = out.data();
  a.lse = lse.data();
  a.page_mass = mass.data();
  a.mass_stride = pages;
  host_decode<Geo, mixed>(ws, a).throw_if_error();
  fidelity f;
  std::vector<double> mref(std::size_t(pages), 0.0);
  for (int g = 0; g < G; ++g) {
    std::vector<double> s(static_cast<std::size_t>(len));
    double m = -INFINITY;
    for (int t = 0; t < len; ++t) {
      double d = 0;
      for (int i = 0; i < D; ++i)
        d +=
            double(q[std::size_t(g) * D + std::size_t(i)]) * k[std::size_t(t) * D + std::size_t(i)];
      s[std::size_t(t)] = d / std::sqrt(double(D));
      m = std::max(m, s[std::size_t(t)]);
    }
    double l = 0;
    std::vector<double> o(D, 0.0), pl(std::size_t(pages), 0.0);
    for (int t = 0; t < len; ++t) {
      const double p = std::exp(s[std::size_t(t)] - m);
      l += p;
      pl[std::size_t(t / P)] += p;
      for (int i = 0; i < D; ++i) o[std::size_t(i)] += p * v[std::size_t(t) * D + std::size_t(i)];
    }
    double num = 0, den = 0;
    for (int i = 0; i < D; ++i) {
      const double r = o[std::size_t(i)] / l, x = out[std::size_t(g) * D + std::size_t(i)];
      num += (x - r) * (x - r);
      den += r * r;
    }
    f.rel_err += std::sqrt(num / den) / G;
    f.lse_err += std::abs(double(lse[std::size_t(g)]) - (m + std::log(l))) / G;
    for (int p = 0; p < pages; ++p) mref[std::size_t(p)] += pl[std::size_t(p)] / l / G;
  }
  if (pages >= 8) {
    std::vector<double> mm(mass.begin(), mass.end());
    f.spearman = spearman(mm, mref);
    f.top8 = topk_overlap(mm, mref, 8);
  }
  return f;
}

// Median of `reps` runs, each averaged over `trials` seeds.
template <int D, int G>
fidelity averaged(arm which, int len, bool outliers, int trials) {
  fidelity acc;
  for (int t = 0; t < trials; ++t) {
    const auto f = measure_fidelity<D, G>(which, len, outliers,
                                          1000 + std::uint64_t(t) * 17 + std::uint64_t(D));
    acc.rel_err += f.rel_err / trials;
    acc.lse_err += f.lse_err / trials;
    acc.spearman += f.spearman / trials;
    acc.top8 += f.top8 / trials;
  }
  return acc;
}

// Host decode throughput: batch x context tokens of one layer (all KV heads) per second.
double throughput(int batch, int len, unsigned threads, double* ms_out, double* cpu_tps) {
  using Geo = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
  constexpr int D = 128, KVH = 8, QH = 32;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(std::size_t(batch) * len * KVH * D), v(k.size()),
      q(std::size_t(batch) * QH * D);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  cache<Geo> c;
  c.build(
      k, v, batch, len,
      [](int p, int pages) {
        return p < 1 || p >= pages - int(std::lround(0.27 * pages)) + 1 ? 0 : 1;
      },
      9);
  std::vector<float> out(q.size());
  host_attention_workspace ws(threads);
  host_decode_args<2> a;
  a.queries = q.data();
  a.index = c.index;
  a.pools = c.pools;
  a.logits = {0.0883883f, 0.f};
  a.out = out.data();
  std::vector<double> times, cpu;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    host_decode<Geo, mixed>(ws, a).throw_if_error();
    cpu.push_back(double(std::clock() - c0) / CLOCKS_PER_SEC);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  std::sort(cpu.begin(), cpu.end());
  // Process CPU time (all threads): tokens per CPU-second, robust to a shared, loaded machine.
  *cpu_tps = double(batch) * len / cpu[cpu.size() / 2];
  *ms_out = times[times.size() / 2] * 1e3;
  return double(batch) * len / times[times.size() / 2];
}
}  // namespace

int main() {
  measure::report rep("attention");
  std::printf(
      "Host decode vs float64 dense reference on the ORIGINAL vectors (batch 1, group 4, 16K "
      "tokens,\n"
      "page 64; mixed = first page + newest pages FP8 = 27%%, rest TQ3); mean over 3 seeds\n\n");
  std::printf("%-8s %-6s %-8s %10s %10s %10s %8s\n", "arm", "d", "keys", "rel_l2", "lse_err",
              "spearman", "top8");
  auto row = [&](const char* arm_s, int d, const char* keys, const fidelity& f) {
    std::printf("%-8s %-6d %-8s %10.4f %10.2e %10.4f %8.3f\n", arm_s, d, keys, f.rel_err, f.lse_err,
                f.spearman, f.top8);
  };
  const int L = 16384;
  for (int a = 0; a < 3; ++a)
    for (int outl = 0; outl < 2; ++outl) {
      const char* keys = outl ? "outlier" : "gauss";
      const auto f64 = averaged<64, 4>(arm(a), L, outl, 3);
      const auto f128 = averaged<128, 4>(arm(a), L, outl, 3);
      const auto f256 = averaged<256, 4>(arm(a), L, outl, 3);
      row(arm_name[a], 64, keys, f64);
      row(arm_name[a], 128, keys, f128);
      row(arm_name[a], 256, keys, f256);
      const std::string suffix = outl ? "_outlier" : "";
      rep.metric(std::string("rel_err_") + arm_name[a] + "_d64" + suffix, f64.rel_err);
      rep.metric(std::string("rel_err_") + arm_name[a] + "_d128" + suffix, f128.rel_err);
      rep.metric(std::string("rel_err_") + arm_name[a] + "_d256" + suffix, f256.rel_err);
      rep.metric(std::string("lse_err_") + arm_name[a] + "_d128" + suffix, f128.lse_err);
      if (a == arm_mixed && !outl) {
        rep.metric("mass_spearman_mixed", f128.spearman);
        rep.metric("mass_top8_overlap_mixed", f128.top8);
      }
      if (a == arm_tq3 && !outl) {
        rep.metric("mass_spearman_tq3", f128.spearman);
        rep.metric("mass_top8_overlap_tq3", f128.top8);
      }
    }
  std::printf("\nContext sweep, mixed, d=128, group 4, Gaussian keys (1 seed)\n");
  std::printf("%-8s %10s %10s %10s %8s\n", "tokens", "rel_l2", "lse_err", "spearman", "top8");
  for (int len : {1, 1024, 32768, 131072}) {
    const auto f = measure_fidelity<128, 4>(arm_mixed, len, false, 77);
    std::printf("%-8d %10.4f %10.2e %10.4f %8.3f\n", len, f.rel_err, f.lse_err, f.spearman, f.top8);
    if (len == 131072) rep.metric("rel_err_mixed_d128_128k", f.rel_err);
  }
  std::printf(
      "\nHost decode throughput (d=128, 8 KV heads x group 4 = 32 query heads, mixed 27%% FP8, one "
      "layer)\n");
  std::printf("%-6s %-8s %-8s %10s %16s %18s\n", "batch", "context", "threads", "ms", "tokens/s",
              "tokens/cpu-s");
  double best = 0;
  for (unsigned th : {1u, 2u}) {
    double ms = 0, cpu_tps = 0;
    const double tps = throughput(4, 16384, th, &ms, &cpu_tps);
    std::printf("%-6d %-8d %-8u %10.2f %16.0f %18.0f\n", 4, 16384, th, ms, tps, cpu_tps);
    if (th == 1) rep.metric("host_decode_tokens_per_cpu_s", cpu_tps);
    best = std::max(best, tps);
    rep.metric("host_decode_tokens_per_s_" + std::to_string(th) + "t", tps);
  }
  rep.metric("host_decode_tokens_per_s", best);
  rep.emit();
  return 0;
}
