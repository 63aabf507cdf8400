// SPDX-License-Identifier: Apache-2.0
// GPU mixed-format decode vs a float64 reference on the decoded vectors and vs the host
// path (attention/host_decode.hpp) on the same codes, with soft-capped logits and sliding
// windows too; plan/run with CUDA-graph replay.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test.hpp"
#include "decode_kernels.hpp"
#include "paged_batch.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/decode_plan.cuh"

namespace {

using namespace tierkv;
using cuda_test::decode_path;
using cuda_test::device_buffer;
using recent = cuda_test::decode_recent;
using stale = cuda_test::decode_stale;
using two_tiers = tiers<recent, stale>;
using cuda_test::host_batch;
using cuda_test::mix;
using cuda_test::rel_l2;

// Device copy of a host batch (index arrays sized for `cap_entries` so a graph can replay
// other batches in the same buffers) with decode's queries and outputs.
template <class G, class Recent = recent, class Stale = stale>
struct device_batch {
  cuda_test::device_pages<G, Recent, Stale> pages;
  device_buffer<float> q, out, lse, mass;
  int mass_stride;
  device_batch(std::size_t pool0_bytes, std::size_t pool1_bytes, int max_batch, int cap_entries,
               int stride)
      : pages(pool0_bytes, pool1_bytes, max_batch, cap_entries),
        q(std::size_t(max_batch) * G::q_heads * G::head_dim),
        out(std::size_t(max_batch) * G::q_heads * G::head_dim),
        lse(std::size_t(max_batch) * G::q_heads),
        mass(std::size_t(max_batch) * stride),
        mass_stride(stride) {}

  void upload(const host_batch<G, Recent, Stale>& h) {
    pages.upload(h);
    q.put(h.q);
    CUDA_OK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));  // NaN: every output must be written
  }
  cuda_test::decode_args inputs(const host_batch<G, Recent, Stale>& h, int batch, bool with_mass) {
    cuda_test::decode_args in;
    in.index = pages.index(batch);
    in.pools[0] = pages.pool(h, 0);
    in.pools[1] = pages.pool(h, 1);
    in.queries = q.p;
    in.softmax_scale = 1.f / std::sqrt(float(G::head_dim));
    in.cache_seed = h.seed;
    in.layer = h.layer;
    in.head_base = h.head_base;
    in.out = out.p;
    in.lse = lse.p;
    if (with_mass) {
      in.page_mass = mass.p;
      in.page_mass_stride = mass_stride;
    }
    return in;
  }
};

template <class HB>
std::vector<std::int32_t> page_counts(const HB& h) {
  std::vector<std::int32_t> c;
  for (int b = 0; b < h.batch(); ++b)
    for (int f = 0; f < 2; ++f) c.push_back(h.indptr[f][b + 1] - h.indptr[f][b]);
  return c;
}

// The float64 reference of host_batch::reference with a soft cap (s -> cap tanh(s / cap)) and a
// sliding window (the query at n - 1 attends positions >= n - window; 0: all): out [b][qh][D],
// lse natural, page mass (pages wholly before the window: 0).
template <class G, class HB>
void reference_capped(const HB& h, double scale, double soft_cap, int window,
                      std::vector<double>& out, std::vector<double>& lse, std::vector<double>& mass,
                      int mass_stride) {
  constexpr int D = G::head_dim, QH = G::q_heads, H = G::kv_heads, T = G::page_tokens;
  const int B = h.batch();
  out.assign(std::size_t(B) * QH * D, 0.0);
  lse.assign(std::size_t(B) * QH, -std::numeric_limits<double>::infinity());
  mass.assign(std::size_t(B) * mass_stride, 0.0);
  for (int b = 0; b < B; ++b) {
    const int n = h.seq_len[std::size_t(b)];
    const int lo = window > 0 ? std::max(0, n - window) : 0;
    if (n == 0) continue;
    for (int qh = 0; qh < QH; ++qh) {
      const int kh = qh / G::group_size;
      std::vector<double> s(std::size_t(n), 0.0);
      double mx = -INFINITY;
      for (int t = lo; t < n; ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += double(h.q[(std::size_t(b) * QH + qh) * D + d]) *
                 h.kdec[std::size_t(b)][(std::size_t(t) * H + kh) * D + d];
        double z = dot * scale;
        if (soft_cap > 0) z = soft_cap * std::tanh(z / soft_cap);
        s[std::size_t(t)] = z;
        mx = std::max(mx, z);
      }
      double l = 0;
      for (int t = lo; t < n; ++t) l += std::exp(s[std::size_t(t)] - mx);
      for (int t = lo; t < n; ++t) {
        const double p = std::exp(s[std::size_t(t)] - mx) / l;
        mass[std::size_t(b) * mass_stride + t / T] += p / QH;
        for (int d = 0; d < D; ++d)
          out[(std::size_t(b) * QH + qh) * D + d] +=
              p * h.vdec[std::size_t(b)][(std::size_t(t) * H + kh) * D + d];
      }
      lse[std::size_t(b) * QH + qh] = mx + std::log(l);
    }
  }
}

