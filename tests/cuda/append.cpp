// SPDX-License-Identifier: Apache-2.0
// GPU append into open FP8 (or int8_rotated) pages: codes and scales equal the host codec's
// encode() bit for bit (fp32 and bf16 inputs, decode and prefill, all layers), bad slots and
// non-finite input are reported, nothing else in the pool is touched.
#include "catch.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "append_kernels.hpp"
#include "cuda_test.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tq3.hpp"

namespace {

using namespace tierkv;
using cuda_test::device_buffer;
using recent = cuda_test::append_recent;

float adversarial(std::mt19937_64& rng, int i) {
  std::normal_distribution<float> nd(0.f, 1.f);
  switch (i % 23) {
    case 0:
      return 0.f;
    case 1:
      return 1e30f;
    case 2:
      return -3e38f;
    case 3:
      return 1e-41f;  // subnormal
    case 4:
      return -1e-30f;
    default:
      return nd(rng) * (i % 5 == 0 ? 1000.f : 1.f);
  }
}

template <class G, class Tier = recent>
void check_append(int tokens, int layers, bool bf16, std::uint64_t seed) {
  constexpr int D = G::head_dim, H = G::kv_heads, T = G::page_tokens;
  using C = typename Tier::template key_codec<D>;
  constexpr std::uint64_t cache_seed = 0xC0FFEE;
  constexpr int layer_base = 5, head_base = 2;  // contexts of layers 5.., global heads 2..
  using L = page_layout<G, C, C>;
  std::mt19937_64 rng(seed);
  const int pages = tokens / 3 + 4;
  const int cap = pages * layers;
  std::vector<std::uint8_t> pool(L::page_bytes * std::size_t(cap), 0xA5);
  // Slot mapping: token n goes to a page of its sequence at some offset; distinct (slot, offset).
  std::vector<std::int32_t> slot(std::size_t(layers) * tokens), offset(tokens);
  std::vector<int> used(std::size_t(cap) * T, 0);
  for (int n = 0; n < tokens; ++n) {
    offset[n] = int(rng() % T);
    for (int l = 0; l < layers; ++l) {
      int s;
      do {
        s = int(rng() % cap);
      } while (used[std::size_t(s) * T + offset[n]]);
      used[std::size_t(s) * T + offset[n]] = 1;
      slot[std::size_t(l) * tokens + n] = s;
    }
  }
  const std::size_t elems = std::size_t(layers) * tokens * H * D;
  std::vector<float> k(elems), v(elems);
  for (std::size_t i = 0; i < elems; ++i) {
    k[i] = adversarial(rng, int(i % 97));
    v[i] = adversarial(rng, int(i % 89) + 3);
  }
  std::vector<__nv_bfloat16> kb(elems), vb(elems);
  if (bf16) {
    for (std::size_t i = 0; i < elems; ++i) {
      kb[i] = __float2bfloat16(k[i]);
      vb[i] = __float2bfloat16(v[i]);
      k[i] = __bfloat162float(kb[i]);  // the host reference encodes what the device reads
      v[i] = __bfloat162float(vb[i]);
    }
  }
  device_buffer<std::uint8_t> dpool(pool);
  device_buffer<float> dkf(k), dvf(v);
  device_buffer<__nv_bfloat16> dkb(kb), dvb(vb);  // zeros unless bf16
  device_buffer<std::int32_t> dslot(slot), doff(offset);
  device_buffer<int> derr(std::vector<int>{0});
  cuda_test::append_args in;
  in.k = bf16 ? static_cast<const void*>(dkb.p) : dkf.p;
  in.v = bf16 ? static_cast<const void*>(dvb.p) : dvf.p;
  in.bf16 = bf16;
  in.layer_stride = std::int64_t(tokens) * H * D;
  in.slot = dslot.p;
  in.slot_layer_stride = tokens;
  in.offset = doff.p;
  in.tokens = tokens;
  in.layers = layers;
  in.pool = {dpool.p, L::page_bytes, std::uint32_t(cap)};
  in.error = derr.p;
  in.cache_seed = cache_seed;
  in.layer_base = layer_base;
  in.head_base = head_base;
  REQUIRE(cuda_test::append<G, Tier>(in, nullptr).is_ok());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<std::uint8_t> got(pool.size());
  CUDA_OK(cudaMemcpy(got.data(), dpool.p, got.size(), cudaMemcpyDeviceToHost));
  int err = -1;
  CUDA_OK(cudaMemcpy(&err, derr.p, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(err == 0);

  // Host reference: the codec's own encode into a copy of the pool.
  for (int l = 0; l < layers; ++l)
    for (int n = 0; n < tokens; ++n)
      for (int h = 0; h < H; ++h) {
        std::uint8_t* page =
            pool.data() + std::size_t(slot[std::size_t(l) * tokens + n]) * L::page_bytes;
        const std::size_t at = (std::size_t(l) * tokens + n) * H * D + std::size_t(h) * D;
        auto* km = reinterpret_cast<bf16_bits*>(page + L::key_meta(h, offset[n]));
        auto* vm = reinterpret_cast<bf16_bits*>(page + L::value_meta(h, offset[n]));
        const auto kc = make_codec_context(cache_seed, layer_base + l, head_base + h, kv_role::key);
        const auto vc =
            make_codec_context(cache_seed, layer_base + l, head_base + h, kv_role::value);
        REQUIRE(C::encode(k.data() + at, page + L::key_payload(h, offset[n]), *km, kc, nullptr) ==
                errc::ok);
        REQUIRE(C::encode(v.data() + at, page + L::value_payload(h, offset[n]), *vm, vc, nullptr) ==
                errc::ok);
      }
  std::size_t diff = 0;
  for (std::size_t i = 0; i < pool.size(); ++i) diff += pool[i] != got[i];
  INFO("tokens " << tokens << " layers " << layers << " bf16 " << bf16);
  CHECK(diff == 0);  // every written byte equal, every untouched byte still 0xA5
}

using g_qwen = cuda_test::append_qwen;
using g_smol = cuda_test::append_smol;

}  // namespace

TEST_CASE("gpu append equals the host FP8 encoder bit for bit", "[cuda][append]") {
  check_append<g_qwen>(64, 1, false, 1);  // decode step, B = 64
  check_append<g_qwen>(300, 2, true, 2);  // prefill chunk, two layers, bf16 input
  check_append<g_smol>(1, 1, false, 3);
  check_append<g_smol>(517, 3, false, 4);
  check_append<g_smol>(128, 1, true, 5);
}

TEST_CASE("gpu append into int8_rotated pages equals the host encoder bit for bit",
          "[cuda][append][int8_rotated]") {
  using recent_int8r = cuda_test::append_int8r;
  check_append<g_qwen, recent_int8r>(64, 1, false, 11);
  check_append<g_qwen, recent_int8r>(300, 2, true, 12);
  check_append<g_smol, recent_int8r>(1, 1, false, 13);
  check_append<g_smol, recent_int8r>(517, 3, false, 14);
}

TEST_CASE("gpu append reports bad slots and non-finite input", "[cuda][append]") {
  using G = g_smol;
  constexpr int D = G::head_dim, H = G::kv_heads;
  using C = recent::key_codec<D>;
  using L = page_layout<G, C, C>;
  std::vector<float> k(std::size_t(2) * H * D, 1.f), v(k);
  k[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::uint8_t> pool(L::page_bytes * 2, 0);
  device_buffer<std::uint8_t> dpool(pool);
  device_buffer<float> dk(k), dv(v);
  device_buffer<std::int32_t> dslot(std::vector<std::int32_t>{0, 7}),
      doff(std::vector<std::int32_t>{3, 0});
  device_buffer<int> derr(std::vector<int>{0});
  cuda_test::append_args in;
  in.k = dk.p;
  in.v = dv.p;
  in.slot = dslot.p;
  in.offset = doff.p;
  in.tokens = 2;
  in.pool = {dpool.p, L::page_bytes, 2};
  in.error = derr.p;
  REQUIRE(cuda_test::append<G, recent>(in, nullptr).is_ok());
  CUDA_OK(cudaDeviceSynchronize());
  int err = 0;
  CUDA_OK(cudaMemcpy(&err, derr.p, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK((err == int(errc::non_finite_input) || err == int(errc::out_of_range)));
  std::vector<std::uint8_t> got(pool.size());
  CUDA_OK(cudaMemcpy(got.data(), dpool.p, got.size(), cudaMemcpyDeviceToHost));
  // NaN key of token 0, head 0: poison (NaN scale); its value and other heads are fine.
  const auto km = *reinterpret_cast<const bf16_bits*>(got.data() + L::key_meta(0, 3));
  CHECK(std::isnan(bf16_to_float(km)));
  const auto vm = *reinterpret_cast<const bf16_bits*>(got.data() + L::value_meta(0, 3));
  CHECK(bf16_to_float(vm) > 0.f);
  // Host-side checks.
  auto bad = in;
  bad.pool.page_bytes += 16;
  CHECK(cuda_test::append<G, recent>(bad, nullptr).code() == errc::geometry_mismatch);
  bad = in;
  bad.k = nullptr;
  CHECK(cuda_test::append<G, recent>(bad, nullptr).code() == errc::invalid_argument);
  bad = in;
  bad.layers = 2;
  bad.layer_stride = 1;
  CHECK(cuda_test::append<G, recent>(bad, nullptr).code() == errc::invalid_argument);
}
