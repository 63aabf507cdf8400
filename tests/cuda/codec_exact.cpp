// SPDX-License-Identifier: Apache-2.0
// On the device: (1) the FP8 conversions equal cuda_fp8.h's __nv_cvt_float_to_fp8 for all
// 2^32 float bit patterns, and the host conversion equals the device one on a sampled set;
// (2) the warp encode/decode kernels produce the host encoder's codes, meta and status
// bit for bit over >= 10^6 random vectors plus special vectors; (3) the slice readers' f16 /
// bf16 pair unpacks (the prefill's tile decode) give their float unpack's values exactly.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "catch.hpp"
#include "codec_exact_kernels.hpp"
#include "cuda_test.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/error_traits.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/formats.hpp"

using namespace tierkv;
using cuda_test::device_buffer;

namespace {

template <fp8_kind K>
void check_all_fp8_patterns() {
  const cuda_test::fp8_sweep_result h = cuda_test::fp8_sweep_all_floats<K>();
  std::printf(
      "fp8 %s: all 2^32 floats: hw vs portable mismatches %llu, public vs hw %llu, "
      "NaN without NaN code %llu, NaN code patterns differing %llu\n",
      fp8_format<K>::name, h.mismatch_hw_portable, h.mismatch_public_hw, h.nan_not_nan,
      h.nan_pattern_differs);
  INFO("first mismatching bits " << h.first_bad_bits);
  CHECK(h.mismatch_hw_portable == 0);
  CHECK(h.mismatch_public_hw == 0);
  CHECK(h.nan_not_nan == 0);

  // Host == device on a sampled set (every 251st pattern) plus specials.
  std::vector<float> xs;
  for (std::uint64_t b = 0; b < (1ull << 32); b += 251)
    xs.push_back(tierkv::detail::bits_float(std::uint32_t(b)));
  for (float s : {0.0f, -0.0f, 448.0f, 464.0f, 480.0f, 57344.0f, 61440.0f, 1e-45f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::min()})
    xs.push_back(s);
  const int n = int(xs.size());
  const std::vector<std::uint8_t> dev = cuda_test::fp8_convert_on_device<K>(xs);
  std::uint64_t bad = 0;
  for (int i = 0; i < n; ++i)
    if (!std::isnan(xs[std::size_t(i)]) &&
        dev[std::size_t(i)] != float_to_fp8<K>(xs[std::size_t(i)]))
      ++bad;
  std::printf("fp8 %s: host vs device on %d sampled floats: %llu mismatches\n", fp8_format<K>::name,
              n, (unsigned long long)bad);
  CHECK(bad == 0);
}

// Random vectors with per-vector magnitudes over 2^[-40, 40], offset channels, and
// special vectors (zeros, NaN, +-Inf, huge, subnormal, one-hot, FP8 ties).
std::vector<float> make_inputs(int d, int n, std::uint64_t seed) {
  std::vector<float> x(std::size_t(d) * std::size_t(n));
  tierkv::detail::gaussian_source rng(seed);
  for (int v = 0; v < n; ++v) {
    float* row = x.data() + std::size_t(v) * std::size_t(d);
    const int kind = v % 97;
    const double scale = std::ldexp(1.0, int(mix64(seed + std::uint64_t(v)) % 81) - 40);
    for (int i = 0; i < d; ++i) row[i] = float(rng.next() * scale);
    switch (kind) {
      case 0:
        for (int i = 0; i < d; ++i) row[i] = 0.0f;
        break;
      case 1:
        row[v % d] = std::numeric_limits<float>::quiet_NaN();
        break;
      case 2:
        row[v % d] = std::numeric_limits<float>::infinity();
        break;
      case 3:
        row[v % d] = -std::numeric_limits<float>::infinity();
        break;
      case 4:
        for (int i = 0; i < d; ++i) row[i] = float(rng.next() * 1e38);
        break;
      case 5:
        for (int i = 0; i < d; ++i) row[i] = float(rng.next() * 1e-41);
        break;
      case 6:
        for (int i = 0; i < d; ++i) row[i] = 0.0f;
        row[v % d] = -2.5f;
        break;
      case 7:
        for (int i = 0; i < d; ++i) row[i] = float((i % 16) + 0.5) * 28.0f;
        break;  // ties
      case 8:
        row[v % d] += float(20 * scale);
        break;  // offset channel
      default:
        break;
    }
  }
  return x;
}

template <class Codec>
void check_codec_exact(int n) {
  constexpr int d = Codec::head_dim;
  using meta_t = typename Codec::meta_type;
  const auto x =
      make_inputs(d, n, 0xC0DEull + std::uint64_t(d) * 31 + std::uint64_t(Codec::format));
  std::vector<std::uint64_t> seeds(static_cast<std::size_t>(n));
  for (int v = 0; v < n; ++v) seeds[std::size_t(v)] = mix64(std::uint64_t(v) * 0x51ull + d);

  // Host reference.
  std::vector<std::uint8_t> hp(std::size_t(n) * Codec::payload_bytes);
  std::vector<meta_t> hm(static_cast<std::size_t>(n));
  std::vector<errc> hs(static_cast<std::size_t>(n));
  std::vector<float> hd(std::size_t(n) * d);
  encode_stats hstats;
  for (int v = 0; v < n; ++v) {
    const codec_context ctx{seeds[std::size_t(v)]};
    hs[std::size_t(v)] = Codec::encode(x.data() + std::size_t(v) * d,
                                       hp.data() + std::size_t(v) * Codec::payload_bytes,
                                       hm[std::size_t(v)], ctx, &hstats);
    Codec::decode(hp.data() + std::size_t(v) * Codec::payload_bytes, hm[std::size_t(v)],
                  hd.data() + std::size_t(v) * d, ctx);
  }

  device_buffer<float> bx(x), bout(x.size());
  device_buffer<std::uint8_t> bp(hp.size());
  device_buffer<meta_t> bm(hm.size());
  device_buffer<errc> bs(hs.size());
  device_buffer<std::uint64_t> bseeds(seeds);
  device_buffer<unsigned long long> bsat(1);
  float *dx = bx.p, *dout = bout.p;
  std::uint8_t* dp = bp.p;
  meta_t* dm = bm.p;
  errc* ds = bs.p;
  std::uint64_t* dseeds = bseeds.p;
  unsigned long long* dsat = bsat.p;

  for (int path = 0; path < 2; ++path) {  // 0: warp kernels, 1: reference thread kernel
    CUDA_OK(cudaMemset(dp, 0xEE, hp.size()));
    CUDA_OK(cudaMemset(dsat, 0, sizeof(unsigned long long)));
    cuda_test::codec_batch<Codec> b;
    b.x = dx;
    b.payload = dp;
    b.meta = dm;
    b.seeds = dseeds;
    b.n = n;
    b.status = ds;
    b.saturated = dsat;
    b.out = dout;
    CUDA_OK(cuda_test::launch_encode(b, path == 1));
    CUDA_OK(cuda_test::launch_decode(b));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<std::uint8_t> gp(hp.size());
    std::vector<meta_t> gm(hm.size());
    std::vector<errc> gs(hs.size());
    std::vector<float> gd(hd.size());
    unsigned long long gsat = 0;
    CUDA_OK(cudaMemcpy(gp.data(), dp, gp.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gm.data(), dm, sizeof(meta_t) * gm.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gs.data(), ds, sizeof(errc) * gs.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gd.data(), dout, sizeof(float) * gd.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&gsat, dsat, sizeof gsat, cudaMemcpyDeviceToHost));
    std::uint64_t bad_payload = 0, bad_meta = 0, bad_status = 0, bad_decode = 0;
    for (int v = 0; v < n; ++v) {
      const std::size_t pb = std::size_t(v) * Codec::payload_bytes;
      bad_payload += std::memcmp(gp.data() + pb, hp.data() + pb, Codec::payload_bytes) != 0;
      if constexpr (Codec::meta_bytes > 0)
        bad_meta += std::memcmp(&gm[std::size_t(v)], &hm[std::size_t(v)], sizeof(meta_t)) != 0;
      bad_status += gs[std::size_t(v)] != hs[std::size_t(v)];
      if (hs[std::size_t(v)] == errc::ok)
        bad_decode += std::memcmp(gd.data() + std::size_t(v) * d, hd.data() + std::size_t(v) * d,
                                  sizeof(float) * d) != 0;
    }
    std::printf(
        "%s d=%d %s: %d vectors: payload mismatches %llu, meta %llu, status %llu, "
        "decode (bitwise) %llu, saturated host %llu device %llu\n",
        Codec::name, d, path == 0 ? "warp" : "thread", n, (unsigned long long)bad_payload,
        (unsigned long long)bad_meta, (unsigned long long)bad_status,
        (unsigned long long)bad_decode, (unsigned long long)hstats.saturated, gsat);
    CHECK(bad_payload == 0);
    CHECK(bad_meta == 0);
    CHECK(bad_status == 0);
    CHECK(bad_decode == 0);
    CHECK(gsat == hstats.saturated);
  }
}

}  // namespace

