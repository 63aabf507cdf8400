// SPDX-License-Identifier: Apache-2.0
// GPU chunked prefill over mixed pages vs a float64 causal reference on the decoded vectors and
// vs the host path (attention/host_prefill.hpp) on the same codes; edge shapes, soft-cap,
// sliding window, bf16 I/O, non-finite queries, bad index entries, CUDA-graph replay.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cuda_test.hpp"
#include "paged_batch.hpp"
#include "prefill_kernels.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/codec/bf16.hpp"
#include "tierkv/cuda/prefill_plan.cuh"

namespace {

using namespace tierkv;
using cuda_test::device_buffer;
using cuda_test::host_batch;
using cuda_test::mix;
using cuda_test::rel_l2;

struct options {
  float soft_cap = 0.f;
  int window = 0;
  bool bf16_io = false;
  float q_scale = 1.f;
  int value_spread = 0;
  float key_offset = 0.f;
};

float bf16_round(float x) { return bf16_to_float(float_to_bf16(x)); }

// A prefill batch: the pages (host_batch), each sequence's chunk length and the chunk queries.
template <class G, class Recent, class Stale>
struct prefill_batch {
  static constexpr int D = G::head_dim, QH = G::q_heads, H = G::kv_heads;
  host_batch<G, Recent, Stale> pages;
  std::vector<int> chunk;
  std::vector<std::int32_t> q_indptr;
  std::vector<float> q;  // [total_q][q_heads][D] (bf16-rounded when the test feeds bf16)

  int total_q() const { return q_indptr.back(); }

  void build(const std::vector<int>& lens, const std::vector<int>& chunks, mix m,
             std::mt19937_64& rng, const options& o) {
    pages.build(lens, m, rng, o.key_offset, o.value_spread, o.q_scale);
    chunk = chunks;
    q_indptr.assign(1, 0);
    for (int n : chunks) q_indptr.push_back(q_indptr.back() + n);
    std::normal_distribution<float> nd(0.f, 1.f);
    q.resize(std::size_t(total_q()) * QH * D);
    for (float& x : q) x = o.bf16_io ? bf16_round(nd(rng) * o.q_scale) : nd(rng) * o.q_scale;
  }

