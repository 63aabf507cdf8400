// SPDX-License-Identifier: Apache-2.0
// KV backends whose bytes live in tierkv's formats: pages of page_tokens tokens of one
// layer and all KV heads (tierkv::page_layout), each page in one tier of a compile-time
// tier list (tierkv::tiers), keys and values encoded by the tier's codecs.
//
// Decode steps read the pages in their stored formats through tierkv::attention_tile
// (per-tier partial states, finalized, merged by log-sum-exp). Prefill chunks decode
// the cached pages into a float scratch and multiply with BLAS: the values read are the
// stored ones, bit for bit what the tile path reads, at GEMM speed.
//
// The tiered arm's policy is tierkv's default, tierkv::policy::recency_anchor: Recent =
// the newest pages, Anchor = attention sinks (first pages), the first / last layers, and
// pages whose smoothed attention mass stays high; Stale = the rest, in TQ3. The engine
// feeds it the last query's per-page attention mass of every chunk and decode step and
// applies its choices after each commit (conversion: decode the page, encode the new
// format into a fresh page, then swap it in).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kv_backend.hpp"
#include "tierkv/attention/partial_state.hpp"
#include "tierkv/attention/tile.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/rotation.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/tiering/recency_anchor.hpp"

#if __has_include("tierkv/codec/int8_rotated.hpp")
#include "tierkv/codec/int8_rotated.hpp"
#define SMOLLM_HAVE_INT8R 1
#else
#define SMOLLM_HAVE_INT8R 0
#endif
#if __has_include("tierkv/codec/fp8.hpp")
#include "tierkv/codec/fp8.hpp"
#define SMOLLM_HAVE_FP8 1
#else
#define SMOLLM_HAVE_FP8 0
#endif
#if __has_include("tierkv/codec/tq3.hpp")
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#define SMOLLM_HAVE_TQ3 1
#else
#define SMOLLM_HAVE_TQ3 0
#endif

namespace smollm {

struct tiering_options {
  tierkv::policy::recency_anchor_options policy{};  // tierkv's defaults unless overridden
  bool use_mass = true;                             // attention-mass anchors on / off
  // TQ3 tiers store keys and values minus a per-(layer, KV head) channel mean, taken from
  // the first chunk a sequence appends (keys carry offset channels; a plain per-vector TQ3
  // spreads an offset's energy over every coordinate). Exact to undo: the mean adds
  // q·mu_k to every logit of the tier (a shift of its partial state's max) and l·mu_v to
  // its accumulator.
  bool center = true;
  // The same centring on the FP8 tiers. Off by default: with rotated FP8 keys it measured
  // no better (GPL-3 perplexity, docs/model.md).
  bool center_fp8 = false;
  // FP8 keys stored in the rotated domain of the TQ3 codec (seeded Hadamard, the same seed):
  // E4M3's relative error then spreads over all coordinates instead of landing on the
  // outlier channels that queries and keys share; the query is rotated once per head.
  // Measured: FP8 everywhere +1.57% -> +0.84% perplexity vs dense (docs/model.md).
  bool rotate_fp8_keys = true;
  // FP8 values stored in the rotated domain of the TQ3 value codec: a tier's accumulator is
  // then a sum of rotated values, rotated back once per (tier, query head) before the merge
  // (the rotation is linear, so this is exact up to rounding).
  bool rotate_fp8_values = false;
  std::uint64_t seed = 0x7469657221ull;  // cache-wide seed of the TQ3 rotations
};

// SmolLM2-135M: head_dim 64, 3 KV heads, 3 query heads per KV head; 16-token pages.
using smol_geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<3>,
                                       tierkv::group_size<3>, tierkv::page_tokens<16>>;

template <class Geometry, class... Tiers>
class paged_backend final : public kv_backend {
  static constexpr int HD = Geometry::head_dim;
  static constexpr int H = Geometry::kv_heads;
  static constexpr int P = Geometry::page_tokens;
  static constexpr int G = Geometry::group_size;
  static constexpr int num_tiers = int(sizeof...(Tiers));
  using tier_list = std::tuple<Tiers...>;
  template <int I>
  using tier_t = std::tuple_element_t<std::size_t(I), tier_list>;
  template <int I>
  using key_codec = typename tier_t<I>::template key_codec<HD>;
  template <int I>
  using value_codec = typename tier_t<I>::template value_codec<HD>;
  template <int I>
  using layout = tierkv::page_layout<Geometry, key_codec<I>, value_codec<I>>;
  template <int I>
  using tile = tierkv::attention_tile<key_codec<I>, value_codec<I>>;
  template <int I>
  static constexpr bool is_tq3_tier = key_codec<I>::format == tierkv::storage_format::tq3 ||
                                      value_codec<I>::format == tierkv::storage_format::tq3;
  template <int I>
  static constexpr bool is_fp8_tier = key_codec<I>::format == tierkv::storage_format::fp8_e4m3;
  // The high-fidelity (8-bit) tiers, whose page share the metrics report as fp8 share.
  template <int I>
  static constexpr bool is_8bit_tier =
      is_fp8_tier<I> || (key_codec<I>::format == tierkv::storage_format::int8_rotated &&
                         value_codec<I>::format == tierkv::storage_format::int8_rotated);
  // FP8 tiers whose keys are stored rotated (option rotate_fp8_keys).
  template <int I>
  bool rotated() const {
    return is_fp8_tier<I> && opt_.rotate_fp8_keys;
  }
  // FP8 tiers whose values are stored rotated (option rotate_fp8_values).
  template <int I>
  bool values_rotated() const {
    return is_fp8_tier<I> && opt_.rotate_fp8_values;
  }
  // Tiers whose pages store keys and values minus the channel means.
  template <int I>
  bool centered() const {
    return (is_tq3_tier<I> && opt_.center) || (is_fp8_tier<I> && opt_.center_fp8);
  }
  using state = tierkv::partial_state<HD>;

