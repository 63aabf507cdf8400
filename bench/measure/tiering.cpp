// SPDX-License-Identifier: Apache-2.0
// scripts/measure tiering: CPU-side figures of the tier controller and the conversion
// protocol. (1) a long randomized run (append / decode mass feedback / retier with
// injected faults / fork / release) under the default policy: conversions, faults, live
// pages lost, pages kept at their old id; (2) host conversion throughput per page;
// (3) whether keeping a demoted page's FP8 copy (shadow) pays; (4) rank agreement of the
// per-page attention mass from the compressed path with a float64 dense reference.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "measure_common.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/tier_controller.hpp"

using namespace tierkv;

namespace {

using tierkv::measure::spearman;

using fp8_tier = tier<fp8_e4m3, fp8_e4m3>;
using tq3_tier = tier<tq3_key, tq3_value>;
using two = tiers<fp8_tier, tq3_tier>;

float gauss(std::uint64_t seed, int layer, int head, int role, int d) {
  const std::uint64_t k =
      mix64(seed * 0x9E3779B97F4A7C15ull ^ (std::uint64_t(layer) << 40 | std::uint64_t(head) << 24 |
                                            std::uint64_t(role) << 16 | std::uint64_t(d)));
  const double u1 = (double(k >> 11) + 0.5) / 9007199254740992.0;
  const double u2 = double(mix64(k) >> 11) / 9007199254740992.0;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}
template <int H, int D>
void make_kv(int layers, const std::vector<std::uint64_t>& seeds, std::vector<float>& k,
             std::vector<float>& v) {
  k.resize(std::size_t(layers) * seeds.size() * H * D);
  v.resize(k.size());
  std::size_t i = 0;
  for (int l = 0; l < layers; ++l)
    for (std::uint64_t s : seeds)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d, ++i) {
          k[i] = gauss(s, l, h, 0, d);
          v[i] = gauss(s, l, h, 1, d);
        }
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// CPU time of this thread: the conversion timings stay meaningful on a shared machine.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// ---- (1) randomized run ---------------------------------------------------------------------
struct run_figures {
  std::uint64_t steps = 0, conversions = 0, promotions = 0, demotions = 0, pressure = 0, faults = 0,
                lost = 0, kept_after_fault = 0, refused = 0;
  double seconds = 0;
};

struct faults_at {
  std::uint64_t calls = 0, fail_at = 0, injected = 0;
  block_ref block;
  int layer = -1;
  errc operator()(conversion_step, block_ref b, int l) {
    if (++calls == fail_at) {
      ++injected;
      block = b;
      layer = l;
      return errc::injected_fault;
    }
    return errc::ok;
  }
};

run_figures randomized_run(std::uint64_t steps) {
  using G = geometry<head_dim<64>, kv_heads<1>, group_size<2>, page_tokens<16>>;
  using S = paged_storage<G, two>;
  using C = tier_controller<S>;
  run_figures fig;
  std::mt19937_64 rng(2026);
  S::options o;
  o.num_layers = 4;
  o.max_sequences = 8;
  o.pages_per_tier = {128, 160};
  auto s = std::move(S::create(o).value());
  policy::recency_anchor::options k;  // defaults, except dwell and recency scaled to this run
  k.recent_pages = 2;
  k.min_dwell_steps = 4;
  auto c = std::move(C::create(*s, policy::recency_anchor(k)).value());
  std::map<std::uint32_t, seq_id> live;
  host_attention_workspace ws(1);
  index_layout<2> layout{1, 64};
  std::vector<std::uint8_t> buf(layout.bytes());
  std::vector<float> keys, values, mass(64);
  std::uint64_t token = 1, step = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < steps; ++i, ++fig.steps) {
    const std::uint64_t op = rng() % 100;
    seq_id* q = nullptr;
    if (!live.empty()) {
      auto it = live.begin();
      std::advance(it, std::ptrdiff_t(rng() % live.size()));
      q = &it->second;
    }
    if (op < 35) {
      if (q == nullptr || (live.size() < 8 && rng() % 4 == 0)) {
        auto n = s->create_sequence();
        if (!n) continue;
        q = &(live[n->value] = *n);
      }
      const int n = int(rng() % 24) + 1;
      std::vector<std::uint64_t> seeds(static_cast<std::size_t>(n));
      for (auto& x : seeds) x = token++;
      make_kv<1, 64>(o.num_layers, seeds, keys, values);
      const std::int64_t len = *s->length(*q);
      const std::int64_t fresh = (len + n + 15) / 16 - (len + 15) / 16;
      status st = c->make_room(std::uint32_t(fresh * o.num_layers));
      if (st) st = s->append(*q, n, keys, values);
      if (!st) ++fig.refused;
    } else if (op < 70 && q != nullptr && *s->length(*q) > 0) {
      const int layer = int(rng() % 4);
      const seq_id batch[1] = {*q};
      auto view = build_batch_index(*s, layer, std::span<const seq_id>(batch, 1), layout, buf);
      float query[2 * 64], out[2 * 64];
      const std::uint64_t target =
          1 + rng() % (token - 1);  // often a token of another sequence: diffuse
      for (int j = 0; j < 128; ++j) query[j] = 2.0f * gauss(target, layer, 0, 0, j % 64);
      const auto pools = s->views();
      host_decode_args<2> a;
      a.queries = query;
      a.index = *view;
      a.pools = pools.data();
      a.source = layer_source{o.codec_seed, layer};
      a.logits.softmax_scale = 0.125f;
      a.out = out;
      a.page_mass = mass.data();
      a.mass_stride = 64;
      if (host_decode<G, two>(ws, a)) (void)c->observe_mass(*q, layer, mass);
    } else if (op < 88) {
      ++step;
      const auto planned = c->plan(step);
      const std::vector<conversion> plan(planned.begin(), planned.end());
      std::vector<page_id> before(plan.size());
      for (std::size_t j = 0; j < plan.size(); ++j)
        before[j] = s->block_page(plan[j].block, plan[j].layer);
      faults_at f;
      if (!plan.empty() && rng() % 3 == 0) f.fail_at = 1 + rng() % (plan.size() * conversion_steps);
      const retier_stats st = c->apply(plan, f);
      fig.conversions += st.converted;
      fig.promotions += st.promoted;
      fig.demotions += st.demoted;
      fig.faults += f.injected;
      for (std::size_t j = 0; j < plan.size(); ++j) {
        const page_id now = s->block_page(plan[j].block, plan[j].layer);
        const bool ok = (now == before[j] || int(now.format) == plan[j].to) &&
                        s->check_page(now).is_ok() && s->page_published(now);
        if (!ok) ++fig.lost;
        if (f.injected && plan[j].block == f.block && plan[j].layer == f.layer && now == before[j])
          ++fig.kept_after_fault;
      }
    } else if (op < 94 && q != nullptr) {
      if (*s->length(*q) % 16 != 0 && !c->make_room(std::uint32_t(o.num_layers))) continue;
      if (auto f = s->fork(*q)) live[f->value] = *f;
    } else if (q != nullptr) {
      const seq_id id = *q;
      (void)s->release(id);
      live.erase(id.value);
    }
    if (!c->check_invariants()) ++fig.lost;  // any broken invariant counts as a lost page
  }
  fig.pressure = c->totals().pressure_demoted;
  fig.seconds = seconds_since(t0);
  fig.conversions += fig.pressure;  // make_room's demotions are conversions too
  fig.demotions += fig.pressure;
  return fig;
}

