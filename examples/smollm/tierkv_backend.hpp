// SPDX-License-Identifier: Apache-2.0
// KV backends held in tierkv's own storage: each arm is a tierkv::tiered_cache (paged
// storage, tier controller, host attention) over a compile-time tier list, with one sequence
// per request. The engine's forward pass drives it the way an inference engine does: at
// layer 0 of a chunk (or decode step) it reserves the chunk's tokens, every layer writes its
// keys and values into the reservation (write_layer) and attends through tiered_cache::prefill
// (the chunk's queries over the committed pages and the reservation, causal, in the stored
// formats, on the library's host tiles); commit makes the chunk live and retier lets the
// controller move pages by the policy, the attention mass of each layer's last query feeding it.
//
// The tiered arms' policy is tierkv's default, tierkv::policy::recency_anchor: Recent = the
// newest pages, Anchor = attention sinks (first pages), the first / last layers, and pages
// whose smoothed attention mass stays high; Stale = the rest.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "kv_backend.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/tiering/recency_anchor.hpp"

namespace smollm {

struct tiering_options {
  tierkv::policy::recency_anchor_options policy{};  // tierkv's defaults unless overridden
  bool use_mass = true;                             // attention-mass anchors on / off
  // Centring (tierkv/centering.hpp): each layer's per-KV-head channel means of keys and values,
  // taken from the first chunk, are subtracted before encoding and added back exactly after
  // attention (keys carry offset channels; a per-vector TQ3 code spreads an offset's energy
  // over every coordinate).
  bool center = true;
  // Retier after every committed chunk, a prompt's prefill chunks included (the default), or
  // only after decode steps (one token): a prompt then prefills over 8-bit pages and its pages
  // move at the first decode step. At 1K, demoting between a prompt's chunks cost the
  // recommended cache multi-key retrievals that the GPU path (which publishes conversions a
  // step later) keeps (docs/model.md, "Retiering inside the prompt").
  bool retier_in_prefill = true;
  std::uint64_t seed = 0x7469657221ull;  // cache-wide seed of the codecs' rotations
  unsigned threads = 1;                  // host attention workers (the caller included)
};

// SmolLM2-135M: head_dim 64, 3 KV heads, 3 query heads per KV head; 16-token pages.
using smol_geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<3>,
                                       tierkv::group_size<3>, tierkv::page_tokens<16>>;

template <class Geometry, class... Tiers>
class library_backend final : public kv_backend {
  using tier_list = tierkv::tiers<Tiers...>;
  using cache_type = tierkv::tiered_cache<Geometry, tier_list>;
  static constexpr int HD = Geometry::head_dim;
  static constexpr int H = Geometry::kv_heads;
  static constexpr int QH = Geometry::q_heads;
  static constexpr int P = Geometry::page_tokens;
  static constexpr int num_tiers = int(sizeof...(Tiers));

 public:
  // capacity: the most tokens one request holds (pools and page lists are sized for it).
  library_backend(std::string name, kv_shape s, const tiering_options& opt, int capacity)
      : name_(std::move(name)), s_(s) {
    if (s.head_dim != HD || s.kv_heads != H || s.q_heads != QH)
      throw std::runtime_error(
          "library_backend: the model's attention shape (head_dim " + std::to_string(s.head_dim) +
          ", kv_heads " + std::to_string(s.kv_heads) + ", q_heads " + std::to_string(s.q_heads) +
          ") differs from the compiled geometry (" + std::to_string(HD) + ", " + std::to_string(H) +
          ", " + std::to_string(QH) + ")");
    if (capacity < 1)
      throw std::runtime_error("library_backend: capacity = " + std::to_string(capacity) +
                               " tokens, at least 1 needed");
    const int pages = (capacity + P - 1) / P;
    opt_.storage.num_layers = s.layers;
    opt_.storage.max_sequences = 1;
    // Every page of every layer may sit in any tier (a pool per tier, each for all of them).
    opt_.storage.pages_per_tier.fill(std::uint32_t(pages) * std::uint32_t(s.layers));
    opt_.storage.codec_seed = opt.seed;
    tierkv::policy::recency_anchor_options po = opt.policy;
    if (!opt.use_mass)  // no page ever reaches the anchor threshold by its attention mass
      po.enter_mass = po.leave_mass = std::numeric_limits<float>::max();
    opt_.policy = tierkv::policy::recency_anchor(po);
    opt_.max_batch = 1;
    opt_.max_pages = pages;
    opt_.threads = opt.threads;
    opt_.center = opt.center;
    retier_in_prefill_ = opt.retier_in_prefill;
    reset();
  }

  std::string name() const override { return name_; }
  // A fresh cache: the next request's centring means come from its own first chunk.
  void reset() override {
    cache_ = check(cache_type::create(opt_));
    seq_ = check(cache_->create_sequence());
    step_ = 0;
  }
  int length() const override { return int(check(cache_->length(seq_))); }

