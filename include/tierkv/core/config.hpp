// SPDX-License-Identifier: Apache-2.0
// Compilation-environment switches shared by every tierkv header.
#pragma once

// TIERKV_HD marks functions callable from host and device code. Under nvcc it
// expands to __host__ __device__; in a plain C++ compiler it is empty, so the
// same numeric code is unit-tested on the CPU under sanitizers.
#if defined(__CUDACC__)
#define TIERKV_HD __host__ __device__
#define TIERKV_HD_INLINE __host__ __device__ __forceinline__
#define TIERKV_DEVICE __device__
#else
#define TIERKV_HD
#define TIERKV_HD_INLINE inline
#define TIERKV_DEVICE
#endif

// True while compiling device code (nvcc's device pass); host-only helpers
// (std::string, exceptions) stay out of those paths.
#if defined(__CUDA_ARCH__)
#define TIERKV_DEVICE_PASS 1
#else
#define TIERKV_DEVICE_PASS 0
#endif

#if defined(__CUDACC__) || defined(__clang__) || defined(__GNUC__)
#define TIERKV_RESTRICT __restrict__
#else
#define TIERKV_RESTRICT
#endif

#define TIERKV_VERSION_MAJOR 0
#define TIERKV_VERSION_MINOR 1
#define TIERKV_VERSION_PATCH 0

namespace tierkv {
/// Internal helpers live in tierkv::detail; nothing there is API.
namespace detail {
/// For static_assert(dependent_false<T>, "...") in primary templates that must
/// never be instantiated.
template <class...>
inline constexpr bool dependent_false = false;
}  // namespace detail
}  // namespace tierkv
