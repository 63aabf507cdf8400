// SPDX-License-Identifier: Apache-2.0
// test_cuda_codec_exact's device side: the FP8 sweep kernels and the codec kernels of
// codec_kernels.cuh behind codec_exact_kernels.hpp (no Catch2 here).
#include "codec_exact_kernels.hpp"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda_test.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/codec_kernels.cuh"

using namespace tierkv;

namespace cuda_test {
namespace {

template <fp8_kind K>
__global__ void fp8_sweep_kernel(std::uint64_t begin, std::uint64_t end, fp8_sweep_result* r) {
  const __nv_fp8_interpretation_t interp = K == fp8_kind::e4m3 ? __NV_E4M3 : __NV_E5M2;
  for (std::uint64_t b = begin + blockIdx.x * std::uint64_t(blockDim.x) + threadIdx.x; b < end;
       b += std::uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(std::uint32_t(b));
    const std::uint8_t hw = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, interp);
    const std::uint8_t portable = tierkv::detail::float_to_fp8_portable<K>(x);
    const std::uint8_t pub = float_to_fp8<K>(x);
    if (isnan(x)) {
      const bool hw_nan = isnan(fp8_to_float<K>(hw));
      const bool p_nan = isnan(fp8_to_float<K>(portable));
      if (!hw_nan || !p_nan) atomicAdd(&r->nan_not_nan, 1ull);
      if (hw != portable) atomicAdd(&r->nan_pattern_differs, 1ull);
      continue;
    }
    if (hw != portable) {
      atomicAdd(&r->mismatch_hw_portable, 1ull);
      atomicExch(&r->first_bad_bits, std::uint32_t(b));
    }
    if (pub != hw) atomicAdd(&r->mismatch_public_hw, 1ull);
  }
}

template <fp8_kind K>
__global__ void fp8_convert_kernel(const float* x, std::uint8_t* out, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = float_to_fp8<K>(x[i]);
}

}  // namespace

