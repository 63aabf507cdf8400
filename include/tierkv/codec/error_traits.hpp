// SPDX-License-Identifier: Apache-2.0
// Error traits: what characterizes a codec in each role, the expected figures (measured,
// documented constants) and the functions that measure them, plus exact bits per scalar.
//   key role:   inner-product error e = (q·k_hat − q·k) / (|q||k|), with query-like q
//               correlated with k (q = k + g, g an independent Gaussian); bias = mean(e),
//               rms = sqrt(mean(e^2)), gain = regression slope of q·k_hat on q·k.
//   value role: relative MSE |x − x_hat|^2 / |x|^2 (sum over vectors / sum of norms).
// Inputs are i.i.d. N(0, 1) vectors; every vector gets its own rotation seed.
// Figures: docs/codecs.md (scripts/measure codec).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/tier.hpp"

namespace tierkv {

/// How a codec's error is measured: inner-product error (key role) or relative MSE (value role).
enum class error_measure : std::uint8_t { inner_product, relative_mse };

/// The role decides the measure (tier.hpp: keys move routing, values move content).
constexpr error_measure measure_for(kv_role role) {
  return role == kv_role::key ? error_measure::inner_product : error_measure::relative_mse;
}

/// Inner-product error e = (q·k_hat − q·k) / (|q||k|) over the measured samples (key role).
struct inner_product_error {
  double bias = 0;            ///< mean of e
  double rms = 0;             ///< sqrt(mean e^2)
  double max_abs = 0;         ///< max |e|
  double gain = 0;            ///< sum (q·k_hat)(q·k) / sum (q·k)^2; 1 = no shrinkage
  std::uint64_t samples = 0;  ///< number of (q, k) pairs measured
};
/// Relative MSE |x − x_hat|^2 / |x|^2 over the measured vectors (value role).
struct mse_error {
  double rel_mse = 0;         ///< sum |x − x_hat|^2 / sum |x|^2
  double max_rel_mse = 0;     ///< worst single vector
  std::uint64_t samples = 0;  ///< number of vectors measured
};

namespace detail {
/// Deterministic N(0,1) source independent of the standard library's distributions, so a
/// seed gives the same vectors with every compiler (splitmix64 + Box–Muller in double).
class gaussian_source {
 public:
  explicit gaussian_source(std::uint64_t seed) : state_(seed) {}
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = (double(mix64(state_++) >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = double(mix64(state_++) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(6.283185307179586 * u2);
    has_spare_ = true;
    return r * std::cos(6.283185307179586 * u2);
  }
  void fill(float* x, int n) {
    for (int i = 0; i < n; ++i) x[i] = float(next());
  }

 private:
  std::uint64_t state_;
  double spare_ = 0;
  bool has_spare_ = false;
};
}  // namespace detail

/// Measures the key-role error of codec C over `vectors` Gaussian keys through the
/// attention path (prepare_query + dot), against a float64 reference.
template <vector_codec C>
inner_product_error measure_inner_product_error(int vectors, std::uint64_t seed) {
  constexpr int d = C::head_dim;
  detail::gaussian_source rng(seed);
  std::vector<float> k(d), g(d), q(d), qp(d);
  std::vector<std::uint8_t> payload(C::payload_bytes);
  typename C::meta_type meta{};
  inner_product_error r;
  double sum = 0, sum2 = 0, cross = 0, ref2 = 0;
  for (int v = 0; v < vectors; ++v) {
    rng.fill(k.data(), d);
    rng.fill(g.data(), d);
    const codec_context ctx{mix64(seed ^ (0x9e3779b97f4a7c15ull * std::uint64_t(v + 1)))};
    if (C::encode(k.data(), payload.data(), meta, ctx, nullptr) != errc::ok) continue;
    double qk = 0, qq = 0, kk = 0;
    for (std::size_t i = 0; i < std::size_t(d); ++i) {
      q[i] = k[i] + g[i];
      qk += double(q[i]) * k[i];
      qq += double(q[i]) * q[i];
      kk += double(k[i]) * k[i];
    }
    C::prepare_query(q.data(), qp.data(), ctx);
    const double qkhat = double(C::dot(qp.data(), payload.data(), meta));
    const double e = (qkhat - qk) / std::sqrt(qq * kk);
    sum += e;
    sum2 += e * e;
    r.max_abs = std::fabs(e) > r.max_abs ? std::fabs(e) : r.max_abs;
    cross += qkhat * qk;
    ref2 += qk * qk;
    ++r.samples;
  }
  if (r.samples) {
    r.bias = sum / double(r.samples);
    r.rms = std::sqrt(sum2 / double(r.samples));
    r.gain = cross / ref2;
  }
  return r;
}

/// Measures the value-role error (relative MSE of decode) of codec C.
template <vector_codec C>
mse_error measure_relative_mse(int vectors, std::uint64_t seed) {
  constexpr int d = C::head_dim;
  detail::gaussian_source rng(seed);
  std::vector<float> x(d), y(d);
  std::vector<std::uint8_t> payload(C::payload_bytes);
  typename C::meta_type meta{};
  mse_error r;
  double err = 0, ref = 0;
  for (int v = 0; v < vectors; ++v) {
    rng.fill(x.data(), d);
    const codec_context ctx{mix64(seed ^ (0x9e3779b97f4a7c15ull * std::uint64_t(v + 1)))};
    if (C::encode(x.data(), payload.data(), meta, ctx, nullptr) != errc::ok) continue;
    C::decode(payload.data(), meta, y.data(), ctx);
    double e = 0, n = 0;
    for (std::size_t i = 0; i < std::size_t(d); ++i) {
      const double diff = double(y[i]) - double(x[i]);
      e += diff * diff;
      n += double(x[i]) * x[i];
    }
    err += e;
    ref += n;
    r.max_rel_mse = e / n > r.max_rel_mse ? e / n : r.max_rel_mse;
    ++r.samples;
  }
  if (r.samples) r.rel_mse = err / ref;
  return r;
}

/// Expected figures of a codec family on N(0,1) vectors (docs/codecs.md has the runs): its
/// `expected_error` (codec.hpp's error_figures), declared beside the family.
template <class Family>
struct codec_error_traits {
  static_assert(detail::dependent_false<Family>,
                "codec_error_traits: the codec family declares no `static constexpr "
                "error_figures expected_error` (its measured figures, codec/codec.hpp)");
};
/// The figures a family declares.
template <class Family>
requires requires { Family::expected_error; }
struct codec_error_traits<Family> {
  /// Expected relative MSE (value role).
  static constexpr double rel_mse = Family::expected_error.rel_mse;
  /// Expected inner-product rms times sqrt(head_dim) (key role).
  static constexpr double ip_rms_sqrt_d = Family::expected_error.ip_rms_sqrt_d;
  /// Expected mean inner-product error (key role).
  static constexpr double ip_bias = Family::expected_error.ip_bias;
};

namespace detail {
template <class Family, class Codec, bool Key>
double role_budget_error() {
  if constexpr (requires { Family::expected_error; }) {
    const double r = codec_error_traits<Family>::ip_rms_sqrt_d;
    return Key ? r * r : codec_error_traits<Family>::rel_mse;
  } else {
    return std::exp2(-2.0 * bits_per_scalar<Codec>);
  }
}
}  // namespace detail

/// The key role's part of a tier's expected error for the bit budget (tiering/bit_budget.hpp):
/// the key family's inner-product rms^2 x head_dim (the variance of a logit's error at
/// unit-variance logits). A family that declares no expected_error (an engine's own codec) is
/// taken at the Gaussian rate-distortion bound of its bits, 2^(-2 bits) per role: a bound, not a
/// measurement, so a budget over such a tier orders it by its cost alone.
template <class Tier, int HeadDim>
double tier_budget_key_error() {
  return detail::role_budget_error<typename Tier::key_family,
                                   typename Tier::template key_codec<HeadDim>, true>();
}
/// The value role's part: the value family's relative MSE (the same bound without figures).
template <class Tier, int HeadDim>
double tier_budget_value_error() {
  return detail::role_budget_error<typename Tier::value_family,
                                   typename Tier::template value_codec<HeadDim>, false>();
}
/// Exact storage cost of a family at a head_dim: payload + per-vector metadata.
template <class Family, int HeadDim>
inline constexpr double family_bits_per_scalar = bits_per_scalar<codec_for<Family, HeadDim>>;

/// What tier<K, V> offers at a head_dim: each role judged by its own measure.
template <class Tier, int HeadDim>
struct tier_error_traits {
  static_assert(is_tier<Tier>::value, "tier_error_traits: Tier must be a tierkv::tier<K, V>");
  /// The key codec of the tier at HeadDim.
  using key_codec = typename Tier::template key_codec<HeadDim>;
  /// The value codec of the tier at HeadDim.
  using value_codec = typename Tier::template value_codec<HeadDim>;
  /// Expected figures of the key family.
  using key_traits = codec_error_traits<typename Tier::key_family>;
  /// Expected figures of the value family.
  using value_traits = codec_error_traits<typename Tier::value_family>;

