// SPDX-License-Identifier: Apache-2.0
// test_cuda_codec_exact's device side (codec_exact_kernels.cu: its kernels and
// codec_kernels.cuh need nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/fp8.hpp"

namespace cuda_test {

struct fp8_sweep_result {
  unsigned long long mismatch_hw_portable;  // non-NaN inputs
  unsigned long long mismatch_public_hw;    // non-NaN inputs
  unsigned long long nan_not_nan;           // NaN input without a NaN code
  unsigned long long nan_pattern_differs;   // NaN codes that differ (informational)
  unsigned int first_bad_bits;
};

// Every float bit pattern converted on the device by cuda_fp8.h's __nv_cvt_float_to_fp8 (the
// hardware), the portable conversion and the public float_to_fp8<K>, compared there.
template <tierkv::fp8_kind K>
fp8_sweep_result fp8_sweep_all_floats();

// float_to_fp8<K>(xs[i]) computed on the device.
template <tierkv::fp8_kind K>
std::vector<std::uint8_t> fp8_convert_on_device(const std::vector<float>& xs);

// The fields of cuda::encode_batch<Codec> and cuda::decode_batch<Codec> the test sets
// (device pointers, n vectors, default strides).
template <class Codec>
struct codec_batch {
  const float* x = nullptr;
  std::uint8_t* payload = nullptr;
  typename Codec::meta_type* meta = nullptr;
  const std::uint64_t* seeds = nullptr;
  int n = 0;
  tierkv::errc* status = nullptr;
  unsigned long long* saturated = nullptr;
  float* out = nullptr;  // decode output
};

// cuda::launch_encode (reference = false: the warp kernels) or cuda::launch_encode_reference
// (one thread a vector), and cuda::launch_decode, on the default stream. Instantiated in
// codec_exact_kernels.cu for the codecs codec_exact.cpp checks.
template <class Codec>
cudaError_t launch_encode(const codec_batch<Codec>& b, bool reference);
template <class Codec>
cudaError_t launch_decode(const codec_batch<Codec>& b);

// Every slice of `payloads` (payload_bytes each) read by Codec's slice reader and unpacked to
// floats, and to f16 / bf16 pairs where the reader has them (unpack_h2 / unpack_bf16x2); a pair
// value that is not the float's (equal, or both NaN) is a mismatch.
struct pair_unpack_result {
  bool has_h2 = false, has_bf16x2 = false;
  unsigned long long slices = 0, h2_mismatch = 0, bf16x2_mismatch = 0;
  unsigned long long first_bad = ~0ull;  // vector * slices_per_vector + slice
};
template <class Codec>
pair_unpack_result pair_unpacks_on_device(const std::vector<std::uint8_t>& payloads);

}  // namespace cuda_test
