// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness over every token-vector codec (issue 24). The first bytes pick a codec,
// a head_dim and a mode; the rest is data.
//  - decode: arbitrary bytes as a payload and its metadata, in buffers of exactly the codec's
//    sizes (ASan sees any read past them): decode, prepare_query, dot, accumulate, finalize
//    never crash, read out of bounds or hit undefined behaviour, whatever the bytes.
//  - encode: adversarial floats (NaN, +-Inf, +-FLT_MAX, subnormals, signed zeros, one huge
//    coordinate, raw bit patterns) against the documented contract (codec/codec.hpp,
//    docs/codecs.md, docs/formats.md): non-finite input -> errc::non_finite_input and a
//    poisoned slot that decodes to NaN; finite input -> ok and a finite decode; a zero vector
//    decodes to exact zeros; within the scale range where no clipping happens, each codec's
//    error bound (derived in the comments below) holds.
// A broken contract aborts with a message: libFuzzer records the input as a crash.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

using namespace tierkv;

namespace {

[[noreturn]] void fail(const char* codec, int d, const char* what, double got, double bound) {
  std::fprintf(stderr, "codec contract broken: %s d=%d: %s (%g, bound %g)\n", codec, d, what, got,
               bound);
  std::abort();
}

enum class bound_kind { fp8_e4m3, fp8_e5m2, int8_rotated, tq_key, tq_value, bf16, exact };

float adversarial(FuzzedDataProvider& in) {
  static constexpr float palette[] = {
      NAN,     INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, 1e-45f, -1e-45f,
      0.0f,    -0.0f,    1e38f,     -3e38f,  1e-41f,   5.2e33f, 1e30f,    448.0f, 57344.0f,
      -448.5f, 1.0f,     -1.0f,     0.5f,    65504.0f, 1e-20f,  3.0e-39f,
  };
  const std::uint8_t kind = in.ConsumeIntegral<std::uint8_t>();
  if (kind < 64) return palette[kind % (sizeof(palette) / sizeof(palette[0]))];
  if (kind < 128) {  // any bit pattern
    const std::uint32_t bits = in.ConsumeIntegral<std::uint32_t>();
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  // a moderate value with a random binary exponent
  const int e = int(in.ConsumeIntegralInRange<int>(-30, 30));
  return std::ldexp(float(in.ConsumeIntegralInRange<int>(-1000, 1000)) / 1000.0f, e);
}

template <class C>
void decode_any(FuzzedDataProvider& in, const char* name) {
  constexpr int d = C::head_dim;
  std::vector<std::uint8_t> payload(C::payload_bytes);
  for (auto& b : payload) b = in.ConsumeIntegral<std::uint8_t>();
  typename C::meta_type meta{};
  if constexpr (C::meta_bytes > 0) {
    std::vector<std::uint8_t> mb(C::meta_bytes);
    for (auto& b : mb) b = in.ConsumeIntegral<std::uint8_t>();
    std::memcpy(&meta, mb.data(), C::meta_bytes);
  }
  const codec_context ctx{in.ConsumeIntegral<std::uint64_t>()};
  std::vector<float> out(d), q(d), pq(d), acc(d, 0.0f);
  C::decode(payload.data(), meta, out.data(), ctx);
  for (int i = 0; i < d; ++i) q[std::size_t(i)] = adversarial(in);
  C::prepare_query(q.data(), pq.data(), ctx);
  volatile float s = C::dot(pq.data(), payload.data(), meta);
  (void)s;
  C::accumulate(in.ConsumeFloatingPoint<float>(), payload.data(), meta, acc.data());
  C::finalize(acc.data(), ctx);
  (void)name;
}

template <class C>
void encode_adversarial(FuzzedDataProvider& in, const char* name, bound_kind kind) {
  constexpr int d = C::head_dim;
  std::vector<float> x(d);
  const std::uint8_t shape = in.ConsumeIntegral<std::uint8_t>();
  if (shape % 4 == 0) {  // one huge coordinate among moderate ones
    const int e = in.ConsumeIntegralInRange<int>(-8, 8);
    for (auto& v : x) v = std::ldexp(float(in.ConsumeIntegralInRange<int>(-999, 999)) / 999.f, e);
    x[in.ConsumeIntegralInRange<std::size_t>(0, d - 1)] = adversarial(in);
  } else if (shape % 4 == 1) {  // all zeros, signed
    for (auto& v : x) v = in.ConsumeBool() ? -0.0f : 0.0f;
  } else {
    for (auto& v : x) v = adversarial(in);
  }
  const codec_context ctx{in.ConsumeIntegral<std::uint64_t>()};
  std::vector<std::uint8_t> payload(C::payload_bytes);
  typename C::meta_type meta{};
  encode_stats stats{};
  const errc e = C::encode(x.data(), payload.data(), meta, ctx, &stats);
  std::vector<float> y(d);
  bool finite = true;
  double amax = 0, sumsq = 0;
  for (float v : x) {
    finite = finite && std::isfinite(v);
    amax = std::fmax(amax, std::fabs(double(v)));
    sumsq += double(v) * double(v);
  }
  if (!finite) {
    if (e != errc::non_finite_input) fail(name, d, "non-finite input not refused", double(e), 0);
    if (kind == bound_kind::exact) return;  // dense_f32 writes nothing
    C::decode(payload.data(), meta, y.data(), ctx);
    bool any_nan = false;
    for (float v : y) any_nan = any_nan || std::isnan(v);
    if (!any_nan) fail(name, d, "poisoned slot decodes without a NaN", 0, 0);
    return;
  }
  if (e != errc::ok) fail(name, d, "finite input refused", double(e), 0);
  C::decode(payload.data(), meta, y.data(), ctx);
  double err2 = 0, inner = 0;
  for (int i = 0; i < d; ++i) {
    if (!std::isfinite(y[std::size_t(i)]))
      fail(name, d, "finite input decodes to a non-finite value", double(y[std::size_t(i)]), 0);
    const double diff = double(y[std::size_t(i)]) - double(x[std::size_t(i)]);
    err2 += diff * diff;
    inner += double(y[std::size_t(i)]) * double(x[std::size_t(i)]);
  }
  if (amax == 0) {
    for (float v : y)
      if (v != 0.0f) fail(name, d, "zero vector decodes to non-zero", double(v), 0);
    return;
  }
  // Error bounds hold where nothing is clipped and the scales stay normal.
  if (stats.saturated != 0 || amax < 0x1p-60 || amax > 0x1p60) return;
  const double rel = std::sqrt(err2 / sumsq);
  switch (kind) {
    case bound_kind::fp8_e4m3:
    case bound_kind::fp8_e5m2: {
      // E4M3: 3 mantissa bits (relative error <= 2^-4 for normal codes), subnormal spacing
      // 2^-9, fmt_max 448; E5M2: 2^-3, 2^-16, 57344. scale <= amax / fmt_max * 1.02 (bf16,
      // rounded up and bumped), so |err_i| <= max(|x_i| r, spacing / 2 * scale).
      const bool e4 = kind == bound_kind::fp8_e4m3;
      const double r = e4 ? 0x1p-4 : 0x1p-3;
      const double absmax = (e4 ? 0x1p-10 / 448.0 : 0x1p-17 / 57344.0) * amax * 1.02;
      double b2 = 0;
      for (float v : x)
        b2 += std::fmax(std::fabs(double(v)) * r, absmax) *
              std::fmax(std::fabs(double(v)) * r, absmax);
      if (err2 > b2 * 1.0001 + 1e-12 * sumsq)
        fail(name, d, "error beyond the FP8 bound", std::sqrt(err2), std::sqrt(b2));
      break;
    }
    case bound_kind::int8_rotated: {
      // Rotated coordinates z (|z| = sqrt(d) |x|) are rounded to a step <= zmax / 127 * 1.01,
      // so |x - x^| = |z - z^| / sqrt(d) <= zmax / 254 * 1.01 <= sqrt(d) |x| / 254 * 1.01.
      const double b = std::sqrt(double(d)) / 254.0 * 1.02 + 1e-5;
      if (rel > b) fail(name, d, "error beyond the int8_rotated bound", rel, b);
      break;
    }
    case bound_kind::tq_value: {
      // Least-squares alpha: the best multiple of the decoded direction is no worse than 0;
      // bf16 rounding of alpha adds at most 2^-8 of |x|.
      if (rel > 1.01) fail(name, d, "error beyond the least-squares bound", rel, 1.01);
      break;
    }
    case bound_kind::tq_key: {
      // Unbiased inner product: alpha makes <x, x^> = |x|^2, up to alpha's bf16 rounding.
      const double ratio = inner / sumsq;
      if (std::fabs(ratio - 1.0) > 0.01) fail(name, d, "<x, x^> / |x|^2 away from 1", ratio, 0.01);
      break;
    }
    case bound_kind::bf16: {
      const double b = 0x1p-8 * 1.01;
      if (rel > b) fail(name, d, "error beyond the bf16 bound", rel, b);
      break;
    }
    case bound_kind::exact:
      if (err2 != 0) fail(name, d, "dense_f32 not exact", err2, 0);
      break;
  }
}

template <class Family, int D>
void run(FuzzedDataProvider& in, bool decode, bound_kind kind) {
  using C = codec_for<Family, D>;
  if (decode)
    decode_any<C>(in, C::name);
  else
    encode_adversarial<C>(in, C::name, kind);
}

template <int D>
void dispatch(FuzzedDataProvider& in, int codec, bool decode) {
  switch (codec) {
    case 0:
      return run<fp8_e4m3, D>(in, decode, bound_kind::fp8_e4m3);
    case 1:
      return run<fp8_e5m2, D>(in, decode, bound_kind::fp8_e5m2);
    case 2:
      return run<int8_rotated, D>(in, decode, bound_kind::int8_rotated);
    case 3:
      return run<tq3_key, D>(in, decode, bound_kind::tq_key);
    case 4:
      return run<tq3_value, D>(in, decode, bound_kind::tq_value);
    case 5:
      return run<tq4_key, D>(in, decode, bound_kind::tq_key);
    case 6:
      return run<tq4_value, D>(in, decode, bound_kind::tq_value);
    case 7:
      return run<dense_bf16, D>(in, decode, bound_kind::bf16);
    default:
      return run<dense_f32, D>(in, decode, bound_kind::exact);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int codec = in.ConsumeIntegralInRange<int>(0, 8);
  const bool decode = in.ConsumeBool();
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0:
      dispatch<64>(in, codec, decode);
      break;
    case 1:
      dispatch<128>(in, codec, decode);
      break;
    default:
      dispatch<256>(in, codec, decode);
      break;
  }
  return 0;
}
