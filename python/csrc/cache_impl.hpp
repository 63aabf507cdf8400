// SPDX-License-Identifier: Apache-2.0
// runtime_cache over one compile-time tierkv::tiered_cache<geometry, tiers>. Sequences,
// reservations, commits, tiering and accounting are the façade's own calls; attention runs
// host_decode / host_prefill over the library's index of each sequence's committed pages and
// its outstanding reservation's (index_scope::readable), so a layer-by-layer forward pass
// attends to its own new tokens before they are committed. Unlike tiered_cache::prefill, a
// prefill here feeds no page mass to the policy (as the GPU façade's prefill: decode steps do).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "cache_options.hpp"
#include "formats.hpp"
#include "runtime.hpp"
#include "tierkv/attention/host_decode.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/attention/host_workspace.hpp"
#include "tierkv/cache.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/paging/prefix_index.hpp"
#include "tierkv/report.hpp"

namespace tierkv_py {

template <class Geometry, class TierSet>
class cache_impl final : public runtime_cache {
 public:
  using tier_list = typename TierSet::type;
  using cache_type =
      tierkv::tiered_cache<Geometry, tier_list, tierkv::registered_policy, tierkv::host_allocator,
                           tierkv::host_allocator, typename TierSet::roles>;
  using storage_type = typename cache_type::storage_type;
  static constexpr int N = tier_list::size;
  static constexpr int D = Geometry::head_dim;
  static constexpr int KVH = Geometry::kv_heads;
  static constexpr int QH = Geometry::q_heads;
  static constexpr int P = Geometry::page_tokens;

  static std::unique_ptr<runtime_cache> make(const cache_config& cfg) {
    return std::unique_ptr<runtime_cache>(new cache_impl(cfg));
  }

  const cache_config& config() const override { return cfg_; }
  int num_tiers() const override { return N; }

  std::int64_t create_sequence() override { return value(cache_->create_sequence()).value; }
  std::int64_t fork(std::int64_t parent) override {
    return value(cache_->fork(to_seq(parent))).value;
  }
  void release(std::int64_t s) override { check(cache_->release(to_seq(s))); }
  std::int64_t length(std::int64_t s) const override { return value(cache_->length(to_seq(s))); }
  std::int64_t reserved(std::int64_t s) const override {
    return value(cache_->reserved(to_seq(s)));
  }