// ---- (2) conversion throughput on a realistic page -----------------------------------------
struct throughput {
  double demote_us = 0, promote_us = 0, page_bytes_fp8 = 0, page_bytes_tq3 = 0;
};
throughput conversion_throughput() {
  using G = geometry<head_dim<128>, kv_heads<8>, group_size<4>, page_tokens<64>>;
  using S = paged_storage<G, two>;
  S::options o;
  o.num_layers = 1;
  o.max_sequences = 2;
  o.pages_per_tier = {70, 70};
  auto s = std::move(S::create(o).value());
  const seq_id q = s->create_sequence().value();
  std::vector<std::uint64_t> seeds(64 * 64);
  std::iota(seeds.begin(), seeds.end(), 1);
  std::vector<float> k, v;
  make_kv<8, 128>(1, seeds, k, v);
  (void)s->append(q, std::int64_t(seeds.size()), k, v);
  conversion_counters cc;
  throughput t;
  t.page_bytes_fp8 = double(S::layout<0>::page_bytes);
  t.page_bytes_tq3 = double(S::layout<1>::page_bytes);
  std::vector<double> dem, pro;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = thread_cpu_seconds();
    for (std::int64_t i = 0; i < 64; ++i) (void)convert_page(*s, *s->block_of(q, i), 0, 1, cc);
    dem.push_back((thread_cpu_seconds() - t0) / 64 * 1e6);
    t0 = thread_cpu_seconds();
    for (std::int64_t i = 0; i < 64; ++i) (void)convert_page(*s, *s->block_of(q, i), 0, 0, cc);
    pro.push_back((thread_cpu_seconds() - t0) / 64 * 1e6);
  }
  std::sort(dem.begin(), dem.end());
  std::sort(pro.begin(), pro.end());
  t.demote_us = dem[1];
  t.promote_us = pro[1];
  return t;
}

