// SPDX-License-Identifier: Apache-2.0
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention_fixture.hpp"
#include "catch.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/codec/dense.hpp"

using namespace tierkv;
using namespace tierkv::test;

namespace {
using dense_tier = tier<dense_f32, dense_f32>;
using one_dense = tiers<dense_tier>;
using two_dense =
    tiers<dense_tier, dense_tier>;  // two pools of one format: exercises the mixed path exactly

template <class Geo>
std::vector<std::int32_t> edge_lengths() {
  constexpr int P = Geo::page_tokens;
  // empty, single token, partial first page, exactly one page, one past a page, a long partial tail
  return {0, 1, 17, P, P + 1, 3 * P - 5, 9 * P + 7};
}

int random_tier(std::mt19937_64& rng) { return int(rng() % 2); }

template <class Geo>
void sweep_dense(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  mixed_cache<Geo, two_dense> c;
  c.seed = seed;
  c.layer = 3;
  c.build(
      edge_lengths<Geo>(), [&](int, int, int) { return random_tier(rng); }, rng);
  const auto q = random_queries(c.seq_len.size() * Geo::q_heads * Geo::head_dim, rng);
  host_attention_workspace ws(2);
  const auto e = check_decode(c, q, logit_params{1.f / std::sqrt(float(Geo::head_dim)), 0.f}, ws);
  INFO("head_dim " << Geo::head_dim << " group " << Geo::group_size << " kv_heads "
                   << Geo::kv_heads);
  CHECK_FALSE(e.non_finite);
  CHECK(e.max_rel_decoded < 2e-6);
  CHECK(e.max_rel_original < 2e-6);  // dense_f32 is lossless
  CHECK(e.max_lse_decoded < 2e-5);
  CHECK(e.max_mass_err < 2e-6);
  CHECK(e.max_mass_sum_err < 2e-5);
}
}  // namespace

TEST_CASE(
    "host decode over dense pages equals float64 attention: head_dim x group sweep, edge lengths",
    "[attention][decode]") {
  // Unused slots of every page are NaN (0xFF bytes): they must never reach an output.
  sweep_dense<geometry<head_dim<64>, kv_heads<3>, group_size<1>, page_tokens<16>>>(1);
  sweep_dense<geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<32>>>(2);
  sweep_dense<geometry<head_dim<128>, kv_heads<2>, group_size<4>, page_tokens<16>>>(3);
  sweep_dense<geometry<head_dim<128>, kv_heads<1>, group_size<6>, page_tokens<64>>>(4);
  sweep_dense<geometry<head_dim<256>, kv_heads<2>, group_size<8>, page_tokens<16>>>(5);
  sweep_dense<geometry<head_dim<256>, kv_heads<1>, group_size<6>, page_tokens<128>>>(6);
  sweep_dense<geometry<head_dim<64>, kv_heads<3>, group_size<16>, page_tokens<16>>>(7);
}

TEST_CASE("host decode: soft-cap, outlier key channels and a long context", "[attention][decode]") {
  using Geo = geometry<head_dim<128>, kv_heads<2>, group_size<4>, page_tokens<64>>;
  std::mt19937_64 rng(21);
  mixed_cache<Geo, two_dense> c;
  c.seed = 99;
  kv_data_options opt;
  opt.outlier_channels = 4;
  opt.outlier_scale = 8.0;
  opt.key_offset = 10.0;
  c.build(
      {8192, 300}, [&](int, int p, int pages) { return p < 4 || p >= pages - 16 ? 0 : 1; }, rng,
      opt);
  const auto q = random_queries(2 * Geo::q_heads * Geo::head_dim, rng, 2.f);
  host_attention_workspace ws(2);
  SECTION("no cap, outlier keys (peaked softmax)") {
    const auto e = check_decode(c, q, logit_params{0.0883883f, 0.f}, ws);
    CHECK_FALSE(e.non_finite);
    CHECK(e.max_rel_decoded < 5e-6);
    CHECK(e.max_lse_decoded < 1e-4);
    CHECK(e.max_mass_err < 5e-6);
  }
  SECTION("soft-cap 5 on large logits") {
    const auto e = check_decode(c, q, logit_params{0.5f, 5.f}, ws);
    CHECK_FALSE(e.non_finite);
    CHECK(e.max_rel_decoded < 5e-6);
    CHECK(e.max_lse_decoded < 1e-4);
    CHECK(e.max_mass_err < 5e-6);
  }
}

