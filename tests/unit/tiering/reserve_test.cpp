// SPDX-License-Identifier: Apache-2.0
// tiered_cache's layer-by-layer writes (issue 22): reserve keeps append's contract (max_pages,
// then make_room only once every other check passed; a refusal changes nothing), attention
// sees only committed tokens, and the result equals append's; prefill attends the reservation.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/cache.hpp"

using namespace tiering_test;

namespace {

using cache_t =
    tiered_cache<tiny, two_tiers, policy::recency_anchor, host_allocator, failing_allocator>;
constexpr int D = tiny::head_dim, QH = tiny::q_heads, KH = tiny::kv_heads;

// Writes every layer of s's reservation (n tokens) with the tokens first, first + 1, ...
void write_tokens(cache_t& c, seq_id s, std::uint64_t first, int n) {
  std::vector<float> k, v;
  const int layers = c.storage().num_layers();
  make_kv<cache_t::storage_type>(layers, seeds_from(first, n), k, v);
  const std::size_t per_layer = std::size_t(n) * KH * D;
  for (int l = 0; l < layers; ++l)
    REQUIRE(c.write_layer(
        s, l, std::span<const float>(k).subspan(std::size_t(l) * per_layer, per_layer),
        std::span<const float>(v).subspan(std::size_t(l) * per_layer, per_layer)));
}

// As contract_test.cpp: 3 layers, two sequence slots, four logical pages of FP8.
cache_t::options pressure_options() {
  cache_t::options opt;
  opt.storage.num_layers = 3;
  opt.storage.max_sequences = 2;
  opt.storage.pages_per_tier = {12, 64};
  opt.policy = policy::recency_anchor({.recent_pages = 1,
                                       .sink_pages = 0,
                                       .ema_alpha = 0.5f,
                                       .enter_mass = 3.0f,
                                       .leave_mass = 1.5f,
                                       .min_dwell_steps = 1,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  opt.max_batch = 2;
  opt.max_pages = 32;
  return opt;
}

}  // namespace

TEST_CASE("a refused reserve changes nothing, even where it would have had to make room first",
          "[tiering][cache][contract][reserve]") {
  auto c = cache_t::create(pressure_options()).value();
  const seq_id a = c->create_sequence().value();
  REQUIRE(append_tokens(*c, a, 1, 64));  // four sealed pages: tier 0 is full
  REQUIRE(c->storage().free_pages(0) == 0);
  const std::string before = cache_snapshot(*c);
  std::vector<std::int32_t> slot(3), offset(1);

  c->storage().meta_alloc().fail_on(1);  // the page list's growth
  CHECK(c->reserve(a, 1, slot_mapping{slot, 0, offset}).code() == errc::capacity_exhausted);
  CHECK(cache_snapshot(*c) == before);
  c->storage().meta_alloc().reset();
  CHECK(c->reserve(a, 1, slot_mapping{std::span<std::int32_t>(slot).first(2), 0, offset}).code() ==
        errc::invalid_argument);  // 3 layers need 3 slots
  CHECK(c->reserve(seq_id(77), 1).code() == errc::stale_id);
  CHECK(cache_snapshot(*c) == before);

  REQUIRE(c->reserve(a, 1, slot_mapping{slot, 0, offset}));  // makes room, then opens a page
  CHECK(c->controller().totals().pressure_demoted > 0);
  CHECK(*c->reserved(a) == 1);
  CHECK(*c->length(a) == 64);
  CHECK(offset[0] == 0);
  write_tokens(*c, a, 65, 1);
  REQUIRE(c->commit(a, 1));
  CHECK(*c->length(a) == 65);
  for (int l = 0; l < 3; ++l) {
    CHECK(std::uint32_t(slot[std::size_t(l)]) == c->storage().page(a, l, 4)->slot);
    const page_error e = page_error_of(c->storage(), a, l, 4, seeds_from(1, 65));
    CHECK(e.max <= fp8_vector_bound);
  }
  REQUIRE(c->check_invariants());
}

TEST_CASE("max_pages is enforced at reserve", "[tiering][cache][contract][reserve]") {
  cache_t::options opt = pressure_options();
  opt.max_pages = 4;
  auto c = cache_t::create(opt).value();
  const seq_id s = c->create_sequence().value();
  REQUIRE(append_tokens(*c, s, 1, 60));
  const std::string before = cache_snapshot(*c);
  const status st = c->reserve(s, 5);  // 65 tokens = 5 pages
  CHECK(st.code() == errc::out_of_range);
  CHECK(st.message().find("max_pages") != std::string::npos);
  CHECK(st.message().find("nothing reserved") != std::string::npos);
  CHECK(cache_snapshot(*c) == before);
  REQUIRE(c->reserve(s, 4));  // exactly max_pages pages
  REQUIRE(c->cancel(s));
  REQUIRE(c->check_invariants());
}

TEST_CASE("attention sees only committed tokens; committed ones attend as appended ones",
          "[tiering][cache][reserve]") {
  cache_t::options opt = pressure_options();
  opt.storage.pages_per_tier = {60, 64};
  auto layered = cache_t::create(opt).value();
  auto appended = cache_t::create(opt).value();
  const std::vector<seq_id> batch{layered->create_sequence().value(),
                                  layered->create_sequence().value()};
  const std::vector<seq_id> batch2{appended->create_sequence().value(),
                                   appended->create_sequence().value()};
  REQUIRE(batch == batch2);
  for (cache_t* c : {layered.get(), appended.get()}) {
    REQUIRE(append_tokens(*c, batch[0], 1, 20));
    REQUIRE(append_tokens(*c, batch[1], 100, 7));
  }
  std::vector<float> q(batch.size() * QH * D);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = gauss(i, 0, 0, 2, 0);
  const auto attend = [&](cache_t& c, int layer) {
    std::vector<float> out(q.size()), mass(batch.size() * 32), lse(batch.size() * QH);
    REQUIRE(c.attend(layer, batch, q, out, mass, lse));
    out.insert(out.end(), mass.begin(), mass.end());
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const auto same_bits = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  std::vector<std::vector<float>> before;
  for (int l = 0; l < 3; ++l) before.push_back(attend(*layered, l));

  // 30 tokens reserved and written on sequence 0 (into its open tail page and two new ones),
  // 5 on sequence 1: invisible to attention until committed.
  REQUIRE(layered->reserve(batch[0], 30));
  REQUIRE(layered->reserve(batch[1], 5));
  write_tokens(*layered, batch[0], 21, 30);
  write_tokens(*layered, batch[1], 107, 5);
  for (int l = 0; l < 3; ++l) CHECK(same_bits(attend(*layered, l), before[std::size_t(l)]));
  REQUIRE(layered->check_invariants());

  REQUIRE(layered->commit(batch[0], 30));
  REQUIRE(layered->commit(batch[1], 5));
  REQUIRE(append_tokens(*appended, batch[0], 21, 30));
  REQUIRE(append_tokens(*appended, batch[1], 107, 5));
  for (int l = 0; l < 3; ++l) {
    const auto got = attend(*layered, l);
    CHECK_FALSE(same_bits(got, before[std::size_t(l)]));
    CHECK(same_bits(got, attend(*appended, l)));
  }
  // A cancelled reservation leaves attention as it was.
  const auto committed = attend(*layered, 1);
  REQUIRE(layered->reserve(batch[1], 12));
  write_tokens(*layered, batch[1], 5000, 12);
  REQUIRE(layered->cancel(batch[1]));
  CHECK(same_bits(attend(*layered, 1), committed));
  REQUIRE(layered->check_invariants());
}

TEST_CASE("make_room for one reservation never moves another's pages",
          "[tiering][cache][reserve]") {
  auto c = cache_t::create(pressure_options()).value();
  const seq_id a = c->create_sequence().value();
  const seq_id b = c->create_sequence().value();
  REQUIRE(append_tokens(*c, a, 1, 40));  // two sealed pages and an open tail: 9 FP8 pages
  std::vector<std::int32_t> slot_a(3 * 20), off_a(20);
  REQUIRE(c->reserve(a, 20, slot_mapping{slot_a, 0, off_a}));  // its tail and one new page
  REQUIRE(c->storage().free_pages(0) == 0);
  REQUIRE(c->reserve(b, 5));  // needs 3 pages: demotes a's sealed pages, not its open ones
  CHECK(c->controller().totals().pressure_demoted >= 3);
  std::vector<std::int32_t> again(slot_a.size()), off_again(20);
  REQUIRE(c->storage().slots(a, slot_mapping{again, 0, off_again}));
  CHECK(again == slot_a);
  CHECK(off_again == off_a);
  write_tokens(*c, a, 41, 20);
  write_tokens(*c, b, 200, 5);
  REQUIRE(c->commit(a, 20));
  REQUIRE(c->commit(b, 5));
  const auto ta = seeds_from(1, 60);
  for (int l = 0; l < 3; ++l) {
    for (std::int64_t p = 2; p < 4; ++p)
      CHECK(page_error_of(c->storage(), a, l, p, ta).max <= fp8_vector_bound);
    CHECK(page_error_of(c->storage(), b, l, 0, seeds_from(200, 5)).max <= fp8_vector_bound);
  }
  REQUIRE(c->check_invariants());
}

TEST_CASE("read_layer decodes committed and reserved tokens of one layer, across tiers",
          "[tiering][cache][reserve]") {
  cache_t::options opt = pressure_options();
  opt.storage.pages_per_tier = {60, 64};
  auto c = cache_t::create(opt).value();
  const seq_id s = c->create_sequence().value();
  REQUIRE(append_tokens(*c, s, 1, 40));  // pages 0-2, page 2 open
  (void)c->retier(1);                    // recent_pages 1: pages 0-1 become TQ3
  (void)c->retier(2);
  auto& st = c->storage();
  REQUIRE(st.page(s, 1, 0).value().format == 1);
  REQUIRE(c->reserve(s, 9));
  write_tokens(*c, s, 41, 9);
  // Committed tokens read as read_token reads them; reserved ones as their write encoded them.
  const std::int64_t first = 10, n = 39;  // 30 committed (TQ3 and FP8 pages) + all 9 reserved
  std::vector<float> k(std::size_t(n) * KH * D), v(k.size());
  REQUIRE(st.read_layer(s, 1, first, n, k, v));
  std::vector<float> rk(D), rv(D);
  for (std::int64_t i = 0; i < 30; ++i)
    for (int h = 0; h < KH; ++h) {
      REQUIRE(st.read_token(s, 1, first + i, h, rk.data(), rv.data()));
      const std::size_t at = (std::size_t(i) * KH + std::size_t(h)) * D;
      CHECK(std::memcmp(rk.data(), k.data() + at, D * sizeof(float)) == 0);
      CHECK(std::memcmp(rv.data(), v.data() + at, D * sizeof(float)) == 0);
    }
  REQUIRE(c->commit(s, 9));
  for (std::int64_t i = 30; i < n; ++i)
    for (int h = 0; h < KH; ++h) {
      REQUIRE(st.read_token(s, 1, first + i, h, rk.data(), rv.data()));
      const std::size_t at = (std::size_t(i) * KH + std::size_t(h)) * D;
      CHECK(std::memcmp(rk.data(), k.data() + at, D * sizeof(float)) == 0);
      CHECK(std::memcmp(rv.data(), v.data() + at, D * sizeof(float)) == 0);
    }
  // Out of range (past length + reserved, negative), short buffers, a bad layer: refused,
  // nothing written.
  std::vector<float> guard(k.size(), -7.f);
  CHECK(st.read_layer(s, 1, 40, 10, guard, guard).code() == errc::out_of_range);
  CHECK(st.read_layer(s, 1, -1, 2, guard, guard).code() == errc::out_of_range);
  CHECK(st.read_layer(s, 1, 0, -1, guard, guard).code() == errc::out_of_range);
  CHECK(st.read_layer(s, 3, 0, 1, guard, guard).code() == errc::out_of_range);
  std::vector<float> tiny_buf(3);
  CHECK(st.read_layer(s, 1, 0, 2, tiny_buf, tiny_buf).code() == errc::invalid_argument);
  CHECK(std::all_of(guard.begin(), guard.end(), [](float x) { return x == -7.f; }));
  CHECK(st.read_layer(s, 1, 49, 0, guard, guard).is_ok());
}

TEST_CASE(
    "prefill attends committed and reserved tokens causally, as float64 over the stored "
    "vectors; one row per sequence is the decode step attend gives after commit",
    "[tiering][cache][reserve][prefill]") {
  cache_t::options opt = pressure_options();
  opt.storage.pages_per_tier = {60, 64};
  auto c = cache_t::create(opt).value();
  const std::vector<seq_id> batch{c->create_sequence().value(), c->create_sequence().value()};
  REQUIRE(append_tokens(*c, batch[0], 1, 40));  // pages 0-2, page 2 open
  REQUIRE(append_tokens(*c, batch[1], 300, 7));
  (void)c->retier(1);  // recent_pages 1: pages 0-1 of sequence 0 become TQ3
  (void)c->retier(2);
  REQUIRE(c->storage().page(batch[0], 1, 0).value().format == 1);
  REQUIRE(c->reserve(batch[0], 30));  // the open tail page and two new ones
  REQUIRE(c->reserve(batch[1], 1));
  write_tokens(*c, batch[0], 41, 30);
  write_tokens(*c, batch[1], 307, 1);

  const std::vector<std::int32_t> indptr{0, 6, 7};  // sequence 0's last 6 tokens, 1's last one
  std::vector<float> q(7 * QH * D), out(q.size()), lse(7 * QH);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = gauss(i, 5, 0, 2, 0);
  const int layer = 1;
  REQUIRE(c->prefill(layer, batch, indptr, q, out, lse));
  double worst = 0;
  for (std::size_t b = 0; b < 2; ++b) {
    const std::int64_t readable = *c->length(batch[b]) + *c->reserved(batch[b]);
    std::vector<float> k(std::size_t(readable) * KH * D), v(k.size());
    REQUIRE(c->storage().read_layer(batch[b], layer, 0, readable, k, v));
    for (int r = indptr[b]; r < indptr[b + 1]; ++r) {
      const std::int64_t len = readable - (indptr[b + 1] - r) + 1;  // causal: up to its position
      std::vector<double> ref, mass;
      reference_attend(
          q.data() + std::size_t(r) * QH * D, len,
          [&](std::int64_t t, int h, float* kk, float* vv) {
            const std::size_t at = (std::size_t(t) * KH + std::size_t(h)) * D;
            std::copy_n(k.data() + at, D, kk);
            std::copy_n(v.data() + at, D, vv);
          },
          ref, mass);
      worst = std::max(worst, rel_l2(out.data() + std::size_t(r) * QH * D, ref));
    }
  }
  CHECK(worst < 1e-5);
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return std::isfinite(x); }));