// ---- (3) shadows: does keeping a demoted page's FP8 copy pay? --------------------------------
struct shadow_figures {
  std::uint64_t promotions = 0, shadow_hits = 0;
  double decode_err = 0;  // mean relative L2 decode error vs float64 over the original tokens
  std::size_t fp8_pages_peak = 0;
};
shadow_figures shadow_run(bool keep) {
  using G = geometry<head_dim<64>, kv_heads<1>, group_size<2>, page_tokens<16>>;
  using cache_t = tiered_cache<G, two>;
  constexpr int D = 64, QH = 2;
  cache_t::options opt;
  opt.storage.num_layers = 1;
  opt.storage.pages_per_tier = {48, 64};
  opt.policy = policy::recency_anchor({.recent_pages = 2,
                                       .sink_pages = 1,
                                       .ema_alpha = 0.5f,
                                       .enter_mass = 3.0f,
                                       .leave_mass = 1.5f,
                                       .min_dwell_steps = 2,
                                       .keep_first_layers = 0,
                                       .keep_last_layers = 0});
  opt.tiering.keep_shadows = keep;
  opt.tiering.shadow_slack_percent = 10;
  opt.max_batch = 1;
  opt.max_pages = 64;
  auto c = std::move(cache_t::create(opt).value());
  const seq_id s = c->create_sequence().value();
  std::vector<std::uint64_t> tokens(400);
  std::iota(tokens.begin(), tokens.end(), 1);
  std::vector<float> k, v, q(QH * D), out(QH * D);
  make_kv<1, 64>(1, tokens, k, v);
  (void)c->append(s, 400, k, v);
  shadow_figures f;
  std::mt19937_64 rng(7);
  double err_sum = 0;
  int err_n = 0;
  for (std::uint64_t step = 1; step <= 400; ++step) {
    // The attended token moves among a few pages, returning after ~10-30 steps (a topic revisited).
    const std::uint64_t target = tokens[std::size_t(32 + 48 * ((step / 12 + rng() % 2) % 7))];
    for (int i = 0; i < QH * D; ++i) q[std::size_t(i)] = 2.0f * gauss(target, 0, 0, 0, i % D);
    (void)c->attend(0, std::vector<seq_id>{s}, q, out);
    // float64 reference over the original tokens.
    double num = 0, den = 0;
    for (int h = 0; h < QH; ++h) {
      std::vector<double> logit(tokens.size());
      double mx = -1e300;
      for (std::size_t t = 0; t < tokens.size(); ++t) {
        double d = 0;
        for (int j = 0; j < D; ++j)
          d += double(q[std::size_t(h * D + j)]) * gauss(tokens[t], 0, 0, 0, j);
        logit[t] = d * 0.125;
        mx = std::max(mx, logit[t]);
      }
      double sum = 0;
      for (double& l : logit) sum += (l = std::exp(l - mx));
      for (int j = 0; j < D; ++j) {
        double o = 0;
        for (std::size_t t = 0; t < tokens.size(); ++t)
          o += logit[t] / sum * gauss(tokens[t], 0, 0, 1, j);
        num += (out[std::size_t(h * D + j)] - o) * (out[std::size_t(h * D + j)] - o);
        den += o * o;
      }
    }
    err_sum += std::sqrt(num / den);
    ++err_n;
    const retier_stats st = c->retier(step);
    f.fp8_pages_peak =
        std::max<std::size_t>(f.fp8_pages_peak, c->storage().template pool<0>().live_count());
    (void)st;
  }
  f.promotions = c->controller().totals().promoted;
  f.shadow_hits = c->controller().totals().shadow_promotions;
  f.decode_err = err_sum / err_n;
  return f;
}