// Tolerances per path: the tensor-core path rounds the probabilities to f16 (f16 queries are
// split hi + lo, so FP8 scores keep ~fp32 precision; int8 keys score against the query
// rounded to 2^-13 of its largest element); TQ3 pages are 3-bit codes whose scores move the
// softmax most. Dense bf16 pages take bf16 probabilities (2^-9 relative, as BF16 attention
// kernels round them) and bf16 hi + lo queries (2^-17).
double out_tol(decode_path path, bool has_tq3, bool bf16_values = false) {
  if (has_tq3 || (bf16_values && path == decode_path::tensor_core)) return 2e-3;
  return path == decode_path::tensor_core ? 2e-4 : 2e-5;
}

template <class G, decode_path Path, class Recent = recent, class Stale = stale>
void check_case_path(const std::vector<int>& lens, mix m, std::uint64_t rng_seed, int waves,
                     std::int64_t min_chunk, float key_offset, int value_spread, float q_scale,
                     int head_base, float soft_cap, int window) {
  constexpr int D = G::head_dim, QH = G::q_heads, T = G::page_tokens;
  std::mt19937_64 rng(rng_seed);
  host_batch<G, Recent, Stale> h;
  h.head_base = head_base;
  h.build(lens, m, rng, key_offset, value_spread, q_scale);
  const int B = h.batch();
  int max_pages = 1;
  for (int l : lens) max_pages = std::max(max_pages, (l + G::page_tokens - 1) / G::page_tokens);
  const int entries = std::max<int>(1, int(std::max(h.slot[0].size(), h.slot[1].size())));
  device_batch<G, Recent, Stale> dev(h.pool[0].size(), h.pool[1].size(), B, entries, max_pages);
  dev.upload(h);
  cuda::decode_capacity cap{B, 64, max_pages, true};
  const auto counts = page_counts(h);
  // min_chunk_pages = 1: the cases below ask for many small chunks on purpose
  auto plan = cuda::plan_decode<G, tiers<Recent, Stale>>(cap, counts.data(), B, 132, waves,
                                                         min_chunk, cuda::balance::work, 1);
  REQUIRE(plan.has_value());
  device_buffer<std::uint8_t> ws(plan->workspace_bytes);
  REQUIRE(cuda_test::decode_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
  auto in = dev.inputs(h, B, true);
  in.soft_cap = soft_cap;
  in.window = window;
  REQUIRE(cuda_test::decode<G, tiers<Recent, Stale>, Path>(*plan, in, ws.p, ws.n, nullptr).is_ok());
  CUDA_OK(cudaDeviceSynchronize());
  auto derr = cuda_test::decode_device_error(*plan, ws.p, nullptr);
  REQUIRE(derr.has_value());
  CHECK(*derr == errc::ok);

  std::vector<double> ref_out, ref_lse, ref_mass;
  const double scale = 1.0 / std::sqrt(double(D));
  if (soft_cap > 0.f || window > 0)
    reference_capped<G>(h, scale, soft_cap, window, ref_out, ref_lse, ref_mass, max_pages);
  else
    h.reference(scale, ref_out, ref_lse, ref_mass, max_pages);
  const auto out = dev.out.get();
  const auto lse = dev.lse.get();
  const auto mass = dev.mass.get();
  for (float x : out) REQUIRE(std::isfinite(x));
  const bool has_tq3 = m != mix::all_fp8;
  const double tol = out_tol(
      Path, has_tq3, host_batch<G, Recent, Stale>::KF::format == storage_format::dense_bf16);
  const double err = rel_l2(out, ref_out, std::size_t(B) * QH * D);
  INFO("shape " << QH << "/" << G::kv_heads << "/" << D << " mix " << int(m) << " soft_cap "
                << soft_cap << " window " << window << " rel_l2 " << err);
  CHECK(err < tol);
  for (int i = 0; i < B * QH; ++i) {
    if (std::isinf(ref_lse[i])) {
      CHECK(std::isinf(lse[i]));
      CHECK(lse[i] < 0);
    } else {
      CHECK(std::abs(lse[i] - ref_lse[i]) <
            (has_tq3 ? 2e-3 : 1e-4) * std::max(1.0, std::abs(ref_lse[i])));
    }
  }
  for (int b = 0; b < B; ++b) {
    double sum = 0;
    const int np = (lens[b] + G::page_tokens - 1) / G::page_tokens;
    for (int p = 0; p < np; ++p) {
      CHECK(std::abs(mass[std::size_t(b) * max_pages + p] -
                     ref_mass[std::size_t(b) * max_pages + p]) < 2e-3);
      if (window > 0 && (p + 1) * T <= lens[b] - window)  // wholly before the window: not read
        CHECK(mass[std::size_t(b) * max_pages + p] == 0.f);
      sum += mass[std::size_t(b) * max_pages + p];
    }
    if (lens[b] > 0) CHECK(std::abs(sum - 1.0) < 1e-3);
  }

  // The host path over the same codes: outputs within float rounding of each other.
  host_attention_workspace hws(2);
  host_decode_args<2> ha;
  ha.queries = h.q.data();
  ha.index.batch = B;
  ha.index.seq_len = h.seq_len.data();
  for (int f = 0; f < 2; ++f)
    ha.index.formats[f] = {h.indptr[f].data(), h.slot[f].data(), h.logical[f].data()};
  pool_view pools[2] = {{h.pool[0].data(), host_batch<G, Recent, Stale>::L8::page_bytes,
                         std::uint32_t(h.pages_cap[0])},
                        {h.pool[1].data(), host_batch<G, Recent, Stale>::L3::page_bytes,
                         std::uint32_t(h.pages_cap[1])}};
  ha.pools = pools;
  ha.source = {h.seed, h.layer, h.head_base};
  ha.logits.softmax_scale = float(scale);
  ha.logits.soft_cap = soft_cap;
  ha.window = window;
  std::vector<float> hout(std::size_t(B) * QH * D), hlse(std::size_t(B) * QH);
  ha.out = hout.data();
  ha.lse = hlse.data();
  REQUIRE(host_decode<G, tiers<Recent, Stale>>(hws, ha).is_ok());
  std::vector<double> hout_d(hout.begin(), hout.end());
  const double herr = rel_l2(out, hout_d, hout.size());
  INFO("vs host path rel_l2 " << herr);
  CHECK(herr < tol);
  std::printf(
      "decode %-11s %-12s %3d/%d/%3d mix %d B %d cap %g window %d: rel_l2 vs float64 %.2e, vs "
      "host path %.2e\n",
      Path == decode_path::tensor_core ? "tensor_core" : "cuda_core",
      host_batch<G, Recent, Stale>::KF::name, QH, G::kv_heads, D, int(m), B, double(soft_cap),
      window, err, herr);
}

// Both split kernels on the same case. Recent: the tier of the "fp8" pages of a mix.
template <class G, class Recent = recent, class Stale = stale>
void check_case(const std::vector<int>& lens, mix m, std::uint64_t rng_seed, int waves = 4,
                std::int64_t min_chunk = 32 * 1024, float key_offset = 0.f, int value_spread = 0,
                float q_scale = 1.f, int head_base = 0, float soft_cap = 0.f, int window = 0) {
  check_case_path<G, decode_path::tensor_core, Recent, Stale>(lens, m, rng_seed, waves, min_chunk,
                                                              key_offset, value_spread, q_scale,
                                                              head_base, soft_cap, window);
  check_case_path<G, decode_path::cuda_core, Recent, Stale>(lens, m, rng_seed, waves, min_chunk,
                                                            key_offset, value_spread, q_scale,
                                                            head_base, soft_cap, window);
}

using g_qwen = cuda_test::decode_qwen;
using g_llama = cuda_test::decode_llama;
using g_smol = cuda_test::decode_smol;
using g_small_pages = cuda_test::decode_small_pages;
using g_pages32 = cuda_test::decode_pages32;

}  // namespace