  // One row per sequence: the decode step over the reservation, bit for bit what attend gives
  // once the tokens are committed.
  const std::vector<std::int32_t> one{0, 1, 2};
  std::vector<float> q1(2 * QH * D), step(q1.size()), after(q1.size());
  for (std::size_t i = 0; i < q1.size(); ++i) q1[i] = gauss(i, 6, 0, 2, 0);
  REQUIRE(c->prefill(layer, batch, one, q1, step));
  REQUIRE(c->commit(batch[0], 30));
  REQUIRE(c->commit(batch[1], 1));
  REQUIRE(c->attend(layer, batch, q1, after));
  CHECK(std::memcmp(step.data(), after.data(), step.size() * sizeof(float)) == 0);
  REQUIRE(c->check_invariants());
}

TEST_CASE("prefill refuses bad rows, sizes and queries, writing and observing nothing",
          "[tiering][cache][reserve][prefill][contract]") {
  auto c = cache_t::create(pressure_options()).value();
  const std::vector<seq_id> batch{c->create_sequence().value()};
  REQUIRE(append_tokens(*c, batch[0], 1, 10));
  REQUIRE(c->reserve(batch[0], 3));
  write_tokens(*c, batch[0], 11, 3);
  const std::string before = cache_snapshot(*c);
  std::vector<float> q(3 * QH * D, 0.5f), out(q.size(), -7.f), lse(3 * QH);
  const auto untouched = [&] {
    return std::all_of(out.begin(), out.end(), [](float x) { return x == -7.f; });
  };
  const auto refused = [&](std::vector<std::int32_t> indptr, std::span<const float> queries,
                           int window = 0) {
    const status st = c->prefill(0, batch, indptr, queries, out, lse, window);
    return !st.is_ok() && untouched() && cache_snapshot(*c) == before ? st.code() : errc::ok;
  };
  CHECK(refused({0}, q) == errc::invalid_argument);         // q_indptr: batch + 1 entries
  CHECK(refused({1, 3}, q) == errc::invalid_argument);      // must start at 0
  CHECK(refused({0, 0}, {}) == errc::invalid_argument);     // no row for the sequence
  CHECK(refused({0, 14}, q) == errc::invalid_argument);     // 14 rows > 13 readable tokens
  CHECK(refused({0, 2}, q) == errc::invalid_argument);      // 3 rows of queries for 2
  CHECK(refused({0, 3}, q, -1) == errc::invalid_argument);  // negative window
  std::vector<float> bad = q;
  bad[QH * D + 5] = std::numeric_limits<float>::quiet_NaN();
  CHECK(refused({0, 3}, bad) == errc::non_finite_input);
  const std::vector<seq_id> gone{seq_id(77)};
  CHECK(c->prefill(0, gone, std::vector<std::int32_t>{0, 1},
                   std::span<const float>(q).first(QH * D), std::span<float>(out).first(QH * D))
            .code() == errc::stale_id);
  CHECK(untouched());
  CHECK(c->prefill(5, batch, std::vector<std::int32_t>{0, 3}, q, out).code() ==
        errc::out_of_range);                                               // 3 layers
  CHECK(c->prefill(0, {}, std::vector<std::int32_t>{0}, {}, {}).is_ok());  // an empty batch
  CHECK(untouched());
  REQUIRE(c->prefill(0, batch, std::vector<std::int32_t>{0, 3}, q, out, lse));
  CHECK_FALSE(untouched());
}

