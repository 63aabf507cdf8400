// SPDX-License-Identifier: Apache-2.0
// A folded compacted prefix written as ordinary pages and read by tiered_cache::attend (no
// bias input): exact through dense f32 pages, within the codec band through FP8 and TQ3 pages,
// and write_prefix's refusals.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "compaction_data.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/compaction/attention_matching.hpp"
#include "tierkv/compaction/biased_attention.hpp"
#include "tierkv/compaction/fold.hpp"
#include "tierkv/compaction/write_prefix.hpp"

using namespace tierkv;
using namespace tierkv::compaction;
using namespace compaction_test;

namespace {

using geo = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
constexpr int D = geo::head_dim, H = geo::kv_heads, G = geo::group_size, QH = geo::q_heads;
constexpr int layers = 2;
constexpr std::int64_t n = 320, n_tok = 48;  // prefix tokens; query tokens (x G rows per head)

// One (layer, KV head)'s data; queries[i][g] for query token i and query head g of the group.
struct prefix_data {
  std::vector<head_set> heads;  // [layer * H + h], q holds n_tok * G rows (token-major)
};

prefix_data make_data() {
  prefix_data p;
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < H; ++h)
      p.heads.push_back(structured(D, n, n_tok * G, 100 + std::uint64_t(l * H + h)));
  return p;
}

std::vector<folded_head> compact(const prefix_data& p, double budget) {
  std::vector<folded_head> out;
  for (const auto& h : p.heads) {
    am_options o;
    o.budget = budget;
    auto c = attention_match({h.k, h.v, h.q, h.d}, o);
    REQUIRE(c);
    auto f = fold(*c, h.q);
    REQUIRE(f);
    out.push_back(std::move(*f));
  }
  return out;
}

template <class Tiers>
using cache_of = tiered_cache<geo, Tiers>;

template <class Cache>
std::unique_ptr<Cache> make_cache(float soft_cap = 0.f) {
  typename Cache::options opt;
  opt.storage.num_layers = layers;
  opt.storage.pages_per_tier = {64};
  opt.max_batch = 4;
  opt.max_pages = 64;
  opt.soft_cap = soft_cap;
  auto c = Cache::create(opt);
  REQUIRE(c);
  return std::move(*c);
}

// Relative L2 over all layers and query tokens: the cache's attend vs float64 plain attention
// over the unquantized folded heads.
template <class Cache>
double cache_vs_folded(Cache& cache, seq_id s, const prefix_data& p,
                       const std::vector<folded_head>& f) {
  std::vector<double> got, want;
  const double scale = 1.0 / std::sqrt(double(D));
  for (int l = 0; l < layers; ++l)
    for (std::int64_t i = 0; i < n_tok; ++i) {
      std::vector<float> q(static_cast<std::size_t>(QH * D)), out(q.size());
      for (int h = 0; h < H; ++h)
        for (int g = 0; g < G; ++g)
          for (int k = 0; k < D; ++k)
            q[std::size_t(((h * G + g) * D) + k)] =
                p.heads[std::size_t(l * H + h)].q[std::size_t((i * G + g) * D + k)];
      const seq_id batch[] = {s};
      REQUIRE(cache.attend(l, batch, q, out));
      for (int h = 0; h < H; ++h) {
        const auto& fh = f[std::size_t(l * H + h)];
        std::vector<double> ref(static_cast<std::size_t>(G * D));
        REQUIRE(biased_attention(
            std::span<const float>(q).subspan(std::size_t(h * G * D), std::size_t(G * D)), fh.keys,
            fh.values, {}, D, scale, ref));
        for (int e = 0; e < G * D; ++e) {
          got.push_back(out[std::size_t(h * G * D + e)]);
          want.push_back(ref[std::size_t(e)]);
        }
      }
    }
  return rel_l2(got, want);
}

template <class Tiers>
double through_cache(const prefix_data& p, const std::vector<folded_head>& f) {
  auto cache = make_cache<cache_of<Tiers>>();
  auto s = cache->create_sequence();
  REQUIRE(s);
  auto pre = assemble_prefix(f, layers, H);
  REQUIRE(pre);
  CHECK(pre->tokens == std::int64_t(std::ceil(0.1 * n)));
  CHECK(pre->original_tokens == n);
  REQUIRE(write_prefix(*cache, *s, *pre));
  CHECK(*cache->length(*s) == pre->tokens);
  return cache_vs_folded(*cache, *s, p, f);
}

}  // namespace

