// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "catch.hpp"
#include "tierkv/attention/partial_state.hpp"
#include "tierkv/attention/tile.hpp"
#include "tierkv/codec/dense.hpp"

using namespace tierkv;

namespace {
constexpr int D = 16;
using state = partial_state<D>;

// The state of n random logits (spread * N(0,1)) with N(0,1) values, built directly.
state make_state(std::mt19937_64& rng, int n, float spread) {
  std::normal_distribution<float> nd;
  std::vector<float> s(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n) * D);
  for (auto& x : s) x = spread * nd(rng);
  for (auto& x : v) x = nd(rng);
  state st = state::empty_state();
  float m = -INFINITY;
  for (float x : s) m = std::max(m, x);
  if (n > 0) st.m = m;
  for (int t = 0; t < n; ++t) {
    const float p = std::exp(s[std::size_t(t)] - m);
    st.l += p;
    for (int i = 0; i < D; ++i) st.acc[i] += p * v[std::size_t(t) * D + std::size_t(i)];
  }
  return st;
}

bool bit_equal(const state& a, const state& b) { return std::memcmp(&a, &b, sizeof(state)) == 0; }
}  // namespace

TEST_CASE("partial_state: empty state is the identity of the merge, bit for bit",
          "[attention][state]") {
  std::mt19937_64 rng(11);
  const state e = state::empty_state();
  CHECK(e.empty());
  CHECK(e.lse() == -std::numeric_limits<float>::infinity());
  float out[D];
  std::fill(out, out + D, 7.f);
  e.normalize(out);
  for (float x : out) CHECK(x == 0.f);

  state a = make_state(rng, 50, 3.f);
  state a2 = a;
  a2.merge(e);
  CHECK(bit_equal(a, a2));
  state e2 = e;
  e2.merge(a);
  CHECK(bit_equal(e2, a));
  // Two empties: still empty, no NaN anywhere (no -inf - -inf was evaluated).
  state ee = e;
  ee.merge(e);
  CHECK(ee.empty());
  CHECK(std::isinf(ee.m));
  CHECK(ee.l == 0.f);
  for (float x : ee.acc) CHECK(x == 0.f);
  CHECK(softmax_mass(ee.m, ee.l, ee.lse()) == 0.f);
}

TEST_CASE("partial_state: merge is commutative and associative within float rounding",
          "[attention][state]") {
  std::mt19937_64 rng(12);
  for (int trial = 0; trial < 200; ++trial) {
    // Spreads up to 60 nats so the rescale factors underflow for some inputs.
    const float spread = trial % 4 == 0 ? 30.f : 2.f;
    state a = make_state(rng, 1 + trial % 37, spread);
    state b = make_state(rng, 1 + trial % 11, spread);
    state c = make_state(rng, 1 + trial % 5, spread);
    state ab = a, ba = b;
    ab.merge(b);
    ba.merge(a);
    state ab_c = ab;
    ab_c.merge(c);
    state bc = b;
    bc.merge(c);
    state a_bc = a;
    a_bc.merge(bc);
    CHECK(ab.lse() == Approx(ba.lse()).epsilon(1e-6).margin(1e-6));
    CHECK(ab_c.lse() == Approx(a_bc.lse()).epsilon(1e-6).margin(1e-6));
    float o1[D], o2[D], o3[D], o4[D];
    ab.normalize(o1);
    ba.normalize(o2);
    ab_c.normalize(o3);
    a_bc.normalize(o4);
    for (int i = 0; i < D; ++i) {
      CHECK(o1[i] == Approx(o2[i]).epsilon(1e-5).margin(1e-6));
      CHECK(o3[i] == Approx(o4[i]).epsilon(1e-5).margin(1e-6));
    }
  }
}