TEST_CASE("gpu decode: benchmark shapes, every mix, unequal lengths", "[cuda][decode]") {
  const std::vector<int> lens = {3000, 1, 700, 64, 129};
  for (mix m : {mix::all_fp8, mix::all_tq3, mix::tiered, mix::interleaved}) {
    check_case<g_qwen>(lens, m, 11 + int(m));
    check_case<g_llama>(lens, m, 21 + int(m));
    check_case<g_smol>(lens, m, 31 + int(m));
  }
}

TEST_CASE("gpu decode: int8_rotated recent pages (alone and with TQ3)",
          "[cuda][decode][int8_rotated]") {
  using recent_int8r = cuda_test::decode_int8r;
  const std::vector<int> lens = {3000, 1, 700, 64, 129};
  for (mix m : {mix::all_fp8, mix::tiered, mix::interleaved}) {
    check_case<g_qwen, recent_int8r>(lens, m, 61 + int(m));
    check_case<g_llama, recent_int8r>(lens, m, 71 + int(m));
    check_case<g_smol, recent_int8r>(lens, m, 81 + int(m));
  }
  check_case<g_small_pages, recent_int8r>({1000, 17, 16, 1}, mix::tiered, 91, 8, 256);
  check_case<g_llama, recent_int8r>({2000, 500}, mix::tiered, 92, 4, 32 * 1024, 8.f, 40);
  check_case<g_qwen, recent_int8r>({1500, 3}, mix::all_fp8, 93, 4, 32 * 1024, 0.f, 0, 1e-7f, 4);
}