template <fp8_kind K>
fp8_sweep_result fp8_sweep_all_floats() {
  fp8_sweep_result* r = nullptr;
  CUDA_OK(cudaMalloc(&r, sizeof(fp8_sweep_result)));
  CUDA_OK(cudaMemset(r, 0, sizeof(fp8_sweep_result)));
  fp8_sweep_kernel<K><<<4096, 256>>>(0, 1ull << 32, r);
  CUDA_OK(cudaGetLastError());
  fp8_sweep_result h{};
  CUDA_OK(cudaMemcpy(&h, r, sizeof h, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(r));
  return h;
}

template <fp8_kind K>
std::vector<std::uint8_t> fp8_convert_on_device(const std::vector<float>& xs) {
  const int n = int(xs.size());
  float* dx = nullptr;
  std::uint8_t* dout = nullptr;
  CUDA_OK(cudaMalloc(&dx, sizeof(float) * xs.size()));
  CUDA_OK(cudaMalloc(&dout, xs.size()));
  CUDA_OK(cudaMemcpy(dx, xs.data(), sizeof(float) * xs.size(), cudaMemcpyHostToDevice));
  fp8_convert_kernel<K><<<(n + 255) / 256, 256>>>(dx, dout, n);
  CUDA_OK(cudaGetLastError());
  std::vector<std::uint8_t> dev(xs.size());
  CUDA_OK(cudaMemcpy(dev.data(), dout, xs.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(dx));
  CUDA_OK(cudaFree(dout));
  return dev;
}

template fp8_sweep_result fp8_sweep_all_floats<fp8_kind::e4m3>();
template fp8_sweep_result fp8_sweep_all_floats<fp8_kind::e5m2>();
template std::vector<std::uint8_t> fp8_convert_on_device<fp8_kind::e4m3>(const std::vector<float>&);
template std::vector<std::uint8_t> fp8_convert_on_device<fp8_kind::e5m2>(const std::vector<float>&);

template <class Codec>
cudaError_t launch_encode(const codec_batch<Codec>& c, bool reference) {
  cuda::encode_batch<Codec> b;
  b.x = c.x;
  b.payload = c.payload;
  b.meta = c.meta;
  b.seeds = c.seeds;
  b.n = c.n;
  b.status = c.status;
  b.saturated = c.saturated;
  return reference ? cuda::launch_encode_reference(b) : cuda::launch_encode(b);
}

template <class Codec>
cudaError_t launch_decode(const codec_batch<Codec>& c) {
  cuda::decode_batch<Codec> db;
  db.payload = c.payload;
  db.meta = c.meta;
  db.seeds = c.seeds;
  db.n = c.n;
  db.out = c.out;
  return cuda::launch_decode(db);
}

namespace {

// Whether any of the 8 pairs (Pair: __half2 or __nv_bfloat162) is not its two floats of x (equal,
// or both NaN).
template <class Pair>
__device__ bool pairs_differ(const std::uint32_t (&h)[8], const float (&x)[16]) {
  bool bad = false;
  for (int c = 0; c < 8; ++c) {
    const Pair p = *reinterpret_cast<const Pair*>(&h[c]);
    const float f[2] = {__low2float(p), __high2float(p)};
    for (int j = 0; j < 2; ++j) {
      const float y = x[2 * c + j];
      bad |= !(f[j] == y || (isnan(f[j]) && isnan(y)));
    }
  }
  return bad;
}

// One thread a (vector, slice): the float unpack against each pair unpack the reader has.
template <class Codec>
__global__ void pair_unpack_kernel(const std::uint8_t* payloads, int vectors,
                                   pair_unpack_result* r) {
  using R = cuda::detail::slice_reader<Codec>;
  constexpr int per_vector = Codec::head_dim / 16;
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= (long long)vectors * per_vector) return;
  const int v = int(i / per_vector), s = int(i % per_vector);
  const typename R::raw raw = R::load(payloads + std::size_t(v) * Codec::payload_bytes, s);
  float x[16];
  R::unpack(raw, s, x);
  std::uint32_t h[8];
  bool h2_bad = false, bf_bad = false;
  if constexpr (cuda::detail::has_unpack_h2<R>) {
    R::unpack_h2(raw, s, h);
    h2_bad = pairs_differ<__half2>(h, x);
  }
  if constexpr (cuda::detail::has_unpack_bf16x2<R>) {
    R::unpack_bf16x2(raw, s, h);
    bf_bad = pairs_differ<__nv_bfloat162>(h, x);
  }
  if (h2_bad) atomicAdd(&r->h2_mismatch, 1ull);
  if (bf_bad) atomicAdd(&r->bf16x2_mismatch, 1ull);
  if (h2_bad || bf_bad) atomicMin(&r->first_bad, (unsigned long long)i);
}

}  // namespace

template <class Codec>
pair_unpack_result pair_unpacks_on_device(const std::vector<std::uint8_t>& payloads) {
  using R = cuda::detail::slice_reader<Codec>;
  const int vectors = int(payloads.size() / Codec::payload_bytes);
  pair_unpack_result h{};
  h.has_h2 = cuda::detail::has_unpack_h2<R>;
  h.has_bf16x2 = cuda::detail::has_unpack_bf16x2<R>;
  h.slices = (unsigned long long)vectors * (Codec::head_dim / 16);
  const device_buffer<std::uint8_t> dp(payloads);
  device_buffer<pair_unpack_result> dr(std::vector<pair_unpack_result>{h});
  pair_unpack_kernel<Codec><<<unsigned((h.slices + 255) / 256), 256>>>(dp.p, vectors, dr.p);
  CUDA_OK(cudaGetLastError());
  return dr.get()[0];
}

#define CUDA_TEST_PAIR_UNPACK(...) \
  template pair_unpack_result pair_unpacks_on_device<__VA_ARGS__>(const std::vector<std::uint8_t>&);
CUDA_TEST_PAIR_UNPACK(fp8_e4m3::bind<128>)
CUDA_TEST_PAIR_UNPACK(int8_rotated::bind<128>)
CUDA_TEST_PAIR_UNPACK(int8_rotated::bind<256>)
CUDA_TEST_PAIR_UNPACK(tq3_key::bind<256>)
CUDA_TEST_PAIR_UNPACK(tq3_value::bind<128>)
CUDA_TEST_PAIR_UNPACK(tq3_value::bind<256>)
CUDA_TEST_PAIR_UNPACK(tq4_key::bind<256>)
CUDA_TEST_PAIR_UNPACK(tq4_value::bind<64>)
CUDA_TEST_PAIR_UNPACK(dense_bf16::bind<128>)
CUDA_TEST_PAIR_UNPACK(tq2_key::bind<64>)
CUDA_TEST_PAIR_UNPACK(tq2_value::bind<256>)

#define CUDA_TEST_CODEC(...)                                                              \
  template cudaError_t launch_encode<__VA_ARGS__>(const codec_batch<__VA_ARGS__>&, bool); \
  template cudaError_t launch_decode<__VA_ARGS__>(const codec_batch<__VA_ARGS__>&);
CUDA_TEST_CODEC(tq3_key::bind<128>)
CUDA_TEST_CODEC(fp8_e4m3::bind<128>)
CUDA_TEST_CODEC(tq3_value::bind<128>)
CUDA_TEST_CODEC(tq3_key::bind<64>)
CUDA_TEST_CODEC(tq3_value::bind<256>)
CUDA_TEST_CODEC(tq3_key::bind<32>)
CUDA_TEST_CODEC(tq3_key::bind<512>)
CUDA_TEST_CODEC(fp8_e5m2::bind<128>)
CUDA_TEST_CODEC(fp8_e4m3::bind<80>)
CUDA_TEST_CODEC(dense_bf16::bind<128>)
CUDA_TEST_CODEC(tq4_key::bind<64>)
CUDA_TEST_CODEC(tq4_value::bind<128>)
CUDA_TEST_CODEC(tq4_key::bind<256>)
CUDA_TEST_CODEC(tq2_key::bind<64>)
CUDA_TEST_CODEC(tq2_value::bind<128>)
CUDA_TEST_CODEC(tq2_key::bind<256>)

}  // namespace cuda_test
