// SPDX-License-Identifier: Apache-2.0
// A batch of paged sequences for the GPU attention tests (decode, prefill): pages of a Recent and
// a Stale tier encoded on the host in a chosen mix, their CSR index, the decoded vectors (the
// float64 references' inputs), and its device copy. Catch2 (REQUIRE): for the tests' .cpp files.
#pragma once

#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "cuda_test.hpp"
#include "test_shapes.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/index_view.hpp"

namespace cuda_test {

using namespace tierkv;

enum class mix { all_fp8, all_tq3, tiered, interleaved };

// A batch on the host: pages of both tiers, the CSR index, and the raw vectors.
template <class G, class Recent = decode_recent, class Stale = decode_stale>
struct host_batch {
  static constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens;
  using KF = typename Recent::template key_codec<D>;
  using KT = typename Stale::template key_codec<D>;
  using VT = typename Stale::template value_codec<D>;
  using L8 = page_layout<G, KF, KF>;
  using L3 = page_layout<G, KT, VT>;

  std::uint64_t seed = 0x5eed;
  int layer = 3;
  int head_base =
      0;  // global index of KV head 0 (a tensor-parallel rank): contexts use head_base + h
  std::vector<std::int32_t> seq_len;
  std::vector<std::uint8_t> pool[2];
  std::vector<std::int32_t> indptr[2], slot[2], logical[2];
  std::vector<float> q;                         // [batch][q_heads][D]
  std::vector<std::vector<double>> kdec, vdec;  // [b] -> [token][head][D] decoded vectors
  int pages_cap[2] = {0, 0};

  int batch() const { return int(seq_len.size()); }

  // Which tier logical page i of a sequence with n pages lives in.
  static int tier_of(mix m, int i, int n) {
    switch (m) {
      case mix::all_fp8:
        return 0;
      case mix::all_tq3:
        return 1;
      case mix::interleaved:
        return i % 2;
      case mix::tiered: {
        const int recent_pages = (n * 27 + 99) / 100 - 1;  // ~27% FP8: anchor page 0 + recent
        return (i == 0 || i >= n - (recent_pages > 0 ? recent_pages : 0)) ? 0 : 1;
      }
    }
    return 0;
  }

  // value_spread: each value vector scaled by 2^k, k uniform in [-value_spread, value_spread]
  // (per-token scales far beyond f16 range); q_scale multiplies the queries.
  void build(const std::vector<int>& lens, mix m, std::mt19937_64& rng, float key_offset = 0.f,
             int value_spread = 0, float q_scale = 1.f) {
    seq_len.assign(lens.begin(), lens.end());
    const int B = batch();
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int f = 0; f < 2; ++f) {
      indptr[f].assign(1, 0);
      slot[f].clear();
      logical[f].clear();
    }
    // Physical slots are shuffled so logical order != physical order.
    std::vector<std::pair<int, int>> order[2];  // (b, logical) per tier
    for (int b = 0; b < B; ++b) {
      const int n = (lens[b] + T - 1) / T;
      for (int i = 0; i < n; ++i) order[tier_of(m, i, n)].push_back({b, i});
      for (int f = 0; f < 2; ++f) indptr[f].push_back(int(order[f].size()));
    }
    std::vector<int> phys[2];
    for (int f = 0; f < 2; ++f) {
      const int cap = int(order[f].size()) + 3;  // spare never-referenced pages
      pages_cap[f] = cap;
      phys[f].resize(cap);
      for (int i = 0; i < cap; ++i) phys[f][i] = i;
      std::shuffle(phys[f].begin(), phys[f].end(), rng);
      const std::size_t pb = f == 0 ? L8::page_bytes : L3::page_bytes;
      pool[f].assign(pb * std::size_t(cap), 0xFF);  // poison: FP8 0xFF and bf16 0xFFFF are NaN
      for (std::size_t e = 0; e < order[f].size(); ++e) {
        slot[f].push_back(phys[f][e]);
        logical[f].push_back(order[f][e].second);
      }
    }
    kdec.assign(B, {});
    vdec.assign(B, {});
    q.resize(std::size_t(B) * G::q_heads * D);
    for (auto& x : q) x = nd(rng) * q_scale;
    std::uniform_int_distribution<int> spread(-value_spread, value_spread);
    std::vector<float> kv(D);
    for (int b = 0; b < B; ++b) {
      kdec[b].assign(std::size_t(lens[b]) * H * D, 0.0);
      vdec[b].assign(std::size_t(lens[b]) * H * D, 0.0);
      const int n = (lens[b] + T - 1) / T;
      for (int i = 0; i < n; ++i) {
        const int f = tier_of(m, i, n);
        int e = indptr[f][b];
        while (logical[f][e] != i) ++e;
        std::uint8_t* page =
            pool[f].data() + std::size_t(slot[f][e]) * (f == 0 ? L8::page_bytes : L3::page_bytes);
        for (int t = 0; t < T && i * T + t < lens[b]; ++t) {
          const int tok = i * T + t;
          for (int h = 0; h < H; ++h) {
            const codec_context kc = make_codec_context(seed, layer, head_base + h, kv_role::key);
            const codec_context vc = make_codec_context(seed, layer, head_base + h, kv_role::value);
            std::vector<float> dec(D);
            for (int role = 0; role < 2; ++role) {
              for (int d = 0; d < D; ++d)
                kv[d] = nd(rng) + (role == 0 && d % 17 == 0 ? key_offset : 0.f);
              if (role == 1 && value_spread > 0) {
                const float f2 = std::ldexp(1.f, spread(rng));
                for (int d = 0; d < D; ++d) kv[d] *= f2;
              }
              if (f == 0) {
                auto& meta = *reinterpret_cast<typename KF::meta_type*>(
                    page + (role == 0 ? L8::key_meta(h, t) : L8::value_meta(h, t)));
                std::uint8_t* pay =
                    page + (role == 0 ? L8::key_payload(h, t) : L8::value_payload(h, t));
                REQUIRE(KF::encode(kv.data(), pay, meta, role == 0 ? kc : vc, nullptr) == errc::ok);
                KF::decode(pay, meta, dec.data(), role == 0 ? kc : vc);
              } else if (role == 0) {
                auto& meta = *reinterpret_cast<typename KT::meta_type*>(page + L3::key_meta(h, t));
                std::uint8_t* pay = page + L3::key_payload(h, t);
                REQUIRE(KT::encode(kv.data(), pay, meta, kc, nullptr) == errc::ok);
                KT::decode(pay, meta, dec.data(), kc);
              } else {
                auto& meta =
                    *reinterpret_cast<typename VT::meta_type*>(page + L3::value_meta(h, t));
                std::uint8_t* pay = page + L3::value_payload(h, t);
                REQUIRE(VT::encode(kv.data(), pay, meta, vc, nullptr) == errc::ok);
                VT::decode(pay, meta, dec.data(), vc);
              }
              auto& dst = role == 0 ? kdec[b] : vdec[b];
              for (int d = 0; d < D; ++d) dst[(std::size_t(tok) * H + h) * D + d] = dec[d];
            }
          }
        }
      }
    }
  }