  struct page {
    int tier = 0;
    std::vector<std::uint8_t> bytes;
    tierkv::policy::recency_anchor::page_state policy{};
    std::uint64_t steps_since_move = 0;
    bool moved = false;
  };

 public:
  paged_backend(std::string name, kv_shape s, tiering_options opt, bool tiered)
      : name_(std::move(name)),
        s_(s),
        opt_(opt),
        tiered_(tiered && num_tiers > 1),
        policy_(opt.policy) {
    if (auto st = policy_.validate(); !st) throw tierkv::error(st);
    if (s.head_dim != HD || s.kv_heads != H || s.q_heads != H * G)
      throw std::runtime_error(
          "paged_backend: the model's attention shape (head_dim " + std::to_string(s.head_dim) +
          ", kv_heads " + std::to_string(s.kv_heads) + ", q_heads " + std::to_string(s.q_heads) +
          ") differs from the compiled geometry (64, 3, 9)");
    pages_.resize(std::size_t(s.layers));
    mass_.resize(std::size_t(s.layers));
    mu_k_.assign(std::size_t(s.layers) * H * HD, 0.0f);
    mu_v_.assign(mu_k_.size(), 0.0f);
    kctx_.resize(std::size_t(s.layers) * H);
    vctx_.resize(kctx_.size());
    for (int l = 0; l < s.layers; ++l)
      for (int h = 0; h < H; ++h) {
        kctx_[std::size_t(l * H + h)] =
            tierkv::make_codec_context(opt.seed, l, h, tierkv::kv_role::key);
        vctx_[std::size_t(l * H + h)] =
            tierkv::make_codec_context(opt.seed, l, h, tierkv::kv_role::value);
      }
  }

  std::string name() const override { return name_; }
  void reset() override {
    for (auto& p : pages_) p.clear();
    for (auto& m : mass_) m.clear();
    len_ = 0;
  }
  int length() const override { return len_; }

