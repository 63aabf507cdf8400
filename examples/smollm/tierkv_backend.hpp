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
// whose smoothed attention mass stays high; Cold (the cold_* arms, issue 52) = old pages whose
// smoothed attention mass stays low; Stale = the rest.
//
// An arm name may carry policy knobs after '+' (no ',' or '-', so the name stays one field of
// scripts/measure ppl-texts's run files): e.g. cold_k3v2+cm=0.5+cl=1+ca=8. Knobs: rp
// recent_pages, sp sink_pages, kf / kl keep_first / keep_last_layers, em / lm enter / leave
// mass, cm / cl cold enter / leave mass, ca cold_after_pages, c centring (0/1), um use_mass
// (0/1), clm Cold layers (a mask), jit input jitter, bpt a bit budget (bits per scalar). They
// override the command line's.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kv_backend.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/tiering/recency_anchor.hpp"

namespace smollm {

struct tiering_options {
  tierkv::policy::recency_anchor_options policy{};  // tierkv's defaults unless overridden
  bool use_mass = true;                             // attention-mass anchors on / off
  // The Cold role's knobs for the arms with a Cold tier (cold_*): < 0 takes the arm's default
  // (cold_arm_defaults); the other arms keep tierkv's (Cold off).
  float cold_enter_mass = -1.0f;
  float cold_leave_mass = -1.0f;
  int cold_after_pages = -1;
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
  // Each K/V element times (1 + e) with e = +-input_jitter, a fixed pseudo-random sign per
  // element: a roundoff-sized perturbation (1e-6) measures how far a configuration's perplexity
  // moves with inputs that differ at rounding level, as two paths' models do (issue 57).
  float input_jitter = 0;
  // A bit budget (tier_controller_options::bits_per_scalar_target, issue 52): > 0 places every
  // movable page by keep value so that the live pages store at most this many bits per scalar.
  double bits_per_scalar_target = 0;
  // The budget's weight of key error (tier_controller_options::budget_key_weight).
  double budget_key_weight = 1;
  std::uint64_t seed = 0x7469657221ull;  // cache-wide seed of the codecs' rotations
  unsigned threads = 1;                  // host attention workers (the caller included)
};

// SmolLM2-135M: head_dim 64, 3 KV heads, 3 query heads per KV head; 16-token pages.
using smol_geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<3>,
                                       tierkv::group_size<3>, tierkv::page_tokens<16>>;

// Which tier each role lives in (tierkv::tier_roles): -1 keeps tier_roles' default (Anchor 0,
// Stale the last tier, Cold Stale's).
template <int Anchor = -1, int Stale = -1, int Cold = -1>
struct role_map {};

template <class TierList, class Map>
struct roles_for;
template <class TierList, int A, int S, int C>
struct roles_for<TierList, role_map<A, S, C>> {
  static constexpr int anchor = A < 0 ? 0 : A;
  static constexpr int stale = S < 0 ? TierList::size - 1 : S;
  static constexpr int cold = C < 0 ? stale : C;
  using type = tierkv::tier_roles<TierList, 0, anchor, stale, cold>;
};

template <class Geometry, class Map, class... Tiers>
class library_backend final : public kv_backend {
  using tier_list = tierkv::tiers<Tiers...>;
  using roles = typename roles_for<tier_list, Map>::type;
  using cache_type = tierkv::tiered_cache<Geometry, tier_list, tierkv::policy::recency_anchor,
                                          tierkv::host_allocator, tierkv::host_allocator, roles>;
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
    if (!opt.use_mass) {  // no page ever reaches the anchor threshold by its attention mass
      po.enter_mass = po.leave_mass = std::numeric_limits<float>::max();
      po.cold_enter_mass = po.cold_leave_mass = 0.0f;  // nor the cold one
    }
    opt_.policy = tierkv::policy::recency_anchor(po);
    opt_.max_batch = 1;
    opt_.max_pages = pages;
    opt_.threads = opt.threads;
    opt_.center = opt.center;
    opt_.tiering.bits_per_scalar_target = opt.bits_per_scalar_target;
    opt_.tiering.budget_key_weight = opt.budget_key_weight;
    retier_in_prefill_ = opt.retier_in_prefill;
    jitter_ = opt.input_jitter;
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
    if (jitter_ != 0) {
      jittered_.assign(k, k + len);
      jittered_.insert(jittered_.end(), v, v + len);
      std::uint64_t h =
          0x9e3779b97f4a7c15ull * (std::uint64_t(length() + 1) * 131 + std::uint64_t(layer));
      for (float& x : jittered_) {
        h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 29;
        x *= 1.0f + ((h & 1) ? jitter_ : -jitter_);
      }
      k = jittered_.data();
      v = jittered_.data() + len;
    }
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
    double per_tier[num_tiers] = {};
    m.layer_tiers.resize(std::size_t(s_.layers));
    for (int l = 0; l < s_.layers; ++l)
      cache_->storage().for_each_page(seq_, l, [&](std::int64_t logical, tierkv::page_id p) {
        pages += 1;
        high += is_8bit(p.format) ? 1 : 0;
        per_tier[p.format] += 1;
        std::string& t = m.layer_tiers[std::size_t(l)];
        if (t.size() <= std::size_t(logical)) t.resize(std::size_t(logical) + 1, '-');
        t[std::size_t(logical)] = char('0' + p.format);
      });
    m.fp8_fraction = pages > 0 ? high / pages : 0;
    for (int t = 0; t < num_tiers; ++t) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%st%d %.3f", t ? " " : "", t,
                    pages > 0 ? per_tier[t] / pages : 0.0);
      m.tier_shares += buf;
    }
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
  float jitter_ = 0;
  std::vector<float> jittered_;
};