// The seam proof of cuda/codec/: dense bf16 pages (the control arm) through one device codec
// file (cuda/codec/dense_bf16.cuh) and its registration, on both paths, alone and beside TQ3 /
// TQ4 pages; the pools' unused bytes are 0xFF (bf16 NaN), so a tail value read into the
// product would show.
TEST_CASE("gpu decode: dense bf16 recent pages (the control arm)", "[cuda][decode][dense_bf16]") {
  using recent_dense = cuda_test::decode_dense;
  const std::vector<int> lens = {3000, 1, 700, 64, 129};
  for (mix m : {mix::all_fp8, mix::tiered, mix::interleaved}) {
    check_case<g_qwen, recent_dense>(lens, m, 261 + int(m));
    check_case<g_llama, recent_dense>(lens, m, 271 + int(m));
    check_case<g_smol, recent_dense>(lens, m, 281 + int(m));
  }
  check_case<g_small_pages, recent_dense, cuda_test::decode_stale_k4>({1000, 17, 16, 1},
                                                                      mix::tiered, 291, 8, 256);
  // large value scales (2^+-40 per token: bf16 holds them, f16 would not), key offsets, tiny
  // queries, a tensor-parallel rank's heads, soft-cap and a window
  check_case<g_llama, recent_dense>({2000, 500}, mix::all_fp8, 292, 4, 32 * 1024, 8.f, 40);
  check_case<g_qwen, recent_dense>({1500, 3}, mix::all_fp8, 293, 4, 32 * 1024, 0.f, 0, 1e-7f, 4);
  check_case<g_smol, recent_dense>({1500, 70}, mix::interleaved, 294, 4, 32 * 1024, 0.f, 0, 1.f, 0,
                                   30.f, 200);
}

TEST_CASE("gpu decode: TQ4 keys with TQ3 values in the Stale tier", "[cuda][decode][tq4]") {
  using recent_int8r = cuda_test::decode_int8r;
  using stale_k4 = cuda_test::decode_stale_k4;
  const std::vector<int> lens = {3000, 1, 700, 64, 129};
  for (mix m :
       {mix::all_tq3, mix::tiered, mix::interleaved}) {  // all_tq3: every page in the Stale tier
    check_case<g_qwen, recent_int8r, stale_k4>(lens, m, 161 + int(m));
    check_case<g_llama, recent, stale_k4>(lens, m, 171 + int(m));
    check_case<g_smol, recent_int8r, stale_k4>(lens, m, 181 + int(m));
  }
  check_case<g_small_pages, recent_int8r, stale_k4>({1000, 17, 16, 1}, mix::tiered, 191, 8, 256);
  // a key offset channel (the score's 1024 + c fold sees large query sums) and value spread
  check_case<g_llama, recent_int8r, stale_k4>({2000, 500}, mix::all_tq3, 192, 4, 32 * 1024, 8.f,
                                              40);
  check_case<g_qwen, recent, stale_k4>({1500, 3}, mix::all_tq3, 193, 4, 32 * 1024, 0.f, 0, 1e-7f,
                                       4);
  check_case<g_smol, recent, stale_k4>({1500, 3}, mix::all_tq3, 194, 4, 32 * 1024, 0.f, 0, 30.f);
}

TEST_CASE("gpu decode: TQ2 pages (the Cold tier's 2-bit values, and keys)", "[cuda][decode][tq2]") {
  using recent_int8r = cuda_test::decode_int8r;
  using cold_v2 = cuda_test::decode_cold_v2;
  using cold = cuda_test::decode_cold;
  const std::vector<int> lens = {3000, 1, 700, 64, 129};
  for (mix m : {mix::all_tq3, mix::tiered, mix::interleaved}) {  // all_tq3: every page 2-bit
    check_case<g_qwen, recent_int8r, cold_v2>(lens, m, 401 + int(m));
    check_case<g_llama, recent, cold_v2>(lens, m, 411 + int(m));
    check_case<g_smol, recent_int8r, cold_v2>(lens, m, 421 + int(m));
    check_case<g_qwen, recent, cold>(lens, m, 431 + int(m));
    check_case<g_llama, recent_int8r, cold>(lens, m, 441 + int(m));
    check_case<g_smol, recent_int8r, cold>(lens, m, 451 + int(m));
  }
  check_case<g_small_pages, recent_int8r, cold>({1000, 17, 16, 1}, mix::tiered, 461, 8, 256);
  check_case<g_pages32, recent, cold>({777, 48, 15}, mix::interleaved, 462, 8, 1024);
  // a key offset channel (the 1.5 x query-sum fold sees large sums) and value spread
  check_case<g_llama, recent_int8r, cold>({2000, 500}, mix::all_tq3, 463, 4, 32 * 1024, 8.f, 40);
  check_case<g_smol, recent_int8r, cold>({1500, 3}, mix::all_tq3, 464, 4, 32 * 1024, 0.f, 0, 30.f);
}