  void append(int layer, int n, const float* k, const float* v) override {
    auto& pl = pages_[std::size_t(layer)];
    if (len_ == 0 && (opt_.center || opt_.center_fp8)) {  // the channel means of the first chunk
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < HD; ++d) {
          double sk = 0, sv = 0;
          for (int i = 0; i < n; ++i) {
            sk += double(k[(std::size_t(i) * H + std::size_t(h)) * HD + std::size_t(d)]);
            sv += double(v[(std::size_t(i) * H + std::size_t(h)) * HD + std::size_t(d)]);
          }
          mu_k_[(std::size_t(layer) * H + std::size_t(h)) * HD + std::size_t(d)] = float(sk / n);
          mu_v_[(std::size_t(layer) * H + std::size_t(h)) * HD + std::size_t(d)] = float(sv / n);
        }
    }
    for (int i = 0; i < n; ++i) {
      const int pos = len_ + i;
      const int logical = pos / P, slot = pos % P;
      if (slot == 0) {
        if (int(pl.size()) != logical) throw std::logic_error("paged_backend: append out of order");
        pl.push_back(page{0, std::vector<std::uint8_t>(page_bytes(0), 0)});
      }
      page& pg = pl[std::size_t(logical)];
      if (pg.tier != 0) throw std::logic_error("paged_backend: append into a converted page");
      for (int h = 0; h < H; ++h) {
        const std::size_t off = (std::size_t(i) * H + std::size_t(h)) * HD;
        const tierkv::errc e = encode_token<0>(pg.bytes.data(), layer, h, slot, k + off, v + off);
        if (e != tierkv::errc::ok)
          throw std::runtime_error("paged_backend: encoding layer " + std::to_string(layer) +
                                   " position " + std::to_string(pos) +
                                   " failed: " + std::string(tierkv::to_string(e)));
      }
    }
  }

  void attend(int layer, int n, const float* q, float* out) override {
    if (n == 1) return attend_decode(layer, q, out);
    // Prefill chunk: decode every cached page (in its stored format) into float rows.
    const int T = len_ + n;
    const std::size_t head_stride = std::size_t(T) * HD;
    kbuf_.resize(H * head_stride);
    vbuf_.resize(H * head_stride);
    const auto& pl = pages_[std::size_t(layer)];
    for (std::size_t p = 0; p < pl.size(); ++p) {
      const int first = int(p) * P;
      const int ntok = std::min(P, T - first);
      for (int h = 0; h < H; ++h)
        visit(pl[p].tier, [&](auto I) {
          decode_tokens<I.value>(
              pl[p].bytes.data(), layer, h, ntok,
              kbuf_.data() + std::size_t(h) * head_stride + std::size_t(first) * HD,
              vbuf_.data() + std::size_t(h) * head_stride + std::size_t(first) * HD);
        });
    }
    float* mass = nullptr;
    if (tiered_ && opt_.use_mass) {
      mass_[std::size_t(layer)].assign(pl.size(), 0.0f);
      mass = mass_[std::size_t(layer)].data();
    }
    detail::attend_float(
        s_, len_, n, q, out, [&](int g) { return kbuf_.data() + std::size_t(g) * head_stride; },
        [&](int g) { return vbuf_.data() + std::size_t(g) * head_stride; }, HD, scores_, mass, P);
  }

  void commit(int n) override {
    len_ += n;
    if (tiered_) retier();
  }

  kv_memory memory() const override {
    kv_memory m;
    m.tokens = len_;
    m.scalars = 2.0 * len_ * s_.layers * H * HD;
    double pages = 0, fp8 = 0;
    for (const auto& pl : pages_)
      for (const auto& pg : pl) {
        m.bytes += double(page_bytes(pg.tier));
        pages += 1;
        visit(pg.tier, [&](auto I) { fp8 += is_8bit_tier<I.value> ? 1 : 0; });
      }
    m.fp8_fraction = pages > 0 ? fp8 / pages : 0;
    bool any_centered = false;
    [&]<int... Is>(std::integer_sequence<int, Is...>) { any_centered = (centered<Is>() || ...); }
    (std::make_integer_sequence<int, num_tiers>{});
    if (any_centered) m.bytes += double(sizeof(float)) * double(mu_k_.size() + mu_v_.size());
    return m;
  }

 private:
  template <class F, int... Is>
  static void visit_impl(int tier, F&& f, std::integer_sequence<int, Is...>) {
    ((tier == Is ? (f(std::integral_constant<int, Is>{}), 0) : 0), ...);
  }
  template <class F>
  static void visit(int tier, F&& f) {
    visit_impl(tier, std::forward<F>(f), std::make_integer_sequence<int, num_tiers>{});
  }
  static std::size_t page_bytes(int tier) {
    std::size_t b = 0;
    visit(tier, [&](auto I) { b = layout<I.value>::page_bytes; });
    return b;
  }

