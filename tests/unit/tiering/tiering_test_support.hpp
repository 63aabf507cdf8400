// SPDX-License-Identifier: Apache-2.0
// Shared by the tiering tests: a tiny geometry over FP8 and TQ3 tiers, seeded Gaussian
// token contents, a float64 error check against the original vectors, and a fault hook.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "tierkv/codec/error_traits.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/formats.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/paging/prefix_index.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace tiering_test {

using namespace tierkv;

// head_dim 64 is the smallest TQ3 supports with 8-byte payloads; one KV head and
// 16-token pages keep the long randomized runs fast.
using tiny = geometry<head_dim<64>, kv_heads<1>, group_size<2>, page_tokens<16>>;
using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using tq3_tier = tier<tq3_key, tq3_value>;
using two_tiers = tiers<fp8_tier, tq3_tier>;
// Recent in tier 0, Anchor in tier 1 (the same FP8 codecs: moves are byte copies), Stale TQ3.
using three_tiers = tiers<fp8_tier, fp8_tier, tq3_tier>;
using storage2 = paged_storage<tiny, two_tiers, host_allocator, failing_allocator>;
using storage3 = paged_storage<tiny, three_tiers, host_allocator, failing_allocator>;
using roles3 = tier_roles<three_tiers, 0, 1, 2>;
// A Cold tier (issue 52): tier 0 FP8 (Recent, Anchor), tier 1 TQ3 (Stale), tier 2 TQ2 (Cold).
using tq2_tier = tier<tq2_key, tq2_value>;
using cold_tiers = tiers<fp8_tier, tq3_tier, tq2_tier>;
using cold_roles = tier_roles<cold_tiers, 0, 0, 1, 2>;
using storage_c = paged_storage<tiny, cold_tiers, host_allocator, failing_allocator>;
using controller_c = tier_controller<storage_c, policy::recency_anchor, cold_roles>;

// Relative MSE bounds per vector: FP8 E4M3 errs by at most 2^-4 relative per element
// in its normal range, so |x - x^|^2 / |x|^2 <= 2^-8; TQ3 per page (32 vectors) stays
// within twice its expected 0.0348 (codec_error_traits), each vector within 0.25.
inline constexpr double fp8_vector_bound = 1.0 / 256.0;
inline constexpr double tq3_page_bound = 2.0 * codec_error_traits<tq3_key>::rel_mse;
inline constexpr double tq3_vector_bound = 0.25;

// Approximately N(0, 1) scalar d of (token seed, layer, head, role): the sum of four
// uniforms from one splitmix64 hash (Irwin-Hall, variance 1). Cheap, because the long
// runs recompute originals for every content check; TQ3's rotation makes the codec see
// near-Gaussian coordinates either way.
inline float gauss(std::uint64_t seed, int layer, int head, int role, int d) {
  const std::uint64_t k =
      mix64(seed * 0x9E3779B97F4A7C15ull ^ (std::uint64_t(layer) << 40 | std::uint64_t(head) << 24 |
                                            std::uint64_t(role) << 16 | std::uint64_t(d)));
  const float sum =
      float(k & 0xFFFF) + float((k >> 16) & 0xFFFF) + float((k >> 32) & 0xFFFF) + float(k >> 48);
  return (sum / 65536.0f - 2.0f) * 1.7320508f;
}

inline std::vector<std::uint64_t> seeds_from(std::uint64_t base, int n) {
  std::vector<std::uint64_t> s(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = base + i;
  return s;
}

// keys / values of the given tokens, laid out [layer][token][head][dim].
template <class Storage>
void make_kv(int layers, const std::vector<std::uint64_t>& seeds, std::vector<float>& keys,
             std::vector<float>& values) {
  constexpr int H = Storage::kv_heads, D = Storage::head_dim;
  keys.resize(std::size_t(layers) * seeds.size() * H * D);
  values.resize(keys.size());
  std::size_t i = 0;
  for (int l = 0; l < layers; ++l)
    for (std::uint64_t s : seeds)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d, ++i) {
          keys[i] = gauss(s, l, h, 0, d);
          values[i] = gauss(s, l, h, 1, d);
        }
}

template <class Storage>
status append_seeds(Storage& s, seq_id seq, const std::vector<std::uint64_t>& seeds) {
  std::vector<float> k, v;
  make_kv<Storage>(s.num_layers(), seeds, k, v);
  return s.append(seq, std::int64_t(seeds.size()), k, v);
}

// Relative squared error of one decoded vector against the original.
inline double rel_err(const float* got, std::uint64_t seed, int layer, int head, int role,
                      int dim) {
  double num = 0, den = 0;
  for (int d = 0; d < dim; ++d) {
    const double x = gauss(seed, layer, head, role, d);
    num += (double(got[d]) - x) * (double(got[d]) - x);
    den += x * x;
  }
  return den > 0 ? num / den : num;
}