// ---- (4) attention-mass ranking: compressed path vs float64 dense reference ------------------
struct mass_figures {
  double spearman_mixed = 0, spearman_tq3 = 0, top8_mixed = 0, top8_tq3 = 0;
  int trials = 0, pages = 0;
};
mass_figures mass_ranking() {
  using G = geometry<head_dim<128>, kv_heads<2>, group_size<4>, page_tokens<16>>;
  using S = paged_storage<G, two>;
  constexpr int D = 128, H = 2, GS = 4, QH = 8, P = 64, T = 16;
  mass_figures m;
  m.pages = P;
  std::vector<double> sm, st, tm, tt;
  for (int trial = 0; trial < 9; ++trial) {
    S::options o;
    o.num_layers = 1;
    o.pages_per_tier = {P + 2, P + 2};
    o.codec_seed = std::uint64_t(trial);
    auto s = std::move(S::create(o).value());
    const seq_id q = s->create_sequence().value();
    std::vector<std::uint64_t> tokens(P * T);
    std::iota(tokens.begin(), tokens.end(), std::uint64_t(trial) * 100000 + 1);
    std::vector<float> k, v;
    make_kv<H, D>(1, tokens, k, v);
    (void)s->append(q, std::int64_t(tokens.size()), k, v);
    // Queries: a mix of a few tokens' keys (what attention heads do) plus noise.
    std::vector<float> query(QH * D);
    for (int h = 0; h < QH; ++h)
      for (int d = 0; d < D; ++d) {
        double x = 0.3 * gauss(999 + std::uint64_t(trial), 0, h, 3, d);
        for (int j = 0; j < 6; ++j)
          x += 0.6 * gauss(tokens[std::size_t((trial * 37 + j * 173) % (P * T))], 0, h / GS, 0, d);
        query[std::size_t(h * D + d)] = float(x);
      }
    // float64 dense reference mass per page over the original tokens.
    std::vector<double> ref(P, 0.0);
    for (int h = 0; h < QH; ++h) {
      std::vector<double> logit(tokens.size());
      double mx = -1e300;
      for (std::size_t t = 0; t < tokens.size(); ++t) {
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += double(query[std::size_t(h * D + d)]) * gauss(tokens[t], 0, h / GS, 0, d);
        logit[t] = dot / std::sqrt(double(D));
        mx = std::max(mx, logit[t]);
      }
      double sum = 0;
      for (double& l : logit) sum += (l = std::exp(l - mx));
      for (std::size_t t = 0; t < tokens.size(); ++t) ref[t / T] += logit[t] / sum / QH;
    }
    index_layout<2> layout{1, P};
    std::vector<std::uint8_t> buf(layout.bytes());
    host_attention_workspace ws(1);
    const auto run = [&](std::vector<double>& got) {
      const seq_id batch[1] = {q};
      auto view = build_batch_index(*s, 0, std::span<const seq_id>(batch, 1), layout, buf);
      std::vector<float> out(QH * D), mass(P);
      const auto pools = s->views();
      host_decode_args<2> a;
      a.queries = query.data();
      a.index = *view;
      a.pools = pools.data();
      a.source = layer_source{o.codec_seed, 0};
      a.out = out.data();
      a.page_mass = mass.data();
      a.mass_stride = P;
      a.logits.softmax_scale = 1.0f / std::sqrt(float(D));
      (void)host_decode<G, two>(ws, a);
      got.assign(mass.begin(), mass.end());
    };
    const auto top8 = [&](const std::vector<double>& a) {
      std::vector<std::size_t> ia(P), ib(P);
      std::iota(ia.begin(), ia.end(), 0);
      ib = ia;
      std::sort(ia.begin(), ia.end(), [&](std::size_t x, std::size_t y) { return a[x] > a[y]; });
      std::sort(ib.begin(), ib.end(),
                [&](std::size_t x, std::size_t y) { return ref[x] > ref[y]; });
      int n = 0;
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) n += ia[std::size_t(i)] == ib[std::size_t(j)];
      return n / 8.0;
    };
    // Mixed: the default-policy shape (sink, last 4 pages and every 5th page FP8, the rest TQ3).
    conversion_counters cc;
    for (int i = 1; i < P - 4; ++i)
      if (i % 5 != 0) (void)convert_page(*s, *s->block_of(q, i), 0, 1, cc);
    std::vector<double> got;
    run(got);
    sm.push_back(spearman(got, ref));
    tm.push_back(top8(got));
    for (int i = 0; i < P; ++i)
      if (s->page(q, 0, i)->format == 0 && s->block_sealed(*s->block_of(q, i)))
        (void)convert_page(*s, *s->block_of(q, i), 0, 1, cc);
    run(got);
    st.push_back(spearman(got, ref));
    tt.push_back(top8(got));
    ++m.trials;
  }
  const auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  m.spearman_mixed = median(sm);
  m.spearman_tq3 = median(st);
  m.top8_mixed = median(tm);
  m.top8_tq3 = median(tt);
  return m;
}

}  // namespace

