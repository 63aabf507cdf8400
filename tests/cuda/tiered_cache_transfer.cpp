// SPDX-License-Identifier: Apache-2.0
// cuda::tiered_cache::export_pages / import_pages against the host's page transfer: a GPU cache
// and a host twin (paged_storage over host memory) hold the same tokens, the twin's pages moved
// to the tiers the GPU's policy chose (host conversions, bit-exact with the GPU's). The GPU's
// export must be the host's byte for byte; buffers go GPU -> host, host -> GPU and GPU -> GPU
// and re-export unchanged; decode over an imported sequence must equal decode over its source
// bit for bit; every bad request or buffer, and every import the pools cannot hold, must be
// refused with the cache exactly as it was (report, counts, pools' bytes, counters).
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../unit/transfer/transfer_support.hpp"
#include "catch.hpp"
#include "policy_knobs.hpp"
#include "tiered_cache_transfer_kernels.hpp"
#include "tierkv/paging/page_transfer.hpp"

namespace {

using namespace tierkv;
using cuda_test::xfer_cache;
using G = cuda_test::xfer_geometry;
using TL = cuda_test::xfer_tiers;
using host_storage = paged_storage<G, TL, host_allocator>;
using bytes = std::vector<std::uint8_t>;
constexpr int D = G::head_dim, KVH = G::kv_heads, QH = G::q_heads, T = G::page_tokens;
constexpr int layers = 3;
constexpr std::size_t kv_vec = std::size_t(KVH) * D;

storage_options<2> pools(std::uint32_t tier0 = 90, std::uint32_t tier1 = 600,
                         std::uint32_t sequences = 8) {
  storage_options<2> o;
  o.num_layers = layers;
  o.max_sequences = sequences;
  o.pages_per_tier = {tier0, tier1};
  o.codec_seed = 91;
  return o;
}

// By age alone, from the first step on: all but the sink page and the 2 newest go to TQ3.
policy::recency_anchor age_only() {
  return policy::recency_anchor(tierkv_test::recency_knobs(2, 1, 1.0f, 1e30f, 1e29f, 0));
}
// Every page Recent: nothing moves unless memory pressure demotes it.
policy::recency_anchor keep_all() {
  return policy::recency_anchor(tierkv_test::recency_knobs(1000, 1, 1.0f, 1e30f, 1e29f, 0));
}

cuda_test::xfer_options gpu_opts(storage_options<2> storage = pools(),
                                 policy::recency_anchor policy = age_only()) {
  cuda_test::xfer_options o;
  o.storage = storage;
  o.policy = policy;
  return o;
}

std::unique_ptr<xfer_cache> make_gpu(const cuda_test::xfer_options& o) {
  return std::move(xfer_cache::create(o).value());
}

// A sequence's tokens in the host's append layout, [layer][token][kv_head][dim].
struct tokens {
  std::int64_t n = 0;
  std::vector<float> k, v;
};
tokens random_tokens(std::mt19937_64& rng, std::int64_t n) {
  return {n, test_transfer::random_kv(rng, layers, n, KVH, D),
          test_transfer::random_kv(rng, layers, n, KVH, D)};
}
// Layer l's tokens [first, first + count) of x: [count][kv_head][dim], what a GPU append takes.
std::vector<float> layer_rows(const std::vector<float>& x, std::int64_t n, int l,
                              std::int64_t first, std::int64_t count) {
  const float* at = x.data() + (std::size_t(l) * std::size_t(n) + std::size_t(first)) * kv_vec;
  return {at, at + std::size_t(count) * kv_vec};
}

// One GPU step appending x to s, then end_step with wait: the policy's conversions are done.
void gpu_prefill(xfer_cache& c, seq_id s, const tokens& x, std::uint64_t step) {
  const std::vector<seq_id> batch{s};
  REQUIRE(c.begin_step(batch, std::vector<std::int32_t>{std::int32_t(x.n)}).is_ok());
  for (int l = 0; l < layers; ++l)
    REQUIRE(c.append(l, layer_rows(x.k, x.n, l, 0, x.n), layer_rows(x.v, x.n, l, 0, x.n)).is_ok());
  REQUIRE(c.end_step(step, true).has_value());
  REQUIRE(c.device_error().is_ok());
}

// The twin's pages of ts moved to the tiers the GPU's policy gave gs's.
void follow_tiers(host_storage& twin, seq_id ts, const xfer_cache& gpu, seq_id gs) {
  const std::int64_t pages = gpu.storage().logical_pages(gs).value();
  REQUIRE(twin.logical_pages(ts).value() == pages);
  for (std::int64_t j = 0; j < pages; ++j)
    for (int l = 0; l < layers; ++l) {
      const int to = gpu.storage().page(gs, l, j)->format;
      if (twin.page(ts, l, j)->format != to)
        REQUIRE(test_transfer::retier(twin, ts, j, l, to).is_ok());
    }
}

// Decode of every layer for `batch` in one step without new tokens, every sequence given the
// same query: per layer, [batch][q_heads][head_dim] outputs then [batch][q_heads] lse.
std::vector<std::vector<float>> decode_all(xfer_cache& c, const std::vector<seq_id>& batch,
                                           const std::vector<std::vector<float>>& q,
                                           std::uint64_t step) {
  REQUIRE(c.begin_step(batch, std::vector<std::int32_t>(batch.size(), 0)).is_ok());
  std::vector<std::vector<float>> res;
  for (int l = 0; l < layers; ++l) {
    std::vector<float> qs, out, lse;
    for (std::size_t b = 0; b < batch.size(); ++b)
      qs.insert(qs.end(), q[std::size_t(l)].begin(), q[std::size_t(l)].end());
    REQUIRE(c.decode(l, qs, out, lse).is_ok());
    out.insert(out.end(), lse.begin(), lse.end());
    res.push_back(std::move(out));
  }
  REQUIRE(c.device_error().is_ok());
  REQUIRE(c.end_step(step, true).has_value());
  return res;
}
// Sequence b's outputs and lse of a decode_all layer of a batch of n.
std::vector<float> row_of(const std::vector<float>& layer, std::size_t b, std::size_t n) {
  constexpr std::size_t o = std::size_t(QH) * D;
  std::vector<float> r(layer.begin() + std::ptrdiff_t(b * o),
                       layer.begin() + std::ptrdiff_t((b + 1) * o));
  const auto lse = layer.begin() + std::ptrdiff_t(n * o);
  r.insert(r.end(), lse + std::ptrdiff_t(b * QH), lse + std::ptrdiff_t((b + 1) * QH));
  return r;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<std::vector<float>> random_queries(std::mt19937_64& rng) {
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<std::vector<float>> q(layers, std::vector<float>(std::size_t(QH) * D));
  for (auto& ql : q)
    for (float& x : ql) x = g(rng);
  return q;
}

// Everything a refused call must leave as it was.
struct cache_state {
  std::string report;
  std::uint32_t sequences = 0, blocks = 0, free0 = 0, free1 = 0;
  std::uint64_t page_bytes = 0, demoted = 0;
  bytes pool0, pool1;
  bool operator==(const cache_state&) const = default;
};
cache_state state_of(const xfer_cache& c) {
  std::ostringstream r;
  r << c.report();
  const auto& s = c.storage();
  return {r.str(),         s.live_sequences(),   s.live_blocks(),      s.free_pages(0),
          s.free_pages(1), c.page_bytes_moved(), c.pressure_demoted(), c.pool_bytes(0),
          c.pool_bytes(1)};
}

// Imports buf into c, which must refuse it with `code` and a message naming `says`, changing
// nothing; returns the message.
std::string import_refused(xfer_cache& c, const bytes& buf, errc code, const char* says) {
  const cache_state before = state_of(c);
  auto r = c.import_pages(buf);
  REQUIRE_FALSE(r.has_value());
  const std::string message = r.error_status().message();
  INFO(message);
  CHECK(r.code() == code);
  CHECK(message.find(says) != std::string::npos);
  CHECK(state_of(c) == before);
  REQUIRE(c.check_invariants().is_ok());
  return message;
}

// A GPU cache holding s0 (150 tokens: 9 full pages and an open one of 6) and s1 (96 tokens, 6
// full pages), its policy's conversions done, and a host twin with the same pages.
struct world {
  std::unique_ptr<xfer_cache> gpu;
  std::unique_ptr<host_storage> twin;
  seq_id s0, s1, t0, t1;
  tokens x0, x1;
};
world make_world(std::mt19937_64& rng, const cuda_test::xfer_options& o = gpu_opts()) {
  world w;
  w.gpu = make_gpu(o);
  w.twin = std::move(host_storage::create(o.storage).value());
  w.x0 = random_tokens(rng, 150);
  w.x1 = random_tokens(rng, 96);
  w.s0 = w.gpu->create_sequence().value();
  w.s1 = w.gpu->create_sequence().value();
  gpu_prefill(*w.gpu, w.s0, w.x0, 1);
  gpu_prefill(*w.gpu, w.s1, w.x1, 2);
  w.t0 = w.twin->create_sequence().value();
  w.t1 = w.twin->create_sequence().value();
  REQUIRE(w.twin->append(w.t0, w.x0.n, w.x0.k, w.x0.v).is_ok());
  REQUIRE(w.twin->append(w.t1, w.x1.n, w.x1.k, w.x1.v).is_ok());
  follow_tiers(*w.twin, w.t0, *w.gpu, w.s0);
  follow_tiers(*w.twin, w.t1, *w.gpu, w.s1);
  return w;
}

}  // namespace

TEST_CASE("cuda::tiered_cache::export_pages writes the host export's bytes, runs and head slices",
          "[cuda][cache][transfer]") {
  std::mt19937_64 rng(20261205);
  world w = make_world(rng);
  const auto info = inspect_transfer(w.gpu->export_pages(w.s0).value()).value();
  REQUIRE(info.pages_per_tier[1] > 0);  // TQ3 pages in the buffer
  REQUIRE(info.last_fill == 6);         // and the open tail page
  const cache_state before = state_of(*w.gpu);

  struct run {
    std::int64_t first, count;
    head_slice heads;
  };
  const run runs[] = {{0, -1, {}},     {2, 3, {}},     {9, -1, {}}, {0, 0, {}},
                      {0, -1, {1, 1}}, {3, 4, {0, 1}}, {10, -1, {}}};
  for (const auto& [s, t] : {std::pair(w.s0, w.t0), std::pair(w.s1, w.t1)})
    for (const run& r : runs) {
      INFO("sequence " << s << ", first " << r.first << ", count " << r.count << ", heads ["
                       << r.heads.begin << ", +" << r.heads.count << ")");
      auto host = export_pages(*w.twin, t, r.first, r.count, r.heads);
      auto gpu = w.gpu->export_pages(s, r.first, r.count, r.heads);
      REQUIRE(host.has_value() == gpu.has_value());
      if (!host) {  // s1 has 6 pages: first = 9 or 10 is past its end
        CHECK(gpu.code() == host.code());
        continue;
      }
      CHECK(*gpu == *host);
      CHECK(inspect_transfer(*gpu).has_value());
    }
  // Exports change nothing but the page-bytes counter.
  cache_state after = state_of(*w.gpu);
  CHECK(after.page_bytes > before.page_bytes);
  after.page_bytes = before.page_bytes;
  CHECK(after == before);

  SECTION("bad requests are refused, naming the value and its limit") {
    const seq_id gone = w.gpu->create_sequence().value();
    REQUIRE(w.gpu->release(gone).is_ok());
    CHECK(w.gpu->export_pages(gone).code() == errc::stale_id);
    CHECK(w.gpu->export_pages(seq_id{}).code() == errc::out_of_range);
    auto past = w.gpu->export_pages(w.s0, 11);
    CHECK(past.code() == errc::out_of_range);
    CHECK(past.error_status().message().find("first logical page = 11") != std::string::npos);
    auto many = w.gpu->export_pages(w.s0, 4, 7);
    CHECK(many.code() == errc::out_of_range);
    CHECK(many.error_status().message().find("export page count = 7") != std::string::npos);
    CHECK(w.gpu->export_pages(w.s0, 0, -1, {2, 1}).code() == errc::out_of_range);
    CHECK(w.gpu->export_pages(w.s0, 0, -1, {-1, 1}).code() == errc::out_of_range);
    CHECK(w.gpu->export_pages(w.s0, 0, -1, {0, 0}).code() == errc::out_of_range);
    const std::vector<seq_id> batch{w.s0};
    REQUIRE(w.gpu->begin_step(batch, std::vector<std::int32_t>{1}).is_ok());
    CHECK(w.gpu->export_pages(w.s0).code() == errc::invalid_argument);  // inside a step
    for (int l = 0; l < layers; ++l)
      REQUIRE(
          w.gpu->append(l, layer_rows(w.x1.k, w.x1.n, l, 0, 1), layer_rows(w.x1.v, w.x1.n, l, 0, 1))
              .is_ok());
    REQUIRE(w.gpu->end_step(3, true).has_value());
    // the step's token is in the export once the step has ended
    std::vector<float> k1, v1;
    for (int l = 0; l < layers; ++l) {
      const auto k = layer_rows(w.x1.k, w.x1.n, l, 0, 1), v = layer_rows(w.x1.v, w.x1.n, l, 0, 1);
      k1.insert(k1.end(), k.begin(), k.end());
      v1.insert(v1.end(), v.begin(), v.end());
    }
    REQUIRE(w.twin->append(w.t0, 1, k1, v1).is_ok());
    follow_tiers(*w.twin, w.t0, *w.gpu, w.s0);
    CHECK(w.gpu->export_pages(w.s0).value() == export_pages(*w.twin, w.t0).value());
    REQUIRE(w.gpu->check_invariants().is_ok());
  }
}

TEST_CASE(
    "cuda::tiered_cache::import_pages: GPU to host, host to GPU, GPU to GPU; decode over the "
    "import equals decode over the source",
    "[cuda][cache][transfer]") {
  std::mt19937_64 rng(20261206);
  world w = make_world(rng);
  const bytes buf = w.gpu->export_pages(w.s0).value();
  REQUIRE(buf == export_pages(*w.twin, w.t0).value());
  const auto q = random_queries(rng);

  // GPU -> host: the host's pages re-export to the same bytes and decode as the twin's.
  auto host = std::move(host_storage::create(pools()).value());
  const seq_id hi = import_pages(*host, buf).value();
  CHECK(export_pages(*host, hi).value() == buf);
  for (int l = 0; l < layers; ++l) {
    std::vector<float> out_t, lse_t, out_i, lse_i;
    REQUIRE(test_transfer::decode_layer(*w.twin, w.t0, l, q[std::size_t(l)], out_t, lse_t));
    REQUIRE(test_transfer::decode_layer(*host, hi, l, q[std::size_t(l)], out_i, lse_i));
    CHECK(same_bits(out_t, out_i));
    CHECK(same_bits(lse_t, lse_i));
  }

  // host -> GPU and GPU -> GPU (the same cache): new sequences with the source's tiers and bytes.
  const std::uint64_t moved = w.gpu->page_bytes_moved();
  const seq_id from_host = w.gpu->import_pages(export_pages(*w.twin, w.t0).value()).value();
  const seq_id copy = w.gpu->import_pages(buf).value();
  CHECK(w.gpu->page_bytes_moved() > moved);
  REQUIRE(w.gpu->check_invariants().is_ok());
  CHECK(w.gpu->storage().length(from_host).value() == 150);
  for (seq_id s : {from_host, copy}) {
    CHECK(w.gpu->export_pages(s).value() == buf);
    for (std::int64_t j = 0; j < 10; ++j)
      for (int l = 0; l < layers; ++l)
        CHECK(w.gpu->storage().page(s, l, j)->format == w.gpu->storage().page(w.s0, l, j)->format);
  }
  // Decode reads the imports through the mirror's index arrays: bit-equal rows.
  const std::vector<seq_id> three{w.s0, from_host, copy};
  const auto d3 = decode_all(*w.gpu, three, q, 3);
  for (int l = 0; l < layers; ++l) {
    INFO("layer " << l);
    CHECK(same_bits(row_of(d3[std::size_t(l)], 1, 3), row_of(d3[std::size_t(l)], 0, 3)));
    CHECK(same_bits(row_of(d3[std::size_t(l)], 2, 3), row_of(d3[std::size_t(l)], 0, 3)));
  }

  // GPU -> another GPU cache: a one-sequence batch there decodes as the source's alone here.
  auto other = make_gpu(gpu_opts());
  const seq_id there = other->import_pages(buf).value();
  CHECK(other->export_pages(there).value() == buf);
  REQUIRE(other->check_invariants().is_ok());
  const auto here = decode_all(*w.gpu, {w.s0}, q, 4);
  const auto away = decode_all(*other, {there}, q, 1);
  for (int l = 0; l < layers; ++l) CHECK(same_bits(away[std::size_t(l)], here[std::size_t(l)]));

  // An import is an ordinary sequence: it grows, and decodes as its source grown alike.
  {
    const std::vector<seq_id> two{w.s0, from_host};
    REQUIRE(w.gpu->begin_step(two, std::vector<std::int32_t>{1, 1}).is_ok());
    const tokens next = random_tokens(rng, 1);
    for (int l = 0; l < layers; ++l) {
      const std::vector<float> k1 = layer_rows(next.k, 1, l, 0, 1),
                               v1 = layer_rows(next.v, 1, l, 0, 1);
      std::vector<float> k = k1, v = v1;  // the same token for both
      k.insert(k.end(), k1.begin(), k1.end());
      v.insert(v.end(), v1.begin(), v1.end());
      REQUIRE(w.gpu->append(l, k, v).is_ok());
      std::vector<float> qs = q[std::size_t(l)], out, lse;
      qs.insert(qs.end(), q[std::size_t(l)].begin(), q[std::size_t(l)].end());
      REQUIRE(w.gpu->decode(l, qs, out, lse).is_ok());
      out.insert(out.end(), lse.begin(), lse.end());
      INFO("grown, layer " << l);
      CHECK(same_bits(row_of(out, 1, 2), row_of(out, 0, 2)));
    }
    REQUIRE(w.gpu->device_error().is_ok());
    REQUIRE(w.gpu->end_step(5, true).has_value());
    CHECK(w.gpu->export_pages(from_host).value() == w.gpu->export_pages(w.s0).value());
  }

  // Everything given back: invariants, reconciled report, full pools.
  REQUIRE(w.gpu->check_invariants().is_ok());
  CHECK(w.gpu->report().reconciles());
  for (seq_id s : {w.s0, w.s1, from_host, copy}) REQUIRE(w.gpu->release(s).is_ok());
  REQUIRE(other->release(there).is_ok());
  for (xfer_cache* c : {w.gpu.get(), other.get()}) {
    REQUIRE(c->drain().is_ok());
    REQUIRE(c->check_invariants().is_ok());
    CHECK(c->storage().free_pages(0) == 90);
    CHECK(c->storage().free_pages(1) == 600);
    CHECK(c->storage().live_blocks() == 0);
  }
}

TEST_CASE("cuda::tiered_cache::import_pages refuses damaged or foreign buffers, changing nothing",
          "[cuda][cache][transfer]") {
  std::mt19937_64 rng(20261207);
  world w = make_world(rng);
  const bytes good = w.gpu->export_pages(w.s0).value();
  const cache_state before = state_of(*w.gpu);
  const auto refused = [&](const bytes& buf, errc code, const char* says) {
    import_refused(*w.gpu, buf, code, says);
    CHECK(state_of(*w.gpu) == before);  // after every refusal before it too
  };
  // A changed field, the checksum made right again, so that the check behind it is reached.
  const auto resealed = [&](std::size_t at, std::uint32_t value) {
    bytes b = good;
    std::memcpy(b.data() + at, &value, sizeof value);
    const std::uint64_t sum =
        detail::transfer_checksum(std::span<const std::uint8_t>(b).first(b.size() - 8));
    std::memcpy(b.data() + b.size() - 8, &sum, sizeof sum);
    return b;
  };
  constexpr std::size_t record0 = page_transfer_header_bytes + 2 * page_transfer_tier_entry_bytes;

  SECTION("corruption and truncation") {
    bytes flipped = good;
    flipped[flipped.size() / 2] ^= 0x40;
    refused(flipped, errc::corrupt_data, "checksum");
    refused(bytes(good.begin(), good.end() - 1), errc::corrupt_data, "truncated");
    refused(bytes(good.begin(), good.begin() + 40), errc::corrupt_data, "truncated");
    refused(bytes{}, errc::corrupt_data, "truncated");
    bytes longer = good;
    longer.push_back(0);
    refused(longer, errc::corrupt_data, "header says");
    bytes magic = good;
    magic[0] = 'X';
    refused(magic, errc::corrupt_data, "magic");
    refused(resealed(8, 1), errc::corrupt_data, "version 1");
    refused(resealed(record0 + 8, 5), errc::corrupt_data, "names tier 5");
    refused(resealed(record0 + 12, 0), errc::corrupt_data, "fill = 0");
    refused(resealed(record0, 1), errc::corrupt_data, "out of order");
  }
  SECTION("another geometry, tier list, layer count or codec seed") {
    const auto exported = [&](auto& storage) {
      using S = std::remove_reference_t<decltype(storage)>;
      const seq_id s = storage.create_sequence().value();
      const int L = storage.num_layers();
      const auto k = test_transfer::random_kv(rng, L, 20, S::kv_heads, S::head_dim);
      REQUIRE(storage.append(s, 20, k, k).is_ok());
      return export_pages(storage, s).value();
    };
    using wide = geometry<head_dim<128>, kv_heads<2>, group_size<2>, page_tokens<16>>;
    auto g128 = std::move(paged_storage<wide, TL, host_allocator>::create(pools()).value());
    refused(exported(*g128), errc::geometry_mismatch, "head_dim = 128");
    using e5m2 = tiers<tier<fp8_e4m3, fp8_e4m3>, tier<fp8_e5m2, fp8_e5m2>>;
    auto other_tiers = std::move(paged_storage<G, e5m2, host_allocator>::create(pools()).value());
    refused(exported(*other_tiers), errc::geometry_mismatch, "tier 1 formats");
    using three =
        tiers<tier<fp8_e4m3, fp8_e4m3>, tier<fp8_e5m2, fp8_e5m2>, tier<tq3_key, tq3_value>>;
    storage_options<3> o3;
    o3.num_layers = layers;
    o3.max_sequences = 2;
    o3.pages_per_tier = {30, 30, 30};
    o3.codec_seed = 91;
    auto three_tiers = std::move(paged_storage<G, three, host_allocator>::create(o3).value());
    refused(exported(*three_tiers), errc::geometry_mismatch, "num_tiers = 3");
    storage_options<2> two_layers = pools();
    two_layers.num_layers = 2;
    auto fewer = std::move(host_storage::create(two_layers).value());
    refused(exported(*fewer), errc::geometry_mismatch, "num_layers = 2");
    storage_options<2> seeded = pools();
    seeded.codec_seed = 92;
    auto reseeded = std::move(host_storage::create(seeded).value());
    refused(exported(*reseeded), errc::geometry_mismatch, "codec seed");
    // A slice of one KV head fits only a cache of one (the export counts its page bytes, so
    // `before` no longer holds; the head_base check is page_transfer_test's)
    import_refused(*w.gpu, w.gpu->export_pages(w.s0, 0, -1, {1, 1}).value(),
                   errc::geometry_mismatch, "kv_heads = 1");
  }
  SECTION("inside a step") {
    const std::vector<seq_id> batch{w.s1};
    REQUIRE(w.gpu->begin_step(batch, std::vector<std::int32_t>{0}).is_ok());
    auto r = w.gpu->import_pages(good);
    CHECK(r.code() == errc::invalid_argument);
    REQUIRE(w.gpu->end_step(3, true).has_value());
    CHECK(w.gpu->storage().live_sequences() == 2);
  }
}

TEST_CASE(
    "cuda::tiered_cache::import_pages on full pools: refused with nothing changed, or room made "
    "by demotion",
    "[cuda][cache][transfer]") {
  std::mt19937_64 rng(20261208);
  world w = make_world(rng);
  const bytes buf = w.gpu->export_pages(w.s0).value();
  const transfer_info info = inspect_transfer(buf).value();
  const import_need need = import_needs(info);
  const auto need0 = std::uint32_t(need.pages_per_tier[0]);
  const auto need1 = std::uint32_t(need.pages_per_tier[1]);
  REQUIRE(need1 > 0);
  const auto q = random_queries(rng);
  const auto source = decode_all(*w.gpu, {w.s0}, q, 3);

  const auto refused = [&](xfer_cache& c, errc code, const char* says) {
    CHECK(import_refused(c, buf, code, says).find("nothing imported") != std::string::npos);
  };
  const auto imported = [&](xfer_cache& c) {
    auto r = c.import_pages(buf);
    REQUIRE(r.has_value());
    CHECK(c.export_pages(*r).value() == buf);
    REQUIRE(c.check_invariants().is_ok());
    const auto d = decode_all(c, {*r}, q, 100);
    for (int l = 0; l < layers; ++l) CHECK(same_bits(d[std::size_t(l)], source[std::size_t(l)]));
  };

  SECTION("the Stale pool one page short, then exactly enough") {
    auto one_short = make_gpu(gpu_opts(pools(90, need1 - 1)));
    refused(*one_short, errc::capacity_exhausted, "tier 1 pool has");
    auto enough = make_gpu(gpu_opts(pools(90, need1)));
    imported(*enough);
  }
  SECTION("no sequence slot") {
    auto full = make_gpu(gpu_opts(pools(90, 600, 2)));
    REQUIRE(full->create_sequence().has_value());
    REQUIRE(full->create_sequence().has_value());
    refused(*full, errc::capacity_exhausted, "sequence slots");
  }
  SECTION("more pages than max_pages") {
    cuda_test::xfer_options o = gpu_opts();
    o.max_pages = 8;
    auto small = make_gpu(o);
    refused(*small, errc::out_of_range, "max_pages = 8");
  }
  SECTION("tier 0 short: room made by demoting a resident's pages, or refused before any") {
    // A resident of 10 sealed tier-0 pages leaves need0 - 3 free: make_room must demote 3.
    const tokens x = random_tokens(rng, 160);
    const auto with_resident = [&](std::uint32_t tier1, bool pinned) {
      auto c = make_gpu(gpu_opts(pools(30 + need0 - 3, tier1), keep_all()));
      const seq_id r = c->create_sequence().value();
      gpu_prefill(*c, r, x, 1);
      REQUIRE(c->storage().free_pages(0) == need0 - 3);
      REQUIRE(c->pin(r, 0, 10, pinned).is_ok());
      return c;
    };
    // every resident page pinned: nothing can be demoted
    auto pinned = with_resident(need1 + 3, true);
    refused(*pinned, errc::capacity_exhausted, "cannot free");
    CHECK(pinned->pressure_demoted() == 0);
    // the demotions would fit tier 0 but leave the import short: refused before demoting (the
    // block count, total pages / layers, says so first)
    auto tight = with_resident(need1 + 2, false);
    refused(*tight, errc::capacity_exhausted, "import: ");
    CHECK(tight->pressure_demoted() == 0);
    // room for the import once 3 pages are demoted
    auto roomy = with_resident(need1 + 3, false);
    imported(*roomy);
    CHECK(roomy->pressure_demoted() == 3);
  }
}

TEST_CASE(
    "cuda::tiered_cache::import_pages with centring: refused until the source's means are set, "
    "then decodes as the source",
    "[cuda][cache][transfer][centering]") {
  std::mt19937_64 rng(20261209);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<std::vector<float>> mu_k(layers, std::vector<float>(kv_vec)), mu_v = mu_k;
  for (int l = 0; l < layers; ++l)
    for (std::size_t i = 0; i < kv_vec; ++i) {
      mu_k[std::size_t(l)][i] = 3.f * g(rng);
      mu_v[std::size_t(l)][i] = g(rng);
    }
  cuda_test::xfer_options o = gpu_opts();
  o.center = true;
  auto src = make_gpu(o), dst = make_gpu(o);
  for (int l = 0; l < layers; ++l)
    REQUIRE(src->set_centering(l, mu_k[std::size_t(l)], mu_v[std::size_t(l)]).is_ok());
  const seq_id s = src->create_sequence().value();
  gpu_prefill(*src, s, random_tokens(rng, 150), 1);
  const bytes buf = src->export_pages(s).value();

  import_refused(*dst, buf, errc::invalid_argument, "centring means are not set");

  for (int l = 0; l < layers; ++l)
    REQUIRE(dst->set_centering(l, mu_k[std::size_t(l)], mu_v[std::size_t(l)]).is_ok());
  const seq_id d = dst->import_pages(buf).value();
  CHECK(dst->export_pages(d).value() == buf);
  const auto q = random_queries(rng);
  const auto a = decode_all(*src, {s}, q, 2);
  const auto b = decode_all(*dst, {d}, q, 1);
  for (int l = 0; l < layers; ++l) CHECK(same_bits(b[std::size_t(l)], a[std::size_t(l)]));
  // means can no longer change under the imported pages
  CHECK(dst->set_centering(0, mu_k[0], mu_v[0]).code() == errc::invalid_argument);
}

// ---- the host tier: offload / restore (cuda/cache/host_tier.cuh) --------------------------------

TEST_CASE(
    "cuda::tiered_cache host tier: offload and restore keep every page byte for byte, decode "
    "bit for bit, and give the host memory back",
    "[cuda][cache][host_tier]") {
  const bool engines = GENERATE(false, true);
  const int chunk = GENERATE(8192, 5);  // one launch, or one every two logical pages (3 layers)
  INFO((engines ? "copy engines" : "copy kernel") << ", restore chunk " << chunk);
  std::mt19937_64 rng(20261209);
  cuda_test::xfer_options o = gpu_opts();
  o.host_pool_bytes = 1 << 20;
  o.copy_engines = engines;
  o.restore_chunk = chunk;
  world w = make_world(rng, o);
  const bytes buf0 = w.gpu->export_pages(w.s0).value(), buf1 = w.gpu->export_pages(w.s1).value();
  const auto q = random_queries(rng);
  const auto d0 = decode_all(*w.gpu, {w.s0}, q, 3);
  const auto d1 = decode_all(*w.gpu, {w.s1}, q, 4);
  CHECK(w.gpu->host_tier().capacity == 1 << 20);

  // A fork shares s0's sealed pages: they stay on the GPU for it while s0 is parked.
  const seq_id f = w.gpu->fork(w.s0).value();
  seq_id s0 = w.s0;
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    const std::uint64_t moved = w.gpu->page_bytes_moved();
    const auto id = w.gpu->offload(s0).value();
    CHECK(w.gpu->page_bytes_moved() > moved);
    CHECK(w.gpu->parked_length(id).value() == 150);
    CHECK(w.gpu->export_pages(s0).code() == errc::stale_id);  // released on the GPU
    const auto parked = w.gpu->host_tier();
    CHECK(parked.parked == 1);
    CHECK(parked.offloads == std::uint64_t(round + 1));
    CHECK(parked.used >= parked.bytes_offloaded / std::uint64_t(round + 1));
    CHECK(w.gpu->storage().live_sequences() == 2);  // s1 and the fork
    REQUIRE(w.gpu->check_invariants().is_ok());
    // the fork reads the shared pages as before
    CHECK(w.gpu->export_pages(f).value() == buf0);

    s0 = w.gpu->restore(id).value();
    CHECK(w.gpu->parked_length(id).code() == errc::stale_id);
    CHECK(w.gpu->restore(id).code() == errc::stale_id);
    REQUIRE(w.gpu->check_invariants().is_ok());
    CHECK(w.gpu->storage().length(s0).value() == 150);
    CHECK(w.gpu->export_pages(s0).value() == buf0);
    const auto d = decode_all(*w.gpu, {s0}, q, 10 + std::uint64_t(round));
    for (int l = 0; l < layers; ++l) CHECK(same_bits(d[std::size_t(l)], d0[std::size_t(l)]));
    const auto after = w.gpu->host_tier();
    CHECK(after.parked == 0);
    CHECK(after.restores == std::uint64_t(round + 1));
    CHECK(after.bytes_restored == after.bytes_offloaded);
  }
  // both at once, then the one restored first; the restored sequence grows like any other
  const auto id1 = w.gpu->offload(w.s1).value();
  const auto id0 = w.gpu->offload(s0).value();
  CHECK(w.gpu->host_tier().parked == 2);
  const seq_id r1 = w.gpu->restore(id1).value();
  const seq_id r0 = w.gpu->restore(id0).value();
  CHECK(w.gpu->export_pages(r1).value() == buf1);
  CHECK(w.gpu->export_pages(r0).value() == buf0);
  const auto d01 = decode_all(*w.gpu, {r0, r1}, q, 20);
  for (int l = 0; l < layers; ++l) {
    CHECK(same_bits(row_of(d01[std::size_t(l)], 0, 2), d0[std::size_t(l)]));
    CHECK(same_bits(row_of(d01[std::size_t(l)], 1, 2), d1[std::size_t(l)]));
  }
  const tokens next = random_tokens(rng, 20);
  gpu_prefill(*w.gpu, r0, next, 21);
  CHECK(w.gpu->storage().length(r0).value() == 170);

