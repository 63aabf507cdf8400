// SPDX-License-Identifier: Apache-2.0
// 04_custom_codec: a user-defined vector codec in a tier of the host cache. int8_token stores a
// token vector as head_dim int8 codes of x / s with one float scale s = max|x| / 127 per vector,
// so every decoded scalar is within s / 2 (plus float rounding) of the input. The example
// 1. checks that bound on 20000 random vectors (and the codec's refusal of NaN input),
// 2. decodes with a tiered_cache whose 8-bit tier is tier<int8_token, int8_token> and compares
//    the output with the same cache in dense float32 pages,
// 3. retiers until old pages are converted from int8_token into TQ3 and decodes again.
// Exits 1 if a check fails.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <vector>

#include <tierkv/tierkv.hpp>

namespace {

// A vector_codec (tierkv/codec/codec.hpp): static members the pools, the attention tiles and
// the conversions call. Attention works in the codec's domain; here that is the identity, so
// prepare_query copies and finalize does nothing.
template <int HeadDim>
struct int8_token_codec {
  using meta_type = float;  // the scale s
  // A tag of its own: storage_format values 0-6 are tierkv's formats. Page-transfer buffers
  // record the tag, and the attention tiles take a fast path only for built-in tags.
  static constexpr tierkv::storage_format format = static_cast<tierkv::storage_format>(0x80);
  static constexpr int head_dim = HeadDim;
  static constexpr std::size_t payload_bytes = std::size_t(HeadDim);
  static constexpr std::size_t meta_bytes = sizeof(float);
  static constexpr const char* name = "int8_token";

