// SPDX-License-Identifier: Apache-2.0
// Storage with the real FP8 and TQ3 codecs: pages hold exactly what the codecs
// produce, conversions publish TQ3 pages, and accounting matches docs/formats.md.
#include <cstring>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/report.hpp"

using namespace tierkv;

namespace {
using G = geometry<head_dim<64>, kv_heads<2>, group_size<3>, page_tokens<16>>;
using S = paged_storage<G, tiers<tier<fp8_e4m3, fp8_e4m3>, tier<tq3_key, tq3_value>>>;
using FP8 = codec_for<fp8_e4m3, 64>;
using TQK = codec_for<tq3_key, 64>;
using TQV = codec_for<tq3_value, 64>;

template <class C>
std::vector<float> roundtrip(const float* x, const codec_context& ctx) {
  std::vector<std::uint8_t> payload(C::payload_bytes);
  typename C::meta_type m{};
  REQUIRE(C::encode(x, payload.data(), m, ctx, nullptr) == errc::ok);
  std::vector<float> y(64);
  C::decode(payload.data(), m, y.data(), ctx);
  return y;
}
}  // namespace

TEST_CASE("FP8 pages hold the codec's bytes; TQ3 conversion publishes TQ3 pages",
          "[paging][codec]") {
  S::options o;
  o.num_layers = 2;
  o.pages_per_tier = {16, 16};
  o.max_sequences = 2;
  o.codec_seed = 99;
  auto created = S::create(o);
  REQUIRE(created);
  auto s = std::move(*created);
  std::mt19937 rng(4);
  std::normal_distribution<float> g;
  const int n = 40;
  std::vector<float> k(std::size_t(2 * n * 2 * 64)), v(k.size());
  for (auto& x : k) x = g(rng) * 3.0f;
  for (auto& x : v) x = g(rng);
  k[5] = 0.0f;  // some exact zeros and a huge magnitude
  k[64 * 7 + 3] = 3.0e38f;
  const seq_id id = *s->create_sequence();
  REQUIRE(s->append(id, n, k, v));

  auto at = [&](const std::vector<float>& src, int l, int t, int h) {
    return src.data() + ((std::size_t(l) * n + std::size_t(t)) * 2 + std::size_t(h)) * 64;
  };
  float kk[64], vv[64];
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < 2; ++h) {
        REQUIRE(s->read_token(id, l, t, h, kk, vv));
        const auto ek = roundtrip<FP8>(at(k, l, t, h), make_codec_context(99, l, h, kv_role::key));
        const auto ev =
            roundtrip<FP8>(at(v, l, t, h), make_codec_context(99, l, h, kv_role::value));
        REQUIRE(std::memcmp(kk, ek.data(), sizeof kk) == 0);
        REQUIRE(std::memcmp(vv, ev.data(), sizeof vv) == 0);
      }
  CHECK(s->saturations() ==
        1);  // 3e38 is beyond the FP8 codec's input limit 2^127: clipped and counted

  // Convert logical page 1 of layer 0: decode FP8, encode TQ3, publish, release.
  using L0 = S::layout<0>;
  using L1 = S::layout<1>;
  const page_id old = *s->page(id, 0, 1);
  const page_id fresh = *s->allocate_page(1);
  const std::uint8_t* src = s->page_bytes(old)->data();
  std::uint8_t* dst = s->page_bytes(fresh)->data();
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 16; ++t) {
      const auto kctx = make_codec_context(99, 0, h, kv_role::key);
      const auto vctx = make_codec_context(99, 0, h, kv_role::value);
      FP8::meta_type fm{};
      std::memcpy(&fm, src + L0::key_meta(h, t), sizeof fm);
      FP8::decode(src + L0::key_payload(h, t), fm, kk, kctx);
      TQK::meta_type km{};
      REQUIRE(TQK::encode(kk, dst + L1::key_payload(h, t), km, kctx, nullptr) == errc::ok);
      std::memcpy(dst + L1::key_meta(h, t), &km, sizeof km);
      std::memcpy(&fm, src + L0::value_meta(h, t), sizeof fm);
      FP8::decode(src + L0::value_payload(h, t), fm, vv, vctx);
      TQV::meta_type vm{};
      REQUIRE(TQV::encode(vv, dst + L1::value_payload(h, t), vm, vctx, nullptr) == errc::ok);
      std::memcpy(dst + L1::value_meta(h, t), &vm, sizeof vm);
    }
  REQUIRE(s->replace_page(id, 0, 1, old, fresh));
  for (int t = 16; t < 32; ++t)
    for (int h = 0; h < 2; ++h) {
      REQUIRE(s->read_token(id, 0, t, h, kk, vv));
      const auto kctx = make_codec_context(99, 0, h, kv_role::key);
      const auto fp8k = roundtrip<FP8>(at(k, 0, t, h), kctx);
      const auto ek = roundtrip<TQK>(fp8k.data(), kctx);
      REQUIRE(std::memcmp(kk, ek.data(), sizeof kk) == 0);
    }
  REQUIRE(s->check_invariants());

  // Accounting: FP8 d64 = 8 + 16/64 bits per scalar, TQ3 d64 = 3 + 16/64 (docs/formats.md).
  const auto r = make_report(*s);
  CHECK(r.reconciles());
  CHECK(L0::page_bytes == 2 * 16 * 64 * 2 + 2 * 16 * 2 * 2);
  CHECK(L1::page_bytes == 2 * 16 * 24 * 2 + 2 * 16 * 2 * 2);
  CHECK(r.tiers[1].bits_per_scalar == Approx(3.25));
  CHECK(r.tiers[1].token_layers == 16);
  CHECK(r.tiers[0].live_pages == 5);
  CHECK(r.tiers[0].key_meta == 5 * 2 * 16 * 2);
  CHECK(r.tiers[0].padding == 0);
  // Live page bytes per stored token, all layers: 3 FP8 pages (2 full + tail) per layer... exact
  // sum.
  const double bytes = 5.0 * double(L0::page_bytes) + double(L1::page_bytes);
  CHECK(r.kib_per_token == Approx(bytes / 40.0 / 1024.0));
}
