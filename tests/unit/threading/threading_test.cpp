// SPDX-License-Identifier: Apache-2.0
// The threading contract (docs/threading.md), exercised so ThreadSanitizer (cmake --preset
// tsan) can see every multi-threaded host path: one cache's attend runs on its own worker
// pool; distinct caches share nothing and may be driven from different threads at once; one
// cache is driven by one thread at a time. The answers must not depend on the thread count.
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "../tiering/tiering_test_support.hpp"
#include "catch.hpp"
#include "tierkv/cache.hpp"

using namespace tiering_test;

namespace {

using cache_t = tiered_cache<tiny, two_tiers>;
constexpr int D = tiny::head_dim, QH = tiny::q_heads;

std::unique_ptr<cache_t> make_cache(unsigned threads) {
  cache_t::options opt;
  opt.storage.num_layers = 2;
  opt.storage.max_sequences = 8;
  opt.storage.pages_per_tier = {40, 80};
  opt.policy = policy::recency_anchor({.recent_pages = 1, .sink_pages = 1, .min_dwell_steps = 0});
  opt.max_batch = 8;
  opt.max_pages = 16;
  opt.threads = threads;
  return cache_t::create(opt).value();
}

// One engine's run: sequences of different lengths, then decode steps (attend on both layers,
// append, retier, a fork and a release midway). Returns every attend output, and whether every
// call succeeded (no Catch2 assertion here: Catch2 is not thread-safe, the threads only record).
struct run_result {
  std::vector<float> out;
  bool ok = true;
};
run_result drive(cache_t& c, std::uint64_t seed, int steps) {
  run_result r;
  const auto need = [&](bool x) { r.ok = r.ok && x; };
  std::vector<seq_id> batch;
  for (int i = 0; i < 6; ++i) {
    batch.push_back(c.create_sequence().value());
    need(append_tokens(c, batch.back(), seed * 1000 + std::uint64_t(i) * 100, 20 + 23 * i).is_ok());
  }
  std::vector<float> q(batch.size() * QH * D), out(q.size());
  for (int step = 0; step < steps; ++step) {
    if (step == steps / 2) {
      need(c.release(batch[1]).is_ok());
      auto f = c.fork(batch[4]);
      need(bool(f));
      if (f) batch[1] = *f;
    }
    q.resize(batch.size() * QH * D);
    out.resize(q.size());
    for (int layer = 0; layer < 2; ++layer) {
      for (std::size_t i = 0; i < q.size(); ++i)
        q[i] = gauss(seed + std::uint64_t(step), layer, int(i / D), 3, int(i % D));
      need(c.attend(layer, batch, q, out).is_ok());
      r.out.insert(r.out.end(), out.begin(), out.end());
    }
    for (std::size_t b = 0; b < batch.size(); ++b)
      need(append_tokens(c, batch[b], seed * 1000000 + std::uint64_t(step * 16) + b, 1).is_ok());
    (void)c.retier(std::uint64_t(step) + 1);
  }
  need(c.check_invariants().is_ok());
  return r;
}

}  // namespace

TEST_CASE("attend on a worker pool gives the single-threaded answer, bit for bit", "[threading]") {
  auto one = make_cache(1), four = make_cache(4);
  const auto a = drive(*one, 7, 40), b = drive(*four, 7, 40);
  REQUIRE(a.ok);
  REQUIRE(b.ok);
  REQUIRE(a.out.size() == b.out.size());
  CHECK(a.out == b.out);  // the split across workers never changes an operation's order
}

TEST_CASE("distinct caches driven from different threads at once share nothing", "[threading]") {
  constexpr int engines = 4;
  std::vector<run_result> serial(engines), parallel(engines);
  for (int e = 0; e < engines; ++e) {
    auto c = make_cache(e % 2 == 0 ? 1 : 2);
    serial[std::size_t(e)] = drive(*c, std::uint64_t(e) + 1, 30);
  }
  // Catch2's assertions are not thread-safe: the threads record, the main thread checks.
  std::vector<std::thread> threads;
  for (int e = 0; e < engines; ++e)
    threads.emplace_back([e, &parallel] {
      auto c = make_cache(e % 2 == 0 ? 1 : 2);
      parallel[std::size_t(e)] = drive(*c, std::uint64_t(e) + 1, 30);
    });
  for (auto& t : threads) t.join();
  for (std::size_t e = 0; e < engines; ++e) {
    REQUIRE(serial[e].ok);
    REQUIRE(parallel[e].ok);
    CHECK(parallel[e].out == serial[e].out);
  }
}

TEST_CASE("one cache handed from thread to thread between calls (externally synchronized)",
          "[threading]") {
  auto c = make_cache(3), ref = make_cache(3);
  run_result got;
  // The run on another thread, joined before this one goes on: the happens-before the contract
  // asks of a cache handed between threads.
  std::thread([&] { got = drive(*c, 11, 10); }).join();
  const run_result want = drive(*ref, 11, 10);
  REQUIRE(got.ok);
  REQUIRE(want.ok);
  CHECK(got.out == want.out);
}
