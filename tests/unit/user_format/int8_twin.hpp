// SPDX-License-Identifier: Apache-2.0
// A storage format registered from outside tierkv (tierkv/formats.hpp, TIERKV_USER_FORMATS):
// int8_rotated's codes under a tag and a name of their own, "int8_twin". What it proves is the
// registration (names, tags, tier lists, transfers, the GPU's device codec, Python's names), and
// every result it gives is checkable bit for bit against int8_rotated's. Adding it touched no
// file of include/ (issue 51: a format is declared once).
#pragma once

#include "tierkv/codec/int8_rotated.hpp"
#if defined(__CUDACC__)
#include "tierkv/cuda/codec/int8_rotated.cuh"
#endif

namespace tierkv_test {

/// int8_rotated's codec under the user tag 200.
template <int HeadDim>
struct int8_twin_codec : tierkv::int8_rotated_codec<HeadDim> {
  static constexpr tierkv::storage_format format = tierkv::storage_format{200};
  static constexpr const char* name = "int8_twin";
};

/// Its codec family (keys and values alike, as int8_rotated).
struct int8_twin {
  template <int HeadDim>
  using bind = int8_twin_codec<HeadDim>;
  static constexpr tierkv::error_figures expected_error = tierkv::int8_rotated::expected_error;
};

namespace formats {
/// The descriptor TIERKV_USER_FORMATS names.
struct int8_twin {
  static constexpr const char* name = "int8_twin";
  using key_family = tierkv_test::int8_twin;
  using value_family = tierkv_test::int8_twin;
};
}  // namespace formats

}  // namespace tierkv_test

#if defined(__CUDACC__)
namespace tierkv::cuda::detail {
/// The kernels read it as int8_rotated (the same codes and meta).
template <class C>
struct device_codec<C, storage_format{200}> : device_codec<C, storage_format::int8_rotated> {};
}  // namespace tierkv::cuda::detail
#endif
