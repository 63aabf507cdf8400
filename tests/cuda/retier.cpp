// SPDX-License-Identifier: Apache-2.0
// GPU retier FP8 -> TQ3 and TQ3 -> FP8: every byte equals the host codecs' decode-then-
// encode, over random pages with adversarial vectors (zeros, huge, subnormal, NaN poison).
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cuda_test.hpp"
#include "retier_kernels.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

namespace {

using namespace tierkv;
using cuda_test::device_buffer;
using recent = cuda_test::retier_recent;
using stale = cuda_test::retier_stale;

// Fills every vector of `pages` pages of tier Tr by encoding random/adversarial floats.
template <class G, class Tr>
std::vector<std::uint8_t> make_pages(int pages, std::uint64_t cache_seed, int layer,
                                     std::mt19937_64& rng, int* poisoned, int head_base) {
  constexpr int D = G::head_dim;
  using K = typename Tr::template key_codec<D>;
  using V = typename Tr::template value_codec<D>;
  using L = page_layout<G, K, V>;
  std::vector<std::uint8_t> pool(L::page_bytes * std::size_t(pages), 0);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(D);
  int vec = 0;
  for (int p = 0; p < pages; ++p)
    for (int h = 0; h < G::kv_heads; ++h)
      for (int t = 0; t < G::page_tokens; ++t, ++vec) {
        for (int role = 0; role < 2; ++role) {
          const int kind = (vec * 2 + role) % 41;
          for (int d = 0; d < D; ++d) {
            float s = nd(rng);
            if (kind == 1) s = 0.f;
            if (kind == 2) s *= 1e30f;
            if (kind == 3) s *= 1e-42f;
            if (kind == 4 && d == 7) s = 1e4f;  // one outlier channel
            x[d] = s;
          }
          std::uint8_t* page = pool.data() + std::size_t(p) * L::page_bytes;
          const codec_context ctx = make_codec_context(cache_seed, layer, head_base + h,
                                                       role == 0 ? kv_role::key : kv_role::value);
          if (role == 0) {
            (void)K::encode(x.data(), page + L::key_payload(h, t),
                            *reinterpret_cast<bf16_bits*>(page + L::key_meta(h, t)), ctx, nullptr);
          } else {
            (void)V::encode(x.data(), page + L::value_payload(h, t),
                            *reinterpret_cast<bf16_bits*>(page + L::value_meta(h, t)), ctx,
                            nullptr);
          }
          if (kind == 5) {  // NaN poison as a freed-slot pattern would leave
            *reinterpret_cast<bf16_bits*>(
                page + (role == 0 ? L::key_meta(h, t) : L::value_meta(h, t))) = bf16_quiet_nan;
            ++*poisoned;
          }
        }
      }
  return pool;
}

// Host reference: decode with From's codecs, encode with To's.
template <class G, class From, class To>
void host_retier(const std::vector<std::uint8_t>& src, std::vector<std::uint8_t>& dst,
                 const std::vector<std::int32_t>& ss, const std::vector<std::int32_t>& ds,
                 std::uint64_t cache_seed, int layer, int head_base) {
  constexpr int D = G::head_dim;
  using SK = typename From::template key_codec<D>;
  using SV = typename From::template value_codec<D>;
  using DK = typename To::template key_codec<D>;
  using DV = typename To::template value_codec<D>;
  using SL = page_layout<G, SK, SV>;
  using DL = page_layout<G, DK, DV>;
  std::vector<float> x(D);
  for (std::size_t i = 0; i < ss.size(); ++i) {
    const std::uint8_t* sp = src.data() + std::size_t(ss[i]) * SL::page_bytes;
    std::uint8_t* dp = dst.data() + std::size_t(ds[i]) * DL::page_bytes;
    for (int h = 0; h < G::kv_heads; ++h)
      for (int t = 0; t < G::page_tokens; ++t) {
        const codec_context kc = make_codec_context(cache_seed, layer, head_base + h, kv_role::key);
        const codec_context vc =
            make_codec_context(cache_seed, layer, head_base + h, kv_role::value);
        SK::decode(sp + SL::key_payload(h, t),
                   *reinterpret_cast<const bf16_bits*>(sp + SL::key_meta(h, t)), x.data(), kc);
        (void)DK::encode(x.data(), dp + DL::key_payload(h, t),
                         *reinterpret_cast<bf16_bits*>(dp + DL::key_meta(h, t)), kc, nullptr);
        SV::decode(sp + SL::value_payload(h, t),
                   *reinterpret_cast<const bf16_bits*>(sp + SL::value_meta(h, t)), x.data(), vc);
        (void)DV::encode(x.data(), dp + DL::value_payload(h, t),
                         *reinterpret_cast<bf16_bits*>(dp + DL::value_meta(h, t)), vc, nullptr);
      }
  }
}

template <class G, class From, class To>
void check_retier(int pages, std::uint64_t seed, int head_base = 0) {
  constexpr int D = G::head_dim;
  using DL =
      page_layout<G, typename To::template key_codec<D>, typename To::template value_codec<D>>;
  using SL =
      page_layout<G, typename From::template key_codec<D>, typename From::template value_codec<D>>;
  std::mt19937_64 rng(seed);
  const std::uint64_t cache_seed = rng();
  const int layer = 5;
  int poisoned = 0;
  auto src = make_pages<G, From>(pages, cache_seed, layer, rng, &poisoned, head_base);
  const int dst_cap = pages + 2;
  std::vector<std::uint8_t> dst(DL::page_bytes * std::size_t(dst_cap), 0x3C);
  std::vector<std::int32_t> ss(pages), ds(pages);
  for (int i = 0; i < pages; ++i) ss[i] = i;
  std::vector<std::int32_t> perm(dst_cap);
  for (int i = 0; i < dst_cap; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < pages; ++i) ds[i] = perm[i];
  device_buffer<std::uint8_t> dsrc(src), ddst(dst);
  device_buffer<std::int32_t> dss(ss), dds(ds);
  device_buffer<int> derr(std::vector<int>{0});
  cuda_test::retier_args in;
  in.src = {dsrc.p, SL::page_bytes, std::uint32_t(pages)};
  in.dst = {ddst.p, DL::page_bytes, std::uint32_t(dst_cap)};
  in.src_slot = dss.p;
  in.dst_slot = dds.p;
  in.layer = layer;
  in.pages = pages;
  in.cache_seed = cache_seed;
  in.head_base = head_base;
  in.error = derr.p;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  REQUIRE(cuda_test::retier<G, From, To>(in, stream).is_ok());
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<std::uint8_t> got(dst.size());
  CUDA_OK(cudaMemcpy(got.data(), ddst.p, got.size(), cudaMemcpyDeviceToHost));
  int err = 0;
  CUDA_OK(cudaMemcpy(&err, derr.p, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(err == (poisoned ? int(errc::non_finite_input) : 0));
  host_retier<G, From, To>(src, dst, ss, ds, cache_seed, layer, head_base);
  std::size_t diff = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != dst[i]) {
      ++diff;
      first = std::min(first, i);
    }
  INFO("pages " << pages << " D " << D << " differing bytes " << diff << " first at " << first);
  CHECK(diff == 0);
  CUDA_OK(cudaStreamDestroy(stream));
}

using g_qwen = cuda_test::retier_qwen;
using g_llama = cuda_test::retier_llama;
using g_smol = cuda_test::retier_smol;

}  // namespace

TEST_CASE("gpu retier FP8 -> TQ3 equals the host codecs bit for bit", "[cuda][retier]") {
  check_retier<g_qwen, recent, stale>(24, 1);
  check_retier<g_llama, recent, stale>(20, 2);
  check_retier<g_smol, recent, stale>(40, 3);
}

TEST_CASE("gpu retier TQ3 -> FP8 (promotion) equals the host codecs bit for bit",
          "[cuda][retier]") {
  check_retier<g_qwen, stale, recent>(24, 5);
  check_retier<g_llama, stale, recent>(20, 6);
  check_retier<g_smol, stale, recent>(40, 7);
}

TEST_CASE("gpu retier of a tensor-parallel rank's pages uses the global heads' rotations",
          "[cuda][retier]") {
  check_retier<g_llama, recent, stale>(12, 8, 8);  // rank 1 of 2 of a 16-head model
  check_retier<g_llama, stale, recent>(12, 9, 8);
}

TEST_CASE("gpu retier int8_rotated <-> TQ3 and <-> FP8 equals the host codecs bit for bit",
          "[cuda][retier][int8_rotated]") {
  using recent_int8r = cuda_test::retier_int8r;
  check_retier<g_qwen, recent_int8r, stale>(12, 11);
  check_retier<g_llama, recent_int8r, stale>(10, 12, 8);
  check_retier<g_smol, recent_int8r, stale>(20, 13);
  check_retier<g_smol, stale, recent_int8r>(20, 14);
  check_retier<g_llama, stale, recent_int8r>(10, 15);
  check_retier<g_qwen, recent, recent_int8r>(8, 16);
  check_retier<g_smol, recent_int8r, recent>(20, 17);
}

TEST_CASE("gpu retier to and from TQ4-key Stale pages equals the host codecs bit for bit",
          "[cuda][retier][tq4]") {
  using recent_int8r = cuda_test::retier_int8r;
  using stale_k4 = cuda_test::retier_stale_k4;
  check_retier<g_qwen, recent_int8r, stale_k4>(12, 21);
  check_retier<g_llama, recent, stale_k4>(10, 22, 8);
  check_retier<g_smol, recent_int8r, stale_k4>(20, 23);
  check_retier<g_smol, stale_k4, recent_int8r>(20, 24);
  check_retier<g_llama, stale_k4, recent>(10, 25);
  check_retier<g_qwen, stale, stale_k4>(8, 26);  // TQ3 keys -> TQ4 keys (decode, re-encode)
}

TEST_CASE("gpu retier to and from TQ2 (Cold tier) pages equals the host codecs bit for bit",
          "[cuda][retier][tq2]") {
  using recent_int8r = cuda_test::retier_int8r;
  using stale_k4 = cuda_test::retier_stale_k4;
  using cold_v2 = cuda_test::retier_cold_v2;
  using cold = cuda_test::retier_cold;
  check_retier<g_qwen, recent_int8r, cold>(12, 31);
  check_retier<g_llama, recent, cold>(10, 32, 8);
  check_retier<g_smol, recent_int8r, cold>(20, 33);
  check_retier<g_smol, cold, recent_int8r>(20, 34);
  check_retier<g_llama, cold, recent>(10, 35);
  check_retier<g_qwen, stale, cold_v2>(8, 36);    // Stale -> Cold: TQ3 values re-coded in 2 bits
  check_retier<g_smol, stale_k4, cold>(12, 37);   // TQ4 keys -> TQ2
  check_retier<g_llama, cold_v2, stale>(10, 38);  // Cold -> Stale (attention mass came back)
}

TEST_CASE(
    "gpu retier to and from a tier of int8_rotated keys and TQ3 values equals the host "
    "codecs bit for bit",
    "[cuda][retier][mixed]") {
  using recent_int8r = cuda_test::retier_int8r;
  using k8v3 = cuda_test::retier_k8v3;
  using cold_v2 = cuda_test::retier_cold_v2;
  check_retier<g_smol, recent_int8r, k8v3>(20, 41);
  check_retier<g_qwen, k8v3, recent_int8r>(12, 42);
  check_retier<g_llama, recent, k8v3>(10, 43, 8);
  check_retier<g_smol, stale, k8v3>(20, 44);  // TQ3 keys -> int8_rotated, TQ3 values kept
  check_retier<g_qwen, k8v3, cold_v2>(8, 45);
}

TEST_CASE("gpu retier rejects bad arguments", "[cuda][retier]") {
  using G = g_smol;
  cuda_test::retier_args in;
  in.pages = -1;
  CHECK(cuda_test::retier<G, recent, stale>(in, nullptr).code() == errc::invalid_argument);
  in.pages = 0;
  CHECK(cuda_test::retier<G, recent, stale>(in, nullptr).is_ok());
  in.pages = 1;
  CHECK(cuda_test::retier<G, recent, stale>(in, nullptr).code() == errc::invalid_argument);
}