  template <int I>
  tierkv::errc encode_token(std::uint8_t* pg, int layer, int h, int slot, const float* k,
                            const float* v) {
    using KC = key_codec<I>;
    using VC = value_codec<I>;
    using L = layout<I>;
    typename KC::meta_type km{};
    typename VC::meta_type vm{};
    float kc[HD], vc[HD];
    if (centered<I>()) {
      const float* mk = mu_k(layer, h);
      const float* mv = mu_v(layer, h);
      for (int d = 0; d < HD; ++d) {
        kc[d] = k[d] - mk[d];
        vc[d] = v[d] - mv[d];
      }
      k = kc;
      v = vc;
    }
    float kr[HD];
    if (rotated<I>()) {
      std::copy(k, k + HD, kr);
      tierkv::randomized_hadamard<HD>::forward(kr, kctx(layer, h).seed);
      k = kr;
    }
    float vr[HD];
    if (values_rotated<I>()) {
      std::copy(v, v + HD, vr);
      tierkv::randomized_hadamard<HD>::forward(vr, vctx(layer, h).seed);
      v = vr;
    }
    tierkv::errc e = KC::encode(k, pg + L::key_payload(h, slot), km, kctx(layer, h), &stats_);
    if (e != tierkv::errc::ok) return e;
    e = VC::encode(v, pg + L::value_payload(h, slot), vm, vctx(layer, h), &stats_);
    if (e != tierkv::errc::ok) return e;
    if constexpr (KC::meta_bytes > 0) std::memcpy(pg + L::key_meta(h, slot), &km, KC::meta_bytes);
    if constexpr (VC::meta_bytes > 0) std::memcpy(pg + L::value_meta(h, slot), &vm, VC::meta_bytes);
    return tierkv::errc::ok;
  }

  template <int I>
  void decode_tokens(const std::uint8_t* pg, int layer, int h, int ntok, float* k, float* v) const {
    using KC = key_codec<I>;
    using VC = value_codec<I>;
    using L = layout<I>;
    for (int t = 0; t < ntok; ++t) {
      const auto km = tierkv::detail::load_meta<KC>(pg + L::key_meta(h, 0), t);
      const auto vm = tierkv::detail::load_meta<VC>(pg + L::value_meta(h, 0), t);
      KC::decode(pg + L::key_payload(h, t), km, k + std::size_t(t) * HD, kctx(layer, h));
      if (rotated<I>())
        tierkv::randomized_hadamard<HD>::inverse(k + std::size_t(t) * HD, kctx(layer, h).seed);
      VC::decode(pg + L::value_payload(h, t), vm, v + std::size_t(t) * HD, vctx(layer, h));
      if (values_rotated<I>())
        tierkv::randomized_hadamard<HD>::inverse(v + std::size_t(t) * HD, vctx(layer, h).seed);
      if (centered<I>()) {
        const float* mk = mu_k(layer, h);
        const float* mv = mu_v(layer, h);
        for (int d = 0; d < HD; ++d) {
          k[std::size_t(t) * HD + std::size_t(d)] += mk[d];
          v[std::size_t(t) * HD + std::size_t(d)] += mv[d];
        }
      }
    }
  }

