// SPDX-License-Identifier: Apache-2.0
// Tests of the SmolLM2 engine: GGUF parsing and dequantization against hand-made
// blocks, the tokenizer and the dense engine's logits against llama.cpp (golden
// fixture in tests/data), and the KV backends against a float64 attention reference.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "engine.hpp"
#include "runner.hpp"

using namespace smollm;

namespace {

double half_ref(std::uint16_t h) {  // float64 reading of IEEE binary16, written from the definition
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double sign = s ? -1.0 : 1.0;
  if (e == 0) return sign * std::ldexp(m / 1024.0, -14);
  if (e == 31) return m ? std::nan("") : sign * INFINITY;
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

std::uint16_t to_half_bits(float f) {  // round-to-nearest search over finite halves (test helper)
  std::uint16_t best = 0;
  double err = INFINITY;
  for (std::uint32_t b = 0; b < 0x7c00; ++b) {
    const double d = std::abs(half_ref(std::uint16_t(b)) - std::abs(double(f)));
    if (d < err) {
      err = d;
      best = std::uint16_t(b);
    }
  }
  return std::uint16_t(best | (f < 0 ? 0x8000 : 0));
}

void put16(std::vector<std::uint8_t>& v, std::uint16_t x) {
  v.push_back(std::uint8_t(x));
  v.push_back(std::uint8_t(x >> 8));
}
template <class T>
void put(std::vector<std::uint8_t>& v, T x) {
  std::uint8_t b[sizeof(T)];
  std::memcpy(b, &x, sizeof(T));
  v.insert(v.end(), b, b + sizeof(T));
}
void put_str(std::vector<std::uint8_t>& v, const std::string& s) {
  put<std::uint64_t>(v, s.size());
  v.insert(v.end(), s.begin(), s.end());
}

std::string from_hex(const std::string& h) {
  std::string s;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2)
    s += char(std::stoi(h.substr(i, 2), nullptr, 16));
  return s;
}

}  // namespace

TEST_CASE("half_to_float is exact for every bit pattern") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = half_to_float(std::uint16_t(b));
    const double r = half_ref(std::uint16_t(b));
    if (std::isnan(r))
      REQUIRE(std::isnan(f));
    else
      REQUIRE(double(f) == r);
  }
}

TEST_CASE("dequantize Q4_0, Q4_1, Q8_0, F16 blocks against their definitions") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> nib(0, 15), byte(-128, 127);
  std::normal_distribution<float> scale(0.f, 0.05f);
  for (int trial = 0; trial < 50; ++trial) {
    // Q4_0 and Q4_1: element j of the block is nibble q[j]; byte i holds q[i] (low) and q[i+16]
    // (high).
    int q[32];
    for (int& x : q) x = nib(rng);
    const std::uint16_t d = to_half_bits(trial == 0 ? 0.f : scale(rng));
    const std::uint16_t m = to_half_bits(trial == 1 ? 0.f : scale(rng));
    std::vector<std::uint8_t> b40, b41, b80;
    put16(b40, d);
    put16(b41, d);
    put16(b41, m);
    put16(b80, d);
    for (int i = 0; i < 16; ++i) {
      b40.push_back(std::uint8_t(q[i] | (q[i + 16] << 4)));
      b41.push_back(std::uint8_t(q[i] | (q[i + 16] << 4)));
    }
    int q8[32];
    for (int& x : q8) {
      x = byte(rng);
      b80.push_back(std::uint8_t(std::int8_t(x)));
    }
    float y40[32], y41[32], y80[32];
    REQUIRE(dequantize(2, b40.data(), 32, y40).is_ok());
    REQUIRE(dequantize(3, b41.data(), 32, y41).is_ok());
    REQUIRE(dequantize(8, b80.data(), 32, y80).is_ok());
    for (int j = 0; j < 32; ++j) {
      CHECK(double(y40[j]) == Approx((q[j] - 8) * half_ref(d)).margin(1e-12));
      CHECK(double(y41[j]) == Approx(q[j] * half_ref(d) + half_ref(m)).margin(1e-7));
      CHECK(double(y80[j]) == Approx(q8[j] * half_ref(d)).margin(1e-12));
    }
  }
  SECTION("adversarial scales propagate as IEEE arithmetic says") {
    std::vector<std::uint8_t> blk;
    put16(blk, 0x7c00);                                                // d = +Inf
    for (int i = 0; i < 16; ++i) blk.push_back(i == 0 ? 0x08 : 0x00);  // q[0] = 8 -> 0 * Inf = NaN
    float y[32];
    REQUIRE(dequantize(2, blk.data(), 32, y).is_ok());
    CHECK(std::isnan(y[0]));  // (8 - 8) * Inf
    CHECK(std::isinf(y[1]));  // (0 - 8) * Inf
    CHECK(y[1] < 0);
    std::vector<std::uint8_t> sub;
    put16(sub, 0x0001);  // smallest subnormal half
    for (int i = 0; i < 32; ++i) sub.push_back(std::uint8_t(std::int8_t(-127)));
    REQUIRE(dequantize(8, sub.data(), 32, y).is_ok());
    CHECK(double(y[31]) == -127 * std::ldexp(1.0, -24));
  }
  SECTION("F16 and F32 rows") {
    std::vector<std::uint8_t> h;
    const std::uint16_t bits[4] = {0x3c00, 0xc000, 0x0400, 0x7bff};
    for (auto x : bits) put16(h, x);
    float y[4];
    REQUIRE(dequantize(1, h.data(), 4, y).is_ok());
    for (int i = 0; i < 4; ++i) CHECK(double(y[i]) == half_ref(bits[i]));
  }
  SECTION("unsupported types and ragged sizes are errors") {
    std::vector<std::uint8_t> any(256);
    float y[64];
    auto s = dequantize(12, any.data(), 32, y);  // Q4_K
    CHECK(s.code() == tierkv::errc::invalid_argument);
    CHECK(s.message().find("12") != std::string::npos);
    CHECK(dequantize(2, any.data(), 33, y).code() == tierkv::errc::invalid_argument);
  }
}