  // everything back: the pools as before the fork's and the restores' pages are released
  for (seq_id s : {r0, r1, f}) REQUIRE(w.gpu->release(s).is_ok());
  REQUIRE(w.gpu->drain().is_ok());
  REQUIRE(w.gpu->check_invariants().is_ok());
  CHECK(w.gpu->storage().free_pages(0) == 90);
  CHECK(w.gpu->storage().free_pages(1) == 600);
  (void)w.gpu->pool_bytes(0);  // synchronizes the streams: every copy has run
  const auto end = w.gpu->host_tier();
  CHECK(end.used == 0);
  CHECK(end.largest_free == end.capacity);
}

TEST_CASE(
    "cuda::tiered_cache host tier: refusals leave the cache and the parked sequence as they were",
    "[cuda][cache][host_tier]") {
  std::mt19937_64 rng(20261210);
  SECTION("no host tier, a host pool too small, bad handles, inside a step") {
    world none = make_world(rng);  // host_pool_bytes = 0
    const cache_state before = state_of(*none.gpu);
    auto r = none.gpu->offload(none.s0);
    CHECK(r.code() == errc::capacity_exhausted);
    CHECK(r.error_status().message().find("host_pool_bytes = 0") != std::string::npos);
    CHECK(state_of(*none.gpu) == before);

    cuda_test::xfer_options o = gpu_opts();
    o.host_pool_bytes = 16 << 10;  // less than s0's 30 pages (~77 KB)
    world w = make_world(rng, o);
    const bytes buf0 = w.gpu->export_pages(w.s0).value();
    const cache_state kept = state_of(*w.gpu);
    auto small = w.gpu->offload(w.s0);
    REQUIRE_FALSE(small.has_value());
    CHECK(small.code() == errc::capacity_exhausted);
    CHECK(small.error_status().message().find("bytes of the host pool") != std::string::npos);
    CHECK(small.error_status().message().find("nothing moved") != std::string::npos);
    CHECK(state_of(*w.gpu) == kept);
    CHECK(w.gpu->export_pages(w.s0).value() == buf0);
    CHECK(w.gpu->host_tier().used == 0);

    CHECK(w.gpu->restore(12345).code() == errc::stale_id);
    CHECK(w.gpu->drop_parked(12345).code() == errc::stale_id);
    CHECK(w.gpu->offload(seq_id{}).code() == errc::out_of_range);
    const std::vector<seq_id> batch{w.s0};
    REQUIRE(w.gpu->begin_step(batch, std::vector<std::int32_t>{0}).is_ok());
    CHECK(w.gpu->offload(w.s0).code() == errc::invalid_argument);
    CHECK(w.gpu->restore(1).code() == errc::invalid_argument);
    REQUIRE(w.gpu->end_step(3, true).has_value());
    CHECK(w.gpu->host_tier().offloads == 0);
  }
  SECTION(
      "restore into full pools: refused, the sequence stays parked; restored once room is made") {
    cuda_test::xfer_options o = gpu_opts();
    o.host_pool_bytes = 1 << 20;
    world w = make_world(rng, o);
    const bytes buf0 = w.gpu->export_pages(w.s0).value();
    const auto q = random_queries(rng);
    const auto d0 = decode_all(*w.gpu, {w.s0}, q, 3);
    const auto id = w.gpu->offload(w.s0).value();
    // Copies of s0 until the pools refuse one more: a restore needs what an import of its
    // export needs, so it is refused too.
    std::vector<seq_id> copies;
    for (;;) {
      auto c = w.gpu->import_pages(buf0);
      if (!c) {
        CHECK(c.code() == errc::capacity_exhausted);
        break;
      }
      copies.push_back(*c);
      REQUIRE(copies.size() < 100);
    }
    REQUIRE_FALSE(copies.empty());
    const cache_state before = state_of(*w.gpu);
    const auto host_before = w.gpu->host_tier();
    auto r = w.gpu->restore(id);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.code() == errc::capacity_exhausted);
    const std::string m = r.error_status().message();
    INFO(m);
    CHECK(m.find("restore: ") == 0);
    CHECK(m.find("nothing restored") != std::string::npos);
    CHECK(state_of(*w.gpu) == before);
    CHECK(w.gpu->host_tier() == host_before);
    CHECK(w.gpu->parked_length(id).value() == 150);
    REQUIRE(w.gpu->check_invariants().is_ok());

    REQUIRE(w.gpu->release(copies.back()).is_ok());
    REQUIRE(w.gpu->drain().is_ok());
    const seq_id back = w.gpu->restore(id).value();
    CHECK(w.gpu->export_pages(back).value() == buf0);
    const auto d = decode_all(*w.gpu, {back}, q, 4);
    for (int l = 0; l < layers; ++l) CHECK(same_bits(d[std::size_t(l)], d0[std::size_t(l)]));
    REQUIRE(w.gpu->check_invariants().is_ok());
  }
  SECTION("drop gives the host memory back") {
    cuda_test::xfer_options o = gpu_opts();
    o.host_pool_bytes = 1 << 20;
    world w = make_world(rng, o);
    const auto id = w.gpu->offload(w.s0).value();
    CHECK(w.gpu->host_tier().used > 0);
    REQUIRE(w.gpu->drop_parked(id).is_ok());
    CHECK(w.gpu->drop_parked(id).code() == errc::stale_id);
    CHECK(w.gpu->restore(id).code() == errc::stale_id);
    (void)w.gpu->pool_bytes(0);  // the offload copy has run
    const auto h = w.gpu->host_tier();
    CHECK(h.used == 0);
    CHECK(h.parked == 0);
    CHECK(h.drops == 1);
    REQUIRE(w.gpu->check_invariants().is_ok());
  }
}

