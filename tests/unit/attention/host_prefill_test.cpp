// SPDX-License-Identifier: Apache-2.0
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention_fixture.hpp"
#include "catch.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"

using namespace tierkv;
using namespace tierkv::test;

namespace {
using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using tq3_tier = tier<tq3_key, tq3_value>;
using mixed = tiers<fp8_tier, tq3_tier>;

// Prefill of chunks (the last chunk[b] tokens of each sequence, already in the cache)
// against float64 causal attention on the decoded vectors.
template <class Geo, class TL>
void check_prefill(const mixed_cache<Geo, TL>& c, const std::vector<std::int32_t>& chunk,
                   logit_params lp, unsigned threads, double tol, int window = 0) {
  constexpr int D = Geo::head_dim, QH = Geo::q_heads, G = Geo::group_size, KVH = Geo::kv_heads;
  const int B = int(chunk.size());
  std::vector<std::int32_t> qptr(std::size_t(B) + 1, 0);
  for (int b = 0; b < B; ++b)
    qptr[std::size_t(b) + 1] = qptr[std::size_t(b)] + chunk[std::size_t(b)];
  const std::size_t total = std::size_t(qptr.back());
  std::mt19937_64 rng(77);
  const auto q = random_queries(total * QH * D, rng);
  std::vector<float> out(total * QH * D, 999.f), lse(total * QH, 999.f);
  host_prefill_args<TL::size> a;
  a.queries = q.data();
  a.q_indptr = qptr.data();
  a.index = c.index;
  a.pools = c.pools;
  a.source = {c.seed, c.layer};
  a.logits = lp;
  a.out = out.data();
  a.lse = lse.data();
  a.window = window;
  host_attention_workspace ws(threads);
  REQUIRE(host_prefill<Geo, TL>(ws, a).is_ok());
  double worst = 0, worst_lse = 0;
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < chunk[std::size_t(b)]; ++j) {
      const int pos = c.seq_len[std::size_t(b)] - chunk[std::size_t(b)] + j;
      for (int h = 0; h < QH; ++h) {
        const std::size_t row = (std::size_t(qptr[std::size_t(b)] + j)) * QH + std::size_t(h);
        const auto r =
            reference_row(q.data() + row * D, c.k_dec[std::size_t(b)], c.v_dec[std::size_t(b)], KVH,
                          h / G, D, pos + 1, Geo::page_tokens, lp.softmax_scale, lp.soft_cap,
                          window > 0 ? pos + 1 - window : 0);
        worst = std::max(worst, rel_l2(out.data() + row * D, r.out));
        worst_lse = std::max(worst_lse, std::abs(double(lse[row]) - r.lse));
      }
    }
  CHECK(worst < tol);
  CHECK(worst_lse < 10 * tol);
}
}  // namespace

TEST_CASE("chunked prefill: causal within the chunk, cached mixed pages before it",
          "[attention][prefill]") {
  SECTION("dense, chunk crossing pages, several sequences, empty chunk; sliding windows") {
    using Geo = geometry<head_dim<64>, kv_heads<2>, group_size<3>, page_tokens<16>>;
    using TL = tiers<tier<dense_f32, dense_f32>, tier<dense_f32, dense_f32>>;
    std::mt19937_64 rng(1);
    mixed_cache<Geo, TL> c;
    c.build(
        {100, 37, 20, 5}, [&](int, int p, int) { return p % 2; }, rng);
    // no window; windows (a query at p attends (p - window, p]) inside a tile, across pages
    // and tiles, of one token, past the sequence start
    for (int w : {0, 1, 5, 16, 17, 50, 1000}) {
      INFO("window " << w);
      check_prefill(c, {29, 37, 0, 1}, logit_params{0.125f, 0.f}, 2, 3e-6, w);
    }
  }
  SECTION("mixed FP8/TQ3 cache, the chunk read in its stored FP8 pages; soft-cap; a window") {
    using Geo = geometry<head_dim<128>, kv_heads<1>, group_size<4>, page_tokens<32>>;
    std::mt19937_64 rng(2);
    mixed_cache<Geo, mixed> c;
    c.seed = 5;
    // Pages 0..5 stale (TQ3) except page 0 (anchor); the chunk's pages (the newest) are FP8.
    c.build(
        {300, 64}, [](int, int p, int pages) { return p == 0 || p >= pages - 4 ? 0 : 1; }, rng);
    for (int w : {0, 100}) {
      INFO("window " << w);
      check_prefill(c, {70, 64}, logit_params{0.09f, 20.f}, 2, 1e-5, w);
    }
  }
}

TEST_CASE("prefill of a one-token chunk equals decode bit for bit, with and without a window",
          "[attention][prefill]") {
  using Geo = geometry<head_dim<128>, kv_heads<2>, group_size<2>, page_tokens<16>>;
  std::mt19937_64 rng(3);
  mixed_cache<Geo, mixed> c;
  c.build(
      {77, 1, 160}, [](int, int p, int) { return p % 3 == 0 ? 0 : 1; }, rng);
  const auto q = random_queries(3 * Geo::q_heads * Geo::head_dim, rng);
  std::vector<float> o1(q.size()), o2(q.size()), l1(3 * Geo::q_heads), l2(3 * Geo::q_heads);
  host_attention_workspace ws(2);
  for (int w : {0, 1, 20}) {  // no window, the last token alone, a window across pages
    INFO("window " << w);
    host_decode_args<2> d;
    d.queries = q.data();
    d.index = c.index;
    d.pools = c.pools;
    d.logits = {0.088f, 0.f};
    d.out = o1.data();
    d.lse = l1.data();
    d.window = w;
    REQUIRE(host_decode<Geo, mixed>(ws, d).is_ok());
    const std::vector<std::int32_t> qptr = {0, 1, 2, 3};
    host_prefill_args<2> p;
    p.queries = q.data();
    p.q_indptr = qptr.data();
    p.index = c.index;
    p.pools = c.pools;
    p.logits = d.logits;
    p.out = o2.data();
    p.lse = l2.data();
    p.window = w;
    REQUIRE(host_prefill<Geo, mixed>(ws, p).is_ok());
    CHECK(std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("prefill rejects a chunk longer than the cached sequence", "[attention][prefill]") {
  using Geo = geometry<head_dim<64>, kv_heads<1>, group_size<1>, page_tokens<16>>;
  using TL = tiers<tier<dense_f32, dense_f32>>;
  std::mt19937_64 rng(4);
  mixed_cache<Geo, TL> c;
  c.build(
      {10}, [](int, int, int) { return 0; }, rng);
  std::vector<float> q(11 * 64), out(11 * 64);
  const std::vector<std::int32_t> qptr = {0, 11};
  host_prefill_args<1> p;
  p.queries = q.data();
  p.q_indptr = qptr.data();
  p.index = c.index;
  p.pools = c.pools;
  p.out = out.data();
  host_attention_workspace ws(1);
  const status s = host_prefill<Geo, TL>(ws, p);
  CHECK(s.code() == errc::out_of_range);
  CHECK(s.message().find("append") != std::string::npos);
}