TEST_CASE("GGUF reader: a hand-made file, and every truncation of it is an error") {
  std::vector<std::uint8_t> f;
  f.insert(f.end(), {'G', 'G', 'U', 'F'});
  put<std::uint32_t>(f, 3);
  put<std::uint64_t>(f, 2);  // tensors
  put<std::uint64_t>(f, 5);  // kv
  put_str(f, "general.architecture");
  put<std::uint32_t>(f, 8);
  put_str(f, "llama");
  put_str(f, "llama.block_count");
  put<std::uint32_t>(f, 4);
  put<std::uint32_t>(f, 30);
  put_str(f, "llama.rope.freq_base");
  put<std::uint32_t>(f, 6);
  put<float>(f, 100000.f);
  put_str(f, "flag");
  put<std::uint32_t>(f, 7);
  f.push_back(1);
  put_str(f, "tokenizer.ggml.tokens");
  put<std::uint32_t>(f, 9);
  put<std::uint32_t>(f, 8);
  put<std::uint64_t>(f, 2);
  put_str(f, "a");
  put_str(f, "bc");
  put_str(f, "w8");
  put<std::uint32_t>(f, 1);
  put<std::uint64_t>(f, 32);
  put<std::uint32_t>(f, 8);
  put<std::uint64_t>(f, 0);
  put_str(f, "wf16");
  put<std::uint32_t>(f, 2);
  put<std::uint64_t>(f, 2);
  put<std::uint64_t>(f, 1);
  put<std::uint32_t>(f, 1);
  put<std::uint64_t>(f, 64);
  while (f.size() % 32) f.push_back(0);
  const std::size_t data = f.size();
  put16(f, 0x3800);  // d = 0.5
  for (int i = 0; i < 32; ++i) f.push_back(std::uint8_t(std::int8_t(i - 16)));
  while (f.size() < data + 64) f.push_back(0);
  put16(f, 0x3c00);
  put16(f, 0xbc00);

  auto g = gguf_file::from_bytes(f);
  REQUIRE(g.has_value());
  CHECK(g->get_string("general.architecture") == "llama");
  CHECK(g->get_int("llama.block_count", 0) == 30);
  CHECK(g->get_float("llama.rope.freq_base", 0) == 100000.0);
  CHECK(std::get<bool>(*g->find("flag")));
  CHECK(std::get<std::vector<std::string>>(*g->find("tokenizer.ggml.tokens"))[1] == "bc");
  auto w8 = g->load("w8");
  REQUIRE(w8.has_value());
  for (int i = 0; i < 32; ++i) CHECK((*w8)[std::size_t(i)] == 0.5f * float(i - 16));
  auto wf = g->load("wf16");
  REQUIRE(wf.has_value());
  CHECK((*wf)[0] == 1.f);
  CHECK((*wf)[1] == -1.f);
  CHECK(g->load("missing").code() == tierkv::errc::invalid_argument);

  for (std::size_t cut = 0; cut < data; ++cut) {
    auto t = gguf_file::from_bytes(
        std::vector<std::uint8_t>(f.begin(), f.begin() + std::ptrdiff_t(cut)));
    REQUIRE_FALSE(t.has_value());
  }
  // Complete header, truncated data: the tensor load reports it.
  auto t = gguf_file::from_bytes(
      std::vector<std::uint8_t>(f.begin(), f.begin() + std::ptrdiff_t(data + 10)));
  REQUIRE(t.has_value());
  CHECK(t->load("w8").code() == tierkv::errc::corrupt_data);
  auto bad = f;
  bad[0] = 'X';
  CHECK(gguf_file::from_bytes(bad).code() == tierkv::errc::corrupt_data);
}

