// SPDX-License-Identifier: Apache-2.0
// The GPU decode's host planner (cuda/decode_plan.cuh, no CUDA needed): bad arguments are
// refused with a status, the workspace regions are disjoint, aligned and inside
// workspace_bytes, chunks are balanced by the weight the plan says, and a TQ3 role's work
// weight moves the chunk target the way it should.
#include <cstdint>
#include <vector>

#include "catch.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/cuda/decode_plan.cuh"

using namespace tierkv;

namespace {
using G = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
using recent = tier<fp8_e4m3, fp8_e4m3>;
using stale = tier<tq3_key, tq3_value>;
using fp8_tq3 = tiers<recent, stale>;

std::vector<std::int32_t> counts(int batch, std::int32_t fp8_pages, std::int32_t tq3_pages) {
  std::vector<std::int32_t> c;
  for (int b = 0; b < batch; ++b) {
    c.push_back(fp8_pages);
    c.push_back(tq3_pages);
  }
  return c;
}
}  // namespace

TEST_CASE("plan_decode: bad arguments are refused with a status", "[decode_plan]") {
  const auto c = counts(2, 10, 30);
  cuda::decode_capacity cap{2, 64, 0, false};
  CHECK(cuda::plan_decode<G, fp8_tq3>(cuda::decode_capacity{0, 64, 0, false}, c.data(), 0, 132).code() ==
        errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 3, 132).code() == errc::out_of_range);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cuda::decode_capacity{2, 0, 0, false}, c.data(), 2, 132).code() ==
        errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cuda::decode_capacity{2, 64, 0, true}, c.data(), 2, 132).code() ==
        errc::invalid_argument);  // page mass without a page capacity
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, nullptr, 2, 132).code() == errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 2, 0).code() == errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 2, 132, 12, 16 * 1024, cuda::balance::work, 16, 3, 0).code() ==
        errc::invalid_argument);
  const auto neg = counts(1, -1, 3);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, neg.data(), 1, 132).code() == errc::invalid_argument);
}

TEST_CASE("plan_decode: workspace regions are disjoint, aligned and inside the workspace", "[decode_plan]") {
  const auto c = counts(4, 7, 100);
  for (bool mass : {false, true}) {
    cuda::decode_capacity cap{4, 48, mass ? 200 : 0, mass};
    auto p = cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 4, 132);
    REQUIRE(p.has_value());
    const std::size_t rows = std::size_t(cap.max_batch) * G::q_heads;
    CHECK(p->state_offset == 0);
    CHECK(p->acc_offset >= p->state_offset + rows * 48 * 2 * sizeof(float));
    CHECK(p->mass_offset >= p->acc_offset + rows * 48 * G::head_dim * sizeof(float));
    CHECK(p->error_offset >= p->mass_offset + rows * std::size_t(p->max_pages) * sizeof(float));
    CHECK(p->result_offset >= p->error_offset + sizeof(int));
    CHECK(p->workspace_bytes >= p->result_offset + sizeof(int));
    for (std::size_t off : {p->acc_offset, p->mass_offset, p->error_offset, p->workspace_bytes})
      CHECK(off % 256 == 0);
    CHECK(p->max_chunks == 48);
    CHECK(p->page_mass == mass);
  }
}

TEST_CASE("plan_decode: page weights by bytes or by work, and the TQ3 work weight", "[decode_plan]") {
  const auto c = counts(1, 64, 448);  // 32K tokens, ~12% FP8 pages
  cuda::decode_capacity cap{1, 64, 0, false};
  auto bytes = cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 1, 132, 12, 16 * 1024, cuda::balance::bytes);
  REQUIRE(bytes.has_value());
  // bytes: a page's payload and meta of both roles, per KV head
  CHECK(bytes->page_cost[0] == std::int64_t(G::page_tokens) * (2 * G::head_dim + 2 + 2));
  CHECK(bytes->page_cost[0] > 2 * bytes->page_cost[1]);  // TQ3 reads ~2.6x fewer bytes
  std::int64_t prev_tq3 = 0;
  for (int pct : {50, 108, 200}) {
    auto w = cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 1, 132, 12, 16 * 1024, cuda::balance::work, 16, 3, pct);
    REQUIRE(w.has_value());
    const std::int64_t scalars = std::int64_t(G::page_tokens) * G::head_dim * 100;
    CHECK(w->page_cost[0] == 2 * scalars);                // FP8 roles weigh 100%
    CHECK(w->page_cost[1] == 2 * (scalars * pct / 100));  // TQ3 roles weigh pct%
    CHECK(w->page_cost[1] > prev_tq3);
    prev_tq3 = w->page_cost[1];
    // the same number of chunks is aimed at whatever the weights: the target is the same share
    // of the (weighted) total
    const std::int64_t total = 64 * w->page_cost[0] + 448 * w->page_cost[1];
    const double chunks = double(total) / double(w->target_chunk_bytes);
    const std::int64_t btotal = 64 * bytes->page_cost[0] + 448 * bytes->page_cost[1];
    CHECK(chunks == Approx(double(btotal) / double(bytes->target_chunk_bytes)).epsilon(0.01));
  }
}
