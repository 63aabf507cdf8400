// SPDX-License-Identifier: Apache-2.0
// test_cuda_user_format's device side: cuda::tiered_cache over a user format's tier.
#include "user_format_kernels.hpp"

#include <random>

#include "cuda_test.hpp"
#include "int8_twin.hpp"
#include "policy_knobs.hpp"
#include "tierkv/cuda/tiered_cache.cuh"

namespace cuda_test {
namespace {

using geo = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>, tierkv::group_size<2>,
                             tierkv::page_tokens<16>>;
constexpr int layers = 2, D = geo::head_dim, QH = geo::q_heads, KVH = geo::kv_heads;

template <class Stale>
tierkv::result<user_format_run> run_with() {
  using tiers = tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>, Stale>;
  using cache_t = tierkv::cuda::tiered_cache<geo, tiers>;
  typename cache_t::options opt;
  opt.storage.num_layers = layers;
  opt.storage.max_sequences = 2;
  opt.storage.pages_per_tier = {40, 40};
  opt.storage.codec_seed = 7;
  opt.policy =
      tierkv::policy::recency_anchor(tierkv_test::recency_knobs(1, 0, 0.5f, 3.0f, 1.5f, 1));
  opt.max_batch = 1;
  opt.max_pages = 16;
  opt.max_step_tokens = 96;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  user_format_run r;
  {
    auto c = cache_t::create(opt, stream);
    if (!c) return c.error_status();
    cache_t& cache = **c;
    const tierkv::seq_id s = cache.create_sequence().value();
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.f, 1.f);
    device_buffer<float> k(std::size_t(80) * KVH * D), v(k.n), q(std::size_t(QH) * D), out(q.n);
    std::vector<float> h(k.n), hq(q.n), ho(q.n);
    // a prompt of 80 tokens, then 4 decode steps of one token each
    for (std::uint64_t step = 1; step <= 5; ++step) {
      const std::int32_t n = step == 1 ? 80 : 1;
      const std::vector<tierkv::seq_id> batch{s};
      const std::vector<std::int32_t> tokens{n};
      if (auto st = cache.begin_step(batch, tokens); !st) return st;
      for (int l = 0; l < layers; ++l) {
        h.resize(std::size_t(n) * KVH * D);
        for (auto& x : h) x = nd(rng);
        k.put(h);
        for (auto& x : h) x = nd(rng);
        v.put(h);
        if (auto st = cache.append(l, k.p, v.p, tierkv::cuda::input_type::f32); !st) return st;
        for (auto& x : hq) x = nd(rng);
        q.put(hq);
        if (step > 1) {
          if (auto st = cache.decode(l, q.p, tierkv::cuda::query_type::f32, out.p); !st) return st;
          CUDA_OK(cudaStreamSynchronize(stream));
          CUDA_OK(cudaMemcpy(ho.data(), out.p, ho.size() * sizeof(float), cudaMemcpyDeviceToHost));
          r.outputs.insert(r.outputs.end(), ho.begin(), ho.end());
        }
        CUDA_OK(cudaStreamSynchronize(stream));  // the host buffers are rewritten next layer
      }
      auto st = cache.end_step(step, true);
      if (!st) return st.error_status();
      if (!st->first_error.is_ok()) return st->first_error;
      r.converted += st->converted;
    }
    if (auto st = cache.drain(); !st) return st;
    r.stale_used = 40 - cache.storage().free_pages(1);
    auto blob = cache.export_pages(s);
    if (!blob) return blob.error_status();
    r.export_blob = std::move(*blob);
  }
  CUDA_OK(cudaStreamDestroy(stream));
  return r;
}

}  // namespace

tierkv::result<user_format_run> run_user_format(bool twin) {
  if (twin) return run_with<tierkv::tier<tierkv_test::int8_twin, tierkv_test::int8_twin>>();
  return run_with<tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>>();
}

}  // namespace cuda_test