TEST_CASE("partial_state: merged chunks equal the float64 softmax over their union",
          "[attention][state]") {
  std::mt19937_64 rng(13);
  std::normal_distribution<float> nd;
  const int n = 300;
  std::vector<float> s(n), v(std::size_t(n) * D);
  for (auto& x : s) x = 4.f * nd(rng);
  for (auto& x : v) x = nd(rng);
  // float64 reference
  double m = -INFINITY, l = 0;
  for (float x : s) m = std::max(m, double(x));
  std::vector<double> ref(D, 0.0);
  for (int t = 0; t < n; ++t) {
    const double p = std::exp(s[std::size_t(t)] - m);
    l += p;
    for (int i = 0; i < D; ++i) ref[std::size_t(i)] += p * v[std::size_t(t) * D + std::size_t(i)];
  }
  for (auto& x : ref) x /= l;
  const double ref_lse = m + std::log(l);
  // Random cut points, chunk states built token by token, merged in a shuffled order.
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int> cuts = {0, n};
    for (int c = 0; c < 1 + trial; ++c) cuts.push_back(int(rng() % n));
    std::sort(cuts.begin(), cuts.end());
    std::vector<state> parts;
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      state st = state::empty_state();
      for (int t = cuts[c]; t < cuts[c + 1]; ++t) {
        state one = state::empty_state();
        one.m = s[std::size_t(t)];
        one.l = 1.f;
        for (int i = 0; i < D; ++i) one.acc[i] = v[std::size_t(t) * D + std::size_t(i)];
        st.merge(one);
      }
      parts.push_back(st);  // may be empty (repeated cut)
    }
    std::shuffle(parts.begin(), parts.end(), rng);
    state total = state::empty_state();
    for (const auto& p : parts) total.merge(p);
    float out[D];
    total.normalize(out);
    CHECK(total.lse() == Approx(ref_lse).epsilon(1e-6));
    for (int i = 0; i < D; ++i) CHECK(out[i] == Approx(ref[std::size_t(i)]).margin(2e-6));
  }
}

TEST_CASE("tile: rows with causal limits match float64 per row; -inf logits give no NaN",
          "[attention][tile]") {
  using C = dense_f32_codec<D>;
  using tile = attention_tile<C, C>;
  std::mt19937_64 rng(14);
  std::normal_distribution<float> nd;
  const int ntok = 20, rows = 5;
  std::vector<float> keys(std::size_t(ntok) * D), vals(std::size_t(ntok) * D),
      q(std::size_t(rows) * D);
  for (auto& x : keys) x = nd(rng);
  for (auto& x : vals) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  const int lim[rows] = {0, 1, 7, 20, 99};
  tile::span sp{reinterpret_cast<const std::uint8_t*>(keys.data()), nullptr,
                reinterpret_cast<const std::uint8_t*>(vals.data()), nullptr};
  std::vector<state> st(rows, state::empty_state());
  std::vector<tile_stats> ts(rows);
  std::vector<float> scores(std::size_t(rows) * ntok);
  const logit_params lp{0.25f, 0.f};
  // Two tiles: tokens [0, 8) then [8, 20), with limits shifted as sequence_pass does.
  int lim0[rows], lim1[rows];
  for (int r = 0; r < rows; ++r) {
    lim0[r] = std::min(lim[r], 8);
    lim1[r] = lim[r] - 8;
  }
  tile::run(q.data(), rows, lim0, sp, 8, lp, st.data(), ts.data(), scores.data());
  tile::span sp1{sp.key_payload + 8 * C::payload_bytes, nullptr,
                 sp.value_payload + 8 * C::payload_bytes, nullptr};
  tile::run(q.data(), rows, lim1, sp1, 12, lp, st.data(), ts.data(), scores.data());
  for (int r = 0; r < rows; ++r) {
    const int n = std::min(lim[r], ntok);
    if (n == 0) {
      CHECK(st[std::size_t(r)].empty());
      CHECK(ts[std::size_t(r)].l == 0.f);
      continue;
    }
    double m = -INFINITY;
    std::vector<double> sc(static_cast<std::size_t>(n));
    for (int t = 0; t < n; ++t) {
      double d = 0;
      for (int i = 0; i < D; ++i)
        d += double(q[std::size_t(r) * D + std::size_t(i)]) *
             keys[std::size_t(t) * D + std::size_t(i)];
      sc[std::size_t(t)] = 0.25 * d;
      m = std::max(m, sc[std::size_t(t)]);
    }
    double l = 0;
    std::vector<double> o(D, 0.0);
    for (int t = 0; t < n; ++t) {
      const double p = std::exp(sc[std::size_t(t)] - m);
      l += p;
      for (int i = 0; i < D; ++i)
        o[std::size_t(i)] += p * vals[std::size_t(t) * D + std::size_t(i)];
    }
    float out[D];
    st[std::size_t(r)].normalize(out);
    for (int i = 0; i < D; ++i) CHECK(out[i] == Approx(o[std::size_t(i)] / l).margin(1e-5));
    CHECK(st[std::size_t(r)].lse() == Approx(m + std::log(l)).epsilon(1e-6));
    // The tile stats of a row over both tiles are the row's {m, l} over its tokens.
    CHECK(ts[std::size_t(r)].m + std::log(ts[std::size_t(r)].l) ==
          Approx(m + std::log(l)).epsilon(1e-6));
  }

  // A query so large that every logit overflows to -inf: no mass, no NaN.
  std::vector<float> big(D, 0.f);
  big[0] = -3e38f;
  std::vector<float> kx(std::size_t(4) * D, 0.f);
  for (int t = 0; t < 4; ++t) kx[std::size_t(t) * D] = 1e10f;
  tile::span sp2{reinterpret_cast<const std::uint8_t*>(kx.data()), nullptr,
                 reinterpret_cast<const std::uint8_t*>(kx.data()), nullptr};
  state s2 = state::empty_state();
  tile_stats t2;
  tile::run(big.data(), 1, nullptr, sp2, 4, logit_params{1.f, 0.f}, &s2, &t2, scores.data());
  CHECK(s2.empty());
  CHECK(!std::isnan(s2.l));
  CHECK(t2.l == 0.f);
}

