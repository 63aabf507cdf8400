// SPDX-License-Identifier: Apache-2.0
// dense_f32: the lossless control format (float32 per scalar, no metadata).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tierkv/codec/codec.hpp"

namespace tierkv {

/// float32 per scalar, no metadata: the lossless control (vector_codec).
template <int HeadDim>
struct dense_f32_codec {
  using meta_type = no_meta;                                             ///< none
  static constexpr storage_format format = storage_format::dense_f32;    ///< the storage format tag
  static constexpr int head_dim = HeadDim;                               ///< scalars per vector
  static constexpr std::size_t payload_bytes = sizeof(float) * HeadDim;  ///< the floats
  static constexpr std::size_t meta_bytes = 0;                           ///< no metadata
  static constexpr const char* name = "dense_f32";                       ///< the format's name

  /// Copies x; non_finite_input on NaN / Inf.
  TIERKV_HD static errc encode(const float* x, std::uint8_t* payload, meta_type&,
                               const codec_context&, encode_stats*) {
    for (int i = 0; i < HeadDim; ++i)
      if (!std::isfinite(x[i])) return errc::non_finite_input;
    std::memcpy(payload, x, payload_bytes);
    return errc::ok;
  }
  /// Copies the floats out.
  TIERKV_HD static void decode(const std::uint8_t* payload, const meta_type&, float* out,
                               const codec_context&) {
    std::memcpy(out, payload, payload_bytes);
  }
  /// The identity.
  TIERKV_HD static void prepare_query(const float* q, float* out, const codec_context&) {
    for (int i = 0; i < HeadDim; ++i) out[i] = q[i];
  }
  /// q . x.
  TIERKV_HD static float dot(const float* q, const std::uint8_t* payload, const meta_type&) {
    const float* k = reinterpret_cast<const float*>(payload);
    float s = 0.f;
    for (int i = 0; i < HeadDim; ++i) s += q[i] * k[i];
    return s;
  }
  /// acc += p x.
  TIERKV_HD static void accumulate(float p, const std::uint8_t* payload, const meta_type&,
                                   float* acc) {
    const float* v = reinterpret_cast<const float*>(payload);
    for (int i = 0; i < HeadDim; ++i) acc[i] += p * v[i];
  }
  /// Nothing to undo.
  TIERKV_HD static void finalize(float*, const codec_context&) {}
};

/// Codec family: dense float32 (lossless control).
struct dense_f32 {
  template <int HeadDim>
  using bind = dense_f32_codec<HeadDim>;  ///< the codec at HeadDim
  /// Expected error (codec/error_traits.hpp): Exact: no error.
  static constexpr error_figures expected_error{0.0, 0.0, 0.0};
};

namespace formats {
/// Dense float32 by name (tierkv/formats.hpp registers it).
struct f32 {
  static constexpr const char* name =
      "f32";                             ///< its run-time name (Python: recent, cache_type_k / _v)
  using key_family = tierkv::dense_f32;  ///< the codec family of its keys
  using value_family = tierkv::dense_f32;  ///< the codec family of its values
};
}  // namespace formats

static_assert(vector_codec<dense_f32_codec<128>>);
static_assert(codec_family<dense_f32>);

}  // namespace tierkv