// An arm name and its '+'-separated knobs (see the header comment) applied to opt.
inline std::string apply_arm_knobs(const std::string& full, tiering_options& opt) {
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const std::size_t plus = full.find('+', at);
    parts.push_back(full.substr(at, plus == std::string::npos ? std::string::npos : plus - at));
    if (plus == std::string::npos) break;
    at = plus + 1;
  }
  auto& p = opt.policy;
  for (std::size_t i = 1; i < parts.size(); ++i) {
    const std::string& kv = parts[i];
    const std::size_t eq = kv.find('=');
    if (eq == std::string::npos || eq + 1 == kv.size())
      throw std::runtime_error("arm '" + full + "': knob '" + kv + "' is not NAME=VALUE");
    const std::string k = kv.substr(0, eq);
    const char* text = kv.c_str() + eq + 1;
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (end == text || *end != '\0')
      throw std::runtime_error("arm '" + full + "': knob " + k + " = '" + text +
                               "' is not a number");
    const auto as_int = [&] {  // range first: int(v) of a value out of int's range is UB
      if (!(v >= double(std::numeric_limits<int>::min()) &&
            v <= double(std::numeric_limits<int>::max()) && v == std::trunc(v)))
        throw std::runtime_error("arm '" + full + "': knob " + k + " = " + text +
                                 " must be an integer in int's range");
      return int(v);
    };
    if (k == "rp")
      p.recent_pages = as_int();
    else if (k == "sp")
      p.sink_pages = as_int();
    else if (k == "kf")
      p.keep_first_layers = as_int();
    else if (k == "kl")
      p.keep_last_layers = as_int();
    else if (k == "em")
      p.enter_mass = float(v);
    else if (k == "lm")
      p.leave_mass = float(v);
    else if (k == "cm")
      opt.cold_enter_mass = float(v);
    else if (k == "cl")
      opt.cold_leave_mass = float(v);
    else if (k == "ca")
      opt.cold_after_pages = as_int();
    else if (k == "c")
      opt.center = as_int() != 0;
    else if (k == "um")
      opt.use_mass = as_int() != 0;
    else if (k == "jit") {
      if (!(std::fabs(v) <= 1e-2))
        throw std::runtime_error("arm '" + full + "': knob jit = " + text +
                                 " must be a relative perturbation in [-0.01, 0.01]");
      opt.input_jitter = float(v);
    } else if (k == "bpt") {  // a bit budget (bits per scalar)
      if (!(v > 0 && v <= 64))
        throw std::runtime_error("arm '" + full + "': knob bpt = " + text +
                                 " must be a bit budget in (0, 64]");
      opt.bits_per_scalar_target = v;
    } else if (k == "bkw") {  // the bit budget's weight of key error
      if (!(v > 0 && v <= 1e6))
        throw std::runtime_error("arm '" + full + "': knob bkw = " + text +
                                 " must be a weight in (0, 1e6]");
      opt.budget_key_weight = v;
    } else if (k == "clm") {  // Cold layers, a bit mask (bench/research/layer_profile.py)
      if (!(v >= 0 && v < 0x1p53 && v == double(std::uint64_t(v))))
        throw std::runtime_error("arm '" + full + "': knob clm = " + text +
                                 " must be an integer mask in [0, 2^53)");
      p.cold_layers = std::uint64_t(v);
    } else
      throw std::runtime_error("arm '" + full + "': unknown knob '" + k +
                               "' (rp, sp, kf, kl, em, lm, cm, cl, ca, c, um, clm, jit, bpt)");
  }
  return parts[0];
}