namespace {
// A world with a 1 MiB host tier whose restores copy s0's 30 pages in several launches.
world chunked_host_world(std::mt19937_64& rng, bool copy_engines) {
  cuda_test::xfer_options o = gpu_opts();
  o.host_pool_bytes = 1 << 20;
  o.copy_engines = copy_engines;
  o.restore_chunk = 5;
  return make_world(rng, o);
}
}  // namespace

TEST_CASE(
    "cuda::tiered_cache host tier: a copy launch that fails (fault injected) at any chunk loses "
    "no page and changes nothing",
    "[cuda][cache][host_tier]") {
  const bool engines = GENERATE(false, true);
  INFO((engines ? "copy engines" : "copy kernel"));
  std::mt19937_64 rng(20261211);
  world w = chunked_host_world(rng, engines);
  const bytes buf0 = w.gpu->export_pages(w.s0).value(), buf1 = w.gpu->export_pages(w.s1).value();
  const auto q = random_queries(rng);
  const auto d0 = decode_all(*w.gpu, {w.s0}, q, 3);
  cuda_test::xfer_faults& faults = w.gpu->faults();
  // What a failed call must leave as it was. Not the pools' free pages' bytes: a restore's
  // chunks queued before the failing one have written pages its rollback gave back.
  const auto live_state = [&] {
    cache_state s = state_of(*w.gpu);
    s.pool0.clear();
    s.pool1.clear();
    return s;
  };

  // The offload's launch fails: s0 stays live, byte for byte.
  faults = {tierkv::transfer_step::offload_copy, 0};
  {
    const cache_state before = state_of(*w.gpu);
    const auto host_before = w.gpu->host_tier();
    auto r = w.gpu->offload(w.s0);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.code() == errc::injected_fault);
    INFO(r.error_status().message());
    CHECK(r.error_status().message().find("nothing moved") != std::string::npos);
    CHECK(faults.calls == 1);
    CHECK(state_of(*w.gpu) == before);
    CHECK(w.gpu->host_tier() == host_before);
    CHECK(w.gpu->export_pages(w.s0).value() == buf0);
    REQUIRE(w.gpu->check_invariants().is_ok());
  }

  // A restore that succeeds counts its launches.
  faults = {tierkv::transfer_step::restore_copy, -1};
  seq_id s0 = w.gpu->restore(w.gpu->offload(w.s0).value()).value();
  const std::int64_t launches = faults.calls;
  CHECK(launches >= 3);  // 30 pages in chunks of >= 5, flushed at logical page boundaries
  CHECK(w.gpu->export_pages(s0).value() == buf0);

  // Each launch fails in turn: the restore is refused, s0 stays parked, nothing else changes.
  const auto id = w.gpu->offload(s0).value();
  for (std::int64_t k = 0; k < launches; ++k) {
    INFO("launch " << k << " of " << launches << " fails");
    faults = {tierkv::transfer_step::restore_copy, k};
    const cache_state before = live_state();
    const auto host_before = w.gpu->host_tier();
    auto r = w.gpu->restore(id);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.code() == errc::injected_fault);
    const std::string m = r.error_status().message();
    INFO(m);
    CHECK(m.find("restore: ") == 0);
    CHECK(m.find("stays parked") != std::string::npos);
    CHECK(live_state() == before);
    CHECK(w.gpu->host_tier() == host_before);
    CHECK(w.gpu->parked_length(id).value() == 150);
    CHECK(w.gpu->export_pages(w.s1).value() == buf1);
    REQUIRE(w.gpu->check_invariants().is_ok());
    REQUIRE(w.gpu->device_error().is_ok());
  }
  faults = {};
  s0 = w.gpu->restore(id).value();
  CHECK(w.gpu->export_pages(s0).value() == buf0);
  const auto d = decode_all(*w.gpu, {s0}, q, 4);
  for (int l = 0; l < layers; ++l) CHECK(same_bits(d[std::size_t(l)], d0[std::size_t(l)]));
  REQUIRE(w.gpu->check_invariants().is_ok());
  (void)w.gpu->pool_bytes(0);  // every copy has run
  CHECK(w.gpu->host_tier().used == 0);
}

