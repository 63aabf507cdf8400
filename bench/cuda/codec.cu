// SPDX-License-Identifier: Apache-2.0
// gpubench_codec --out FILE.json: encode / decode kernel throughput (GB/s of float
// input + compressed output bytes moved) against a device-to-device copy of the float
// input measured in the same run. Median of CUDA-event timings after warm-up;
// 2^21 vectors (1 GiB of float input at d = 128: cache-cold).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "tierkv/cuda/codec_kernels.cuh"

using namespace tierkv;

#define CK(expr)                                                              \
  do {                                                                        \
    const cudaError_t e_ = (expr);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

namespace {

__global__ void fill_kernel(float* x, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint64_t h = mix64(i);
    // Roughly uniform in (-2, 2), never zero.
    x[i] = (float(h >> 40) * 0x1p-24f - 0.5f) * 4.0f + 1e-3f;
  }
}

template <class F>
float median_ms(F&& f, int reps = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();
  f();  // warm-up
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct row {
  std::string name;
  double ms, gbps, ratio_to_copy;
};

template <class Codec>
void bench_codec(const char* label, int n, float* x, float* y, std::uint8_t* payload, void* meta,
                 double copy_gbps, std::vector<row>& rows) {
  using meta_t = typename Codec::meta_type;
  cuda::encode_batch<Codec> e;
  e.x = x;
  e.payload = payload;
  e.meta = static_cast<meta_t*>(meta);
  e.seed = 1234;
  e.n = n;
  cuda::decode_batch<Codec> d;
  d.payload = payload;
  d.meta = static_cast<const meta_t*>(meta);
  d.seed = 1234;
  d.n = n;
  d.out = y;
  const double bytes =
      double(n) * (Codec::head_dim * 4.0 + Codec::payload_bytes + Codec::meta_bytes);
  const float enc = median_ms([&] { CK(cuda::launch_encode(e)); });
  const float dec = median_ms([&] { CK(cuda::launch_decode(d)); });
  const double ge = bytes / (enc * 1e-3) / 1e9, gd = bytes / (dec * 1e-3) / 1e9;
  rows.push_back({std::string(label) + "_encode", enc, ge, ge / copy_gbps});
  rows.push_back({std::string(label) + "_decode", dec, gd, gd / copy_gbps});
}

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--out") == 0) out = argv[i + 1];
  const int n = 1 << 21;
  const int dmax = 256;
  float *x = nullptr, *y = nullptr;
  std::uint8_t* payload = nullptr;
  void* meta = nullptr;
  const std::size_t xfloats = std::size_t(n) * 128;  // d = 128 input; d = 256 uses n/2
  CK(cudaMalloc(&x, xfloats * 4));
  CK(cudaMalloc(&y, xfloats * 4));
  CK(cudaMalloc(&payload, std::size_t(n) * dmax));
  CK(cudaMalloc(&meta, std::size_t(n) * 2));
  fill_kernel<<<4096, 256>>>(x, xfloats);
  CK(cudaGetLastError());
  const double copy_bytes = 2.0 * double(xfloats) * 4;  // read + write
  const float copy_ms =
      median_ms([&] { CK(cudaMemcpyAsync(y, x, xfloats * 4, cudaMemcpyDeviceToDevice)); });
  const double copy_gbps = copy_bytes / (copy_ms * 1e-3) / 1e9;
  std::vector<row> rows;
  rows.push_back({"d2d_copy", copy_ms, copy_gbps, 1.0});
  bench_codec<fp8_e4m3::bind<128>>("fp8_e4m3_d128", n, x, y, payload, meta, copy_gbps, rows);
  bench_codec<tq3_key::bind<128>>("tq3_key_d128", n, x, y, payload, meta, copy_gbps, rows);
  bench_codec<tq3_value::bind<64>>("tq3_value_d64", n, x, y, payload, meta, copy_gbps, rows);
  bench_codec<tq3_key::bind<256>>("tq3_key_d256", n / 2, x, y, payload, meta, copy_gbps, rows);
  bench_codec<fp8_e4m3::bind<256>>("fp8_e4m3_d256", n / 2, x, y, payload, meta, copy_gbps, rows);
  CK(cudaDeviceSynchronize());

  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s; %d vectors (d=128); bytes = float input + payload + meta\n", prop.name,
              n);
  std::printf("%-22s %10s %10s %10s\n", "kernel", "ms", "GB/s", "vs copy");
  for (const auto& r : rows)
    std::printf("%-22s %10.4f %10.1f %10.3f\n", r.name.c_str(), r.ms, r.gbps, r.ratio_to_copy);
  if (!out.empty()) {
    FILE* f = std::fopen(out.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", out.c_str());
      return 1;
    }
    std::fprintf(f, "{\"name\":\"gpubench_codec\",\"device\":\"%s\",\"metrics\":{", prop.name);
    for (std::size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f, "%s\"%s_ms\":%.6f,\"%s_gbps\":%.3f,\"%s_vs_copy\":%.4f", i ? "," : "",
                   rows[i].name.c_str(), rows[i].ms, rows[i].name.c_str(), rows[i].gbps,
                   rows[i].name.c_str(), rows[i].ratio_to_copy);
    std::fprintf(f, "}}\n");
    std::fclose(f);
  }
  CK(cudaFree(x));
  CK(cudaFree(y));
  CK(cudaFree(payload));
  CK(cudaFree(meta));
  return 0;
}