TEST_CASE("pre-tokenizer: digits alone, GPT-2 split") {
  using V = std::vector<std::string>;
  CHECK(tokenizer::pre_split("Hello world") == V{"Hello", " world"});
  CHECK(tokenizer::pre_split("a  b") == V{"a", " ", " b"});
  CHECK(tokenizer::pre_split("x\n\ny") == V{"x", "\n", "\n", "y"});
  CHECK(tokenizer::pre_split("it's 2024!") == V{"it", "'s", " ", "2", "0", "2", "4", "!"});
  CHECK(tokenizer::pre_split("end  ") == V{"end", "  "});
  CHECK(tokenizer::pre_split(" ...?!") == V{" ...?!"});
}

// ---- KV backends against a float64 attention reference --------------------------------------

namespace {

// Reference causal attention over all appended tokens, float64.
void reference_attention(const kv_shape& s, const std::vector<float>& K,
                         const std::vector<float>& V, int T, const float* q, int pos,
                         std::vector<double>& out) {
  const int hd = s.head_dim, G = s.q_heads / s.kv_heads;
  out.assign(std::size_t(s.q_heads * hd), 0.0);
  for (int h = 0; h < s.q_heads; ++h) {
    const int g = h / G;
    std::vector<double> w(std::size_t(pos + 1));
    double m = -INFINITY;
    for (int t = 0; t <= pos; ++t) {
      double d = 0;
      for (int i = 0; i < hd; ++i)
        d += double(q[h * hd + i]) *
             K[(std::size_t(t) * std::size_t(s.kv_heads) + std::size_t(g)) * std::size_t(hd) +
               std::size_t(i)];
      w[std::size_t(t)] = d / std::sqrt(double(hd));
      m = std::max(m, w[std::size_t(t)]);
    }
    double z = 0;
    for (auto& x : w) z += (x = std::exp(x - m));
    for (int t = 0; t <= pos; ++t)
      for (int i = 0; i < hd; ++i)
        out[std::size_t(h * hd + i)] +=
            w[std::size_t(t)] / z *
            V[(std::size_t(t) * std::size_t(s.kv_heads) + std::size_t(g)) * std::size_t(hd) +
              std::size_t(i)];
  }
  (void)T;
}

// Appends T tokens in chunks, attends every query, returns the worst relative L2 error.
double backend_error(kv_backend& kv, const kv_shape& s, int T, int chunk, unsigned seed,
                     float key_offset) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n01(0.f, 1.f);
  const int kvw = s.kv_heads * s.head_dim, qw = s.q_heads * s.head_dim;
  std::vector<float> K(std::size_t(T * kvw)), V(K.size()), Q(std::size_t(T * qw));
  for (auto& x : K) x = n01(rng);
  for (auto& x : V) x = n01(rng);
  for (auto& x : Q) x = n01(rng) * 0.5f;
  // key_offset != 0: tokens [32, 48) (logical page 2) get a channel every query reads.
  if (key_offset != 0.f) {
    for (int t = 32; t < 48 && t < T; ++t)
      for (int h = 0; h < s.kv_heads; ++h)
        K[std::size_t((t * s.kv_heads + h) * s.head_dim + 3)] += key_offset;
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < s.q_heads; ++h)
        Q[std::size_t((t * s.q_heads + h) * s.head_dim + 3)] += 1.f;
  }
  double worst = 0;
  std::vector<float> out;
  std::vector<double> ref;
  for (int start = 0; start < T; start += chunk) {
    const int n = std::min(chunk, T - start);
    out.assign(std::size_t(n * qw), NAN);
    for (int l = 0; l < s.layers; ++l) {
      kv.append(l, n, K.data() + std::size_t(start * kvw), V.data() + std::size_t(start * kvw));
      kv.attend(l, n, Q.data() + std::size_t(start * qw), out.data());
    }
    kv.commit(n);
    for (int i = 0; i < n; ++i) {
      reference_attention(s, K, V, T, Q.data() + std::size_t((start + i) * qw), start + i, ref);
      double num = 0, den = 0;
      for (int j = 0; j < qw; ++j) {
        const double d = double(out[std::size_t(i * qw + j)]) - ref[std::size_t(j)];
        num += d * d;
        den += ref[std::size_t(j)] * ref[std::size_t(j)];
      }
      worst = std::max(worst, std::sqrt(num / den));
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("KV backends: dense and the library's tiered caches against float64 attention") {
  const kv_shape s{2, 3, 9, 64};
  tiering_options opt;
  opt.policy.sink_pages = 1;
  opt.policy.recent_pages = 2;
  opt.policy.keep_first_layers = 0;
  opt.policy.keep_last_layers = 0;
  opt.policy.min_dwell_steps = 1;  // a page moves at the first commit after its role changes
  opt.use_mass = false;
  // The centring means (tierkv::channel_means): keys and values, 2 layers x 3 KV heads x 64
  // floats each, and a byte per layer (set or not), for the whole sequence, over `tokens`
  // tokens of 2 layers x 3 heads x 64 keys and values.
  const auto mean_bits = [](int tokens) {
    return 8.0 * (4 * 2 * 2 * 3 * 64 + 2) / (2.0 * tokens * 2 * 3 * 64);
  };
  SECTION("dense and lossless pages: float rounding only, prefill chunks and decode steps") {
    for (int chunk : {1, 7, 40}) {
      dense_backend d(s, 200);
      CHECK(backend_error(d, s, 90, chunk, 1, 0.f) < 1e-5);
      auto p = make_tierkv_backend("paged_f32", s, opt, 200);
      CHECK(backend_error(*p, s, 90, chunk, 1, 0.f) < 1e-5);
      CHECK(p->memory().bits_per_scalar() >= 32.0);
    }
  }
  SECTION("fp8 pages") {
    auto p = make_tierkv_backend("fp8", s, opt, 200);
    const double e = backend_error(*p, s, 100, 33, 2, 0.f);
    CHECK(e < 0.05);
    CHECK(e > 0.0);
    // 16-token pages of 8-bit codes + a 2-byte scale per vector: 8.25 bits when pages are
    // full, plus the centring means.
    auto full = make_tierkv_backend("fp8", s, opt, 200);
    backend_error(*full, s, 96, 96, 3, 0.f);
    CHECK(full->memory().bits_per_scalar() == Approx(8.25 + mean_bits(96)));
    tiering_options plain = opt;
    plain.center = false;
    auto fp = make_tierkv_backend("fp8", s, plain, 200);
    backend_error(*fp, s, 96, 96, 3, 0.f);
    CHECK(fp->memory().bits_per_scalar() == Approx(8.25));
  }
  SECTION("tq3 and tiered pages; the policy keeps anchor + recent pages in FP8") {
    auto t = make_tierkv_backend("tq3", s, opt, 200);
    const double et = backend_error(*t, s, 96, 32, 4, 0.f);
    CHECK(et < 0.35);
    // Pages: 3 bits per code + a 2-byte norm per 64 scalars.
    CHECK(t->memory().bits_per_scalar() == Approx(3.25 + mean_bits(96)));
    tiering_options plain = opt;
    plain.center = false;
    auto tp = make_tierkv_backend("tq3", s, plain, 200);
    const double et_plain = backend_error(*tp, s, 96, 32, 4, 0.f);
    CHECK(tp->memory().bits_per_scalar() == Approx(3.25));
    CHECK(et_plain < 0.35);
    auto m = make_tierkv_backend("tiered", s, opt, 200);
    const double em = backend_error(*m, s, 160, 32, 4, 0.f);
    CHECK(em < et + 0.05);
    // 10 pages per layer: anchor 1 + recent 2 in FP8, 7 in TQ3.
    CHECK(m->memory().fp8_fraction == Approx(0.3));
    CHECK(m->memory().bits_per_scalar() == Approx((3 * 8.25 + 7 * 3.25) / 10 + mean_bits(160)));
    // The default keeps the first layer in FP8 (of 2 layers here: layer 1 is the last, kept 0).
    tiering_options first = opt;
    first.policy.keep_first_layers = 1;
    auto f = make_tierkv_backend("tiered", s, first, 200);
    backend_error(*f, s, 160, 32, 4, 0.f);
    CHECK(f->memory().fp8_fraction == Approx((10 + 3) / 20.0));
    // Attention-mass anchors: page 2's keys align with every query, so it takes most of the
    // mass, is anchored while Recent, and stays FP8 when it ages out (4 of 10 pages FP8);
    // without the mass signal it goes Stale like the others (3 of 10).
    tiering_options mass = opt;
    mass.use_mass = true;
    mass.policy.enter_mass = 2.f;  // relative mass: 1 = a uniform share of the attention
    mass.policy.leave_mass = 1.f;
    auto ma = make_tierkv_backend("tiered", s, mass, 200);
    backend_error(*ma, s, 160, 16, 5, 30.f);
    CHECK(ma->memory().fp8_fraction == Approx(0.4));
    tiering_options no_mass = mass;
    no_mass.use_mass = false;
    auto nm = make_tierkv_backend("tiered", s, no_mass, 200);
    backend_error(*nm, s, 160, 16, 5, 30.f);
    CHECK(nm->memory().fp8_fraction == Approx(0.3));
    // retier_in_prefill = false: the chunks of 32 (a prompt) leave every page FP8; the first
    // decode step (one token) moves them as the default would have (3 of 11 pages FP8).
    tiering_options hold = opt;
    hold.retier_in_prefill = false;
    auto h = make_tierkv_backend("tiered", s, hold, 200);
    backend_error(*h, s, 160, 32, 4, 0.f);
    CHECK(h->memory().fp8_fraction == Approx(1.0));
    const std::vector<float> kv1(std::size_t(s.kv_heads * s.head_dim), 0.5f);
    const std::vector<float> q1(std::size_t(s.q_heads * s.head_dim), 0.25f);
    std::vector<float> o1(q1.size());
    for (int l = 0; l < s.layers; ++l) {
      h->append(l, 1, kv1.data(), kv1.data());
      h->attend(l, 1, q1.data(), o1.data());
    }
    h->commit(1);
    CHECK(h->memory().fp8_fraction == Approx(3.0 / 11.0));
  }
  SECTION("the recommended mix and the other arms build and attend; bad input is refused") {
    for (const char* arm : {"int8r", "tiered_int8r", "tiered_k4", "tiered_k8"}) {
      auto p = make_tierkv_backend(arm, s, opt, 200);
      CHECK(backend_error(*p, s, 100, 25, 6, 0.f) < 0.35);
    }
    CHECK_THROWS_WITH(make_tierkv_backend("tq2", s, opt, 200),
                      tierkv_test::contains("unknown KV arm"));
    CHECK_THROWS_WITH(make_tierkv_backend("tq3", kv_shape{2, 4, 8, 64}, opt, 200),
                      tierkv_test::contains("differs from the compiled geometry"));
    auto small = make_tierkv_backend("tq3", s, opt, 20);  // two pages per layer
    CHECK_THROWS_WITH(backend_error(*small, s, 40, 8, 7, 0.f), tierkv_test::contains("max_pages"));
  }
  SECTION("issue 52's arms: build, attend, exact bits; policy knobs after '+'") {
    for (const char* arm :
         {"stale_k4v2",   "stale_k3v2",   "stale_k2v2",    "stale_k3v2u",   "stale_k3v3u",
          "rec_u",        "cold_k3v2u",   "cold_u4_k3v2u", "cold_u3_k3v2u", "uniform_k4v4",
          "uniform_k3v3", "uniform_k4v2", "uniform_k3v2",  "uniform_k2v2",  "uniform_k8v4",
          "uniform_k3v4", "cold_k4v2",    "cold_k3v2",     "cold_k2v2",     "a4_k3v2_k2v2",
          "a4_k4v2_k3v2", "a4_k3v2",      "a44_k3v2",      "a84_k3v2",      "a48_k3v2",
          "a4_cold_k3v2"}) {
      INFO(arm);
      auto p = make_tierkv_backend(arm, s, opt, 200);
      CHECK(backend_error(*p, s, 100, 25, 6, 0.f) < 0.6);  // the worst case: all-TQ2 pages
    }
    // Uniform presets: every page in one format, the centring means on top (c=0: none).
    const std::pair<const char*, double> uniform[] = {
        {"uniform_k4v4", 4.25}, {"uniform_k4v2", 3.25}, {"uniform_k3v2", 2.75},
        {"uniform_k2v2", 2.25}, {"uniform_k8v4", 6.25}, {"uniform_k3v3", 3.25},
        {"uniform_k3v4", 3.75}};
    for (const auto& [arm, bits] : uniform) {
      INFO(arm);
      auto p = make_tierkv_backend(arm, s, opt, 200);
      backend_error(*p, s, 96, 32, 4, 0.f);
      CHECK(p->memory().bits_per_scalar() == Approx(bits + mean_bits(96)));
      auto plain = make_tierkv_backend(std::string(arm) + "+c=0", s, opt, 200);
      backend_error(*plain, s, 96, 32, 4, 0.f);
      CHECK(plain->memory().bits_per_scalar() == Approx(bits));
    }
    // rp=4: sink 1 + recent 4 of 10 pages in int8_rotated, 5 in TQ3 keys + TQ2 values.
    auto r4 = make_tierkv_backend("stale_k3v2+rp=4", s, opt, 200);
    backend_error(*r4, s, 160, 32, 4, 0.f);
    CHECK(r4->memory().fp8_fraction == Approx(0.5));
    CHECK(r4->memory().bits_per_scalar() == Approx((5 * 8.25 + 5 * 2.75) / 10 + mean_bits(160)));
    CHECK(r4->memory().tier_shares == "t0 0.500 t1 0.500");
    // Each layer's pages' tiers, one digit a logical page (smollm ppl --nll-out's layer_tiers).
    const auto layer_tiers = r4->memory().layer_tiers;
    REQUIRE(layer_tiers.size() == std::size_t(s.layers));
    for (const std::string& t : layer_tiers) CHECK(t == "0111110000");
    // jit: inputs perturbed at rounding level move the error a little, not a lot; 0 is the
    // arm itself bit for bit.
    auto base = make_tierkv_backend("stale_k3v2+rp=4", s, opt, 200);
    auto j0 = make_tierkv_backend("stale_k3v2+rp=4+jit=0", s, opt, 200);
    auto j6 = make_tierkv_backend("stale_k3v2+rp=4+jit=1e-6", s, opt, 200);
    const double e4 = backend_error(*base, s, 160, 32, 4, 0.f);
    CHECK(backend_error(*j0, s, 160, 32, 4, 0.f) == e4);
    CHECK(backend_error(*j6, s, 160, 32, 4, 0.f) == Approx(e4).epsilon(0.05));
    // A Cold arm with the mass signal: page 2 takes the attention (an anchor), the other old
    // pages fall below half a uniform share and go Cold (tier 2, TQ3 keys + TQ2 values);
    // with the cold knobs off (cm=0, cl=0) the Cold tier stays empty.
    tiering_options mass = opt;
    mass.use_mass = true;
    mass.policy.enter_mass = 2.f;
    mass.policy.leave_mass = 1.f;
    auto c = make_tierkv_backend("cold_k3v2+cm=0.5+cl=1+ca=0", s, mass, 200);
    backend_error(*c, s, 160, 16, 5, 30.f);
    const std::string shares = c->memory().tier_shares;
    INFO(shares);
    REQUIRE(shares.find("t2 ") != std::string::npos);
    CHECK(std::stod(shares.substr(shares.find("t2 ") + 3)) >= 0.5);
    CHECK(c->memory().fp8_fraction == Approx(0.4));  // sink, page 2, recent 2
    auto off = make_tierkv_backend("cold_k3v2+cm=0+cl=0", s, mass, 200);
    backend_error(*off, s, 160, 16, 5, 30.f);
    CHECK(off->memory().tier_shares.find("t2 0.000") != std::string::npos);
    // Per-layer budgets (clm, the policy's cold_layers mask): layer 1's old pages Cold, layer
    // 0's Stale, with no mass signal at all: as many pages in tier 2 as in tier 1.
    auto by_layer = make_tierkv_backend("cold_k3v2+um=0+cm=0+cl=0+ca=0+clm=2", s, opt, 200);
    backend_error(*by_layer, s, 160, 16, 5, 0.f);
    const std::string split = by_layer->memory().tier_shares;
    INFO(split);
    REQUIRE(split.find("t1 ") != std::string::npos);
    REQUIRE(split.find("t2 ") != std::string::npos);
    CHECK(std::stod(split.substr(split.find("t2 ") + 3)) > 0.25);
    CHECK(split.substr(split.find("t1 ") + 3, 5) == split.substr(split.find("t2 ") + 3, 5));
    // bpt: a bit budget; the 8 movable pages end at or under it (the Recent page, rp=1, and the
    // sink stay int8_rotated at 8.25 bits), mass deciding who keeps bits.
    for (const double target : {3.0, 5.0}) {
      auto b = make_tierkv_backend("cold_k3v2+rp=1+bpt=" + std::to_string(target), s, mass, 200);
      backend_error(*b, s, 160, 16, 5, 30.f);
      INFO(target << ": " << b->memory().tier_shares);
      const double bits = b->memory().bits_per_scalar() - mean_bits(160);
      CHECK(bits <= (2 * 8.25 + 8 * target) / 10 + 1e-9);
      CHECK(bits > (2 * 8.25 + 8 * (target - 1.0)) / 10);
    }
    CHECK_THROWS_WITH(make_tierkv_backend("cold_k3v2+bpt=0", s, opt, 200),
                      tierkv_test::contains("must be a bit budget in (0, 64]"));
    // Bad knobs name themselves.
    CHECK_THROWS_WITH(make_tierkv_backend("cold_k3v2+cm", s, opt, 200),
                      tierkv_test::contains("is not NAME=VALUE"));
    CHECK_THROWS_WITH(make_tierkv_backend("cold_k3v2+zz=1", s, opt, 200),
                      tierkv_test::contains("unknown knob 'zz'"));
    CHECK_THROWS_WITH(make_tierkv_backend("stale_k3v2+rp=1.5", s, opt, 200),
                      tierkv_test::contains("must be an integer"));
    for (const char* out_of_int : {"rp=1e12", "sp=-3e9", "ca=inf", "kf=nan"})  // no UB cast
      CHECK_THROWS_WITH(make_tierkv_backend(std::string("stale_k3v2+") + out_of_int, s, opt, 200),
                        tierkv_test::contains("must be an integer in int's range"));
    CHECK_THROWS_WITH(make_tierkv_backend("cold_k3v2+clm=0.5", s, opt, 200),
                      tierkv_test::contains("must be an integer mask"));
    CHECK_THROWS_WITH(make_tierkv_backend("stale_k3v2+jit=0.5", s, opt, 200),
                      tierkv_test::contains("must be a relative perturbation"));
    CHECK_THROWS_WITH(make_tierkv_backend("cold_k3v2+cm=abc", s, opt, 200),
                      tierkv_test::contains("is not a number"));
    CHECK_THROWS_WITH(make_tierkv_backend("cold_k3v2+cm=3+cl=3", s, mass, 200),
                      tierkv_test::contains("cold_enter_mass = 3"));
  }
}

// ---- the real model against llama.cpp ------------------------------------------------------

namespace {
struct golden {
  std::vector<std::pair<std::string, std::vector<std::int32_t>>> tokenized;
  std::string prompt;
  std::vector<std::int32_t> prompt_ids, greedy;
  std::vector<std::pair<int, std::vector<std::pair<int, float>>>> logits;
};
golden read_golden() {
  std::ifstream in(std::string(TIERKV_TEST_DATA) + "/smollm_golden.txt");
  REQUIRE(in.good());
  golden g;
  std::string line;
  auto ints = [](std::istringstream& ss) {
    std::vector<std::int32_t> v;
    std::int32_t x;
    while (ss >> x) v.push_back(x);
    return v;
  };
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string tag;
    ss >> tag;
    if (tag == "tokenize") {
      std::string hex;
      ss >> hex;
      g.tokenized.push_back({from_hex(hex), ints(ss)});
    } else if (tag == "prompt") {
      std::string hex;
      ss >> hex;
      g.prompt = from_hex(hex);
    } else if (tag == "prompt_ids") {
      g.prompt_ids = ints(ss);
    } else if (tag == "greedy") {
      g.greedy = ints(ss);
    } else if (tag == "logits") {
      int pos;
      ss >> pos;
      std::vector<std::pair<int, float>> top;
      std::string item;
      while (ss >> item) {
        const auto c = item.find(':');
        top.push_back({std::stoi(item.substr(0, c)), std::stof(item.substr(c + 1))});
      }
      g.logits.push_back({pos, top});
    }
  }
  return g;
}

engine& shared_engine() {
  static engine e = engine::open("");
  return e;
}
}  // namespace

TEST_CASE("tokenizer matches llama.cpp on the fixture strings", "[model]") {
  const golden g = read_golden();
  engine& e = shared_engine();
  REQUIRE(g.tokenized.size() >= 4);
  for (const auto& [text, ids] : g.tokenized) {
    INFO(text);
    CHECK(e.tok.encode(text) == ids);
  }
  CHECK(e.tok.encode(g.prompt) == g.prompt_ids);
  CHECK(e.tok.decode(e.tok.encode(g.tokenized[0].first)) == g.tokenized[0].first);
}

TEST_CASE("dense engine logits and greedy tokens match llama.cpp (f32 KV)", "[model]") {
  const golden g = read_golden();
  engine& e = shared_engine();
  const int V = e.net.config().vocab;
  // Chunks of 64, so positions >= 64 read keys and values from the cache of earlier chunks.
  dense_backend kv(e.net.config().kv(), int(g.prompt_ids.size()) + 64);
  std::vector<float> all, logits;
  for (std::size_t i = 0; i < g.prompt_ids.size(); i += 64) {
    const int n = int(std::min<std::size_t>(64, g.prompt_ids.size() - i));
    e.net.forward(g.prompt_ids.data() + i, n, kv, logits, true);
    all.insert(all.end(), logits.begin(), logits.end());
  }
  // Tolerance: llama.cpp against itself, f16 KV cache + flash attention vs f32 KV cache,
  // differs by up to 0.76 on these logits (measured with peer_llamacpp.py's loader on this
  // fixture: 0.24, 0.37, 0.59, 0.76, 0.21, 0.26, 0.45 at the 7 positions), and its CPU path
  // rounds activations to 8 bits before the Q4_1 products. This float32 engine measured a
  // largest difference of 0.60 (the same order as that noise); 0.75 bounds it, and the top
  // token must agree at every position.
  double worst = 0;
  REQUIRE(g.logits.size() >= 5);
  for (const auto& [pos, top] : g.logits) {
    const float* row = all.data() + std::size_t(pos) * std::size_t(V);
    for (const auto& [id, val] : top)
      worst = std::max(worst, std::abs(double(row[id]) - double(val)));
    CHECK(engine::argmax(row, V) == top[0].first);
  }
  INFO("max |logit - llama.cpp| = " << worst);
  CHECK(worst < 0.75);
  // Greedy: llama.cpp's 32 tokens teacher-forced through this engine. At every step this
  // engine's choice is llama.cpp's token, or a near-tie: llama.cpp's token scores within
  // the tolerance above of this engine's best.
  dense_backend kv2(e.net.config().kv(), int(g.prompt_ids.size()) + 64);
  std::vector<float> last;
  e.prefill(g.prompt_ids, kv2, last, 64);
  int same = 0, near_ties = 0;
  for (std::size_t i = 0; i < g.greedy.size(); ++i) {
    const std::int32_t mine = engine::argmax(last.data(), V);
    const std::int32_t theirs = g.greedy[i];
    if (mine == theirs)
      ++same;
    else {
      ++near_ties;
      CHECK(last[std::size_t(mine)] - last[std::size_t(theirs)] < 0.75f);
    }
    e.net.forward(&theirs, 1, kv2, last, false);
  }
  INFO("greedy steps agreeing: " << same << " of " << g.greedy.size());
  CHECK(same >= int(g.greedy.size()) - 2);
  CHECK(near_ties <= 2);
  // Free-running, the first 16 tokens are identical (measured: the paths split at token 17).
  dense_backend kv3(e.net.config().kv(), int(g.prompt_ids.size()) + 64);
  e.prefill(g.prompt_ids, kv3, last, 64);
  std::vector<std::int32_t> out;
  for (int i = 0; i < 16; ++i) {
    const std::int32_t t = engine::argmax(last.data(), V);
    out.push_back(t);
    e.net.forward(&t, 1, kv3, last, false);
  }
  CHECK(out == std::vector<std::int32_t>(g.greedy.begin(), g.greedy.begin() + 16));
}

TEST_CASE("tasks: every kind is deterministic, fits its length and holds its answers", "[model]") {
  const tokenizer& tok = shared_engine().tok;
  auto count = [](const std::string& text, const std::string& what) {
    int n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  for (const auto& task : niah_task_names())
    for (int target : {1024, 4096})
      for (int index : {0, 7}) {
        INFO(task << " " << target << " " << index);
        const niah_item a = make_niah_item(tok, task, target, index, 20261129);
        const niah_item b = make_niah_item(tok, task, target, index, 20261129);
        CHECK(a.prompt == b.prompt);
        CHECK(a.answers == b.answers);
        CHECK(make_niah_item(tok, task, target, index + 1, 20261129).prompt != a.prompt);
        CHECK(int(a.prompt.size()) + a.max_new <= target);
        CHECK(int(a.prompt.size()) > target * 3 / 4);
        CHECK(a.prompt == tok.encode(chat_prompt(a.user) + a.answer_prefix));
        REQUIRE(!a.answers.empty());
        for (const auto& ans : a.answers) CHECK(count(a.user, ans) >= 1);
        if (task == "vartrack") {  // a chain: each variable assigned after the one it copies
          REQUIRE(a.answers.size() == 5);
          for (std::size_t i = 1; i < a.answers.size(); ++i) {
            const auto def = a.user.find("VAR " + a.answers[i - 1] + " = ");
            const auto use = a.user.find("VAR " + a.answers[i] + " = " + a.answers[i - 1] + ".");
            CHECK(def != std::string::npos);
            CHECK(use != std::string::npos);
            CHECK(def < use);
          }
        } else if (task == "cwe") {  // the 10 answers are strictly the most frequent entries
          REQUIRE(a.answers.size() == 10);
          std::map<std::string, int> freq;
          const auto begin = a.user.find("\n1. "), end = a.user.find("\nWhat are the 10");
          REQUIRE(begin < end);
          std::istringstream list(a.user.substr(begin, end - begin));
          std::string tokn;
          while (list >> tokn)
            if (tokn.back() != '.') ++freq[tokn];  // not the entry numbers
          int least_common = 1 << 30, most_rare = 0;
          for (const auto& [w, n] : freq) {
            const bool common = std::find(a.answers.begin(), a.answers.end(), w) != a.answers.end();
            if (common)
              least_common = std::min(least_common, n);
            else
              most_rare = std::max(most_rare, n);
          }
          CHECK(least_common >= 5);
          CHECK(most_rare <= 3);
          CHECK(most_rare >= 1);
        } else if (task == "qa") {  // the asked deed happens exactly once, by the answer
          const auto q = a.user.rfind("person who "), end = a.user.rfind(" in the provided text?");
          REQUIRE(q < end);
          const std::string deed = a.user.substr(q + 11, end - q - 11);
          CHECK(count(a.user, " " + deed + ".") == 1);
          CHECK(count(a.user, a.answers[0] + " " + deed + ".") == 1);
        } else {
          CHECK(count(a.user, "special magic number") >= 2);
        }
      }
  CHECK_THROWS_WITH(make_niah_item(tok, "sorting", 1024, 0, 1),
                    tierkv_test::contains("unknown task 'sorting'"));
}

TEST_CASE("niah_score: the fraction of answers found, ignoring ASCII case") {
  niah_item item;
  item.answers = {"old gardener", "1234567"};
  CHECK(niah_score(item, "The Old Gardener did it.") == 0.5);
  CHECK(niah_score(item, "the old gardener, 1234567") == 1.0);
  CHECK(niah_score(item, "123456 and a gardener") == 0.0);
  item.answers = {"ABCDE"};
  CHECK(niah_score(item, "abcde") == 1.0);
}