  void reserve(std::span<const std::int64_t> seqs, std::span<const std::int64_t> counts) override {
    if (seqs.size() != counts.size())
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "reserve: ", seqs.size(),
                                " sequences but ", counts.size(), " token counts"));
    check_distinct(seqs, "reserve");
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const tierkv::seq_id s = to_seq(seqs[b]);
      const std::int64_t n = counts[b];
      tierkv::status st;
      if (n < 0 || n > std::numeric_limits<std::int32_t>::max())
        st = tierkv::status::make(tierkv::errc::invalid_argument, "reserve: token count ", n,
                                  " for batch entry ", b, " is outside [0, 2^31)");
      if (st) st = cache_->reserve(s, n);
      if (!st) {  // all or none: give back what this call reserved
        for (std::size_t j = 0; j < b; ++j) (void)cache_->cancel(to_seq(seqs[j]));
        fail(tierkv::status(st.code(), tierkv::status::format(st.message(), " (batch entry ", b,
                                                              ", ", s, "); nothing reserved")));
      }
    }
  }

  void write_layer(std::span<const std::int64_t> seqs, int layer, const float* keys,
                   const float* values, std::int64_t tokens) override {
    check_layer(layer);
    std::int64_t total = 0;
    for (std::int64_t s : seqs) total += value(cache_->reserved(to_seq(s)));
    if (total != tokens)
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "write: the batch's ", seqs.size(),
                                " sequences have ", total, " reserved tokens, keys/values hold ",
                                tokens));
    const std::size_t per_token = std::size_t(KVH) * D;
    // Every row is checked before any is written, so a refusal writes nothing.
    for (const float* x : {keys, values}) {
      const std::size_t n = std::size_t(tokens) * per_token;
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i]))
          fail(tierkv::status::make(tierkv::errc::non_finite_input,
                                    "write: ", x == keys ? "keys" : "values", "[", i, "] = ", x[i],
                                    " (token ", i / per_token, ", kv head ", i / D % KVH,
                                    ") is not finite; nothing written"));
    }
    // Centring: a layer's first write estimates its means from the whole batch, as the GPU
    // cache's first append does (the paths then hold the same codes; record
    // bench/results/tests/gpu-tests-2026-12-06-logits.txt found them apart by 0.10 in logits).
    const std::size_t all = std::size_t(tokens) * per_token;
    (void)cache_->estimate_centering(layer, {keys, all}, {values, all});
    std::size_t at = 0;
    for (std::int64_t s : seqs) {
      const std::int64_t n = value(cache_->reserved(to_seq(s)));
      if (n == 0) continue;
      const std::size_t len = std::size_t(n) * per_token;
      check(cache_->write_layer(to_seq(s), layer, {keys + at, len}, {values + at, len}));
      at += len;
    }
  }

  void commit(std::span<const std::int64_t> seqs) override {
    check_distinct(seqs, "commit");
    for (std::int64_t s : seqs) (void)to_seq(s), (void)value(cache_->reserved(to_seq(s)));
    for (std::int64_t s : seqs) {
      const std::int64_t n = value(cache_->reserved(to_seq(s)));
      check(cache_->commit(to_seq(s), n));
    }
  }
  void cancel(std::span<const std::int64_t> seqs) override {
    for (std::int64_t s : seqs) (void)value(cache_->reserved(to_seq(s)));
    for (std::int64_t s : seqs) check(cache_->cancel(to_seq(s)));
  }

  void append(std::int64_t s, std::int64_t n, const float* keys, const float* values) override {
    if (n < 0)
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "append: token count ", n,
                                " is negative"));
    const std::size_t len = std::size_t(cfg_.num_layers) * std::size_t(n) * KVH * D;
    check(cache_->append(to_seq(s), n, {keys, len}, {values, len}));
  }

  void decode(int layer, std::span<const std::int64_t> seqs, const float* queries, float* out,
              float* lse, int window) override {
    const auto view = build_index(layer, seqs);
    tierkv::host_decode_args<N> a;
    a.queries = queries;
    a.index = view;
    a.pools = pools_.data();
    a.source = source(layer);
    a.logits = logits();
    a.out = out;
    a.lse = lse;
    a.page_mass = mass_.data();
    a.mass_stride = cfg_.max_pages;
    a.window = window;
    check(tierkv::host_decode<Geometry, tier_list>(workspace_, a));
    for (std::size_t b = 0; b < seqs.size(); ++b)
      restore_centering(layer, seqs[b], 1, queries + b * QH * D, out + b * QH * D,
                        lse ? lse + b * QH : nullptr);
    observe_masses(layer, seqs);
  }

  void prefill(int layer, std::span<const std::int64_t> seqs,
               std::span<const std::int32_t> q_indptr, const float* queries, float* out, float* lse,
               int window) override {
    if (q_indptr.size() != seqs.size() + 1)
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "prefill: q_indptr holds ",
                                q_indptr.size(), " entries, ", seqs.size() + 1,
                                " needed (batch + 1)"));
    const auto view = build_index(layer, seqs);
    tierkv::host_prefill_args<N> a;
    a.queries = queries;
    a.q_indptr = q_indptr.data();
    a.index = view;
    a.pools = pools_.data();
    a.source = source(layer);
    a.logits = logits();
    a.out = out;
    a.lse = lse;
    a.window = window;
    check(tierkv::host_prefill<Geometry, tier_list>(workspace_, a));
    // The page masses a chunk gives the policy, as tiered_cache::prefill: each sequence's last
    // query row again as a decode step. Without them a run made of prefill chunks (a perplexity
    // pass) never makes an Anchor by attention on this path, though the engine's does (issue 57).
    // (A sequence with no row this call gets a zero query and observes nothing.)
    const std::size_t row = std::size_t(QH) * D;
    std::vector<float>& q_last = last_rows_;  // kept: a prefill per layer and step
    q_last.assign(seqs.size() * row, 0.f);
    std::vector<float>& o_last = last_out_;
    o_last.resize(q_last.size());
    for (std::size_t b = 0; b < seqs.size(); ++b)
      if (q_indptr[b + 1] > q_indptr[b])
        std::copy_n(queries + std::size_t(q_indptr[b + 1] - 1) * row, row, q_last.data() + b * row);
    tierkv::host_decode_args<N> d;
    d.queries = q_last.data();
    d.index = view;
    d.pools = pools_.data();
    d.source = source(layer);
    d.logits = logits();
    d.out = o_last.data();
    d.page_mass = mass_.data();
    d.mass_stride = cfg_.max_pages;
    d.window = window;
    check(tierkv::host_decode<Geometry, tier_list>(workspace_, d));
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const std::size_t r = std::size_t(q_indptr[b]);
      restore_centering(layer, seqs[b], q_indptr[b + 1] - q_indptr[b], queries + r * QH * D,
                        out + r * QH * D, lse ? lse + r * QH : nullptr);
    }
    observe_masses(layer, seqs, q_indptr);
  }

  tierkv::retier_stats retier(std::uint64_t step) override { return cache_->retier(step); }
  tierkv::memory_report report() const override { return cache_->report(); }
  void pin(std::int64_t s, std::int64_t first, std::int64_t pages, bool pinned) override {
    check(cache_->pin(to_seq(s), first, pages, pinned));
  }
  void read_layer(std::int64_t s, int layer, std::int64_t first, std::int64_t n, float* keys,
                  float* values) const override {
    const std::size_t len = std::size_t(std::max<std::int64_t>(n, 0)) * KVH * D;
    check(cache_->storage().read_layer(to_seq(s), layer, first, n, {keys, len}, {values, len}));
    // A centred cache's pages hold x - mu: give back x, the vectors attention sees
    const auto* means = cache_->centering();
    if (means == nullptr || !means->known(layer) || n <= 0) return;
    means->add(layer, false, n, keys);
    means->add(layer, true, n, values);
  }
  std::vector<std::int64_t> page_tiers(std::int64_t s, int layer) const override {
    (void)value(cache_->length(to_seq(s)));
    check_layer(layer);
    std::vector<std::int64_t> t;
    cache_->storage().for_each_page(
        to_seq(s), layer, [&](std::int64_t, tierkv::page_id p) { t.push_back(p.format); });
    return t;
  }

  std::int64_t prefix_insert(std::int64_t s, std::uint64_t salt,
                             std::span<const std::int32_t> tokens) override {
    return std::int64_t(value(prefixes_->insert(to_seq(s), salt, tokens)));
  }
  std::array<std::int64_t, 2> prefix_start(std::uint64_t salt,
                                           std::span<const std::int32_t> tokens) override {
    return started_sequence(prefixes_->start_sequence(salt, tokens));
  }
  std::int64_t prefix_evict(std::int64_t n) override {
    return std::int64_t(prefixes_->evict(evict_count(n)));
  }
  std::int64_t prefix_entries() const override { return std::int64_t(prefixes_->size()); }

  // Page transfer through the storage's public hooks (tierkv::export_pages_into / import_pages,
  // as the host façade's own create_sequence, reserve and commit are the storage's): the import
  // is a new sequence the controller meets at its next observation, like any other.
  std::int64_t export_size(std::int64_t s, std::int64_t first, std::int64_t count, int head_begin,
                           int head_count) const override {
    refuse_centred_transfer(cfg_, "export_pages", "nothing exported");
    const tierkv::seq_id id = to_seq(s);
    // Pages opened by an outstanding reservation hold tokens that are not committed yet.
    if (const std::int64_t r = value(cache_->reserved(id)); r > 0)
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "export_pages: ", id, " has ", r,
                                " reserved tokens not committed; commit or cancel them first; "
                                "nothing exported"));
    return std::int64_t(value(tierkv::export_size(cache_->storage(), id, first, count,
                                                  tierkv::head_slice{head_begin, head_count})));
  }
  void export_pages(std::int64_t s, std::int64_t first, std::int64_t count, int head_begin,
                    int head_count, std::span<std::uint8_t> out) const override {
    check(tierkv::export_pages_into(cache_->storage(), to_seq(s), out, first, count,
                                    tierkv::head_slice{head_begin, head_count}));
  }
  std::int64_t import_pages(std::span<const std::uint8_t> buf) override {
    refuse_centred_transfer(cfg_, "import_pages", "nothing imported");
    return value(tierkv::import_pages(cache_->storage(), buf)).value;
  }

 private:
  explicit cache_impl(const cache_config& cfg)
      : cfg_(cfg), workspace_(checked_threads(cfg.threads)) {
    typename cache_type::options o;
    std::tie(o.storage, o.policy) = common_options<N>(cfg);
    o.max_batch = cfg.max_batch;
    o.max_pages = cfg.max_pages;
    o.threads = 1;  // the façade's own attention workers are unused: attention runs here
    o.softmax_scale = float(cfg.softmax_scale);
    o.soft_cap = float(cfg.soft_cap);
    o.center = cfg.center;
    o.tiering.bits_per_scalar_target = cfg.bits_per_scalar;
    cache_ = value(cache_type::create(o));  // checks every other option, naming it
    index_.emplace(value(tierkv::index_arrays<storage_type>::create(cache_->storage(),
                                                                    cfg.max_batch, cfg.max_pages)));
    mass_.assign(std::size_t(cfg.max_batch) * std::size_t(cfg.max_pages), 0.f);
    pools_ = cache_->storage().views();
    prefixes_ = std::make_unique<tierkv::prefix_index<storage_type>>(cache_->storage());
  }

  // The attention workers, checked before the pool starts them.
  static unsigned checked_threads(int threads) {
    if (threads < 0 || threads > int(cache_type::max_threads))
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "threads = ", threads,
                                " must lie in [0, ", cache_type::max_threads, "] (0 = all cores)"));
    return unsigned(threads);
  }

  void check_layer(int layer) const {
    if (layer < 0 || layer >= cfg_.num_layers)
      fail(tierkv::status::out_of_range("layer", layer, cfg_.num_layers));
  }
  static void check_distinct(std::span<const std::int64_t> seqs, const char* op) {
    std::vector<std::int64_t> s(seqs.begin(), seqs.end());
    std::sort(s.begin(), s.end());
    if (auto it = std::adjacent_find(s.begin(), s.end()); it != s.end())
      fail(tierkv::status::make(tierkv::errc::invalid_argument, op, ": sequence ", *it,
                                " appears twice in the batch"));
  }
  // Centring (center = true): what the façade's write took from keys and values goes back into
  // `rows` query rows of sequence s (outputs + mu_v, lse + scale q.mu_k), as tiered_cache::attend
  // does; a sequence with no token, or a layer never written, keeps the kernels' result.
  void restore_centering(int layer, std::int64_t s, std::int64_t rows, const float* q, float* out,
                         float* lse) const {
    const auto* means = cache_->centering();
    if (means == nullptr || !means->known(layer)) return;
    const tierkv::seq_id id = to_seq(s);
    if (value(cache_->length(id)) + value(cache_->reserved(id)) == 0) return;
    for (std::int64_t r = 0; r < rows; ++r)
      means->restore(layer, Geometry::group_size, logits().softmax_scale, q + r * QH * D,
                     out + r * QH * D, lse ? lse + r * QH : nullptr);
  }
  // Every readable page's mass (mass_, rows of a decode just run) feeds the policy, the
  // reservation's too (as tiered_cache::prefill and the GPU façade, whose step pages are
  // committed at begin_step): a step's own page can become an Anchor by the mass its last query
  // gave it.
  // With q_indptr (a prefill), only the sequences that had query rows.
  void observe_masses(int layer, std::span<const std::int64_t> seqs,
                      std::span<const std::int32_t> q_indptr = {}) {
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      if (!q_indptr.empty() && q_indptr[b + 1] == q_indptr[b]) continue;
      const std::span<const float> row(mass_.data() + b * std::size_t(cfg_.max_pages),
                                       std::size_t(cfg_.max_pages));
      check(cache_->controller().observe_mass(to_seq(seqs[b]), layer, row,
                                              tierkv::index_scope::readable));
    }
  }
  tierkv::layer_source source(int layer) const {
    return tierkv::layer_source{cfg_.codec_seed, layer, 0};
  }
  tierkv::logit_params logits() const {
    return tierkv::logit_params{
        cfg_.softmax_scale > 0 ? float(cfg_.softmax_scale) : 1.f / std::sqrt(float(D)),
        float(cfg_.soft_cap)};
  }

  // The layer's index over each sequence's committed pages and its outstanding reservation's
  // (index_scope::readable), in the library's index buffer (the report counts it).
  tierkv::batch_index_view<N> build_index(int layer, std::span<const std::int64_t> seqs) {
    check_layer(layer);
    ids_.clear();
    for (std::int64_t s : seqs) ids_.push_back(to_seq(s));
    return value(index_->build(layer, ids_, tierkv::index_scope::readable));
  }

  cache_config cfg_;
  std::unique_ptr<cache_type> cache_;
  std::unique_ptr<tierkv::prefix_index<storage_type>> prefixes_;  // destroyed before cache_
  std::optional<tierkv::index_arrays<storage_type>> index_;
  std::vector<float> mass_;
  std::vector<float> last_rows_, last_out_;  // prefill's last query rows and their outputs
  std::array<tierkv::pool_view, N> pools_{};
  std::vector<tierkv::seq_id> ids_;  // build_index's batch
  tierkv::host_attention_workspace workspace_;
};

