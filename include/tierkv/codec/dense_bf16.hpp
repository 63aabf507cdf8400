// SPDX-License-Identifier: Apache-2.0
// dense_bf16: the realistic dense control (what engines store today): bf16 per
// scalar, round to nearest even, no metadata.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/float_bits.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// bf16 per scalar (round to nearest even), no metadata: the BF16 control (vector_codec).
template <int HeadDim>
struct dense_bf16_codec {
  static_assert(HeadDim >= 1 && HeadDim <= 4096, "dense_bf16: head_dim must lie in [1, 4096]");
  using meta_type = no_meta;                                            ///< none
  static constexpr storage_format format = storage_format::dense_bf16;  ///< the storage format tag
  static constexpr int head_dim = HeadDim;                              ///< scalars per vector
  static constexpr std::size_t payload_bytes =
      sizeof(bf16_bits) * std::size_t(HeadDim);      ///< the bf16 values
  static constexpr std::size_t meta_bytes = 0;       ///< no metadata
  static constexpr const char* name = "dense_bf16";  ///< the format's name
  /// GPU decode work per scalar against an 8-bit format (codec.hpp): not measured apart from FP8.
  static constexpr int decode_work_percent = 100;

  /// The bf16 bits of scalar i of a payload.
  TIERKV_HD static bf16_bits load(const std::uint8_t* p, int i) {
    return bf16_bits(p[2 * i] | (p[2 * i + 1] << 8));
  }
  /// Scalar i of a payload as a float.
  TIERKV_HD static float value(const std::uint8_t* p, int i) { return bf16_to_float(load(p, i)); }

  /// Finite values beyond the bf16 range (|x| > 3.3895e38 after rounding) saturate to
  /// +-max finite and are counted. Non-finite input: every element is written as a bf16
  /// NaN, so a slot read by mistake is loud.
  TIERKV_HD static errc encode(const float* x, std::uint8_t* payload, meta_type&,
                               const codec_context&, encode_stats* stats) {
    for (int i = 0; i < HeadDim; ++i)
      if (!detail::is_finite_bits(x[i])) {
        for (int j = 0; j < HeadDim; ++j) {
          payload[2 * j] = std::uint8_t(bf16_quiet_nan & 0xFF);
          payload[2 * j + 1] = std::uint8_t(bf16_quiet_nan >> 8);
        }
        return errc::non_finite_input;
      }
    std::uint64_t sat = 0;
    for (int i = 0; i < HeadDim; ++i) {
      bool s = false;
      const bf16_bits b = float_to_bf16_satfinite(x[i], &s);
      sat += s ? 1u : 0u;
      payload[2 * i] = std::uint8_t(b & 0xFF);
      payload[2 * i + 1] = std::uint8_t(b >> 8);
    }
    if (stats) stats->saturated += sat;
    return errc::ok;
  }
  /// The values as floats.
  TIERKV_HD static void decode(const std::uint8_t* payload, const meta_type&, float* out,
                               const codec_context&) {
    for (int i = 0; i < HeadDim; ++i) out[i] = value(payload, i);
  }
  /// The identity.
  TIERKV_HD static void prepare_query(const float* q, float* out, const codec_context&) {
    for (int i = 0; i < HeadDim; ++i) out[i] = q[i];
  }
  /// q . x_hat.
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload, const meta_type&) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0;
    for (; i + 4 <= HeadDim; i += 4)
      for (int u = 0; u < 4; ++u) s[u] += q[i + u] * value(payload, i + u);
    if constexpr (HeadDim % 4 != 0)
      for (; i < HeadDim; ++i) s[0] += q[i] * value(payload, i);
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
  /// acc += p x_hat.
  TIERKV_HD static void accumulate(float p, const std::uint8_t* payload, const meta_type&,
                                   float* acc) {
    for (int i = 0; i < HeadDim; ++i) acc[i] += p * value(payload, i);
  }
  /// Nothing to undo.
  TIERKV_HD static void finalize(float*, const codec_context&) {}
};

/// Codec family: dense bf16 (the BF16 control).
struct dense_bf16 {
  template <int HeadDim>
  using bind = dense_bf16_codec<HeadDim>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): Measured at head_dim 128, 20000 vectors
  /// (docs/codecs.md, scripts/measure codec).
  static constexpr error_figures expected_error{2.9e-6, 0.00234, 0.0};
};

namespace formats {
/// Dense bf16 by name (the BF16 control) (tierkv/formats.hpp registers it).
struct bf16 {
  static constexpr const char* name =
      "bf16";                             ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::dense_bf16;  ///< the codec family of its keys
  using value_family = tierkv::dense_bf16;  ///< the codec family of its values
};
}  // namespace formats

static_assert(vector_codec<dense_bf16_codec<128>>);
static_assert(codec_family<dense_bf16>);

}  // namespace tierkv