TEST_CASE(
    "host decode: any split of a sequence's pages over tiers and threads gives the same result",
    "[attention][decode][order]") {
  using Geo = geometry<head_dim<64>, kv_heads<2>, group_size<4>, page_tokens<16>>;
  constexpr int D = Geo::head_dim, QH = Geo::q_heads;
  const std::vector<std::int32_t> lens = {1000, 37, 16};
  auto run = [&](const tier_of_page_fn& split, unsigned threads) {
    std::mt19937_64 rng(5);  // same data every time; only the page placement differs
    mixed_cache<Geo, two_dense> c;
    c.seed = 1;
    c.build(lens, split, rng);
    const auto q = random_queries(lens.size() * QH * D, rng);
    std::vector<float> out(lens.size() * QH * D), lse(lens.size() * QH);
    host_attention_workspace ws(threads);
    host_decode_args<2> a;
    a.queries = q.data();
    a.index = c.index;
    a.pools = c.pools;
    a.source = {c.seed, c.layer};
    a.logits = {0.125f, 0.f};
    a.out = out.data();
    a.lse = lse.data();
    REQUIRE(host_decode<Geo, two_dense>(ws, a).is_ok());
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const auto base = run([](int, int, int) { return 0; }, 1);
  std::mt19937_64 pick(8);
  std::vector<tier_of_page_fn> splits = {
      [](int, int, int) { return 1; },
      [](int, int p, int) { return p % 2; },
      [](int, int p, int pages) { return p < pages / 2 ? 1 : 0; },
      [&](int, int, int) { return int(pick() % 2); },
  };
  for (const auto& sp : splits) {
    const auto other = run(sp, 2);
    double worst = 0;
    for (std::size_t i = 0; i < base.size(); ++i)
      worst =
          std::max(worst, std::abs(double(other[i]) - base[i]) / (1.0 + std::abs(double(base[i]))));
    CHECK(worst < 2e-6);
  }
  // Same split, 1 vs 2 threads: every (sequence, kv head) is one task, so bit-identical.
  const auto t1 = run(splits[1], 1), t2 = run(splits[1], 2);
  CHECK(std::memcmp(t1.data(), t2.data(), t1.size() * sizeof(float)) == 0);
}

TEST_CASE("host decode rejects inconsistent index arrays and pools with a clear error",
          "[attention][decode]") {
  using Geo = geometry<head_dim<64>, kv_heads<1>, group_size<2>, page_tokens<16>>;
  std::mt19937_64 rng(31);
  mixed_cache<Geo, two_dense> c;
  c.build(
      {40, 20}, [](int, int p, int) { return p % 2; }, rng);
  const auto q = random_queries(2 * Geo::q_heads * Geo::head_dim, rng);
  std::vector<float> out(2 * Geo::q_heads * Geo::head_dim), mass(2 * 3);
  host_attention_workspace ws(1);
  auto args = [&] {
    host_decode_args<2> a;
    a.queries = q.data();
    a.index = c.index;
    a.pools = c.pools;
    a.out = out.data();
    return a;
  };
  REQUIRE(host_decode<Geo, two_dense>(ws, args()).is_ok());

  SECTION("slot beyond the pool") {
    auto slots = c.slot[0];
    slots[0] = std::int32_t(c.pools[0].capacity);
    auto a = args();
    a.index.formats[0].slot = slots.data();
    const status s = host_decode<Geo, two_dense>(ws, a);
    CHECK(s.code() == errc::out_of_range);
    CHECK(s.message().find("slot") != std::string::npos);
  }
  SECTION("a logical page listed twice, or missing") {
    auto logical = c.logical[1];
    logical[0] = c.logical[0][0];  // duplicate of a page of format 0
    auto a = args();
    a.index.formats[1].logical = logical.data();
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::invalid_argument);
    std::vector<std::int32_t> lens = {40, 33};  // 3 pages claimed, 2 listed
    a = args();
    a.index.seq_len = lens.data();
    const status s = host_decode<Geo, two_dense>(ws, a);
    CHECK(s.code() == errc::invalid_argument);
    CHECK(s.message().find("cover") != std::string::npos);
  }
  SECTION("pool of another page layout") {
    pool_view pools[2] = {c.pools[0], c.pools[1]};
    pools[1].page_bytes += 16;
    auto a = args();
    a.pools = pools;
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::geometry_mismatch);
  }
  SECTION("page-mass stride too small, bad logit params, negative length") {
    auto a = args();
    a.page_mass = mass.data();
    a.mass_stride = 2;  // sequence 0 has 3 pages
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::out_of_range);
    a = args();
    a.logits.soft_cap = -1.f;
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::invalid_argument);
    a = args();
    a.window = -1;
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::invalid_argument);
    a = args();
    a.logits.softmax_scale = std::numeric_limits<float>::quiet_NaN();
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::invalid_argument);
    std::vector<std::int32_t> lens = {40, -1};
    a = args();
    a.index.seq_len = lens.data();
    CHECK(host_decode<Geo, two_dense>(ws, a).code() == errc::invalid_argument);
  }
  SECTION("empty batch is a no-op") {
    auto a = args();
    a.index.batch = 0;
    CHECK(host_decode<Geo, two_dense>(ws, a).is_ok());
  }
}

TEST_CASE("host decode with one tier list entry (single-format cache)", "[attention][decode]") {
  using Geo = geometry<head_dim<128>, kv_heads<2>, group_size<3>, page_tokens<32>>;
  std::mt19937_64 rng(41);
  mixed_cache<Geo, one_dense> c;
  c.build(
      {0, 1, 33, 500}, [](int, int, int) { return 0; }, rng);
  const auto q = random_queries(4 * Geo::q_heads * Geo::head_dim, rng);
  host_attention_workspace ws(2);
  const auto e = check_decode(c, q, logit_params{0.1f, 0.f}, ws);
  CHECK_FALSE(e.non_finite);
  CHECK(e.max_rel_decoded < 2e-6);
  CHECK(e.max_mass_err < 2e-6);
}