// Error of one logical page of seq at one layer against the originals: max and mean
// over its vectors (keys and values). tokens: the token seeds of the sequence.
struct page_error {
  double max = 0, mean = 0;
  bool finite = true;
};
template <class Storage>
page_error page_error_of(const Storage& s, seq_id seq, int layer, std::int64_t logical,
                         const std::vector<std::uint64_t>& tokens) {
  constexpr int D = Storage::head_dim, T = Storage::page_tokens;
  page_error e;
  int n = 0;
  float k[D], v[D];
  for (std::int64_t t = logical * T;
       t < std::min<std::int64_t>((logical + 1) * T, std::int64_t(tokens.size())); ++t)
    for (int h = 0; h < Storage::kv_heads; ++h) {
      if (!s.read_token(seq, layer, t, h, k, v)) return page_error{1e9, 1e9, false};
      for (int d = 0; d < D; ++d) e.finite = e.finite && std::isfinite(k[d]) && std::isfinite(v[d]);
      const double ek = rel_err(k, tokens[std::size_t(t)], layer, h, 0, D);
      const double ev = rel_err(v, tokens[std::size_t(t)], layer, h, 1, D);
      e.max = std::max({e.max, ek, ev});
      e.mean += ek + ev;
      n += 2;
    }
  if (n) e.mean /= n;
  return e;
}

// Fails the k-th hook call (1-based; 0 = never) and counts.
struct fault_injector {
  std::uint64_t calls = 0;
  std::uint64_t fail_at = 0;
  std::uint64_t injected = 0;
  errc operator()(conversion_step, block_ref, int) {
    ++calls;
    if (fail_at != 0 && calls == fail_at) {
      ++injected;
      return errc::injected_fault;
    }
    return errc::ok;
  }
};

// Byte copy of a page (to compare before / after).
template <class Storage>
std::vector<std::uint8_t> bytes_of(Storage& s, page_id p) {
  auto b = s.page_bytes(p);
  if (!b) return {};
  return std::vector<std::uint8_t>(b->begin(), b->end());
}

// Everything observable about a tiered_cache, as text: equal before and after a refused
// operation (the contract and reserve tests).
template <class Cache>
std::string cache_snapshot(Cache& c) {
  std::ostringstream o;
  o << c.report() << '\n';
  const auto& s = c.storage();
  s.for_each_sequence([&](seq_id q, std::int64_t len) {
    o << q << " length " << len << " reserved " << *s.reserved(q) << ':';
    for (int l = 0; l < s.num_layers(); ++l)
      s.for_each_page(q, l, [&](std::int64_t, page_id p) { o << ' ' << p; });
    o << '\n';
  });
  s.for_each_block([&](block_ref b, int fill, std::uint32_t refs) {
    o << "block " << b.index << '@' << b.generation << " fill " << fill << " refs " << refs << '\n';
  });
  for (int t = 0; t < Cache::num_tiers; ++t)
    o << "tier " << t << " free " << s.free_pages(t) << '\n';
  const retier_stats& tot = c.controller().totals();
  o << "converted " << tot.converted << " pressure_demoted " << tot.pressure_demoted << " failed "
    << tot.failed << " shadows " << c.controller().shadow_pages() << '\n';
  return o.str();
}

// Appends n tokens (seeds first, first + 1, ...) to every layer of s.
template <class Cache>
status append_tokens(Cache& c, seq_id s, std::uint64_t first, int n) {
  std::vector<float> k, v;
  make_kv<typename Cache::storage_type>(c.storage().num_layers(), seeds_from(first, n), k, v);
  return c.append(s, n, k, v);
}

// float64 decode (tiny geometry) of one query row set against token vectors given by
// fetch(t, kv_head, k, v): out [q_heads][head_dim], page_mass per 16-token page.
template <class Fetch>
inline void reference_attend(const float* q, std::int64_t len, Fetch fetch,
                             std::vector<double>& out, std::vector<double>& page_mass) {
  constexpr int D = tiny::head_dim, QH = tiny::q_heads, G = tiny::group_size;
  const double scale = 1.0 / std::sqrt(double(D));
  out.assign(std::size_t(QH) * D, 0.0);
  page_mass.assign(std::size_t((len + 15) / 16), 0.0);
  std::vector<float> k(D), v(D);
  for (int h = 0; h < QH; ++h) {
    std::vector<double> logit(static_cast<std::size_t>(len));
    double mx = -1e300;
    for (std::int64_t t = 0; t < len; ++t) {
      fetch(t, h / G, k.data(), v.data());
      double s = 0;
      for (int d = 0; d < D; ++d) s += double(q[h * D + d]) * k[std::size_t(d)];
      logit[std::size_t(t)] = s * scale;
      mx = std::max(mx, logit[std::size_t(t)]);
    }
    double sum = 0;
    for (auto& l : logit) sum += (l = std::exp(l - mx));
    for (std::int64_t t = 0; t < len; ++t) {
      fetch(t, h / G, k.data(), v.data());
      const double p = logit[std::size_t(t)] / sum;
      page_mass[std::size_t(t / 16)] += p / QH;
      for (int d = 0; d < D; ++d) out[std::size_t(h * D + d)] += p * v[std::size_t(d)];
    }
  }
}

inline double rel_l2(const float* got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace tiering_test