  void append(int layer, int n, const float* k, const float* v) override {
    if (layer == 0) check(cache_->reserve(seq_, n));
    const std::size_t len = std::size_t(n) * H * HD;
    check(cache_->write_layer(seq_, layer, {k, len}, {v, len}));
  }
  void attend(int layer, int n, const float* q, float* out) override {
    const std::int32_t indptr[2] = {0, n};
    const std::size_t len = std::size_t(n) * QH * HD;
    check(cache_->prefill(layer, {&seq_, 1}, indptr, {q, len}, {out, len}));
  }
  void commit(int n) override {
    check(cache_->commit(seq_, n));
    if constexpr (num_tiers > 1)
      if (n == 1 || retier_in_prefill_) (void)cache_->retier(++step_);
  }

  kv_memory memory() const override {
    const tierkv::memory_report r = cache_->report();
    kv_memory m;
    m.tokens = double(r.sequence_tokens);
    m.scalars = 2.0 * m.tokens * s_.layers * H * HD;
    m.bytes = double(r.live_page_bytes() + r.scratch);  // pages and the centring means
    double pages = 0, high = 0;
    for (int l = 0; l < s_.layers; ++l)
      cache_->storage().for_each_page(seq_, l, [&](std::int64_t, tierkv::page_id p) {
        pages += 1;
        high += is_8bit(p.format) ? 1 : 0;
      });
    m.fp8_fraction = pages > 0 ? high / pages : 0;
    return m;
  }

 private:
  // The 8-bit tiers (FP8, int8_rotated keys and values), reported as the "fp8" share.
  static constexpr bool eight_bit(tierkv::storage_format f) {
    return f == tierkv::storage_format::fp8_e4m3 || f == tierkv::storage_format::int8_rotated;
  }
  static bool is_8bit(int tier) {
    constexpr bool eight[] = {(eight_bit(Tiers::template key_codec<HD>::format) &&
                               eight_bit(Tiers::template value_codec<HD>::format))...};
    return eight[tier];
  }
  template <class T>
  static T check(tierkv::result<T> r) {
    if (!r) throw tierkv::error(r.error_status());
    return std::move(*r);
  }
  static void check(const tierkv::status& st) {
    if (!st) throw tierkv::error(st);
  }

  std::string name_;
  kv_shape s_;
  typename cache_type::options opt_{};
  std::unique_ptr<cache_type> cache_;
  tierkv::seq_id seq_{};
  std::uint64_t step_ = 0;
  bool retier_in_prefill_ = true;
};

// Arms by name: paged_f32 (the paging and tile machinery over lossless pages), the single
// formats fp8, tq3 and int8r, and the tiered mixes (Recent + Anchor pages in tier 0, Stale
// pages in tier 1). capacity: the most tokens a request holds.
inline std::unique_ptr<kv_backend> make_tierkv_backend(const std::string& arm, kv_shape s,
                                                       const tiering_options& opt, int capacity) {
  using dense_tier = tierkv::tier<tierkv::dense_f32, tierkv::dense_f32>;
  using fp8_tier = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
  using tq3_tier = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
  using int8r_tier = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;
  // Stale keys int8_rotated, values TQ3: a diagnostic over the bit budget (Stale pages cost
  // 5.75 bits) that tells key (routing) error from value error.
  using stale_k8_tier = tierkv::tier<tierkv::int8_rotated, tierkv::tq3_value>;
  // Stale keys TQ4 (routing precision for multi-needle retrieval), values TQ3: the
  // recommended Stale tier.
  using stale_k4_tier = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;
  const auto make = [&]<class... T>() -> std::unique_ptr<kv_backend> {
    return std::make_unique<library_backend<smol_geometry, T...>>(arm, s, opt, capacity);
  };
  if (arm == "paged_f32") return make.template operator()<dense_tier>();
  if (arm == "fp8") return make.template operator()<fp8_tier>();
  if (arm == "tq3") return make.template operator()<tq3_tier>();
  if (arm == "int8r") return make.template operator()<int8r_tier>();
  if (arm == "tiered") return make.template operator()<fp8_tier, tq3_tier>();
  if (arm == "tiered_int8r") return make.template operator()<int8r_tier, tq3_tier>();
  if (arm == "tiered_k8") return make.template operator()<int8r_tier, stale_k8_tier>();
  if (arm == "tiered_k4") return make.template operator()<int8r_tier, stale_k4_tier>();
  // The two configurations the quality records compare (bench/gpu/needle_suite.py's arms),
  // centring fixed: rec = tiered_k4 centred (the recommended cache), seed = the seed paper's
  // FP8 + TQ3 cache, not centred.
  if (arm == "rec" || arm == "seed") {
    tiering_options o = opt;
    o.center = arm == "rec";
    if (arm == "rec")
      return std::make_unique<library_backend<smol_geometry, int8r_tier, stale_k4_tier>>(arm, s, o,
                                                                                         capacity);
    return std::make_unique<library_backend<smol_geometry, fp8_tier, tq3_tier>>(arm, s, o,
                                                                                capacity);
  }
  throw std::runtime_error("unknown KV arm '" + arm +
                           "' (dense, paged_f32, fp8, tq3, int8r, tiered, tiered_int8r, "
                           "tiered_k4, tiered_k8, rec, seed)");
}

}  // namespace smollm