TEST_CASE("cuda fp8: conversions equal cuda_fp8.h over all 2^32 floats", "[cuda][fp8]") {
  check_all_fp8_patterns<fp8_kind::e4m3>();
  check_all_fp8_patterns<fp8_kind::e5m2>();
}

TEST_CASE("cuda codecs: device codes equal host codes bit for bit", "[cuda][codec]") {
  check_codec_exact<tq3_key::bind<128>>(1 << 20);
  check_codec_exact<fp8_e4m3::bind<128>>(1 << 20);
  check_codec_exact<tq3_value::bind<128>>(1 << 18);
  check_codec_exact<tq3_key::bind<64>>(1 << 18);
  check_codec_exact<tq3_value::bind<256>>(1 << 17);
  check_codec_exact<tq3_key::bind<32>>(1 << 16);
  check_codec_exact<tq3_key::bind<512>>(1 << 15);
  check_codec_exact<fp8_e5m2::bind<128>>(1 << 18);
  check_codec_exact<fp8_e4m3::bind<80>>(1 << 16);
  check_codec_exact<dense_bf16::bind<128>>(1 << 16);
  // TQ4 runs the host code path on the device (one thread per vector, cuda::encode / decode).
  check_codec_exact<tq4_key::bind<64>>(1 << 17);
  check_codec_exact<tq4_value::bind<128>>(1 << 16);
  check_codec_exact<tq4_key::bind<256>>(1 << 15);
  // TQ2 (the Cold tier) likewise
  check_codec_exact<tq2_key::bind<64>>(1 << 17);
  check_codec_exact<tq2_value::bind<128>>(1 << 16);
  check_codec_exact<tq2_key::bind<256>>(1 << 15);
}

