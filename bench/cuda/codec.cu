// SPDX-License-Identifier: Apache-2.0
// gpubench_codec [--out FILE.json] [--commit SHA] [--benchmark_* flags]: encode / decode kernel
// throughput (GB/s of float input + compressed output bytes moved) against a device-to-device
// copy of the float input measured in the same run; 2^21 vectors (1 GiB of float input at
// d = 128: cache-cold). Google Benchmark: codec/op:d2d_copy and one benchmark per (codec, d, op),
// e.g. codec/codec:tq3_key/head_dim:128/op:encode/vectors:2097152, 15 repetitions of one timed
// call after 2 warm-up calls, the median reported (bench_support.cuh: L2 flushed, spin kernel,
// CUDA-event manual time). Counters: bytes, GB/s. bench/gpu/gbench_record.py turns the JSON into
// the codec record (metrics <codec>_d<d>_<op>_ms / _gbps / _vs_copy).
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bench_support.cuh"
#include "gbench_main.hpp"
#include "tierkv/cuda/codec_kernels.cuh"

namespace {

using namespace tierkv;
using namespace tierkv::bench;

constexpr int vectors = 1 << 21;  // at d = 128; d = 256 takes half as many
constexpr int dmax = 256;
constexpr std::size_t xfloats = std::size_t(vectors) * 128;
constexpr int reps = 15, warm = 2;

struct device_state {
  cudaStream_t stream = nullptr;
  std::unique_ptr<l2_flusher> flush;
  device_array<float> x, y;
  device_array<std::uint8_t> payload;
  device_array<std::uint16_t> meta;  // bf16 scales / norms
};
std::unique_ptr<device_state> dev;

__global__ void fill_kernel(float* x, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint64_t h = mix64(i);
    // Roughly uniform in (-2, 2), never zero.
    x[i] = (float(h >> 40) * 0x1p-24f - 0.5f) * 4.0f + 1e-3f;
  }
}

template <class F>
void time_it(benchmark::State& st, const first_time& first, double bytes, F&& call) {
  if (first()) warm_up(dev->stream, warm, call);
  gpu_timer t(dev->stream, dev->flush.get());
  const double us = timed_iterations(st, t, call);
  st.counters["bytes"] = bytes;
  st.counters["GB/s"] = bytes / us * 1e-3;
}

template <class Codec>
void register_codec(const char* codec, int n) {
  using meta_t = typename Codec::meta_type;
  const double bytes =
      double(n) * (Codec::head_dim * 4.0 + Codec::payload_bytes + Codec::meta_bytes);
  for (int op = 0; op < 2; ++op) {
    const bench_name name = bench_name("codec")
                                .add("codec", codec)
                                .add("head_dim", Codec::head_dim)
                                .add("op", op == 0 ? "encode" : "decode");
    auto* b = benchmark::RegisterBenchmark(
        name.c_str(), [op, bytes, first = first_time()](benchmark::State& st) {
          const int count = int(st.range(0));
          if (op == 0) {
            cuda::encode_batch<Codec> e;
            e.x = dev->x.get();
            e.payload = dev->payload.get();
            e.meta = reinterpret_cast<meta_t*>(dev->meta.get());
            e.seed = 1234;
            e.n = count;
            time_it(st, first, bytes, [&] { CK(cuda::launch_encode(e, dev->stream)); });
          } else {
            cuda::decode_batch<Codec> d;
            d.payload = dev->payload.get();
            d.meta = reinterpret_cast<const meta_t*>(dev->meta.get());
            d.seed = 1234;
            d.n = count;
            d.out = dev->y.get();
            time_it(st, first, bytes, [&] { CK(cuda::launch_decode(d, dev->stream)); });
          }
        });
    gpu_bench(b, reps)->Args({n})->ArgNames({"vectors"});
  }
}

void register_all() {
  auto* copy = benchmark::RegisterBenchmark(
      "codec/op:d2d_copy", [first = first_time()](benchmark::State& st) {
        time_it(st, first, 2.0 * double(xfloats) * 4, [] {
          CK(cudaMemcpyAsync(dev->y.get(), dev->x.get(), xfloats * 4, cudaMemcpyDeviceToDevice,
                             dev->stream));
        });
      });
  gpu_bench(copy, reps);
  register_codec<fp8_e4m3::bind<128>>("fp8_e4m3", vectors);
  register_codec<tq3_key::bind<128>>("tq3_key", vectors);
  register_codec<tq3_value::bind<64>>("tq3_value", vectors);
  register_codec<tq3_key::bind<256>>("tq3_key", vectors / 2);
  register_codec<fp8_e4m3::bind<256>>("fp8_e4m3", vectors / 2);
}

void setup(const device_facts& f) {
  dev = std::make_unique<device_state>();
  CK(cudaStreamCreate(&dev->stream));
  dev->flush = std::make_unique<l2_flusher>(f.l2_bytes);
  dev->x = device_array<float>(xfloats);  // d = 128 input; d = 256 reads n/2 vectors of it
  dev->y = device_array<float>(xfloats);
  dev->payload = device_array<std::uint8_t>(std::size_t(vectors) * dmax);
  dev->meta = device_array<std::uint16_t>(std::size_t(vectors));
  fill_kernel<<<4096, 256, 0, dev->stream>>>(dev->x.get(), xfloats);
  CK(cudaGetLastError());
  // defined bytes for a decode the filter runs before any encode
  CK(cudaMemsetAsync(dev->payload.get(), 0, dev->payload.bytes(), dev->stream));
  CK(cudaMemsetAsync(dev->meta.get(), 0, dev->meta.bytes(), dev->stream));
  CK(cudaStreamSynchronize(dev->stream));
  add_context("l2_flush_bytes", std::to_string(dev->flush->bytes()));
}

void teardown() {
  if (!dev) return;
  cudaStream_t s = dev->stream;
  dev.reset();
  if (s) cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  program p;
  p.name = "gpubench_codec";
  p.summary =
      "Encode / decode kernel throughput of the codecs against a device-to-device copy, on Google "
      "Benchmark (docs/codecs.md).";
  p.setup = setup;
  p.register_benchmarks = register_all;
  p.teardown = teardown;
  return run(argc, argv, p);
}
