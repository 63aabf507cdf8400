// SPDX-License-Identifier: Apache-2.0
// The GPU decode's host planner (cuda/decode_plan.cuh, no CUDA needed): bad arguments are
// refused with a status, the workspace regions are disjoint, aligned and inside
// workspace_bytes, chunks are balanced by the weight the plan says, and a TQ3 role's work
// weight moves the chunk target the way it should.
#include <cstdint>
#include <utility>
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
  CHECK(cuda::plan_decode<G, fp8_tq3>(cuda::decode_capacity{0, 64, 0, false}, c.data(), 0, 132)
            .code() == errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 3, 132).code() == errc::out_of_range);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cuda::decode_capacity{2, 0, 0, false}, c.data(), 2, 132)
            .code() == errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cuda::decode_capacity{2, 64, 0, true}, c.data(), 2, 132)
            .code() == errc::invalid_argument);  // page mass without a page capacity
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, nullptr, 2, 132).code() == errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 2, 0).code() == errc::invalid_argument);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 2, 132, 12, 16 * 1024, cuda::balance::work, 16,
                                      3, -1)
            .code() == errc::invalid_argument);
  const auto neg = counts(1, -1, 3);
  CHECK(cuda::plan_decode<G, fp8_tq3>(cap, neg.data(), 1, 132).code() == errc::invalid_argument);
}

TEST_CASE("plan_decode: workspace regions are disjoint, aligned and inside the workspace",
          "[decode_plan]") {
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

TEST_CASE("plan_decode: page weights by bytes or by work, and the TQ3 work weight",
          "[decode_plan]") {
  const auto c = counts(1, 64, 448);  // 32K tokens, ~12% FP8 pages
  cuda::decode_capacity cap{1, 64, 0, false};
  auto bytes =
      cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 1, 132, cuda::decode_default_waves,
                                    cuda::decode_default_min_chunk_bytes, cuda::balance::bytes);
  REQUIRE(bytes.has_value());
  // bytes: a page's payload and meta of both roles, per KV head
  CHECK(bytes->page_cost[0] == std::int64_t(G::page_tokens) * (2 * G::head_dim + 2 + 2));
  CHECK(bytes->page_cost[0] > 2 * bytes->page_cost[1]);  // TQ3 reads ~2.6x fewer bytes
  // by default each role weighs its codec's decode_work_percent (TQ3: 75)
  const std::int64_t scalars = std::int64_t(G::page_tokens) * G::head_dim * 100;
  auto declared = cuda::plan_decode<G, fp8_tq3>(cap, c.data(), 1, 132);
  REQUIRE(declared.has_value());
  CHECK(declared->page_cost[0] == 2 * scalars);
  CHECK(declared->page_cost[1] ==
        2 * (scalars * tq3_key::bind<G::head_dim>::decode_work_percent / 100));
  CHECK(tq3_key::bind<G::head_dim>::decode_work_percent == 75);
  std::int64_t prev_tq3 = 0;
  for (int pct : {50, 108, 200}) {
    auto w = cuda::plan_decode<G, fp8_tq3>(
        cap, c.data(), 1, 132, cuda::decode_default_waves, cuda::decode_default_min_chunk_bytes,
        cuda::balance::work, cuda::decode_default_min_chunk_pages, cuda::decode_blocks_per_sm<G>,
        pct);
    REQUIRE(w.has_value());
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

// The blocks a plan launches, counted by the kernels' own chunk count.
template <class Geometry>
std::int64_t planned_blocks(const cuda::decode_plan& p, const std::vector<std::int32_t>& c,
                            int batch) {
  std::int64_t blocks = 0;
  for (int b = 0; b < batch; ++b) {
    const std::int64_t t = c[2 * b] * p.page_cost[0] + c[2 * b + 1] * p.page_cost[1];
    blocks += std::int64_t(cuda::detail::sequence_chunks(t, c[2 * b] + c[2 * b + 1],
                                                         p.target_chunk_bytes, p.max_chunks)) *
              Geometry::kv_heads;
  }
  return blocks;
}

TEST_CASE("plan_decode: where the one-wave floor binds, the blocks fit one wave", "[decode_plan]") {
  // head_dim 128: 4 blocks per SM by default (decode_blocks_per_sm); every sequence rounds its
  // chunk count up, and the plan leaves a block per (sequence, KV head) for that.
  STATIC_REQUIRE(cuda::decode_blocks_per_sm<G> == 4);
  for (int batch : {1, 2, 5, 8, 13}) {
    for (auto [fp8, tq3] :
         {std::pair{128, 0}, std::pair{0, 128}, std::pair{35, 93}, std::pair{140, 372}}) {
      const auto c = counts(batch, fp8, tq3);
      cuda::decode_capacity cap{batch, 4096, 0, false};
      auto p = cuda::plan_decode<G, fp8_tq3>(cap, c.data(), batch, 132);
      REQUIRE(p.has_value());
      const std::int64_t blocks = planned_blocks<G>(*p, c, batch);
      INFO("batch " << batch << ", pages " << fp8 << " + " << tq3 << ": " << blocks << " blocks");
      // more than a wave only when the 16-page floor, not the wave, sets the chunk size
      const std::int64_t wave = 132 * cuda::decode_blocks_per_sm<G>;
      if (std::int64_t(fp8 + tq3) * batch * G::kv_heads / cuda::decode_default_min_chunk_pages <
          wave)
        CHECK(blocks <= wave);
    }
  }
}
