// SPDX-License-Identifier: Apache-2.0
// gpu_cache over one compile-time cuda::tiered_cache<geometry, tiers>: every call is the
// façade's own, its status turned into an exception; options come from the run-time config
// through the host binding's common_options (cache_options.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "cache_options.hpp"
#include "formats.hpp"
#include "gpu_cache.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/cuda/tiered_cache.cuh"

namespace tierkv_py {

template <class Geometry, class TierSet>
class gpu_cache_impl final : public gpu_cache {
 public:
  using tier_list = typename TierSet::type;
  using cache_type =
      tierkv::cuda::tiered_cache<Geometry, tier_list, tierkv::registered_policy,
                                 tierkv::cuda::decode_path::tensor_core, typename TierSet::roles>;
  static constexpr int N = tier_list::size;

  static std::unique_ptr<gpu_cache> make(const gpu_cache_config& cfg, cudaStream_t stream) {
    return std::unique_ptr<gpu_cache>(new gpu_cache_impl(cfg, stream));
  }

  const gpu_cache_config& config() const override { return cfg_; }
  int num_tiers() const override { return N; }

  std::int64_t create_sequence() override { return value(c_->create_sequence()).value; }
  std::int64_t fork(std::int64_t parent) override { return value(c_->fork(to_seq(parent))).value; }
  void release(std::int64_t s) override { check(c_->release(to_seq(s))); }
  std::int64_t length(std::int64_t s) const override { return value(c_->length(to_seq(s))); }
  std::int64_t prefix_insert(std::int64_t s, std::uint64_t salt,
                             std::span<const std::int32_t> tokens) override {
    return std::int64_t(value(c_->insert_prefix(to_seq(s), salt, tokens)));
  }
  std::array<std::int64_t, 2> prefix_start(std::uint64_t salt,
                                           std::span<const std::int32_t> tokens) override {
    return started_sequence(c_->start_from_prefix(salt, tokens));
  }
  std::int64_t prefix_evict(std::int64_t n) override {
    return std::int64_t(value(c_->evict_prefixes(evict_count(n))));
  }
  void drain() override { check(c_->drain()); }
  std::vector<std::uint8_t> export_pages(std::int64_t s, std::int64_t first, std::int64_t count,
                                         int head_begin, int head_count) override {
    refuse_centred_transfer(cfg_, "export_pages", "nothing exported");
    return value(
        c_->export_pages(to_seq(s), first, count, tierkv::head_slice{head_begin, head_count}));
  }
  std::int64_t import_pages(std::span<const std::uint8_t> buf) override {
    refuse_centred_transfer(cfg_, "import_pages", "nothing imported");
    return value(c_->import_pages(buf)).value;
  }

  void set_stream(cudaStream_t s) override { check(c_->set_stream(s)); }
  void begin_step(std::span<const std::int64_t> seqs,
                  std::span<const std::int32_t> counts) override {
    std::vector<tierkv::seq_id> batch;
    batch.reserve(seqs.size());
    for (std::int64_t s : seqs) batch.push_back(to_seq(s));
    check(c_->begin_step(batch, counts));
  }
  void append(int layer, const void* k, const void* v, gpu_dtype type,
              cudaStream_t stream) override {
    check(c_->append(layer, k, v, tierkv::cuda::input_type(type), stream));
  }
  void decode(int layer, const void* q, gpu_dtype qtype, void* out, gpu_dtype otype, float* lse,
              float soft_cap, int window, cudaStream_t stream) override {
    check(c_->decode(layer, q, tierkv::cuda::query_type(qtype), out,
                     tierkv::cuda::output_type(otype), lse, soft_cap, window, stream));
  }
  void prefill(int layer, const void* q, gpu_dtype qtype, void* out, gpu_dtype otype, float* lse,
               float soft_cap, int window, cudaStream_t stream) override {
    check(c_->prefill(layer, q, tierkv::cuda::query_type(qtype), out,
                      tierkv::cuda::output_type(otype), lse, soft_cap, window, stream));
  }
  tierkv::retier_stats end_step(std::uint64_t step, bool wait) override {
    return value(c_->end_step(step, wait));
  }