int main() {
  measure::report rep("tiering");
  const run_figures r = randomized_run(100000);
  std::printf(
      "randomized run (default policy, R=2, dwell 4, 4 layers, faults injected in 1/3 of "
      "retiers)\n");
  std::printf(
      "  steps %llu  conversions %llu (promotions %llu, demotions %llu, of them under memory "
      "pressure %llu)\n",
      (unsigned long long)r.steps, (unsigned long long)r.conversions,
      (unsigned long long)r.promotions, (unsigned long long)r.demotions,
      (unsigned long long)r.pressure);
  std::printf(
      "  faults injected %llu  live pages lost %llu  faulted pages at old id %llu (%.1f%%)  "
      "refused appends %llu  (%.2f s)\n",
      (unsigned long long)r.faults, (unsigned long long)r.lost,
      (unsigned long long)r.kept_after_fault,
      r.faults ? 100.0 * double(r.kept_after_fault) / double(r.faults) : 100.0,
      (unsigned long long)r.refused, r.seconds);
  const throughput t = conversion_throughput();
  std::printf(
      "host conversion, one page (d=128, 8 KV heads, 64 tokens; FP8 page %.0f B, TQ3 page %.0f B), "
      "1 thread:\n",
      t.page_bytes_fp8, t.page_bytes_tq3);
  std::printf("  FP8 -> TQ3 %.1f us/page (%.3f GB/s of FP8 read)   TQ3 -> FP8 %.1f us/page\n",
              t.demote_us, t.page_bytes_fp8 / t.demote_us * 1e-3, t.promote_us);
  const shadow_figures off = shadow_run(false), on = shadow_run(true);
  std::printf("shadow copies (attention revisits pages; 400 steps, 25 pages):\n");
  std::printf(
      "  off: promotions %llu, decode rel err vs float64 originals %.4f, FP8 pages peak %zu\n",
      (unsigned long long)off.promotions, off.decode_err, off.fp8_pages_peak);
  std::printf(
      "  on:  promotions %llu (lossless from shadow %llu), decode rel err %.4f, FP8 pages peak "
      "%zu\n",
      (unsigned long long)on.promotions, (unsigned long long)on.shadow_hits, on.decode_err,
      on.fp8_pages_peak);
  const mass_figures mf = mass_ranking();
  std::printf(
      "per-page attention mass, compressed path vs float64 dense (%d pages, median of %d "
      "trials):\n",
      mf.pages, mf.trials);
  std::printf(
      "  mixed FP8/TQ3: Spearman %.4f, top-8 overlap %.3f   all TQ3 (but the open page): Spearman "
      "%.4f, top-8 %.3f\n",
      mf.spearman_mixed, mf.top8_mixed, mf.spearman_tq3, mf.top8_tq3);
  rep.metric("steps", double(r.steps));
  rep.metric("conversions", double(r.conversions));
  rep.metric("promotions", double(r.promotions));
  rep.metric("demotions", double(r.demotions));
  rep.metric("pressure_demotions", double(r.pressure));
  rep.metric("faults_injected", double(r.faults));
  rep.metric("live_pages_lost", double(r.lost));
  rep.metric("pages_at_old_id_after_fault_pct",
             r.faults ? 100.0 * double(r.kept_after_fault) / double(r.faults) : 100.0);
  rep.metric("demote_us_per_page", t.demote_us);
  rep.metric("promote_us_per_page", t.promote_us);
  rep.metric("shadow_off_decode_err", off.decode_err);
  rep.metric("shadow_on_decode_err", on.decode_err);
  rep.metric("shadow_on_lossless_promotions", double(on.shadow_hits));
  rep.metric("shadow_on_promotions", double(on.promotions));
  rep.metric("mass_spearman_mixed", mf.spearman_mixed);
  rep.metric("mass_spearman_tq3", mf.spearman_tq3);
  rep.metric("mass_top8_overlap_mixed", mf.top8_mixed);
  rep.metric("mass_top8_overlap_tq3", mf.top8_tq3);
  rep.emit();
  return r.lost == 0 ? 0 : 1;
}
