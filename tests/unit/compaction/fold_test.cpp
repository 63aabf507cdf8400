// SPDX-License-Identifier: Apache-2.0
// The fold against AM's explicit-bias attention in float64: the folded logit differs from the
// biased one by exactly beta (q.u - 1) at any softmax scale, within the reported bound, and the
// outputs stay within the bound's consequence; on the hyperplane q.u = 1 it is exact.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "catch.hpp"
#include "compaction_data.hpp"
#include "tierkv/compaction/attention_matching.hpp"
#include "tierkv/compaction/biased_attention.hpp"
#include "tierkv/compaction/fold.hpp"

using namespace tierkv;
using namespace tierkv::compaction;
using namespace compaction_test;

namespace {

double dot(const float* a, const float* b, int d) {
  double s = 0;
  for (int k = 0; k < d; ++k) s += double(a[k]) * double(b[k]);
  return s;
}

void check_fold(const head_set& h, float scale, fold_direction dir) {
  am_options o;
  o.budget = 0.1;
  o.softmax_scale = scale;
  auto c = attention_match({h.k, h.v, h.q, h.d}, o);
  REQUIRE(c);
  fold_options fo;
  fo.direction = dir;
  auto f = fold(*c, h.q, fo);
  REQUIRE(f);
  const double s = scale > 0 ? double(scale) : 1.0 / std::sqrt(double(h.d));
  CHECK(f->softmax_scale == float(s));
  const auto t = std::size_t(c->size()), D = std::size_t(h.d);
  double max_beta = 0;
  for (float b : c->beta) max_beta = std::max(max_beta, std::abs(double(b)));
  REQUIRE(max_beta > 0.1);  // the bias is not trivially zero
  // Logits: scale q.k' - (scale q.k + beta) = beta (q.u - 1), bounded by the report.
  double worst = 0;
  for (std::size_t i = 0; i < std::size_t(h.nq); ++i) {
    const float* q = h.q.data() + i * D;
    const double qu = dot(q, f->u.data(), h.d);
    CHECK(std::abs(f->logit_bound[i] - max_beta * std::abs(qu - 1)) <
          1e-9 * (1 + f->logit_bound[i]));
    for (std::size_t a = 0; a < t; ++a) {
      const double folded = s * dot(q, f->keys.data() + a * D, h.d);
      const double biased = s * dot(q, c->keys.data() + a * D, h.d) + double(c->beta[a]);
      const double err = folded - biased, want = double(c->beta[a]) * (qu - 1);
      const double slack = 1e-5 * (1 + std::abs(folded));  // float keys
      CHECK(std::abs(err - want) <= slack);
      CHECK(std::abs(err) <= f->logit_bound[i] + slack);
      worst = std::max(worst, std::abs(err));
    }
  }
  CHECK(worst <= f->max_logit_bound + 1e-4);
  // Outputs: plain attention over the folded keys vs biased attention over the originals.
  std::vector<double> o_fold(h.q.size()), o_am(h.q.size());
  REQUIRE(biased_attention(h.q, f->keys, f->values, {}, h.d, s, o_fold));
  REQUIRE(biased_attention(h.q, c->keys, c->values, c->beta, h.d, s, o_am));
  double vmax = 0;
  for (std::size_t a = 0; a < t; ++a)
    vmax = std::max(vmax, std::sqrt(dot(c->values.data() + a * D, c->values.data() + a * D, h.d)));
  for (std::size_t i = 0; i < std::size_t(h.nq); ++i) {
    double e = 0;
    for (std::size_t k = 0; k < D; ++k)
      e += (o_fold[i * D + k] - o_am[i * D + k]) * (o_fold[i * D + k] - o_am[i * D + k]);
    CHECK(std::sqrt(e) <= (std::exp(2 * (f->logit_bound[i] + 1e-5)) - 1) * vmax + 1e-6);
  }
}

}  // namespace

TEST_CASE("fold reproduces biased attention within the reported bound", "[compaction][fold]") {
  const auto g = gaussian(32, 320, 256, 21, 1.2);
  const auto st = structured(32, 320, 256, 22);
  for (auto dir : {fold_direction::ridge, fold_direction::mean}) {
    for (float scale : {0.f, 0.3f}) {  // 0: 1/sqrt(d); 0.3: the fold uses beta / scale, not sqrt(d)
      INFO("direction " << int(dir) << " scale " << scale);
      check_fold(g, scale, dir);
      check_fold(st, scale, dir);
    }
  }
}