  // float64 causal reference on the decoded vectors: out [total_q][QH][D], lse natural.
  void reference(double scale, const options& o, std::vector<double>& out,
                 std::vector<double>& lse) const {
    out.assign(q.size(), 0.0);
    lse.assign(std::size_t(total_q()) * QH, -std::numeric_limits<double>::infinity());
    for (int b = 0; b < pages.batch(); ++b) {
      const int len = pages.seq_len[std::size_t(b)], n = chunk[std::size_t(b)];
      for (int j = 0; j < n; ++j) {
        const int pos = len - n + j;
        const int lo = o.window > 0 ? std::max(0, pos - o.window + 1) : 0;
        const std::size_t row = std::size_t(q_indptr[std::size_t(b)] + j);
        for (int qh = 0; qh < QH; ++qh) {
          const int h = qh / G::group_size;
          const float* qq = q.data() + (row * QH + std::size_t(qh)) * D;
          std::vector<double> s(std::size_t(pos + 1), 0.0);
          double mx = -INFINITY;
          for (int t = lo; t <= pos; ++t) {
            double dot = 0;
            const double* k = pages.kdec[std::size_t(b)].data() + (std::size_t(t) * H + h) * D;
            for (int d = 0; d < D; ++d) dot += double(qq[d]) * k[d];
            double z = dot * scale;
            if (o.soft_cap > 0.f) z = o.soft_cap * std::tanh(z / o.soft_cap);
            s[std::size_t(t)] = z;
            mx = std::max(mx, z);
          }
          double l = 0;
          for (int t = lo; t <= pos; ++t) l += std::exp(s[std::size_t(t)] - mx);
          double* dst = out.data() + (row * QH + std::size_t(qh)) * D;
          for (int t = lo; t <= pos; ++t) {
            const double p = std::exp(s[std::size_t(t)] - mx) / l;
            const double* v = pages.vdec[std::size_t(b)].data() + (std::size_t(t) * H + h) * D;
            for (int d = 0; d < D; ++d) dst[d] += p * v[d];
          }
          lse[row * QH + std::size_t(qh)] = mx + std::log(l);
        }
      }
    }
  }
};

// Device buffers of a prefill batch and the call's arguments.
template <class G, class Recent, class Stale>
struct device_prefill {
  static constexpr int D = G::head_dim, QH = G::q_heads;
  cuda_test::device_pages<G, Recent, Stale> pages;
  device_buffer<std::int32_t> q_indptr;
  device_buffer<float> q, out, lse;
  device_buffer<std::uint16_t> q16, out16;
  device_prefill(const prefill_batch<G, Recent, Stale>& p, int max_batch, int cap_entries,
                 int max_total_q)
      : pages(p.pages.pool[0].size(), p.pages.pool[1].size(), max_batch, cap_entries),
        q_indptr(max_batch + 1),
        q(std::size_t(max_total_q) * QH * D),
        out(std::size_t(max_total_q) * QH * D),
        lse(std::size_t(max_total_q) * QH),
        q16(std::size_t(max_total_q) * QH * D),
        out16(std::size_t(max_total_q) * QH * D) {}
  void upload(const prefill_batch<G, Recent, Stale>& p) {
    pages.upload(p.pages);
    q_indptr.put(p.q_indptr);
    q.put(p.q);
    std::vector<std::uint16_t> h(p.q.size());
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = float_to_bf16(p.q[i]);
    q16.put(h);
    CUDA_OK(cudaMemset(out.p, 0xFF, out.n * sizeof(float)));  // NaN: every output is written
    CUDA_OK(cudaMemset(out16.p, 0xFF, out16.n * sizeof(std::uint16_t)));
  }
  cuda_test::prefill_args args(const prefill_batch<G, Recent, Stale>& p, const options& o) const {
    cuda_test::prefill_args a;
    a.index = pages.index(p.pages.batch());
    a.pools[0] = pages.pool(p.pages, 0);
    a.pools[1] = pages.pool(p.pages, 1);
    a.queries_bf16 = o.bf16_io;
    a.queries = o.bf16_io ? static_cast<const void*>(q16.p) : static_cast<const void*>(q.p);
    a.q_indptr = q_indptr.p;
    a.softmax_scale = 1.f / std::sqrt(float(D));
    a.soft_cap = o.soft_cap;
    a.window = o.window;
    a.cache_seed = p.pages.seed;
    a.layer = p.pages.layer;
    a.head_base = p.pages.head_base;
    a.out_bf16 = o.bf16_io;
    a.out = o.bf16_io ? static_cast<void*>(out16.p) : static_cast<void*>(out.p);
    a.lse = lse.p;
    return a;
  }
  std::vector<float> output(const options& o, std::size_t n) const {
    std::vector<float> r(n);
    if (o.bf16_io) {
      const auto h = out16.get();
      for (std::size_t i = 0; i < n; ++i) r[i] = bf16_to_float(h[i]);
    } else {
      const auto h = out.get();
      std::copy(h.begin(), h.begin() + std::ptrdiff_t(n), r.begin());
    }
    return r;
  }
};

template <class HB>
int max_entries(const HB& h) {
  return std::max<int>(1, int(std::max(h.slot[0].size(), h.slot[1].size())));
}

// The GPU's error against float64 over the decoded vectors: f16 queries (scaled per row) and
// keys, bf16 probabilities x value scales; TQ3 keys' coarse scores move the softmax most.
// Logits of magnitude |s| carry the queries' f16 rounding, about 2^-12 |s| (a near-one-hot
// softmax at |s| ~ 1e4 moves by a few units: the q_scale 3e3 case).
double prefill_tol(mix m, const options& o) {
  if (o.q_scale > 100.f) return 3e-2;
  return o.bf16_io ? 8e-3 : m == mix::all_fp8 ? 2e-3 : 4e-3;
}
double lse_tol(const options& o) { return o.q_scale > 100.f ? 1e-4 * 1e5 : 2e-3; }

template <class G, class Recent = cuda_test::decode_recent, class Stale = cuda_test::decode_stale>
void check_prefill(const std::vector<int>& lens, const std::vector<int>& chunks, mix m,
                   std::uint64_t seed, const options& o = {}) {
  constexpr int D = G::head_dim, QH = G::q_heads;
  using TL = tiers<Recent, Stale>;
  std::mt19937_64 rng(seed);
  prefill_batch<G, Recent, Stale> p;
  p.build(lens, chunks, m, rng, o);
  const int B = p.pages.batch();
  const int max_chunk = std::max(1, *std::max_element(chunks.begin(), chunks.end()));
  device_prefill<G, Recent, Stale> dev(p, B, max_entries(p.pages), std::max(1, p.total_q()));
  const std::size_t n = std::size_t(p.total_q()) * QH * D;
  std::vector<double> ref, ref_lse;
  p.reference(1.0 / std::sqrt(double(D)), o, ref, ref_lse);
  std::vector<float> out;
  double err = 0, lse_err = 0;
  int planned_splits = 0;
  // the planner's split count, no split (one pass writes the output) and an odd split count
  for (int splits : {0, 1, 5}) {
    dev.upload(p);
    auto plan = cuda::plan_prefill<G>(B, max_chunk, 0, 132, splits);
    REQUIRE(plan.has_value());
    if (splits == 0) planned_splits = plan->kv_splits;
    device_buffer<std::uint8_t> ws(plan->workspace_bytes);
    REQUIRE(cuda_test::prefill_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
    const auto args = dev.args(p, o);
    const status st = cuda_test::prefill<G, TL>(*plan, args, ws.p, ws.n, nullptr);
    INFO(st.message());
    REQUIRE(st.is_ok());
    CUDA_OK(cudaDeviceSynchronize());
    auto derr = cuda_test::prefill_device_error(*plan, ws.p, nullptr);
    REQUIRE(derr.has_value());
    CHECK(*derr == errc::ok);
    out = dev.output(o, n);
    const auto lse = dev.lse.get();
    for (std::size_t i = 0; i < n; ++i) REQUIRE(std::isfinite(out[i]));
    err = rel_l2(out, ref, n);
    lse_err = 0;
    for (std::size_t i = 0; i < std::size_t(p.total_q()) * QH; ++i)
      lse_err = std::max(lse_err, std::abs(double(lse[i]) - ref_lse[i]));
    INFO("shape " << QH << "/" << G::kv_heads << "/" << D << " pages " << G::page_tokens << " mix "
                  << int(m) << " splits " << plan->kv_splits << " rel_l2 " << err << " lse "
                  << lse_err);
    CHECK(err < prefill_tol(m, o));
    CHECK(lse_err < lse_tol(o));
  }

  // the host path on the same codes (no sliding window there)
  double herr = 0;
  if (o.window == 0) {
    host_attention_workspace hws(2);
    pool_view pools[2] = {
        {const_cast<std::uint8_t*>(p.pages.pool[0].data()),
         host_batch<G, Recent, Stale>::L8::page_bytes, std::uint32_t(p.pages.pages_cap[0])},
        {const_cast<std::uint8_t*>(p.pages.pool[1].data()),
         host_batch<G, Recent, Stale>::L3::page_bytes, std::uint32_t(p.pages.pages_cap[1])}};
    host_prefill_args<2> ha;
    ha.queries = p.q.data();
    ha.q_indptr = p.q_indptr.data();
    ha.index.batch = B;
    ha.index.seq_len = p.pages.seq_len.data();
    for (int f = 0; f < 2; ++f)
      ha.index.formats[f] = {p.pages.indptr[f].data(), p.pages.slot[f].data(),
                             p.pages.logical[f].data()};
    ha.pools = pools;
    ha.source = {p.pages.seed, p.pages.layer, p.pages.head_base};
    ha.logits = {1.f / std::sqrt(float(D)), o.soft_cap};
    std::vector<float> hout(std::max<std::size_t>(1, n));
    ha.out = hout.data();
    REQUIRE(host_prefill<G, TL>(hws, ha).is_ok());
    std::vector<double> hd(hout.begin(), hout.end());
    herr = rel_l2(out, hd, n);
    INFO("vs host path rel_l2 " << herr);
    CHECK(herr < prefill_tol(m, o));
  }
  std::printf(
      "prefill %-12s %-9s %3d/%d/%3d p%-2d mix %d B %d q %4d splits %2d%s%s%s: rel_l2 vs float64 "
      "%.2e, lse %.1e, vs host %.2e\n",
      host_batch<G, Recent, Stale>::KF::name, host_batch<G, Recent, Stale>::KT::name, QH,
      G::kv_heads, D, G::page_tokens, int(m), B, p.total_q(), planned_splits,
      o.soft_cap > 0 ? " softcap" : "", o.window > 0 ? " window" : "", o.bf16_io ? " bf16" : "",
      err, lse_err, herr);
}

using g_qwen = cuda_test::decode_qwen;
using g_llama = cuda_test::decode_llama;
using g_smol = cuda_test::decode_smol;
using g_small = cuda_test::decode_small_pages;
using g_p32 = cuda_test::decode_pages32;
using int8r = cuda_test::decode_int8r;
using stale_k4 = cuda_test::decode_stale_k4;
using cold_v2 = cuda_test::decode_cold_v2;
using cold = cuda_test::decode_cold;

}  // namespace

TEST_CASE("gpu prefill: every mix and shape against float64 and the host path", "[cuda][prefill]") {
  // chunks: a long one, one that is the whole sequence, one token (a decode step), none
  const std::vector<int> lens = {700, 64, 300, 45};
  const std::vector<int> chunks = {130, 64, 1, 0};
  for (mix m : {mix::all_fp8, mix::all_tq3, mix::tiered, mix::interleaved}) {
    check_prefill<g_qwen>(lens, chunks, m, 11 + int(m));
    check_prefill<g_llama>(lens, chunks, m, 21 + int(m));
    check_prefill<g_smol>(lens, chunks, m, 31 + int(m));
    check_prefill<g_small>(lens, chunks, m, 41 + int(m));
    check_prefill<g_p32>(lens, chunks, m, 51 + int(m));
  }
}

TEST_CASE("gpu prefill: int8_rotated Recent pages, TQ4 Stale keys", "[cuda][prefill]") {
  const std::vector<int> lens = {520, 200, 33};
  const std::vector<int> chunks = {77, 200, 5};
  for (mix m : {mix::all_fp8, mix::all_tq3, mix::tiered, mix::interleaved}) {
    check_prefill<g_qwen, int8r, stale_k4>(lens, chunks, m, 61 + int(m));
    check_prefill<g_llama, int8r, stale_k4>(lens, chunks, m, 71 + int(m));
    check_prefill<g_small, int8r, stale_k4>(lens, chunks, m, 81 + int(m));
    check_prefill<g_qwen, cuda_test::decode_recent, stale_k4>(lens, chunks, m, 91 + int(m));
  }
}

TEST_CASE("gpu prefill: TQ2 pages (the Cold tier)", "[cuda][prefill][tq2]") {
  const std::vector<int> lens = {520, 200, 33};
  const std::vector<int> chunks = {77, 200, 5};
  for (mix m : {mix::all_tq3, mix::tiered, mix::interleaved}) {  // all_tq3: every page 2-bit
    check_prefill<g_qwen, int8r, cold_v2>(lens, chunks, m, 101 + int(m));
    check_prefill<g_llama, cuda_test::decode_recent, cold>(lens, chunks, m, 111 + int(m));
    check_prefill<g_small, int8r, cold>(lens, chunks, m, 121 + int(m));
    check_prefill<g_qwen, cuda_test::decode_recent, cold>(lens, chunks, m, 131 + int(m));
  }
}

TEST_CASE("gpu prefill: soft-cap, sliding window, bf16 I/O, hard data", "[cuda][prefill]") {
  const std::vector<int> lens = {400, 129};
  const std::vector<int> chunks = {150, 129};
  options cap;
  cap.soft_cap = 5.f;
  cap.q_scale = 4.f;  // logits well into the cap's bend
  check_prefill<g_qwen>(lens, chunks, mix::tiered, 101, cap);
  check_prefill<g_small, int8r, stale_k4>(lens, chunks, mix::interleaved, 102, cap);
  options win;
  win.window = 37;  // shorter than a tile: tiles wholly outside are skipped, others masked
  check_prefill<g_llama>(lens, chunks, mix::tiered, 103, win);
  check_prefill<g_small>(lens, chunks, mix::interleaved, 104, win);
  win.window = 200;
  check_prefill<g_qwen, int8r, stale_k4>(lens, chunks, mix::tiered, 105, win);
  options io;
  io.bf16_io = true;
  check_prefill<g_qwen>(lens, chunks, mix::tiered, 106, io);
  check_prefill<g_smol>(lens, chunks, mix::all_fp8, 107, io);
  options hard;
  hard.value_spread = 40;  // value scales 2^-40 .. 2^40: far beyond f16's range
  hard.key_offset = 6.f;
  hard.q_scale = 1e-3f;
  check_prefill<g_qwen>(lens, chunks, mix::tiered, 108, hard);
  hard.q_scale = 3e3f;  // near-one-hot softmax
  check_prefill<g_llama, int8r, stale_k4>(lens, chunks, mix::interleaved, 109, hard);
}

TEST_CASE("gpu prefill: a non-finite query poisons its own row only", "[cuda][prefill]") {
  using G = g_llama;
  constexpr int D = G::head_dim, QH = G::q_heads;
  std::mt19937_64 rng(7);
  prefill_batch<G, cuda_test::decode_recent, cuda_test::decode_stale> p;
  const options o;
  p.build({300, 90}, {40, 90}, mix::tiered, rng, o);
  const std::size_t nan_row = (std::size_t(3) * QH + 5) * D, inf_row = (std::size_t(41) * QH) * D;
  p.q[nan_row + 17] = std::numeric_limits<float>::quiet_NaN();
  p.q[inf_row + 3] = -std::numeric_limits<float>::infinity();
  device_prefill<G, cuda_test::decode_recent, cuda_test::decode_stale> dev(
      p, 2, max_entries(p.pages), p.total_q());
  dev.upload(p);
  auto plan = cuda::plan_prefill<G>(2, 90);
  REQUIRE(plan.has_value());
  device_buffer<std::uint8_t> ws(plan->workspace_bytes);
  REQUIRE(cuda_test::prefill_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
  REQUIRE(cuda_test::prefill<G, tiers<cuda_test::decode_recent, cuda_test::decode_stale>>(
              *plan, dev.args(p, o), ws.p, ws.n, nullptr)
              .is_ok());
  const auto out = dev.out.get();
  const auto lse = dev.lse.get();
  std::vector<double> ref, ref_lse;
  p.q[nan_row + 17] = 0.f;  // the reference of the other rows
  p.q[inf_row + 3] = 0.f;
  p.reference(1.0 / std::sqrt(double(D)), o, ref, ref_lse);
  double num = 0, den = 0;
  for (std::size_t row = 0; row < std::size_t(p.total_q()) * QH; ++row) {
    const bool poisoned = row * D == nan_row || row * D == inf_row;
    CHECK(std::isnan(lse[row]) == poisoned);
    for (int d = 0; d < D; ++d) {
      const float x = out[row * D + std::size_t(d)];
      if (poisoned) {
        CHECK(std::isnan(x));
      } else {
        REQUIRE(std::isfinite(x));
        num += (x - ref[row * D + std::size_t(d)]) * (x - ref[row * D + std::size_t(d)]);
        den += ref[row * D + std::size_t(d)] * ref[row * D + std::size_t(d)];
      }
    }
  }
  CHECK(std::sqrt(num / den) < 4e-3);
}

TEST_CASE("gpu prefill: bad input is refused or reported", "[cuda][prefill]") {
  using G = g_smol;
  using TL = tiers<cuda_test::decode_recent, cuda_test::decode_stale>;
  std::mt19937_64 rng(9);
  prefill_batch<G, cuda_test::decode_recent, cuda_test::decode_stale> p;
  const options o;
  p.build({200, 64}, {20, 8}, mix::tiered, rng, o);
  device_prefill<G, cuda_test::decode_recent, cuda_test::decode_stale> dev(
      p, 2, max_entries(p.pages), 64);
  dev.upload(p);
  auto plan = cuda::plan_prefill<G>(2, 20);
  REQUIRE(plan.has_value());
  CHECK(cuda::plan_prefill<G>(0, 20).code() == errc::out_of_range);
  CHECK(cuda::plan_prefill<G>(2, 0).code() == errc::out_of_range);
  CHECK(cuda::plan_prefill<G>(2, 20, 0, 132, cuda::prefill_max_splits + 1).code() ==
        errc::out_of_range);
  device_buffer<std::uint8_t> ws(plan->workspace_bytes);
  REQUIRE(cuda_test::prefill_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
  auto run = [&](const cuda_test::prefill_args& a) {
    return cuda_test::prefill<G, TL>(*plan, a, ws.p, ws.n, nullptr);
  };
  const auto good = dev.args(p, o);
  REQUIRE(run(good).is_ok());
  auto bad = good;
  bad.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  CHECK(run(bad).code() == errc::invalid_argument);
  bad = good;
  bad.soft_cap = -1.f;
  CHECK(run(bad).code() == errc::invalid_argument);
  bad = good;
  bad.window = -3;
  CHECK(run(bad).code() == errc::invalid_argument);
  bad = good;
  bad.index.batch = 3;
  CHECK(run(bad).code() == errc::out_of_range);
  bad = good;
  bad.pools[1].page_bytes += 16;
  CHECK(run(bad).code() == errc::geometry_mismatch);
  bad = good;
  bad.q_indptr = nullptr;
  CHECK(run(bad).code() == errc::invalid_argument);
  CUDA_OK(cudaDeviceSynchronize());
  auto e = cuda_test::prefill_device_error(*plan, ws.p, nullptr);
  REQUIRE(e.has_value());
  CHECK(*e == errc::ok);

  // on the device: a chunk beyond the plan, a chunk longer than its sequence, a bad slot
  auto device_error_of = [&](const std::vector<std::int32_t>& indptr, bool bad_slot) {
    dev.upload(p);
    dev.q_indptr.put(indptr);
    if (bad_slot) {
      std::vector<std::int32_t> slots = p.pages.slot[0];
      slots[0] = p.pages.pages_cap[0] + 5;
      dev.pages.slot0.put(slots);
    }
    REQUIRE(run(good).is_ok());
    auto r = cuda_test::prefill_device_error(*plan, ws.p, nullptr);
    REQUIRE(r.has_value());
    return *r;
  };
  CHECK(cuda::plan_prefill<G>(2, 20, 19).code() == errc::out_of_range);  // below one chunk
  CHECK(device_error_of({0, 20, 41}, false) == errc::out_of_range);      // 21 > max_chunk_tokens
  p.pages.seq_len[1] = 6;                                                // chunk 8 > 6 tokens
  CHECK(device_error_of({0, 20, 28}, false) == errc::out_of_range);
  p.pages.seq_len[1] = 64;
  CHECK(device_error_of({0, 20, 28}, true) == errc::out_of_range);
  CHECK(device_error_of({0, 20, 28}, false) == errc::ok);  // read and cleared
}

TEST_CASE("gpu prefill: CUDA-graph replay reads the buffers' contents at replay",
          "[cuda][prefill]") {
  using G = g_qwen;
  using R = cuda_test::decode_recent;
  using S = cuda_test::decode_stale;
  constexpr int D = G::head_dim, QH = G::q_heads;
  const options o;
  std::mt19937_64 rng(13);
  const int max_batch = 3, max_chunk = 96, cap_entries = 40;
  prefill_batch<G, R, S> first;
  first.build({1000, 96, 5}, {96, 96, 5}, mix::tiered, rng, o);
  // pools sized for every replay below
  first.pages.pool[0].resize(host_batch<G, R, S>::L8::page_bytes * (cap_entries + 3), 0xFF);
  first.pages.pool[1].resize(host_batch<G, R, S>::L3::page_bytes * (cap_entries + 3), 0xFF);
  first.pages.pages_cap[0] = first.pages.pages_cap[1] = cap_entries + 3;  // the captured views
  device_prefill<G, R, S> dev(first, max_batch, cap_entries, max_batch * max_chunk);
  auto plan = cuda::plan_prefill<G>(max_batch, max_chunk);
  REQUIRE(plan.has_value());
  device_buffer<std::uint8_t> ws(plan->workspace_bytes);
  REQUIRE(cuda_test::prefill_workspace_init(*plan, ws.p, ws.n, nullptr).is_ok());
  dev.upload(first);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  REQUIRE(
      cuda_test::prefill<G, tiers<R, S>>(*plan, dev.args(first, o), ws.p, ws.n, stream).is_ok());
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  struct step {
    std::vector<int> lens, chunks;
    mix m;
  };
  const std::vector<step> steps = {{{1000, 96, 5}, {96, 96, 5}, mix::tiered},
                                   {{64, 2000, 300}, {1, 40, 96}, mix::interleaved},
                                   {{1, 1, 1}, {1, 1, 0}, mix::all_fp8},
                                   {{2400, 0, 77}, {96, 0, 77}, mix::all_tq3}};
  for (const step& s : steps) {
    prefill_batch<G, R, S> p;
    p.build(s.lens, s.chunks, s.m, rng, o);
    REQUIRE(max_entries(p.pages) <= cap_entries);
    dev.upload(p);
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<double> ref, ref_lse;
    p.reference(1.0 / std::sqrt(double(D)), o, ref, ref_lse);
    const std::size_t n = std::size_t(p.total_q()) * QH * D;
    const double err = rel_l2(dev.output(o, n), ref, n);
    INFO("replay mix " << int(s.m) << " rel_l2 " << err);
    CHECK(err < prefill_tol(s.m, o));
  }
  auto e = cuda_test::prefill_device_error(*plan, ws.p, stream);
  REQUIRE(e.has_value());
  CHECK(*e == errc::ok);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(stream));
}
