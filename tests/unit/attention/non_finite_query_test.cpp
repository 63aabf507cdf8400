// SPDX-License-Identifier: Apache-2.0
// A NaN or Inf query never becomes a finite output: host decode and prefill refuse it with
// non_finite_input, naming where it is, before writing anything (issue 24).
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_fixture.hpp"
#include "catch.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"

using namespace tierkv;
using namespace tierkv::test;

namespace {
using Geo = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
using mixed = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>;
constexpr int D = Geo::head_dim, QH = Geo::q_heads;
const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
}  // namespace

TEST_CASE("host decode refuses a non-finite query, naming the batch row and query head",
          "[attention][decode]") {
  std::mt19937_64 rng(5);
  mixed_cache<Geo, mixed> c;
  c.build(
      {40, 0, 20}, [](int, int p, int) { return p % 2; }, rng);  // an empty sequence too
  const auto q = random_queries(3 * QH * D, rng);
  host_attention_workspace ws(2);
  for (const int row : {1, 2})
    for (const float bad : bad_values) {
      INFO("row " << row << ", value " << bad);
      std::vector<float> qb = q, out(q.size(), 7.f), lse(3 * QH, 7.f), mass(3 * 3, 7.f);
      qb[(std::size_t(row) * QH + 3) * D + 9] = bad;  // query head 3, dim 9
      host_decode_args<2> a;
      a.queries = qb.data();
      a.index = c.index;
      a.pools = c.pools;
      a.logits = {0.125f, 20.f};  // soft cap: an Inf logit would be capped to a finite one
      a.out = out.data();
      a.lse = lse.data();
      a.page_mass = mass.data();
      a.mass_stride = 3;
      const status s = host_decode<Geo, mixed>(ws, a);
      INFO(s);
      CHECK(s.code() == errc::non_finite_input);
      CHECK(s.message().find("batch row " + std::to_string(row)) != std::string::npos);
      CHECK(s.message().find("query head 3") != std::string::npos);
      for (float x : out) REQUIRE(x == 7.f);
      for (float x : lse) REQUIRE(x == 7.f);
      for (float x : mass) REQUIRE(x == 7.f);
    }
}

TEST_CASE("host prefill refuses a non-finite query, naming the token, sequence and query head",
          "[attention][prefill]") {
  std::mt19937_64 rng(6);
  mixed_cache<Geo, mixed> c;
  c.build(
      {40, 20}, [](int, int p, int) { return p % 2; }, rng);
  const std::vector<std::int32_t> qptr = {0, 5, 8};  // the last 5 and 3 tokens
  const auto q = random_queries(8 * QH * D, rng);
  host_attention_workspace ws(2);
  for (const float bad : bad_values) {
    INFO("value " << bad);
    std::vector<float> qb = q, out(q.size(), 7.f);
    qb[(6 * QH + 2) * D + 1] = bad;  // query token 6 (sequence 1), query head 2
    host_prefill_args<2> p;
    p.queries = qb.data();
    p.q_indptr = qptr.data();
    p.index = c.index;
    p.pools = c.pools;
    p.logits = {0.125f, 0.f};
    p.out = out.data();
    const status s = host_prefill<Geo, mixed>(ws, p);
    INFO(s);
    CHECK(s.code() == errc::non_finite_input);
    CHECK(s.message().find("query token 6 of sequence 1") != std::string::npos);
    CHECK(s.message().find("query head 2") != std::string::npos);
    for (float x : out) REQUIRE(x == 7.f);
  }
}