TEST_CASE("attention mass observed over a reservation reaches its pages once committed",
          "[tiering][cache][reserve][mass]") {
  cache_t::options opt = pressure_options();  // recent 1, no sink, enter 3x, leave 1.5x, EMA 0.5
  opt.storage.pages_per_tier = {60, 64};
  for (const index_scope scope : {index_scope::readable, index_scope::committed}) {
    auto c = cache_t::create(opt).value();
    const seq_id s = c->create_sequence().value();
    REQUIRE(append_tokens(*c, s, 1, 64));  // pages 0-3
    REQUIRE(c->reserve(s, 16));            // page 4, reserved
    write_tokens(*c, s, 65, 16);
    // The chunk's last query put most of its mass on page 4 (4.8x a uniform share of 5 pages).
    std::vector<float> row(std::size_t(opt.max_pages), 0.01f);
    row[4] = 0.96f;
    CHECK(c->controller().observe_mass(s, 0, std::span<const float>(row).first(4), scope).code() ==
          (scope == index_scope::readable ? errc::invalid_argument : errc::ok));
    for (std::uint64_t step = 1; step <= 2; ++step) {
      REQUIRE(c->controller().observe_mass(s, 0, row, scope));
      (void)c->retier(step);
    }
    REQUIRE(c->commit(s, 16));
    REQUIRE(append_tokens(*c, s, 81, 32));  // pages 5, 6: page 4 is no longer Recent
    for (std::uint64_t step = 3; step <= 4; ++step) (void)c->retier(step);
    // Read over the reservation, page 4 became an Anchor at layer 0 and stays in tier 0; the
    // committed scope never saw it, and it goes Stale like pages 0-3 and like layer 1's.
    CHECK(c->storage().page(s, 0, 4).value().format == (scope == index_scope::readable ? 0 : 1));
    CHECK(c->storage().page(s, 1, 4).value().format == 1);
    CHECK(c->storage().page(s, 0, 3).value().format == 1);
    REQUIRE(c->check_invariants());
  }
}
