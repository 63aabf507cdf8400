// SPDX-License-Identifier: Apache-2.0
// Test fixture for host attention: builds mixed-format pages directly in host memory
// with page_layout and the codecs' encode (no pool classes), and a float64 dense
// reference of attention over either the original or the decoded vectors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"

namespace tierkv::test {

// Which tier holds logical page `page` of sequence `seq` (of `pages` pages).
using tier_of_page_fn = std::function<int(int seq, int page, int pages)>;

struct kv_data_options {
  double outlier_scale = 1.0;  // keys' first `outlier_channels` channels scaled by this
  int outlier_channels = 0;
  double key_offset = 0.0;  // added to the outlier channels (a real-model offset channel)
};

template <class Geometry, class TierList>
struct mixed_cache {
  static constexpr int D = Geometry::head_dim;
  static constexpr int P = Geometry::page_tokens;
  static constexpr int KVH = Geometry::kv_heads;
  static constexpr int QH = Geometry::q_heads;
  static constexpr int T = TierList::size;

  std::uint64_t seed = 0;
  int layer = 0;
  std::vector<std::int32_t> seq_len;
  // Original and decoded vectors: [seq][token][kv head][D] (row-major per sequence).
  std::vector<std::vector<float>> k, v, k_dec, v_dec;
  std::vector<std::vector<int>> page_tier;  // [seq][logical page]
  // Per tier: page storage, CSR.
  std::vector<std::uint8_t> storage[T];
  std::size_t page_bytes[T] = {};
  std::vector<std::int32_t> indptr[T], slot[T], logical[T];
  pool_view pools[T];
  batch_index_view<T> index{};

  std::size_t at(int t, int h) const { return (std::size_t(t) * KVH + std::size_t(h)) * D; }

  void build(const std::vector<std::int32_t>& lens, const tier_of_page_fn& tier_of,
             std::mt19937_64& rng, const kv_data_options& opt = {}, std::uint8_t poison = 0xFF) {
    seq_len = lens;
    const int B = int(lens.size());
    k.assign(std::size_t(B), {});
    v.assign(std::size_t(B), {});
    k_dec.assign(std::size_t(B), {});
    v_dec.assign(std::size_t(B), {});
    page_tier.assign(std::size_t(B), {});
    std::normal_distribution<float> nd;
    std::vector<std::vector<std::pair<int, int>>> owned(T);  // (seq, page) per tier
    for (int b = 0; b < B; ++b) {
      const int n = lens[std::size_t(b)];
      const int pages = (n + P - 1) / P;
      auto& kb = k[std::size_t(b)];
      auto& vb = v[std::size_t(b)];
      kb.resize(std::size_t(n) * KVH * D);
      vb.resize(std::size_t(n) * KVH * D);
      for (int t = 0; t < n; ++t)
        for (int h = 0; h < KVH; ++h)
          for (int i = 0; i < D; ++i) {
            float kx = nd(rng);
            if (i < opt.outlier_channels) kx = float(kx * opt.outlier_scale + opt.key_offset);
            kb[at(t, h) + std::size_t(i)] = kx;
            vb[at(t, h) + std::size_t(i)] = nd(rng);
          }
      for (int p = 0; p < pages; ++p) {
        const int tr = tier_of(b, p, pages);
        page_tier[std::size_t(b)].push_back(tr);
        owned[std::size_t(tr)].emplace_back(b, p);
      }
    }
    encode_all(owned, rng, poison, std::make_index_sequence<T>{});
    index.batch = B;
    index.seq_len = seq_len.data();
    for (int f = 0; f < T; ++f)
      index.formats[f] = {indptr[f].data(), slot[f].data(), logical[f].data()};
  }

 private:
  template <std::size_t... I>
  void encode_all(const std::vector<std::vector<std::pair<int, int>>>& owned, std::mt19937_64& rng,
                  std::uint8_t poison, std::index_sequence<I...>) {
    (encode_tier<int(I)>(owned[I], rng, poison), ...);
  }