TEST_CASE(
    "cuda::tiered_cache host tier: a restore's copy overlaps other sequences' steps, and the "
    "first work on the restored sequence waits for it",
    "[cuda][cache][host_tier]") {
  const bool engines = GENERATE(false, true);
  INFO((engines ? "copy engines" : "copy kernel"));
  std::mt19937_64 rng(20261212);
  world w = chunked_host_world(rng, engines);
  const bytes buf0 = w.gpu->export_pages(w.s0).value(), buf1 = w.gpu->export_pages(w.s1).value();
  const auto q = random_queries(rng);
  const auto d0 = decode_all(*w.gpu, {w.s0}, q, 3);
  const auto d1 = decode_all(*w.gpu, {w.s1}, q, 4);

  SECTION("steps of another sequence, then the restored one's") {
    const seq_id r0 = w.gpu->restore(w.gpu->offload(w.s0).value()).value();
    const auto e1 = decode_all(*w.gpu, {w.s1}, q, 5);  // enqueued while the copy may run
    for (int l = 0; l < layers; ++l) CHECK(same_bits(e1[std::size_t(l)], d1[std::size_t(l)]));
    const auto e0 = decode_all(*w.gpu, {r0, w.s1}, q, 6);
    for (int l = 0; l < layers; ++l) {
      CHECK(same_bits(row_of(e0[std::size_t(l)], 0, 2), d0[std::size_t(l)]));
      CHECK(same_bits(row_of(e0[std::size_t(l)], 1, 2), d1[std::size_t(l)]));
    }
    CHECK_FALSE(w.gpu->restore_pending(r0));  // the step waited for it
    REQUIRE(w.gpu->check_invariants().is_ok());
  }
  SECTION("fork, export, offload and release right after the restore") {
    seq_id r0 = w.gpu->restore(w.gpu->offload(w.s0).value()).value();
    const seq_id f = w.gpu->fork(r0).value();
    CHECK_FALSE(w.gpu->restore_pending(r0));
    CHECK(w.gpu->export_pages(f).value() == buf0);
    CHECK(w.gpu->export_pages(r0).value() == buf0);
    r0 = w.gpu->restore(w.gpu->offload(r0).value()).value();
    const auto id = w.gpu->offload(r0).value();  // reads the pages the restore writes
    r0 = w.gpu->restore(id).value();
    CHECK(w.gpu->export_pages(r0).value() == buf0);
    // Released while its copy may run: pages reused at once (an import) hold what it wrote.
    const seq_id r1 = w.gpu->restore(w.gpu->offload(w.s1).value()).value();
    REQUIRE(w.gpu->release(r1).is_ok());
    REQUIRE(w.gpu->release(f).is_ok());
    const seq_id i0 = w.gpu->import_pages(buf0).value();
    const seq_id i1 = w.gpu->import_pages(buf1).value();
    CHECK(w.gpu->export_pages(i0).value() == buf0);
    CHECK(w.gpu->export_pages(i1).value() == buf1);
    const auto e = decode_all(*w.gpu, {r0}, q, 7);
    for (int l = 0; l < layers; ++l) CHECK(same_bits(e[std::size_t(l)], d0[std::size_t(l)]));
    REQUIRE(w.gpu->check_invariants().is_ok());
    REQUIRE(w.gpu->device_error().is_ok());
  }
}