TEST_CASE("gpu decode: edge shapes", "[cuda][decode]") {
  SECTION("single-token sequences") { check_case<g_llama>({1, 1, 1}, mix::tiered, 41); }
  SECTION("partial last pages and an empty sequence") {
    check_case<g_smol>({65, 0, 127, 63}, mix::interleaved, 42);
  }
  SECTION("very unequal lengths, many chunks") {
    check_case<g_qwen>({9000, 2, 300}, mix::tiered, 43, 16, 1024);
  }
  SECTION("a tensor-parallel rank's heads (head_base 4: contexts of global heads 4..11)") {
    check_case<g_llama>({3000, 650}, mix::tiered, 47, 4, 32 * 1024, 0.f, 0, 1.f, 4);
  }
  SECTION("one chunk per sequence") {
    check_case<g_qwen>({5000, 70}, mix::tiered, 44, 1, 1ll << 40);
  }
  SECTION("small pages, group 1") {
    check_case<g_small_pages>({1000, 17, 16, 1}, mix::tiered, 45, 8, 256);
  }
  SECTION("32-token pages: one TQ3 step a page, partial sub-steps") {
    check_case<g_pages32>({1000, 33, 32, 31, 17, 16, 1}, mix::interleaved, 51, 8, 1024);
    check_case<g_pages32, recent, tier<tq4_key, tq3_value>>({777, 48, 15}, mix::tiered, 52, 8,
                                                            1024);
  }
  SECTION("offset key channels (large logits)") {
    check_case<g_llama>({2000, 500}, mix::tiered, 46, 4, 32 * 1024, 8.f);
  }
  SECTION("value vectors scaled by 2^-40 .. 2^40 per token (f16 range exceeded)") {
    check_case<g_qwen>({1500, 300}, mix::tiered, 47, 4, 32 * 1024, 0.f, 40);
    check_case<g_llama>({700}, mix::all_fp8, 48, 4, 32 * 1024, 0.f, 40);
  }
  SECTION("tiny and large queries (f16 subnormal / sharp softmax)") {
    check_case<g_qwen>({900, 64}, mix::tiered, 49, 4, 32 * 1024, 0.f, 0, 1e-7f);
    check_case<g_llama>({900, 65}, mix::interleaved, 50, 4, 32 * 1024, 0.f, 0, 8.f);
  }
}