TEST_CASE("a folded prefix read through tiered_cache pages matches its float attention",
          "[compaction][cache]") {
  const auto p = make_data();
  const auto f = compact(p, 0.1);
  // The same kept keys without the fold (bias dropped): the codecs' own error on these tokens.
  auto unfolded = f;
  for (std::size_t i = 0; i < f.size(); ++i) {
    am_options o;
    o.budget = 0.1;
    const auto& h = p.heads[i];
    auto c = attention_match({h.k, h.v, h.q, h.d}, o);
    REQUIRE(c);
    unfolded[i].keys = c->keys;
  }
  const double dense = through_cache<tiers<tier<dense_f32, dense_f32>>>(p, f);
  const double fp8 = through_cache<tiers<tier<fp8_e4m3, fp8_e4m3>>>(p, f);
  const double tq3 = through_cache<tiers<tier<tq3_key, tq3_value>>>(p, f);
  const double fp8_0 = through_cache<tiers<tier<fp8_e4m3, fp8_e4m3>>>(p, unfolded);
  const double tq3_0 = through_cache<tiers<tier<tq3_key, tq3_value>>>(p, unfolded);
  INFO("dense " << dense << " fp8 " << fp8 << " (unfolded " << fp8_0 << ") tq3 " << tq3
                << " (unfolded " << tq3_0 << ")");
  CHECK(dense < 1e-5);  // the page path adds nothing but float rounding
  // The codec band is the codecs' own error on these tokens (the unfolded keys; 4 outlier
  // channels and a key mean at d = 64 make it wider than docs/attention.md's Gaussian figures:
  // FP8 ~0.09, TQ3 ~0.64 here); the folded keys, longer by (beta / scale) u, stay within it
  // (measured: FP8 0.081, TQ3 0.54).
  CHECK(fp8_0 < 0.15);
  CHECK(tq3_0 < 0.8);
  CHECK(fp8 < 1.1 * fp8_0);
  CHECK(tq3 < 1.1 * tq3_0);
  CHECK(fp8 < tq3);
}

TEST_CASE("write_prefix refuses mismatched caches and sequences, changing nothing",
          "[compaction][cache]") {
  const auto p = make_data();
  const auto f = compact(p, 0.05);
  auto pre = assemble_prefix(f, layers, H);
  REQUIRE(pre);
  using fp8c = cache_of<tiers<tier<fp8_e4m3, fp8_e4m3>>>;
  {
    auto cache = make_cache<fp8c>(30.f);
    auto s = cache->create_sequence();
    REQUIRE(s);
    auto st = write_prefix(*cache, *s, *pre);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("soft_cap = 30") != std::string::npos);
    CHECK(*cache->length(*s) == 0);
  }
  auto cache = make_cache<fp8c>();
  auto s = cache->create_sequence();
  REQUIRE(s);
  {
    auto other = *pre;
    other.softmax_scale = 0.5f;
    auto st = write_prefix(*cache, *s, other);
    CHECK(st.code() == errc::invalid_argument);
    CHECK(st.message().find("softmax_scale = 0.5") != std::string::npos);
    other = *pre;
    other.layers = 3;
    CHECK(write_prefix(*cache, *s, other).code() == errc::geometry_mismatch);
  }
  REQUIRE(write_prefix(*cache, *s, *pre));
  auto again = write_prefix(*cache, *s, *pre);
  CHECK(again.code() == errc::invalid_argument);
  CHECK(again.message().find("sequence holds 16 tokens") != std::string::npos);
  CHECK(*cache->length(*s) == pre->tokens);
  // New requests share the compacted document by forking it.
  auto child = cache->fork(*s);
  REQUIRE(child);
  CHECK(*cache->length(*child) == pre->tokens);
  // Unequal budgets per head cannot share page slots.
  auto uneven = f;
  uneven[1].keys.resize(uneven[1].keys.size() - D);
  uneven[1].values.resize(uneven[1].values.size() - D);
  auto bad = assemble_prefix(uneven, layers, H);
  REQUIRE(!bad);
  CHECK(bad.error_status().code() == errc::geometry_mismatch);
  CHECK(bad.error_status().message().find("equal budgets per head") != std::string::npos);
}
