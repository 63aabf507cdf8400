// SPDX-License-Identifier: Apache-2.0
// 03_custom_tier_policy: a user-defined tier policy driving tiered_cache. `keep_layers` keeps
// every page of the layers it is given in the 8-bit tier (Anchor: int8_rotated), keeps the
// newest pages of every sequence there too (Recent) and sends the rest to TQ3 (Stale). The
// example decodes a few steps with retier() between them, then checks the tier of every page
// against the policy's rule and prints the report. Exits 1 if a page is in the wrong tier.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <vector>

#include <tierkv/tierkv.hpp>

namespace {

// A tier policy (tierkv/tiering/tier_policy.hpp): a copyable value of knobs with the members
// the controller calls. check_tier_policy<P>() names the first missing one at compile time.
class keep_layers {
 public:
  struct page_state {};  // what the controller stores per page for us: nothing

  keep_layers() = default;
  keep_layers(std::uint64_t layer_mask, int recent_pages)
      : mask_(layer_mask), recent_(recent_pages) {}

  bool kept(int layer) const { return layer < 64 && ((mask_ >> layer) & 1u) != 0; }

  // One step's attention mass of a page (1 = an average page); this policy does not use it.
  void observe(page_state&, float) const {}

  // The role of a page now: Anchor for the kept layers, Recent for the newest pages, else Stale.
  tierkv::tier_role choose(const page_state&, const tierkv::page_facts& f) const {
    if (kept(f.layer)) return tierkv::tier_role::anchor;
    if (f.age < recent_) return tierkv::tier_role::recent;
    return tierkv::tier_role::stale;
  }

  // Pages may move at every step (no hysteresis needed: the rule does not flap).
  std::uint64_t min_dwell_steps() const { return 0; }

  // Under memory pressure the lowest values are demoted first: kept layers never, then the
  // oldest pages first.
  float keep_value(const page_state&, const tierkv::page_facts& f) const {
    if (kept(f.layer)) return std::numeric_limits<float>::infinity();
    return f.age == tierkv::page_facts::no_holder ? 0.f : 1.f / (1.f + float(f.age));
  }

  tierkv::status validate() const {
    if (recent_ < 1)
      return tierkv::status::make(tierkv::errc::invalid_argument,
                                  "keep_layers: recent_pages = ", recent_,
                                  " must be >= 1 (the open page is written in tier 0)");
    return {};
  }

  int recent_pages() const { return recent_; }

 private:
  std::uint64_t mask_ = 0;
  int recent_ = 2;
};
static_assert(tierkv::check_tier_policy<keep_layers>());

using geometry = tierkv::geometry<tierkv::head_dim<64>, tierkv::kv_heads<2>, tierkv::group_size<4>,
                                  tierkv::page_tokens<16>>;
using int8r = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;  // tier 0: 8-bit
using tq3 = tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>;            // tier 1: 3-bit
using cache_t = tierkv::tiered_cache<geometry, tierkv::tiers<int8r, tq3>, keep_layers>;

constexpr int kLayers = 4, D = geometry::head_dim, KV = geometry::kv_heads;

}  // namespace

int main() {
  cache_t::options opt;
  opt.storage.num_layers = kLayers;
  opt.storage.max_sequences = 4;
  opt.storage.pages_per_tier = {128, 128};
  opt.policy = keep_layers(/*layers 1 and 2*/ 0b0110, /*recent_pages*/ 2);
  opt.max_batch = 2;
  opt.max_pages = 32;
  auto cache = cache_t::create(opt).value();

  std::uint64_t rng = 1;
  auto next = [&] { return float(double(tierkv::mix64(rng++) >> 11) * 0x1.0p-53 * 2.0 - 1.0); };
  auto append = [&](tierkv::seq_id s, long n) {
    std::vector<float> k(std::size_t(kLayers * n * KV * D)), v(k.size());
    for (auto& x : k) x = next();
    for (auto& x : v) x = next();
    cache->append(s, n, k, v).throw_if_error();
  };
  const std::vector<tierkv::seq_id> batch{cache->create_sequence().value(),
                                          cache->create_sequence().value()};
  append(batch[0], 300);
  append(batch[1], 170);

  std::vector<float> q(batch.size() * geometry::q_heads * D), out(q.size());
  std::uint64_t converted = 0;
  for (std::uint64_t step = 1; step <= 8; ++step) {
    for (auto s : batch) append(s, 1);
    for (int l = 0; l < kLayers; ++l) {
      for (auto& x : q) x = next();
      cache->attend(l, batch, q, out).throw_if_error();  // feeds page masses to the policy
    }
    const tierkv::retier_stats st = cache->retier(step);  // asks the policy, converts
    st.first_error.throw_if_error();
    converted += st.converted;
  }

  // Every page must sit where the policy says: the tier of role choose() picked.
  const auto& storage = cache->storage();
  long wrong = 0, kept_pages = 0, stale_pages = 0;
  for (auto s : batch) {
    const long pages = long(storage.logical_pages(s).value());
    for (int l = 0; l < kLayers; ++l)
      for (long i = 0; i < pages; ++i) {
        const int tier = storage.page(s, l, i).value().format;
        const bool expect_8bit = opt.policy.kept(l) || pages - 1 - i < opt.policy.recent_pages();
        wrong += tier != (expect_8bit ? 0 : 1);
        kept_pages += opt.policy.kept(l) ? 1 : 0;
        stale_pages += tier == 1 ? 1 : 0;
      }
  }
  const tierkv::memory_report report = cache->report();
  std::printf(
      "keep_layers policy (layers 1 and 2 in 8 bits, 2 recent pages): %llu conversions in 8 "
      "steps; %ld pages of the kept layers, %ld pages in TQ3, %ld pages in the wrong tier\n",
      static_cast<unsigned long long>(converted), kept_pages, stale_pages, wrong);
  std::cout << report << "\n";
  const bool ok = wrong == 0 && stale_pages > 0 && report.reconciles();
  if (!ok)
    std::printf("FAILED: pages outside the policy's tiers, or the report does not reconcile\n");
  return ok ? 0 : 1;
}