TEST_CASE("gpu decode: soft-capped logits and sliding windows", "[cuda][decode][window]") {
  // Arguments after the rng seed: waves, min_chunk, key_offset, value_spread, q_scale, head_base,
  // soft_cap, window. Every case checks both kernels against float64 (page mass included: the
  // pages wholly before a window get exactly 0, a sequence's masses still sum to 1) and against
  // the host path with the same soft_cap / window.
  using recent_int8r = cuda_test::decode_int8r;
  using stale_k4 = cuda_test::decode_stale_k4;
  constexpr std::int64_t mc = 32 * 1024;
  const std::vector<int> lens = {3000, 1, 700, 64, 129};
  SECTION("soft-cap 30 and 5 over large logits") {
    check_case<g_llama>(lens, mix::tiered, 201, 4, mc, 0.f, 0, 8.f, 0,
                        30.f);  // q x 8: ~8-nat logits
    check_case<g_qwen>({1500, 300}, mix::tiered, 202, 4, mc, 6.f, 0, 4.f, 0, 5.f);
    check_case<g_smol, recent_int8r, stale_k4>(lens, mix::interleaved, 203, 4, mc, 0.f, 0, 4.f, 0,
                                               5.f);
    check_case<g_llama>({2000, 65}, mix::all_fp8, 204, 4, mc, 0.f, 0, 2.f, 0, 5.f);
  }
  SECTION("windows of 1, 37 and 200 tokens and one longer than every sequence") {
    for (int w : {1, 37, 200, 5000})
      check_case<g_llama>(lens, mix::tiered, 210, 4, mc, 0.f, 0, 1.f, 0, 0.f, w);
    check_case<g_smol>(lens, mix::interleaved, 211, 4, mc, 0.f, 0, 1.f, 0, 0.f, 37);
    check_case<g_qwen, recent_int8r, stale_k4>(lens, mix::tiered, 212, 4, mc, 0.f, 0, 1.f, 0, 0.f,
                                               200);
    check_case<g_llama>({2000, 700}, mix::all_fp8, 213, 4, mc, 0.f, 0, 1.f, 0, 0.f, 37);
  }
  SECTION("windows starting on a page boundary, mid-page and mid-step; small and 32-token pages") {
    // 3008 - 192 = 44 x 64: the window starts a page; 3000 - 192 = 2808: mid-page
    check_case<g_llama>({3008, 3000}, mix::tiered, 220, 4, mc, 0.f, 0, 1.f, 0, 0.f, 192);
    check_case<g_small_pages>({1000, 17, 16, 1}, mix::tiered, 221, 8, 256, 0.f, 0, 1.f, 0, 0.f, 37);
    check_case<g_pages32>({1000, 33, 32, 31, 17, 16, 1}, mix::interleaved, 222, 8, 1024, 0.f, 0,
                          1.f, 0, 0.f, 50);
    check_case<g_pages32, recent, stale_k4>({777, 48, 15}, mix::tiered, 223, 8, 1024, 0.f, 0, 1.f,
                                            0, 0.f, 20);
  }
  SECTION("windows over many KV splits: chunks wholly before the window store empty states") {
    check_case<g_qwen>({9000, 2, 300}, mix::tiered, 230, 16, 1024, 0.f, 0, 1.f, 0, 0.f, 200);
    check_case<g_qwen>({9000, 2, 300}, mix::tiered, 231, 16, 1024, 0.f, 0, 1.f, 0, 0.f, 3000);
    check_case<g_llama>({6000, 1500}, mix::interleaved, 232, 16, 512, 0.f, 0, 4.f, 0, 30.f, 1000);
  }
}

