// SPDX-License-Identifier: Apache-2.0
// paged_storage::reserve's slot mapping drives cuda::append as is: two sequences' reservations
// in one strided [layers][tokens] mapping, one launch for all layers, then commit; every page
// equals, byte for byte, the page the host append of the same tokens stores.
#include "catch.hpp"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/paged_storage.hpp"

#include "append_kernels.hpp"
#include "cuda_test.hpp"

namespace {

using namespace tierkv;
using G = cuda_test::reserve_geo;

template <class Recent>
void check_reserve_append() {
  using TL = tiers<Recent, tier<tq3_key, tq3_value>>;
  using host_storage = paged_storage<G, TL, host_allocator>;
  using gpu_storage = paged_storage<G, TL, pinned_host_allocator>;  // device-visible pages
  constexpr int L = 3, H = G::kv_heads, D = G::head_dim;
  constexpr std::size_t per_token = std::size_t(H) * D;
  auto options = [] {
    typename host_storage::options o;
    o.num_layers = L;
    o.max_sequences = 2;
    o.pages_per_tier = {60, 4};
    o.codec_seed = 77;
    o.head_base = 2;
    return o;
  };
  auto hs = std::move(host_storage::create(options()).value());
  auto gs = std::move(gpu_storage::create(options()).value());
  const seq_id ha = *hs->create_sequence(), hb = *hs->create_sequence();
  const seq_id ga = *gs->create_sequence(), gb = *gs->create_sequence();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  // Steps of (tokens of a, tokens of b): prefill chunks across pages, then decode steps.
  const int steps[][2] = {{37, 5}, {1, 20}, {1, 1}, {11, 1}, {1, 16}, {1, 1}, {0, 3}};
  for (const auto& step : steps) {
    const int na = step[0], nb = step[1], n = na + nb;
    // All layers of both sequences' new tokens, [layer][token][head][dim], a's tokens first.
    std::vector<float> k(std::size_t(L * n) * per_token), v(k.size());
    for (auto& x : k) x = nd(rng) * 3.f;
    for (auto& x : v) x = nd(rng);
    // Host: append of each sequence's tokens ([layer][its tokens][head][dim]).
    const auto part = [&](const std::vector<float>& x, int first, int count) {
      std::vector<float> out;
      for (int l = 0; l < L; ++l) {
        const auto* at =
            x.data() + (std::size_t(l) * std::size_t(n) + std::size_t(first)) * per_token;
        out.insert(out.end(), at, at + std::size_t(count) * per_token);
      }
      return out;
    };
    if (na > 0) REQUIRE(hs->append(ha, na, part(k, 0, na), part(v, 0, na)));
    if (nb > 0) REQUIRE(hs->append(hb, nb, part(k, na, nb), part(v, na, nb)));
    // GPU: one mapping [L][n], a in columns [0, na), b in [na, n); one launch.
    std::vector<std::int32_t> slot(static_cast<std::size_t>(L * n)),
        offset(static_cast<std::size_t>(n));
    if (na > 0)
      REQUIRE(gs->reserve(
          ga, na, slot_mapping{slot, n, std::span<std::int32_t>(offset).first(std::size_t(na))}));
    if (nb > 0)
      REQUIRE(gs->reserve(gb, nb,
                          slot_mapping{std::span<std::int32_t>(slot).subspan(std::size_t(na)), n,
                                       std::span<std::int32_t>(offset).subspan(std::size_t(na))}));
    const cuda_test::device_buffer<float> dk(k), dv(v);
    const cuda_test::device_buffer<std::int32_t> dslot(slot), doff(offset);
    const cuda_test::device_buffer<int> derr(std::vector<int>{0});
    cuda_test::append_args in;
    in.k = dk.p;
    in.v = dv.p;
    in.layer_stride = std::int64_t(n) * H * D;
    in.slot = dslot.p;
    in.slot_layer_stride = n;
    in.offset = doff.p;
    in.tokens = n;
    in.layers = L;
    in.pool = gs->views()[0];
    in.cache_seed = gs->config().codec_seed;
    in.head_base = gs->config().head_base;
    in.error = derr.p;
    REQUIRE(cuda_test::append<G, Recent>(in, nullptr).is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    CHECK(derr.get()[0] == 0);
    if (na > 0) REQUIRE(gs->commit(ga, na));
    if (nb > 0) REQUIRE(gs->commit(gb, nb));
  }
  for (const auto& [h, g] : {std::pair{ha, ga}, std::pair{hb, gb}}) {
    REQUIRE(*gs->length(g) == *hs->length(h));
    for (int l = 0; l < L; ++l)
      for (std::int64_t p = 0; p < *hs->logical_pages(h); ++p) {
        const page_id hp = *hs->page(h, l, p), gp = *gs->page(g, l, p);
        CHECK(hp == gp);
        CHECK(hs->page_state_of(hp) == gs->page_state_of(gp));
        const auto hb_ = *hs->page_bytes(hp);
        const auto gb_ = *gs->page_bytes(gp);
        REQUIRE(hb_.size() == gb_.size());
        INFO("layer " << l << " logical page " << p);
        CHECK(std::memcmp(hb_.data(), gb_.data(), hb_.size()) == 0);
      }
  }
  REQUIRE(gs->check_invariants());
}

}  // namespace

TEST_CASE("reserve's slot mapping drives cuda::append: pages equal the host append's",
          "[cuda][append][reserve]") {
  SECTION("FP8 E4M3") { check_reserve_append<tier<fp8_e4m3, fp8_e4m3>>(); }
  SECTION("int8_rotated") { check_reserve_append<tier<int8_rotated, int8_rotated>>(); }
}