// Registers cache_impl for every (kv_heads, group size) of the two lists at one tier set,
// head_dim and page size (one instantiation unit each, so the set compiles in parallel).
template <class TierSet, int HeadDim, int PageSize, int... KV, int... G>
void register_product(std::integer_sequence<int, KV...>, std::integer_sequence<int, G...>) {
  auto one_kv = [](auto kv) {
    constexpr int K = decltype(kv)::value;
    (register_combo(
         combo{tier_set_index<TierSet>, HeadDim, K, G, PageSize},
         &cache_impl<tierkv::geometry<tierkv::head_dim<HeadDim>, tierkv::kv_heads<K>,
                                      tierkv::group_size<G>, tierkv::page_tokens<PageSize>>,
                     TierSet>::make),
     ...);
  };
  (one_kv(std::integral_constant<int, KV>{}), ...);
}

template <class TierSet, int HeadDim, int KV, int G, int PageSize>
void register_one() {
  register_combo(combo{tier_set_index<TierSet>, HeadDim, KV, G, PageSize},
                 &cache_impl<tierkv::geometry<tierkv::head_dim<HeadDim>, tierkv::kv_heads<KV>,
                                              tierkv::group_size<G>, tierkv::page_tokens<PageSize>>,
                             TierSet>::make);
}

}  // namespace tierkv_py