// The Cold arms' defaults when neither the command line nor the arm name sets them: a page
// whose smoothed attention mass falls below half a uniform share is Cold, back to Stale above
// one share; the newest 8 pages are never Cold (bench/results/cold/ has the sweep).
inline void cold_arm_defaults(tiering_options& o) {
  if (o.cold_enter_mass < 0) o.cold_enter_mass = 0.5f;
  if (o.cold_leave_mass < 0) o.cold_leave_mass = std::max(1.0f, o.cold_enter_mass);
  if (o.cold_after_pages < 0) o.cold_after_pages = 8;
}

// The tiers the arms are made of (arms_*.cpp), bits per scalar at head_dim 64 in the comments.
namespace arm_tiers {
using tierkv::int8_rotated;
using tierkv::tq2_key;
using tierkv::tq2_value;
using tierkv::tq3_key;
using tierkv::tq3_value;
using tierkv::tq4_key;
using tierkv::tq4_value;
using dense_tier = tierkv::tier<tierkv::dense_f32, tierkv::dense_f32>;
using fp8_tier = tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>;
using tq3_tier = tierkv::tier<tq3_key, tq3_value>;
using int8r_tier = tierkv::tier<int8_rotated, int8_rotated>;
// Stale keys int8_rotated, values TQ3: a diagnostic over the bit budget (Stale pages cost
// 5.75 bits) that tells key (routing) error from value error.
using stale_k8_tier = tierkv::tier<int8_rotated, tq3_value>;
// Stale keys TQ4 (routing precision for multi-needle retrieval), values TQ3: the
// recommended Stale tier.
using stale_k4_tier = tierkv::tier<tq4_key, tq3_value>;
// Issue 52's candidates: key and value codecs apart (key error moves routing, value error
// only the content read).
using k4v4 = tierkv::tier<tq4_key, tq4_value>;       // 4.25
using k4v2 = tierkv::tier<tq4_key, tq2_value>;       // 3.25
using k3v2 = tierkv::tier<tq3_key, tq2_value>;       // 2.75
using k3v4 = tierkv::tier<tq3_key, tq4_value>;       // 3.75
using k2v2 = tierkv::tier<tq2_key, tq2_value>;       // 2.25
using k8v4 = tierkv::tier<int8_rotated, tq4_value>;  // 6.25 (vLLM-like K8V4)
using k4v8 = tierkv::tier<tq4_key, int8_rotated>;    // 6.25
// Values with the keys' alpha (unbiased inner products: attention averages values, and the
// least-squares alpha shrinks each by ~cos^2 of its error angle, 0.88 at 2 bits): *u arms.
using k3v2u = tierkv::tier<tq3_key, tq2_key>;  // 2.75
using k4v3u = tierkv::tier<tq4_key, tq3_key>;  // 3.75
using k3v3u = tierkv::tier<tq3_key, tq3_key>;  // 3.25
using k4v2u = tierkv::tier<tq4_key, tq2_key>;  // 3.25: the key bits where routing needs them
using default_roles = role_map<>;
}  // namespace arm_tiers

// One arm: a library_backend over the tiers T... with the roles of Map.
template <class Map, class... T>
std::unique_ptr<kv_backend> make_arm(const std::string& full_arm, kv_shape s,
                                     const tiering_options& o, int capacity) {
  return std::make_unique<library_backend<smol_geometry, Map, T...>>(full_arm, s, o, capacity);
}

// Arms by name, one family a translation unit (~35 tiered_cache instantiations: apart, they
// compile in parallel, and once for smollm and test_smollm):
// - arms_core.cpp: paged_f32 (the paging and tile machinery over lossless pages), the single
//   formats fp8, tq3 and int8r, the tiered mixes (Recent + Anchor pages in tier 0, Stale pages
//   in tier 1), rec and seed; and make_tierkv_backend, which asks each family in turn;
// - arms_sub3.cpp: issue 52's one- and two-tier candidates (uniform_*, stale_*, rec_u);
// - arms_cold.cpp: issue 52's Cold and 4-bit-Anchor candidates (cold_*, a4*, a44_*, a84_*,
//   a48_*).
// capacity: the most tokens a request holds. An unknown arm or knob throws, naming them.
std::unique_ptr<kv_backend> make_tierkv_backend(const std::string& full_arm, kv_shape s,
                                                const tiering_options& base, int capacity);

namespace arm_family {
// The family's arm `arm` (its knobs already applied to opt), nullptr for a name outside it.
std::unique_ptr<kv_backend> core(const std::string& arm, const std::string& full_arm, kv_shape s,
                                 const tiering_options& opt, int capacity);
std::unique_ptr<kv_backend> sub3(const std::string& arm, const std::string& full_arm, kv_shape s,
                                 const tiering_options& opt, int capacity);
std::unique_ptr<kv_backend> cold(const std::string& arm, const std::string& full_arm, kv_shape s,
                                 const tiering_options& opt, int capacity);
}  // namespace arm_family

}  // namespace smollm
