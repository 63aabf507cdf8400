// SPDX-License-Identifier: Apache-2.0
// CPU codec throughput: encode / decode GB/s of float input, beside memcpy of the same
// bytes; plus the host attention operation dot() per token.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "tierkv/codec/error_traits.hpp"
#include "tierkv/formats.hpp"

using namespace tierkv;

namespace {

constexpr int kVectors = 4096;

std::vector<float> inputs(int d) {
  std::vector<float> x(std::size_t(d) * kVectors);
  detail::gaussian_source rng(42);
  for (auto& v : x) v = float(rng.next());
  return x;
}

template <class C>
void BM_encode(benchmark::State& state) {
  const auto x = inputs(C::head_dim);
  std::vector<std::uint8_t> p(C::payload_bytes * kVectors);
  std::vector<typename C::meta_type> m(kVectors);
  const codec_context ctx{7};
  for (auto _ : state) {
    for (int v = 0; v < kVectors; ++v)
      benchmark::DoNotOptimize(C::encode(x.data() + std::size_t(v) * C::head_dim,
                                         p.data() + std::size_t(v) * C::payload_bytes,
                                         m[std::size_t(v)], ctx, nullptr));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * kVectors * C::head_dim * 4);
}

template <class C>
void BM_decode(benchmark::State& state) {
  const auto x = inputs(C::head_dim);
  std::vector<std::uint8_t> p(C::payload_bytes * kVectors);
  std::vector<typename C::meta_type> m(kVectors);
  std::vector<float> y(x.size());
  const codec_context ctx{7};
  for (int v = 0; v < kVectors; ++v)
    (void)C::encode(x.data() + std::size_t(v) * C::head_dim,
                    p.data() + std::size_t(v) * C::payload_bytes, m[std::size_t(v)], ctx, nullptr);
  for (auto _ : state) {
    for (int v = 0; v < kVectors; ++v)
      C::decode(p.data() + std::size_t(v) * C::payload_bytes, m[std::size_t(v)],
                y.data() + std::size_t(v) * C::head_dim, ctx);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * kVectors * C::head_dim * 4);
}

// dot of a prepared query with every stored key: the host decode inner loop.
template <class C>
void BM_dot(benchmark::State& state) {
  const auto x = inputs(C::head_dim);
  std::vector<std::uint8_t> p(C::payload_bytes * kVectors);
  std::vector<typename C::meta_type> m(kVectors);
  const codec_context ctx{7};
  for (int v = 0; v < kVectors; ++v)
    (void)C::encode(x.data() + std::size_t(v) * C::head_dim,
                    p.data() + std::size_t(v) * C::payload_bytes, m[std::size_t(v)], ctx, nullptr);
  std::vector<float> q(C::head_dim);
  C::prepare_query(x.data(), q.data(), ctx);
  for (auto _ : state) {
    float s = 0;
    for (int v = 0; v < kVectors; ++v)
      s += C::dot(q.data(), p.data() + std::size_t(v) * C::payload_bytes, m[std::size_t(v)]);
    benchmark::DoNotOptimize(s);
  }
  state.SetItemsProcessed(std::int64_t(state.iterations()) * kVectors);  // tokens
  state.SetBytesProcessed(std::int64_t(state.iterations()) * kVectors * C::head_dim * 4);
}

void BM_memcpy(benchmark::State& state) {
  const int d = int(state.range(0));
  const auto x = inputs(d);
  std::vector<float> y(x.size());
  for (auto _ : state) {
    std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) *
                          std::int64_t(x.size() * sizeof(float)));
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(128);
BENCHMARK(BM_encode<fp8_e4m3::bind<128>>);
BENCHMARK(BM_decode<fp8_e4m3::bind<128>>);
BENCHMARK(BM_encode<tq3_key::bind<128>>);
BENCHMARK(BM_decode<tq3_key::bind<128>>);
BENCHMARK(BM_encode<dense_bf16::bind<128>>);
BENCHMARK(BM_decode<dense_bf16::bind<128>>);
BENCHMARK(BM_dot<fp8_e4m3::bind<128>>);
BENCHMARK(BM_dot<tq3_key::bind<128>>);
BENCHMARK(BM_dot<dense_bf16::bind<128>>);
BENCHMARK(BM_encode<tq3_key::bind<64>>);
BENCHMARK(BM_encode<tq3_key::bind<256>>);