  tierkv::memory_report report() const override { return c_->report(); }
  void pin(std::int64_t seq, std::int64_t first_page, std::int64_t pages, bool pinned) override {
    check(c_->pin(to_seq(seq), first_page, pages, pinned));
  }
  std::vector<std::int64_t> page_tiers(std::int64_t seq, int layer) const override {
    if (layer < 0 || layer >= cfg_.num_layers)
      fail(tierkv::status::out_of_range("layer", layer, cfg_.num_layers));
    const tierkv::seq_id s = to_seq(seq);
    const std::int64_t pages = value(c_->storage().logical_pages(s));
    std::vector<std::int64_t> t(static_cast<std::size_t>(pages));
    for (std::int64_t p = 0; p < pages; ++p) {
      t[std::size_t(p)] = value(c_->storage().page(s, layer, p)).format;
    }
    return t;
  }
  void check_invariants() const override { check(c_->check_invariants()); }
  void device_error() override { check(c_->device_error()); }
  std::uint64_t offload(std::int64_t s) override { return value(c_->offload(to_seq(s))); }
  std::int64_t restore(std::uint64_t parked) override { return value(c_->restore(parked)).value; }
  void drop_parked(std::uint64_t parked) override { check(c_->drop_parked(parked)); }
  bool restore_pending(std::int64_t s) override { return c_->restore_pending(to_seq(s)); }
  std::array<std::uint64_t, 9> host_stats() override {
    const tierkv::cuda::host_tier_stats h = c_->host_stats();
    return {h.capacity_bytes, h.used_bytes, h.largest_free_bytes, h.parked,        h.offloads,
            h.restores,       h.drops,      h.bytes_offloaded,    h.bytes_restored};
  }
  std::array<std::uint64_t, 3> transfers() const override {
    const auto& t = c_->transfers();
    return {t.h2d_metadata_bytes, t.d2h_metadata_bytes, t.page_bytes};
  }
  std::array<std::uint64_t, 9> host_times() const override {
    const auto& t = c_->times();
    return {t.steps,        t.begin_step_ns, t.make_room_ns, t.index_ns, t.end_step_ns,
            t.mass_wait_ns, t.mass_fold_ns,  t.plan_ns,      t.retier_ns};
  }
  std::array<std::uint64_t, 8> retier_totals() const override {
    const tierkv::retier_stats s = c_->retier_totals();
    return {s.planned,          s.converted, s.promoted,      s.demoted,
            s.pressure_demoted, s.deferred,  s.deferred_full, s.failed};
  }

 private:
  gpu_cache_impl(const gpu_cache_config& cfg, cudaStream_t stream) : cfg_(cfg) {
    typename cache_type::options o;
    std::tie(o.storage, o.policy) = common_options<N>(cfg);
    o.max_batch = cfg.max_batch;
    o.max_pages = cfg.max_pages;
    o.max_step_tokens = cfg.max_step_tokens;
    o.max_retier_pages = cfg.max_retier_pages;
    o.max_chunks_per_seq = cfg.max_chunks_per_seq;
    o.mass_layers_per_step = cfg.mass_layers_per_step;
    o.softmax_scale = float(cfg.softmax_scale);
    o.center = cfg.center;
    o.tiering.bits_per_scalar_target = cfg.bits_per_scalar;
    o.host_pool_bytes = cfg.host_pool_bytes;
    c_ = value(cache_type::create(o, stream));  // checks every other option, naming it
  }

  gpu_cache_config cfg_;
  std::unique_ptr<cache_type> c_;
};

template <class TierSet, int HeadDim, int KvHeads, int Group, int Page>
void register_gpu_one() {
  using G = tierkv::geometry<tierkv::head_dim<HeadDim>, tierkv::kv_heads<KvHeads>,
                             tierkv::group_size<Group>, tierkv::page_tokens<Page>>;
  register_gpu_combo(combo{tier_set_index<TierSet>, HeadDim, KvHeads, Group, Page},
                     &gpu_cache_impl<G, TierSet>::make);
}

}  // namespace tierkv_py