  /// Exact storage bits per key scalar (payload + per-vector metadata).
  static constexpr double key_bits_per_scalar = bits_per_scalar<key_codec>;
  /// Exact storage bits per value scalar (payload + per-vector metadata).
  static constexpr double value_bits_per_scalar = bits_per_scalar<value_codec>;
  /// Mean bits per scalar over keys and values.
  static constexpr double bits_per_scalar_kv = (key_bits_per_scalar + value_bits_per_scalar) / 2;
  /// Expected mean inner-product error of the keys.
  static constexpr double expected_key_ip_bias = key_traits::ip_bias;
  /// Expected inner-product rms of the keys at HeadDim (ip_rms_sqrt_d / sqrt(HeadDim)).
  static double expected_key_ip_rms() {
    return key_traits::ip_rms_sqrt_d / std::sqrt(double(HeadDim));
  }
  /// Expected relative MSE of the values.
  static constexpr double expected_value_rel_mse = value_traits::rel_mse;

  /// Measures the key codec's inner-product error on `vectors` N(0,1) vectors from `seed`.
  static inner_product_error measure_keys(int vectors, std::uint64_t seed) {
    return measure_inner_product_error<key_codec>(vectors, seed);
  }
  /// Measures the value codec's relative MSE on `vectors` N(0,1) vectors from `seed`.
  static mse_error measure_values(int vectors, std::uint64_t seed) {
    return measure_relative_mse<value_codec>(vectors, seed);
  }
};

}  // namespace tierkv