  // One token's queries over the whole cache, read in the stored formats.
  void attend_decode(int layer, const float* q, float* out) {
    const auto& pl = pages_[std::size_t(layer)];
    const int T = len_ + 1;
    const bool want_mass = tiered_ && opt_.use_mass;
    if (want_mass) mass_[std::size_t(layer)].assign(pl.size(), 0.0f);
    tierkv::logit_params lp;
    lp.softmax_scale = 1.0f / std::sqrt(float(HD));
    for (int g = 0; g < H; ++g) {
      if (want_mass) page_stats_.assign(pl.size() * G, tierkv::tile_stats{});
      state total[G];
      for (auto& st : total) st.clear();
      for (int tier = 0; tier < num_tiers; ++tier)
        visit(tier, [&](auto I) {
          constexpr int ti = I.value;
          float prepared[G * HD];
          for (int r = 0; r < G; ++r) {
            key_codec<ti>::prepare_query(q + std::size_t(g * G + r) * HD, prepared + r * HD,
                                         kctx(layer, g));
            if (rotated<ti>())
              tierkv::randomized_hadamard<HD>::forward(prepared + r * HD, kctx(layer, g).seed);
          }
          state st[G];
          for (auto& x : st) x.clear();
          float scores[G * P];
          bool any = false;
          for (std::size_t p = 0; p < pl.size(); ++p) {
            if (pl[p].tier != ti) continue;
            any = true;
            const int ntok = std::min(P, T - int(p) * P);
            const auto span =
                tierkv::kv_span<key_codec<ti>, value_codec<ti>>::template in_page<layout<ti>>(
                    pl[p].bytes.data(), g, 0);
            tile<ti>::run(prepared, G, nullptr, span, ntok, lp, st,
                          want_mass ? page_stats_.data() + p * G : nullptr, scores);
          }
          if (!any) return;
          for (int r = 0; r < G; ++r) {
            value_codec<ti>::finalize(st[r].acc, vctx(layer, g));
            if (values_rotated<ti>())
              tierkv::randomized_hadamard<HD>::inverse(st[r].acc, vctx(layer, g).seed);
            if (centered<ti>() && !st[r].empty()) {
              // Undo the centring: every logit of this tier is short by scale * q·mu_k (a
              // shift of the state's max), every value by mu_v (l * mu_v in the accumulator).
              const float* qr = q + std::size_t(g * G + r) * HD;
              const float* mk = mu_k(layer, g);
              const float* mv = mu_v(layer, g);
              float qm = 0;
              for (int d = 0; d < HD; ++d) qm += qr[d] * mk[d];
              for (int d = 0; d < HD; ++d) st[r].acc[d] += st[r].l * mv[d];
              st[r].m += lp.softmax_scale * qm;
              if (want_mass)
                for (std::size_t p = 0; p < pl.size(); ++p)
                  if (pl[p].tier == ti)
                    page_stats_[p * G + std::size_t(r)].m += lp.softmax_scale * qm;
            }
            total[r].merge(st[r]);
          }
        });
      for (int r = 0; r < G; ++r) total[r].normalize(out + std::size_t(g * G + r) * HD);
      if (want_mass)
        for (std::size_t p = 0; p < pl.size(); ++p)
          for (int r = 0; r < G; ++r) {
            const auto& ts = page_stats_[p * G + std::size_t(r)];
            mass_[std::size_t(layer)][p] += tierkv::softmax_mass(ts.m, ts.l, total[r].lse());
          }
    }
  }

  // tierkv::policy::recency_anchor decides each page's role; Recent and Anchor pages live
  // in tier 0 (FP8), Stale pages in tier 1 (TQ3). A page's first move (out of the append
  // tier) happens as soon as it is chosen Stale; later moves respect min_dwell_steps.
  void retier() {
    if constexpr (num_tiers > 1) {
      for (int l = 0; l < s_.layers; ++l) {
        auto& pl = pages_[std::size_t(l)];
        const auto& mass = mass_[std::size_t(l)];
        const int npages = int(pl.size());
        for (int p = 0; p < npages; ++p) {
          page& pg = pl[std::size_t(p)];
          ++pg.steps_since_move;
          // Relative mass: the page's share of the last query's attention (averaged over
          // query heads) times the page count, so 1 = a uniform share.
          if (opt_.use_mass && std::size_t(p) < mass.size())
            policy_.observe(pg.policy, mass[std::size_t(p)] / float(s_.q_heads) * float(npages));
          tierkv::page_facts f;
          f.layer = l;
          f.num_layers = s_.layers;
          f.tier = pg.tier;
          f.position = p;
          f.age = npages - 1 - p;
          f.holders = 1;
          f.steps_since_move = pg.steps_since_move;
          const int want = policy_.choose(pg.policy, f) == tierkv::tier_role::stale ? 1 : 0;
          if (want == pg.tier || (p + 1) * P > len_) continue;
          if (pg.moved && pg.steps_since_move < policy_.min_dwell_steps()) continue;
          if (want == 1)
            convert<0, 1>(l, pg);
          else
            convert<1, 0>(l, pg);
          pg.moved = true;
          pg.steps_since_move = 0;
        }
      }
    }
  }

  template <int From, int To>
  void convert(int layer, page& pg) {
    float k[P * HD], v[P * HD];
    std::vector<std::uint8_t> fresh(page_bytes(To), 0);
    for (int h = 0; h < H; ++h) {
      decode_tokens<From>(pg.bytes.data(), layer, h, P, k, v);
      for (int t = 0; t < P; ++t) {
        const tierkv::errc e = encode_token<To>(fresh.data(), layer, h, t, k + t * HD, v + t * HD);
        if (e != tierkv::errc::ok)
          throw std::runtime_error("paged_backend: retier of layer " + std::to_string(layer) +
                                   " failed: " + std::string(tierkv::to_string(e)));
      }
    }
    // The new page is complete before it replaces the old one.
    pg.bytes.swap(fresh);
    pg.tier = To;
  }