  static tierkv::errc encode(const float* x, std::uint8_t* payload, meta_type& scale,
                             const tierkv::codec_context&, tierkv::encode_stats*) {
    float amax = 0.f;
    for (int i = 0; i < HeadDim; ++i) {
      if (!std::isfinite(x[i])) {  // the concept's contract: refuse, leave a loud slot
        std::fill(payload, payload + HeadDim, std::uint8_t(0));
        scale = std::numeric_limits<float>::quiet_NaN();
        return tierkv::errc::non_finite_input;
      }
      amax = std::max(amax, std::fabs(x[i]));
    }
    scale = amax / 127.f;
    for (int i = 0; i < HeadDim; ++i) {
      const long c = scale > 0.f ? std::lrint(x[i] / scale) : 0;
      payload[i] = std::uint8_t(std::int8_t(std::clamp(c, -127L, 127L)));
    }
    return tierkv::errc::ok;
  }
  static float code(std::uint8_t b) { return float(std::int8_t(b)); }
  static void decode(const std::uint8_t* payload, const meta_type& scale, float* out,
                     const tierkv::codec_context&) {
    for (int i = 0; i < HeadDim; ++i) out[i] = code(payload[i]) * scale;
  }
  static void prepare_query(const float* q, float* out, const tierkv::codec_context&) {
    std::copy(q, q + HeadDim, out);
  }
  static float dot(const float* q, const std::uint8_t* payload, const meta_type& scale) {
    float s = 0.f;
    for (int i = 0; i < HeadDim; ++i) s += q[i] * code(payload[i]);
    return s * scale;
  }
  static void accumulate(float p, const std::uint8_t* payload, const meta_type& scale, float* acc) {
    const float w = p * scale;
    for (int i = 0; i < HeadDim; ++i) acc[i] += w * code(payload[i]);
  }
  static void finalize(float*, const tierkv::codec_context&) {}
};
// The family: a tag that binds to a head_dim, what tier<K, V> takes.
struct int8_token {
  template <int HeadDim>
  using bind = int8_token_codec<HeadDim>;
};
static_assert(tierkv::vector_codec<int8_token_codec<64>>);
static_assert(tierkv::codec_family<int8_token>);

using geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>, tierkv::group_size<2>,
                                  tierkv::page_tokens<16>>;
constexpr int kLayers = 4, D = geometry::head_dim, KV = geometry::kv_heads;
using codec = int8_token::bind<D>;
using int8t = tierkv::tier<int8_token, int8_token>;
using tq3 = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;
using dense = tierkv::tier<tierkv::dense_f32, tierkv::dense_f32>;
using cache_t = tierkv::tiered_cache<geometry, tierkv::tiers<int8t, tq3>>;
using dense_cache_t = tierkv::tiered_cache<geometry, tierkv::tiers<dense>>;

std::uint64_t rng = 1;
float gauss() {  // Box-Muller over mix64
  const double u1 = (double(tierkv::mix64(rng++) >> 11) + 0.5) * 0x1.0p-53;
  const double u2 = double(tierkv::mix64(rng++) >> 11) * 0x1.0p-53;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Worst |x - decode(encode(x))| / (s / 2 + rounding) over random vectors of varied magnitude,
// some with an outlier channel; <= 1 means the bound holds.
double codec_bound_ratio(int vectors) {
  double worst = 0;
  std::vector<float> x(D), y(D);
  std::uint8_t payload[D];
  for (int n = 0; n < vectors; ++n) {
    const float magnitude = std::ldexp(1.f, n % 41 - 20);
    for (auto& e : x) e = magnitude * gauss();
    if (n % 3 == 0) x[std::size_t(n) % D] *= 50.f;
    float s = 0.f;
    if (codec::encode(x.data(), payload, s, {}, nullptr) != tierkv::errc::ok) return INFINITY;
    codec::decode(payload, s, y.data(), {});
    float amax = 0.f;
    for (float e : x) amax = std::max(amax, std::fabs(e));
    const double bound = 0.5 * double(s) + 4.0 * FLT_EPSILON * double(amax);
    for (int i = 0; i < D; ++i)
      worst = std::max(worst, std::fabs(double(x[std::size_t(i)]) - double(y[std::size_t(i)])) /
                                  std::max(bound, 1e-300));
  }
  return worst;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main() {
  bool ok = true;
  auto check = [&](bool cond, const char* what) {
    if (!cond) std::printf("FAILED: %s\n", what);
    ok = ok && cond;
  };

  // 1. The codec on its own.
  const double ratio = codec_bound_ratio(20000);
  std::vector<float> bad(D, 1.f);
  bad[7] = std::numeric_limits<float>::quiet_NaN();
  std::uint8_t payload[D];
  float s = 0.f;
  const bool refused =
      codec::encode(bad.data(), payload, s, {}, nullptr) == tierkv::errc::non_finite_input;
  std::printf(
      "int8_token codec: %.2f bits/scalar; worst error / (s/2 + rounding) over 20000 "
      "vectors = %.3f (must be <= 1); NaN input refused: %s\n",
      tierkv::bits_per_scalar<codec>, ratio, refused ? "yes" : "no");
  check(ratio <= 1.0, "the codec's error bound");
  check(refused, "non-finite input refused");

  // 2. The codec as the 8-bit tier of a cache, against the same cache in dense float32 pages.
  cache_t::options opt;
  opt.storage.num_layers = kLayers;
  opt.storage.max_sequences = 2;
  opt.storage.pages_per_tier = {128, 128};
  opt.policy = tierkv::policy::recency_anchor(
      {.recent_pages = 2, .keep_first_layers = 0, .keep_last_layers = 0});
  opt.max_batch = 1;
  opt.max_pages = 32;
  auto cache = cache_t::create(opt).value();
  dense_cache_t::options dopt;
  dopt.storage.num_layers = kLayers;
  dopt.storage.max_sequences = 2;
  dopt.storage.pages_per_tier = {128};
  dopt.max_batch = 1;
  dopt.max_pages = 32;
  auto reference = dense_cache_t::create(dopt).value();

  const std::vector<tierkv::seq_id> seq{cache->create_sequence().value()};
  const std::vector<tierkv::seq_id> ref_seq{reference->create_sequence().value()};
  auto append = [&](long n) {
    std::vector<float> k(std::size_t(kLayers * n * KV * D)), v(k.size());
    for (auto& x : k) x = gauss();
    for (auto& x : v) x = gauss();
    cache->append(seq[0], n, k, v).throw_if_error();
    reference->append(ref_seq[0], n, k, v).throw_if_error();
  };
  std::vector<float> q(std::size_t(geometry::q_heads) * D), out(q.size()), ref(q.size());
  auto decode_error = [&] {
    double worst = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (auto& x : q) x = gauss();
      cache->attend(l, seq, q, out).throw_if_error();
      reference->attend(l, ref_seq, q, ref).throw_if_error();
      worst = std::max(worst, rel_l2(out, ref));
    }
    return worst;
  };
  append(400);
  const double err_8bit = decode_error();
  std::printf(
      "decode over int8_token pages vs dense float32 pages: worst relative L2 %.4f "
      "(bound 0.02)\n",
      err_8bit);
  check(err_8bit <= 0.02, "decode error over int8_token pages");

  // 3. Old pages leave the custom tier: the controller decodes them with int8_token and
  // encodes them as TQ3 (the default policy: once out of the Recent window; min_dwell_steps =
  // 8 steps between a page's later moves).
  std::uint64_t demoted = 0;
  for (std::uint64_t step = 1; step <= 10; ++step) {
    append(1);
    (void)decode_error();
    const auto st = cache->retier(step);
    st.first_error.throw_if_error();
    demoted += st.demoted;
  }
  const double err_mixed = decode_error();
  const tierkv::memory_report report = cache->report();
  std::printf(
      "after 10 steps: %llu pages demoted into TQ3; decode over int8_token + TQ3 pages vs "
      "dense: worst relative L2 %.4f (bound 0.35)\n",
      static_cast<unsigned long long>(demoted), err_mixed);
  std::cout << report << "\n";
  check(demoted > 0 && report.tiers[1].live_pages == demoted, "pages converted into TQ3");
  // Most pages are TQ3 now: all-TQ3 pages decode at about 0.27 relative L2 (docs/attention.md).
  check(err_mixed <= 0.35, "decode error over mixed pages");
  check(report.reconciles() && cache->check_invariants().is_ok(), "report and invariants");
  return ok ? 0 : 1;
}