TEST_CASE("fold is exact for queries on the hyperplane q.u = 1", "[compaction][fold]") {
  auto h = structured(32, 200, 64, 31);
  for (std::int64_t i = 1; i < h.nq; ++i)  // every reference query equal to the first
    for (int k = 0; k < h.d; ++k) h.q[std::size_t(i * h.d + k)] = h.q[std::size_t(k)];
  auto c = attention_match({h.k, h.v, h.q, h.d}, {});
  REQUIRE(c);
  fold_options fo;
  fo.direction = fold_direction::mean;
  auto f = fold(*c, h.q, fo);
  REQUIRE(f);
  CHECK(f->max_logit_bound < 1e-6);
  const double s = 1.0 / std::sqrt(double(h.d));
  std::vector<double> o_fold(h.q.size()), o_am(h.q.size());
  REQUIRE(biased_attention(h.q, f->keys, f->values, {}, h.d, s, o_fold));
  REQUIRE(biased_attention(h.q, c->keys, c->values, c->beta, h.d, s, o_am));
  CHECK(rel_l2(o_fold, o_am) < 1e-5);
}

TEST_CASE("ridge direction fits q.u = 1 at least as well as the mean direction",
          "[compaction][fold]") {
  const auto h = structured(32, 100, 256, 41);
  fold_options r, m;
  m.direction = fold_direction::mean;
  auto ur = fit_fold_direction(h.q, h.d, r);
  auto um = fit_fold_direction(h.q, h.d, m);
  REQUIRE(ur);
  REQUIRE(um);
  double tr = 0, sr = 0, sm = 0, nm = 0;
  for (std::int64_t i = 0; i < h.nq; ++i) {
    double qr = 0, qm = 0;
    for (int k = 0; k < h.d; ++k) {
      const double q = h.q[std::size_t(i * h.d + k)];
      qr += q * (*ur)[std::size_t(k)];
      qm += q * (*um)[std::size_t(k)];
      tr += q * q;
    }
    sr += (qr - 1) * (qr - 1);
    sm += (qm - 1) * (qm - 1);
  }
  for (double v : *um) nm += v * v;
  const double lambda = 1e-3 * tr / h.d;
  CHECK(sr <= sm + lambda * nm + 1e-9);  // the ridge objective's optimum
}

TEST_CASE("fold refuses queries that admit no direction", "[compaction][fold]") {
  std::vector<float> zero(16 * 5, 0.f);
  auto r = fit_fold_direction(zero, 16);
  REQUIRE(!r);
  CHECK(r.error_status().code() == errc::invalid_argument);
  CHECK(r.error_status().message().find("all 5 reference queries have norm 0") !=
        std::string::npos);
  fold_options m;
  m.direction = fold_direction::mean;
  auto rm = fit_fold_direction(zero, 16, m);
  REQUIRE(!rm);
  CHECK(rm.error_status().message().find("norm 0") != std::string::npos);
  std::vector<float> q(16 * 3, 1.f);
  q[20] = std::nanf("");
  auto rn = fit_fold_direction(q, 16);
  REQUIRE(!rn);
  CHECK(rn.error_status().code() == errc::non_finite_input);
  CHECK(rn.error_status().message().find("queries[1][4]") != std::string::npos);
  fold_options bad;
  bad.ridge = 0;
  auto rr = fit_fold_direction(std::vector<float>(16 * 3, 1.f), 16, bad);
  REQUIRE(!rr);
  CHECK(rr.error_status().message().find("ridge = 0") != std::string::npos);
  // some zero queries among others are fine
  auto h = gaussian(16, 50, 20, 9);
  for (int k = 0; k < 16; ++k) h.q[std::size_t(k)] = 0.f;
  auto c = attention_match({h.k, h.v, h.q, h.d}, {});
  REQUIRE(c);
  auto f = fold(*c, h.q);
  REQUIRE(f);
  double bmax = 0;
  for (float b : c->beta) bmax = std::max(bmax, std::abs(double(b)));
  CHECK(std::abs(f->logit_bound[0] - bmax) < 1e-9);  // q = 0: q.u - 1 = -1
}