TEST_CASE("gpu decode: the chunk split does not change the result", "[cuda][decode]") {
  // Same inputs, 1 chunk vs up to 64 chunks per sequence: outputs within float rounding.
  using G = g_llama;
  std::mt19937_64 rng(77);
  host_batch<G> h;
  h.build({6000, 1500}, mix::tiered, rng);
  const int entries = int(std::max(h.slot[0].size(), h.slot[1].size()));
  device_batch<G> dev(h.pool[0].size(), h.pool[1].size(), 2, entries, 128);
  dev.upload(h);
  const auto counts = page_counts(h);
  std::vector<float> outs[2];
  for (int variant = 0; variant < 2; ++variant) {
    cuda::decode_capacity cap{2, 64, 128, false};
    auto plan =
        cuda::plan_decode<G, two_tiers>(cap, counts.data(), 2, 132, variant ? 64 : 1,
                                        variant ? 512 : (1ll << 40), cuda::balance::work, 1);
    REQUIRE(plan.has_value());
    device_buffer<std::uint8_t> ws(plan->workspace_bytes);
    REQUIRE(cuda_test::decode_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
    auto in = dev.inputs(h, 2, false);
    REQUIRE(cuda_test::decode<G, two_tiers>(*plan, in, ws.p, ws.n, nullptr).is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    outs[variant] = dev.out.get();
  }
  std::vector<double> ref(outs[0].begin(), outs[0].end());
  // f16 probabilities are rounded relative to each chunk's running maxima
  const double split_err = rel_l2(outs[1], ref, ref.size());
  std::printf("decode tensor_core chunk split 1 vs 64: rel_l2 %.2e\n", split_err);
  CHECK(split_err < 1e-3);
}

TEST_CASE("gpu decode: CUDA graph captured once, replayed with new lengths and formats",
          "[cuda][decode]") {
  using G = g_qwen;
  constexpr int D = G::head_dim, QH = G::q_heads;
  const int max_batch = 4, max_pages = 80, cap_entries = max_batch * max_pages;
  // Fixed-capacity buffers: pools big enough for every replayed batch.
  std::mt19937_64 rng(99);
  host_batch<G> first;
  first.build({5000, 100, 2000, 1}, mix::tiered, rng);
  const std::size_t p0 = host_batch<G>::L8::page_bytes * (cap_entries + 3);
  const std::size_t p1 = host_batch<G>::L3::page_bytes * (cap_entries + 3);
  device_batch<G> dev(p0, p1, max_batch, cap_entries, max_pages);
  cuda::decode_capacity cap{max_batch, 32, max_pages, true};
  std::vector<std::int32_t> counts(std::size_t(max_batch) * 2, max_pages / 2);  // plan for capacity
  auto plan = cuda::plan_decode<G, two_tiers>(cap, counts.data(), max_batch, 132);
  REQUIRE(plan.has_value());
  device_buffer<std::uint8_t> ws(plan->workspace_bytes);
  REQUIRE(cuda_test::decode_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  dev.upload(first);
  auto in = dev.inputs(first, max_batch, true);
  in.pools[0].capacity = std::uint32_t(cap_entries + 3);
  in.pools[1].capacity = std::uint32_t(cap_entries + 3);
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  REQUIRE(cuda_test::decode<G, two_tiers>(*plan, in, ws.p, ws.n, stream).is_ok());
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  struct step {
    std::vector<int> lens;
    mix m;
  };
  const std::vector<step> steps = {{{5000, 100, 2000, 1}, mix::tiered},
                                   {{64, 4900, 1, 3333}, mix::interleaved},
                                   {{1, 1, 1, 1}, mix::all_fp8},
                                   {{5100, 0, 77, 4000}, mix::all_tq3}};
  for (const step& s : steps) {
    host_batch<G> h;
    h.build(s.lens, s.m, rng);
    REQUIRE(int(h.slot[0].size()) <= cap_entries);
    REQUIRE(int(h.slot[1].size()) <= cap_entries);
    dev.upload(h);  // same device buffers, new contents
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<double> ref_out, ref_lse, ref_mass;
    h.reference(1.0 / std::sqrt(double(D)), ref_out, ref_lse, ref_mass, max_pages);
    const auto out = dev.out.get();
    const double err = rel_l2(out, ref_out, std::size_t(max_batch) * QH * D);
    INFO("replay mix " << int(s.m) << " rel_l2 " << err);
    CHECK(err < out_tol(decode_path::tensor_core, s.m != mix::all_fp8));
    const auto mass = dev.mass.get();
    for (std::size_t i = 0; i < std::size_t(max_batch) * max_pages; ++i)
      if (i % max_pages < std::size_t((s.lens[i / max_pages] + 63) / 64))
        CHECK(std::abs(mass[i] - ref_mass[i]) < 2e-3);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("gpu decode: bad input is reported", "[cuda][decode]") {
  using G = g_smol;
  std::mt19937_64 rng(5);
  host_batch<G> h;
  h.build({200, 100}, mix::tiered, rng);
  const int entries = int(std::max(h.slot[0].size(), h.slot[1].size()));
  device_batch<G> dev(h.pool[0].size(), h.pool[1].size(), 2, entries, 8);
  h.slot[1][0] = h.pages_cap[1] + 5;  // a slot beyond its pool
  dev.upload(h);
  const auto counts = page_counts(h);
  cuda::decode_capacity cap{2, 8, 8, false};
  auto plan = cuda::plan_decode<G, two_tiers>(cap, counts.data(), 2, 132);
  REQUIRE(plan.has_value());
  device_buffer<std::uint8_t> ws(plan->workspace_bytes);
  REQUIRE(cuda_test::decode_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
  auto in = dev.inputs(h, 2, false);
  SECTION("slot beyond the pool: device error, no fault; the next good step reads ok") {
    // Garbage left in the workspace must not show as an error, and an error must not outlive
    // its step (a later good step on the same workspace reads ok), on both paths and for a
    // plan with an odd chunk count.
    cuda::decode_capacity cap7{2, 7, 8, false};
    auto plan7 = cuda::plan_decode<G, two_tiers>(cap7, counts.data(), 2, 132);
    REQUIRE(plan7.has_value());
    REQUIRE(plan7->workspace_bytes <= ws.n);
    auto run = [&](const cuda::decode_plan& p, decode_path path) {
      CUDA_OK(cudaMemset(ws.p, 0x5a, ws.n));
      REQUIRE(cuda_test::decode_workspace_init(p, ws.p, ws.n, nullptr).is_ok());
      REQUIRE((path == decode_path::tensor_core
                   ? cuda_test::decode<G, two_tiers>(p, in, ws.p, ws.n, nullptr)
                   : cuda_test::decode<G, two_tiers, decode_path::cuda_core>(p, in, ws.p, ws.n,
                                                                             nullptr))
                  .is_ok());
      auto e = cuda_test::decode_device_error(p, ws.p, nullptr);
      REQUIRE(e.has_value());
      return *e;
    };
    for (const auto* p : {&*plan, &*plan7})
      for (auto path : {decode_path::tensor_core, decode_path::cuda_core}) {
        INFO("max_chunks " << p->max_chunks << " path " << int(path));
        CHECK(run(*p, path) == errc::out_of_range);
      }
    CUDA_OK(cudaMemset(ws.p, 0x5a, ws.n));  // not initialized: said so, not a made-up error
    CHECK(cuda_test::decode_device_error(*plan, ws.p, nullptr).code() == errc::invalid_argument);
    h.slot[1][0] = 0;  // a valid slot: the same workspace now reports no error
    dev.upload(h);
    in = dev.inputs(h, 2, false);
    for (const auto* p : {&*plan, &*plan7})
      for (auto path : {decode_path::tensor_core, decode_path::cuda_core}) {
        INFO("max_chunks " << p->max_chunks << " path " << int(path));
        CHECK(run(*p, path) == errc::ok);
      }
  }
  SECTION("a non-finite query element: its head's output and lse are NaN, nothing else moves") {
    h.slot[1][0] = 0;
    dev.upload(h);
    in = dev.inputs(h, 2, false);
    constexpr int D = G::head_dim, QH = G::q_heads;
    auto run = [&](decode_path path) {
      REQUIRE((path == decode_path::tensor_core
                   ? cuda_test::decode<G, two_tiers>(*plan, in, ws.p, ws.n, nullptr)
                   : cuda_test::decode<G, two_tiers, decode_path::cuda_core>(*plan, in, ws.p, ws.n,
                                                                             nullptr))
                  .is_ok());
      CUDA_OK(cudaDeviceSynchronize());
      return std::make_pair(dev.out.get(), dev.lse.get());
    };
    for (auto path : {decode_path::tensor_core, decode_path::cuda_core}) {
      for (float poison :
           {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        INFO("path " << int(path) << " poison " << poison);
        dev.q.put(h.q);
        const auto clean = run(path);
        const int bad_row = 1 * QH + 4;  // sequence 1, query head 4
        auto q = h.q;
        q[std::size_t(bad_row) * D + 7] = poison;
        dev.q.put(q);
        const auto got = run(path);
        for (int r = 0; r < 2 * QH; ++r) {
          INFO("row " << r);
          if (r == bad_row) {
            CHECK(std::isnan(got.second[std::size_t(r)]));
            for (int i = 0; i < D; ++i) CHECK(std::isnan(got.first[std::size_t(r) * D + i]));
          } else {  // bit-equal to the clean step
            CHECK(std::memcmp(&got.second[std::size_t(r)], &clean.second[std::size_t(r)], 4) == 0);
            CHECK(std::memcmp(&got.first[std::size_t(r) * D], &clean.first[std::size_t(r) * D],
                              sizeof(float) * D) == 0);
          }
        }
      }
    }
    dev.q.put(h.q);
  }
  SECTION("host checks") {
    CHECK(cuda_test::decode<G, two_tiers>(*plan, in, ws.p, ws.n - 1, nullptr).code() ==
          errc::capacity_exhausted);
    auto bad = in;
    bad.index.batch = 3;
    CHECK(cuda_test::decode<G, two_tiers>(*plan, bad, ws.p, ws.n, nullptr).code() ==
          errc::out_of_range);
    bad = in;
    bad.pools[1].page_bytes += 16;
    CHECK(cuda_test::decode<G, two_tiers>(*plan, bad, ws.p, ws.n, nullptr).code() ==
          errc::geometry_mismatch);
    bad = in;
    bad.softmax_scale = std::numeric_limits<float>::quiet_NaN();
    CHECK(cuda_test::decode<G, two_tiers>(*plan, bad, ws.p, ws.n, nullptr).code() ==
          errc::invalid_argument);
    for (float bad_cap :
         {-1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      bad = in;
      bad.soft_cap = bad_cap;
      const status st = cuda_test::decode<G, two_tiers>(*plan, bad, ws.p, ws.n, nullptr);
      INFO(st.message());
      CHECK(st.code() == errc::invalid_argument);
      CHECK(st.message().find("soft_cap") != std::string::npos);
      CHECK(cuda_test::decode<G, two_tiers, decode_path::cuda_core>(*plan, bad, ws.p, ws.n, nullptr)
                .code() == errc::invalid_argument);
    }
    bad = in;
    bad.window = -3;
    {
      const status st = cuda_test::decode<G, two_tiers>(*plan, bad, ws.p, ws.n, nullptr);
      INFO(st.message());
      CHECK(st.code() == errc::invalid_argument);
      CHECK(st.message().find("window = -3") != std::string::npos);
    }
    bad = in;
    bad.page_mass = dev.mass.p;  // plan without page mass
    bad.page_mass_stride = 8;
    CHECK(cuda_test::decode<G, two_tiers>(*plan, bad, ws.p, ws.n, nullptr).code() ==
          errc::invalid_argument);
    cuda::decode_capacity zero{0, 8, 0, false};
    CHECK(!cuda::plan_decode<G, two_tiers>(zero, counts.data(), 0, 132).has_value());
  }
}