  // float64 reference on the decoded vectors: out [b][qh][D], lse natural, page mass.
  void reference(double scale, std::vector<double>& out, std::vector<double>& lse,
                 std::vector<double>& mass, int mass_stride) const {
    const int B = batch(), QH = G::q_heads;
    out.assign(std::size_t(B) * QH * D, 0.0);
    lse.assign(std::size_t(B) * QH, -std::numeric_limits<double>::infinity());
    mass.assign(std::size_t(B) * mass_stride, 0.0);
    for (int b = 0; b < B; ++b) {
      const int n = seq_len[b];
      for (int qh = 0; qh < QH; ++qh) {
        const int h = qh / G::group_size;
        std::vector<double> s(n);
        double mx = -INFINITY;
        for (int t = 0; t < n; ++t) {
          double dot = 0;
          for (int d = 0; d < D; ++d)
            dot += double(q[(std::size_t(b) * QH + qh) * D + d]) *
                   kdec[b][(std::size_t(t) * H + h) * D + d];
          s[t] = dot * scale;
          mx = std::max(mx, s[t]);
        }
        if (n == 0) continue;
        double l = 0;
        for (int t = 0; t < n; ++t) l += std::exp(s[t] - mx);
        for (int t = 0; t < n; ++t) {
          const double p = std::exp(s[t] - mx) / l;
          mass[std::size_t(b) * mass_stride + t / T] += p / QH;
          for (int d = 0; d < D; ++d)
            out[(std::size_t(b) * QH + qh) * D + d] +=
                p * vdec[b][(std::size_t(t) * H + h) * D + d];
        }
        lse[std::size_t(b) * QH + qh] = mx + std::log(l);
      }
    }
  }
};

inline double rel_l2(const std::vector<float>& a, const std::vector<double>& ref, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The pools and the index of a host batch in device memory (index arrays sized for
// `cap_entries`, so a graph can replay other batches in the same buffers).
template <class G, class Recent = decode_recent, class Stale = decode_stale>
struct device_pages {
  using batch_t = host_batch<G, Recent, Stale>;
  device_buffer<std::uint8_t> pool0, pool1;
  device_buffer<std::int32_t> seq_len, indptr0, indptr1, slot0, slot1, logical0, logical1;
  device_pages(std::size_t pool0_bytes, std::size_t pool1_bytes, int max_batch, int cap_entries)
      : pool0(pool0_bytes),
        pool1(pool1_bytes),
        seq_len(max_batch),
        indptr0(max_batch + 1),
        indptr1(max_batch + 1),
        slot0(cap_entries),
        slot1(cap_entries),
        logical0(cap_entries),
        logical1(cap_entries) {}
  void upload(const batch_t& h) {
    pool0.put(h.pool[0]);
    pool1.put(h.pool[1]);
    seq_len.put(h.seq_len);
    indptr0.put(h.indptr[0]);
    indptr1.put(h.indptr[1]);
    slot0.put(h.slot[0]);
    slot1.put(h.slot[1]);
    logical0.put(h.logical[0]);
    logical1.put(h.logical[1]);
  }
  batch_index_view<2> index(int batch) const {
    batch_index_view<2> v;
    v.batch = batch;
    v.seq_len = seq_len.p;
    v.formats[0] = {indptr0.p, slot0.p, logical0.p};
    v.formats[1] = {indptr1.p, slot1.p, logical1.p};
    return v;
  }
  pool_view pool(const batch_t& h, int f) const {
    return f == 0 ? pool_view{pool0.p, batch_t::L8::page_bytes, std::uint32_t(h.pages_cap[0])}
                  : pool_view{pool1.p, batch_t::L3::page_bytes, std::uint32_t(h.pages_cap[1])};
  }
};

}  // namespace cuda_test