namespace {

// Every byte value at every payload offset (256 vectors of a counting pattern), all-zero and
// all-0xFF vectors, and random vectors.
template <class Codec>
void check_pair_unpacks(bool want_h2, bool want_bf16x2, int random_vectors = 4096) {
  constexpr std::size_t pb = Codec::payload_bytes;
  std::vector<std::uint8_t> p;
  for (std::size_t i = 0; i < 256 * pb; ++i) p.push_back(std::uint8_t(i + i / 256));
  p.insert(p.end(), pb, 0x00);
  p.insert(p.end(), pb, 0xFF);
  for (std::size_t i = 0; i < std::size_t(random_vectors) * pb; ++i)
    p.push_back(std::uint8_t(mix64((std::uint64_t(pb) << 32) + i) >> 56));
  const cuda_test::pair_unpack_result r = cuda_test::pair_unpacks_on_device<Codec>(p);
  std::printf(
      "pair unpacks %s (head_dim %d): %llu slices, f16 pairs %s (%llu differ), bf16 "
      "pairs %s (%llu differ)\n",
      Codec::name, Codec::head_dim, r.slices, r.has_h2 ? "yes" : "no", r.h2_mismatch,
      r.has_bf16x2 ? "yes" : "no", r.bf16x2_mismatch);
  INFO(Codec::name << " head_dim " << Codec::head_dim << ", first differing slice " << r.first_bad);
  CHECK(r.has_h2 == want_h2);
  CHECK(r.has_bf16x2 == want_bf16x2);
  CHECK(r.slices == (256 + 2 + std::size_t(random_vectors)) * (Codec::head_dim / 16));
  CHECK(r.h2_mismatch == 0);
  CHECK(r.bf16x2_mismatch == 0);
}

}  // namespace

TEST_CASE("cuda slice readers: f16 / bf16 pair unpacks equal the float unpack exactly",
          "[cuda][codec]") {
  // want_h2, want_bf16x2: which exact paths the prefill's tile decode takes for the format
  check_pair_unpacks<fp8_e4m3::bind<128>>(true, false);
  check_pair_unpacks<int8_rotated::bind<128>>(true, true);
  check_pair_unpacks<int8_rotated::bind<256>>(true, true);
  check_pair_unpacks<tq3_key::bind<256>>(true, true);
  check_pair_unpacks<tq3_value::bind<128>>(true, true);
  check_pair_unpacks<tq3_value::bind<256>>(true, true);
  check_pair_unpacks<tq4_key::bind<256>>(true, false);
  check_pair_unpacks<tq4_value::bind<64>>(true, false);
  check_pair_unpacks<dense_bf16::bind<128>>(false, false);
  check_pair_unpacks<tq2_key::bind<64>>(true, true);
  check_pair_unpacks<tq2_value::bind<256>>(true, true);
}
