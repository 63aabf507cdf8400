// SPDX-License-Identifier: Apache-2.0
// A format registered from outside tierkv (int8_twin.hpp through TIERKV_USER_FORMATS, set by
// this area's libs.cmake): it is a registered format like tierkv's own, by name and tag, in a
// tiered cache's tier list and in page transfers, and it gives int8_rotated's results bit for bit.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "int8_twin.hpp"
#include "policy_knobs.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/formats.hpp"
#include "tierkv/paging/page_transfer.hpp"

using namespace tierkv;

namespace {

using geo = geometry<head_dim<64>, kv_heads<2>, group_size<2>, page_tokens<16>>;
using twin_tiers =
    tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tierkv_test::int8_twin, tierkv_test::int8_twin>>;
using int8r_tiers = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<int8_rotated, int8_rotated>>;
template <class Tiers>
using cache_of = tiered_cache<geo, Tiers>;
constexpr int layers = 2, D = geo::head_dim, QH = geo::q_heads, KVH = geo::kv_heads;

template <class Tiers>
std::unique_ptr<cache_of<Tiers>> make_cache() {
  typename cache_of<Tiers>::options opt;
  opt.storage.num_layers = layers;
  opt.storage.max_sequences = 4;
  opt.storage.pages_per_tier = {40, 40};
  opt.storage.codec_seed = 7;
  opt.policy = policy::recency_anchor(tierkv_test::recency_knobs(1, 0, 0.5f, 3.0f, 1.5f, 1));
  opt.max_batch = 1;
  opt.max_pages = 16;
  return std::move(cache_of<Tiers>::create(opt).value());
}

// The same appends, decodes and retier steps on a cache of each tier list; every output.
template <class Tiers>
std::vector<float> run(cache_of<Tiers>& c, seq_id s) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> k(std::size_t(layers) * 80 * KVH * D), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  REQUIRE(c.append(s, 80, k, v));
  std::vector<float> q(std::size_t(QH) * D), out(q.size()), all;
  const std::vector<seq_id> batch{s};
  for (std::uint64_t step = 1; step <= 4; ++step) {
    REQUIRE(c.retier(step).first_error.is_ok());
    for (int l = 0; l < layers; ++l) {
      for (auto& x : q) x = nd(rng);
      REQUIRE(c.attend(l, batch, q, out));
      all.insert(all.end(), out.begin(), out.end());
    }
  }
  return all;
}

}  // namespace

TEST_CASE("user format: registered by name and tag after tierkv's own", "[registry][user]") {
  STATIC_REQUIRE(format_count == builtin_formats::size + 1);
  CHECK(find_format("int8_twin") == builtin_formats::size);
  CHECK(format_name(storage_format{200}) == "int8_twin");
  CHECK(format_name(format_count - 1) == "int8_twin");
  CHECK(find_format("int8_rotated") >= 0);  // tierkv's own stay where they were
  CHECK(find_format("int8_rotated") < builtin_formats::size);
  STATIC_REQUIRE(std::is_same_v<format_at<format_count - 1>, tierkv_test::formats::int8_twin>);
  STATIC_REQUIRE(bits_per_scalar<tierkv_test::int8_twin::bind<128>> ==
                 bits_per_scalar<int8_rotated::bind<128>>);
}

TEST_CASE(
    "user format: a tier of it stores, decodes and transfers as int8_rotated does, tagged 200",
    "[tiering][user]") {
  auto twin = make_cache<twin_tiers>();
  auto base = make_cache<int8r_tiers>();
  const seq_id a = twin->create_sequence().value(), b = base->create_sequence().value();
  const std::vector<float> got = run(*twin, a), want = run(*base, b);
  REQUIRE(got.size() == want.size());
  CHECK(std::equal(got.begin(), got.end(), want.begin()));  // bit for bit
  CHECK(twin->storage().free_pages(1) < 40);  // the run demoted pages into the user tier
  CHECK(twin->storage().free_pages(1) == base->storage().free_pages(1));

  // transfers carry the tag: another twin cache imports it, an int8_rotated one refuses by tag
  const auto blob = export_pages(twin->storage(), a).value();
  auto twin2 = make_cache<twin_tiers>();
  const seq_id c = import_pages(twin2->storage(), blob).value();
  CHECK(*twin2->storage().length(c) == 80);
  auto base2 = make_cache<int8r_tiers>();
  const auto refused = import_pages(base2->storage(), blob);
  REQUIRE(!refused);
  CHECK(refused.error_status().code() == errc::geometry_mismatch);
  CHECK(std::string(refused.error_status().message()).find("value 200") != std::string::npos);
}