  const float* mu_k(int layer, int h) const {
    return mu_k_.data() + (std::size_t(layer) * H + std::size_t(h)) * HD;
  }
  const float* mu_v(int layer, int h) const {
    return mu_v_.data() + (std::size_t(layer) * H + std::size_t(h)) * HD;
  }
  const tierkv::codec_context& kctx(int layer, int h) const {
    return kctx_[std::size_t(layer * H + h)];
  }
  const tierkv::codec_context& vctx(int layer, int h) const {
    return vctx_[std::size_t(layer * H + h)];
  }

  std::string name_;
  kv_shape s_;
  tiering_options opt_;
  bool tiered_;
  int len_ = 0;
  std::vector<std::vector<page>> pages_;
  std::vector<tierkv::codec_context> kctx_, vctx_;
  std::vector<float> mu_k_, mu_v_;  // [layer][kv head][dim] channel means of the TQ3 tiers
  std::vector<float> kbuf_, vbuf_, scores_;
  std::vector<std::vector<float>> mass_;  // per layer: last query's attention mass per page
  std::vector<tierkv::tile_stats> page_stats_;
  tierkv::policy::recency_anchor policy_;
  tierkv::encode_stats stats_;
};

// Arms by name: paged_f32 (the paging + tile machinery over lossless pages), and, once
// tierkv's codecs are present, fp8, tq3 and tiered.
inline std::unique_ptr<kv_backend> make_tierkv_backend(const std::string& arm, kv_shape s,
                                                       const tiering_options& opt) {
  using dense_tier = tierkv::tier<tierkv::dense_f32, tierkv::dense_f32>;
  if (arm == "paged_f32")
    return std::make_unique<paged_backend<smol_geometry, dense_tier>>(arm, s, opt, false);
#if SMOLLM_HAVE_FP8
  using fp8_tier = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
  if (arm == "fp8")
    return std::make_unique<paged_backend<smol_geometry, fp8_tier>>(arm, s, opt, false);
#endif
#if SMOLLM_HAVE_TQ3
  using tq3_tier = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
  if (arm == "tq3")
    return std::make_unique<paged_backend<smol_geometry, tq3_tier>>(arm, s, opt, false);
#endif
#if SMOLLM_HAVE_FP8 && SMOLLM_HAVE_TQ3
  if (arm == "tiered")
    return std::make_unique<paged_backend<smol_geometry, fp8_tier, tq3_tier>>(arm, s, opt, true);
#endif
#if SMOLLM_HAVE_INT8R
  using int8r_tier = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
  if (arm == "int8r")
    return std::make_unique<paged_backend<smol_geometry, int8r_tier>>(arm, s, opt, false);
#if SMOLLM_HAVE_TQ3
  if (arm == "tiered_int8r")
    return std::make_unique<paged_backend<smol_geometry, int8r_tier, tq3_tier>>(arm, s, opt, true);
  // Diagnostic (not a budget configuration: Stale pages cost 5.75 bits): Stale keys in
  // int8_rotated, Stale values in TQ3, to tell key (routing) error from value error.
  using stale_k8_tier = tierkv::tier<tierkv::int8_rotated, tierkv::tq3_value>;
  if (arm == "tiered_k8")
    return std::make_unique<paged_backend<smol_geometry, int8r_tier, stale_k8_tier>>(arm, s, opt,
                                                                                     true);
  // Stale keys in TQ4 (routing precision for multi-needle retrieval), values in TQ3.
  using stale_k4_tier = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;
  if (arm == "tiered_k4")
    return std::make_unique<paged_backend<smol_geometry, int8r_tier, stale_k4_tier>>(arm, s, opt,
                                                                                     true);
#endif
#endif
  throw std::runtime_error(
      "unknown or unavailable KV arm '" + arm + "' (dense, paged_f32" +
      (SMOLLM_HAVE_FP8 ? ", fp8" : "") + (SMOLLM_HAVE_TQ3 ? ", tq3" : "") +
      (SMOLLM_HAVE_FP8 && SMOLLM_HAVE_TQ3 ? ", tiered" : "") +
      (SMOLLM_HAVE_INT8R ? ", int8r" : "") +
      (SMOLLM_HAVE_INT8R && SMOLLM_HAVE_TQ3 ? ", tiered_int8r, tiered_k4, tiered_k8" : "") + ")");
}

}  // namespace smollm