  template <int I>
  void encode_tier(const std::vector<std::pair<int, int>>& owned, std::mt19937_64& rng,
                   std::uint8_t poison) {
    using tier_t = tier_at_t<TierList, I>;
    using KC = typename tier_t::template key_codec<D>;
    using VC = typename tier_t::template value_codec<D>;
    using layout = page_layout<Geometry, KC, VC>;
    const int B = int(seq_len.size());
    const std::size_t npages = owned.size() + 1;  // one spare page, never referenced
    page_bytes[I] = layout::page_bytes;
    storage[I].assign(npages * layout::page_bytes + 64, poison);
    // 64-byte aligned base inside the vector.
    auto addr = reinterpret_cast<std::uintptr_t>(storage[I].data());
    std::uint8_t* base = storage[I].data() + ((64 - addr % 64) % 64);
    // Physical slots in shuffled order, so logical order != physical order.
    std::vector<std::int32_t> perm(npages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    indptr[I].assign(std::size_t(B) + 1, 0);
    slot[I].clear();
    logical[I].clear();
    std::size_t next = 0;
    for (int b = 0; b < B; ++b) {
      auto& kd = k_dec[std::size_t(b)];
      auto& vd = v_dec[std::size_t(b)];
      kd.resize(k[std::size_t(b)].size());
      vd.resize(v[std::size_t(b)].size());
      for (const auto& [sb, p] : owned) {
        if (sb != b) continue;
        const std::int32_t s = perm[next++];
        slot[I].push_back(s);
        logical[I].push_back(p);
        std::uint8_t* page = base + std::size_t(s) * layout::page_bytes;
        const int n = std::min(P, seq_len[std::size_t(b)] - p * P);
        for (int h = 0; h < KVH; ++h) {
          const codec_context kctx = make_codec_context(seed, layer, h, kv_role::key);
          const codec_context vctx = make_codec_context(seed, layer, h, kv_role::value);
          for (int t = 0; t < n; ++t) {
            const std::size_t off = at(p * P + t, h);
            typename KC::meta_type km{};
            typename VC::meta_type vm{};
            REQUIRE(KC::encode(k[std::size_t(b)].data() + off, page + layout::key_payload(h, t), km,
                               kctx, nullptr) == errc::ok);
            REQUIRE(VC::encode(v[std::size_t(b)].data() + off, page + layout::value_payload(h, t),
                               vm, vctx, nullptr) == errc::ok);
            if constexpr (KC::meta_bytes > 0)
              std::memcpy(page + layout::key_meta(h, t), &km, KC::meta_bytes);
            if constexpr (VC::meta_bytes > 0)
              std::memcpy(page + layout::value_meta(h, t), &vm, VC::meta_bytes);
            KC::decode(page + layout::key_payload(h, t), km, kd.data() + off, kctx);
            VC::decode(page + layout::value_payload(h, t), vm, vd.data() + off, vctx);
          }
        }
      }
      indptr[I][std::size_t(b) + 1] = std::int32_t(slot[I].size());
    }
    pools[I] = pool_view{base, layout::page_bytes, std::uint32_t(npages)};
  }
};

// float64 reference of one query row over tokens [0, limit) of one sequence's (kv head h)
// vectors K, V laid out [token][kv head][D].
struct ref_result {
  std::vector<double> out;
  double lse = -std::numeric_limits<double>::infinity();
  std::vector<double> page_l, page_m;  // per logical page, {m, l} of this row
};

inline ref_result reference_row(const float* q, const std::vector<float>& K,
                                const std::vector<float>& V, int kvh, int h, int D, int limit,
                                int page_tokens, double scale, double cap, int first = 0) {
  ref_result r;
  r.out.assign(std::size_t(D), 0.0);
  if (limit <= 0) return r;
  first = std::max(first, 0);  // tokens [first, limit): a sliding window's
  std::vector<double> s(static_cast<std::size_t>(limit));
  double m = -std::numeric_limits<double>::infinity();
  for (int t = first; t < limit; ++t) {
    const float* kk =
        K.data() + (std::size_t(t) * std::size_t(kvh) + std::size_t(h)) * std::size_t(D);
    double d = 0;
    for (int i = 0; i < D; ++i) d += double(q[i]) * double(kk[i]);
    d *= scale;
    if (cap > 0) d = cap * std::tanh(d / cap);
    s[std::size_t(t)] = d;
    m = std::max(m, d);
  }
  double l = 0;
  const int pages = (limit + page_tokens - 1) / page_tokens;
  r.page_l.assign(std::size_t(pages), 0.0);
  r.page_m.assign(std::size_t(pages), 0.0);
  for (int t = first; t < limit; ++t) {
    const double p = std::exp(s[std::size_t(t)] - m);
    l += p;
    r.page_l[std::size_t(t / page_tokens)] += p;
    const float* vv =
        V.data() + (std::size_t(t) * std::size_t(kvh) + std::size_t(h)) * std::size_t(D);
    for (int i = 0; i < D; ++i) r.out[std::size_t(i)] += p * double(vv[i]);
  }
  for (auto& o : r.out) o /= l;
  for (int pg = 0; pg < pages; ++pg) r.page_m[std::size_t(pg)] = m;
  r.lse = m + std::log(l);
  return r;
}

inline double rel_l2(const float* a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::vector<float> random_queries(std::size_t n, std::mt19937_64& rng, float sd = 1.f) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> q(n);
  for (auto& x : q) x = nd(rng);
  return q;
}

}  // namespace tierkv::test

namespace tierkv::test {

// Errors of one host decode call against float64 references on the decoded vectors
// (isolates the attention math) and on the original vectors (adds the codec error).
struct decode_errors {
  double max_rel_decoded = 0, max_rel_original = 0, mean_rel_original = 0;
  double max_lse_decoded = 0, max_lse_original = 0;
  double max_mass_err = 0;      // |mass - reference mass on decoded vectors|
  double max_mass_sum_err = 0;  // |sum of a non-empty sequence's masses - 1|
  bool non_finite = false;      // any NaN/Inf in outputs, or a finite LSE where -inf is due
  int rows = 0;
};

template <class Geometry, class TierList>
decode_errors check_decode(const mixed_cache<Geometry, TierList>& c, const std::vector<float>& q,
                           const logit_params& lp, host_attention_workspace& ws) {
  constexpr int D = Geometry::head_dim, QH = Geometry::q_heads, G = Geometry::group_size;
  constexpr int KVH = Geometry::kv_heads, P = Geometry::page_tokens;
  const int B = int(c.seq_len.size());
  int max_pages = 0;
  for (int n : c.seq_len) max_pages = std::max(max_pages, (n + P - 1) / P);
  const int stride = max_pages + 3;
  std::vector<float> out(std::size_t(B) * QH * D, 12345.f), lse(std::size_t(B) * QH, 12345.f),
      mass(std::size_t(B) * std::size_t(stride), 12345.f);
  host_decode_args<TierList::size> a;
  a.queries = q.data();
  a.index = c.index;
  a.pools = c.pools;
  a.source = {c.seed, c.layer};
  a.logits = lp;
  a.out = out.data();
  a.lse = lse.data();
  a.page_mass = mass.data();
  a.mass_stride = stride;
  const status st = host_decode<Geometry, TierList>(ws, a);
  REQUIRE(st.is_ok());
  decode_errors e;
  for (int b = 0; b < B; ++b) {
    const int n = c.seq_len[std::size_t(b)];
    const int pages = (n + P - 1) / P;
    std::vector<double> mref(static_cast<std::size_t>(pages), 0.0);
    for (int h = 0; h < QH; ++h) {
      const std::size_t row = std::size_t(b) * QH + std::size_t(h);
      const float* o = out.data() + row * D;
      const float* qq = q.data() + row * D;
      for (int i = 0; i < D; ++i)
        if (!std::isfinite(o[i])) e.non_finite = true;
      if (n == 0) {
        for (int i = 0; i < D; ++i)
          if (o[i] != 0.f) e.non_finite = true;
        if (lse[row] != -std::numeric_limits<float>::infinity()) e.non_finite = true;
        continue;
      }
      if (!std::isfinite(lse[row])) e.non_finite = true;
      const auto rd = reference_row(qq, c.k_dec[std::size_t(b)], c.v_dec[std::size_t(b)], KVH,
                                    h / G, D, n, P, lp.softmax_scale, lp.soft_cap);
      const auto ro = reference_row(qq, c.k[std::size_t(b)], c.v[std::size_t(b)], KVH, h / G, D, n,
                                    P, lp.softmax_scale, lp.soft_cap);
      const double ed = rel_l2(o, rd.out), eo = rel_l2(o, ro.out);
      e.max_rel_decoded = std::max(e.max_rel_decoded, ed);
      e.max_rel_original = std::max(e.max_rel_original, eo);
      e.mean_rel_original += eo;
      e.max_lse_decoded = std::max(e.max_lse_decoded, std::abs(double(lse[row]) - rd.lse));
      e.max_lse_original = std::max(e.max_lse_original, std::abs(double(lse[row]) - ro.lse));
      for (int p = 0; p < pages; ++p)
        mref[std::size_t(p)] +=
            rd.page_l[std::size_t(p)] * std::exp(rd.page_m[std::size_t(p)] - rd.lse) / QH;
      ++e.rows;
    }
    double sum = 0;
    for (int p = 0; p < stride; ++p) {
      const float mv = mass[std::size_t(b) * std::size_t(stride) + std::size_t(p)];
      if (!std::isfinite(mv)) e.non_finite = true;
      if (p >= pages) {
        if (mv != 0.f) e.non_finite = true;
        continue;
      }
      sum += mv;
      e.max_mass_err = std::max(e.max_mass_err, std::abs(double(mv) - mref[std::size_t(p)]));
    }
    if (n > 0) e.max_mass_sum_err = std::max(e.max_mass_sum_err, std::abs(sum - 1.0));
  }
  if (e.rows) e.mean_rel_original /= e.rows;
  return e;
}

}  // namespace tierkv::test