TEST_CASE("partial_state: a NaN state poisons every merge it joins, never a silent zero",
          "[attention][state]") {
  // A NaN logit (a non-finite key the GPU append reported) gives l = NaN: not empty.
  std::mt19937_64 rng(17);
  state bad = make_state(rng, 8, 1.f);
  bad.l = std::numeric_limits<float>::quiet_NaN();
  CHECK(!bad.empty());
  CHECK(std::isnan(bad.lse()));
  for (const bool bad_first : {true, false}) {
    state a = make_state(rng, 40, 2.f), b = bad;
    if (bad_first) std::swap(a, b);
    a.merge(b);
    CHECK(std::isnan(a.l));
    CHECK(std::isnan(a.lse()));
    float out[D];
    a.normalize(out);
    for (float x : out) CHECK(std::isnan(x));
  }
  state e = state::empty_state();
  e.merge(bad);
  CHECK(std::isnan(e.lse()));
  // the shared arithmetic: empty weighs 0, NaN weighs like a state and poisons the sum
  CHECK(softmax_merge::state_weight<log_base::natural>(-INFINITY, 0.f, -INFINITY) == 0.f);
  CHECK(softmax_merge::state_weight<log_base::two>(1.f, 2.f, 1.f) == 1.f);
  CHECK(std::isnan(softmax_merge::state_lse<log_base::two>(0.f, NAN)));
  CHECK(softmax_merge::state_lse<log_base::two>(-INFINITY, 0.f) == -INFINITY);
  CHECK(softmax_merge::state_lse<log_base::two>(3.f, 4.f) == 5.f);
  CHECK(softmax_merge::lse_weight<log_base::two>(-INFINITY, 2.f) == 0.f);
  CHECK(softmax_merge::lse_weight<log_base::two>(1.f, 2.f) == 0.5f);
  CHECK(softmax_merge::to_natural<log_base::two>(log2e) == 1.f);
}
