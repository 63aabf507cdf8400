// SPDX-License-Identifier: Apache-2.0
// What a cuda::tiered_cache's decode and prefill read of the page table: the device mirror
// (page_table_mirror.cuh) with one row per live sequence, kept in step with the storage on the
// host (a sequence's new pages, a block the mirror has not seen at its generation, a published
// conversion), and built per step into every layer's index arrays for the batch, with the
// decode plan over them.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/decode_plan.cuh"
#include "tierkv/cuda/page_table_mirror.cuh"

namespace tierkv::cuda::detail {

template <class Storage, class Geometry, class Tiers>
class step_index {
  static constexpr int num_tiers = Tiers::size;

 public:
  using mirror_type = page_table_mirror<num_tiers>;

  // The mirror for `storage`'s sequences and blocks, rows of up to `cap.max_pages_per_seq`
  // pages, batches of up to `cap.max_batch`.
  status create(const Storage& storage, const decode_capacity& cap, int layers) {
    auto m = mirror_type::create(int(storage.max_sequences()), cap.max_pages_per_seq,
                                 int(storage.block_capacity()), layers, cap.max_batch);
    if (!m) return m.error_status();
    mirror_ = std::move(*m);
    cap_ = cap;
    layers_ = layers;
    pages_per_tier_ = storage.config().pages_per_tier;
    known_gen_.assign(storage.block_capacity(), 0);
    free_rows_.resize(storage.max_sequences());
    for (std::uint32_t r = 0; r < storage.max_sequences(); ++r)
      free_rows_[r] = std::int32_t(storage.max_sequences() - 1 - r);
    return {};
  }

  mirror_type& mirror() const noexcept { return *mirror_; }

  // ---- the mirror's rows ----
  void open_row(seq_id s) {
    const std::int32_t r = free_rows_.back();
    free_rows_.pop_back();
    row_of_[s.value] = r;
  }
  void close_row(seq_id s) {
    auto it = row_of_.find(s.value);
    free_rows_.push_back(it->second);
    row_of_.erase(it);
  }
  std::int32_t row_of(seq_id s) const { return row_of_.at(s.value); }

  // Mirrors s's committed logical pages from `from` on (their blocks and, for blocks the
  // mirror has not seen at this generation, every layer's page).
  void sync_rows(const Storage& storage, seq_id s, std::int64_t from) {
    const std::int32_t row = row_of(s);
    const std::int64_t pages = *storage.logical_pages(s);
    for (std::int64_t p = from; p < pages; ++p) {
      const block_ref b = *storage.block_of(s, p);
      mirror_->set_row(row, int(p), std::int32_t(b.index));
      if (known_gen_[b.index] == b.generation + 1) continue;
      known_gen_[b.index] = b.generation + 1;
      for (int l = 0; l < layers_; ++l) mirror_page(storage, b, l);
    }
  }
  // Mirrors layer's page of block b where the storage has it now.
  void mirror_page(const Storage& storage, block_ref b, int layer) {
    const page_id pg = storage.block_page(b, layer);
    mirror_->set_page(b.index, layer, pg.format, pg.slot);
  }

  // ---- the step ----
  // The batch's rows, page counts and lengths, and its pages per tier as the plan estimates
  // them (build's inputs).
  void prepare(std::span<const seq_id> batch, const Storage& storage) {
    rows_.resize(batch.size());
    pages_.resize(batch.size());
    lens_.resize(batch.size());
    per_format_.assign(batch.size() * std::size_t(num_tiers), 0);
    const auto share = tier_shares(storage);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t len = *storage.length(batch[b]);
      const std::int64_t pages = *storage.logical_pages(batch[b]);
      rows_[b] = row_of(batch[b]);
      pages_[b] = std::int32_t(pages);
      lens_[b] = std::int32_t(len);
      for (int f = 0; f < num_tiers; ++f)
        per_format_[b * num_tiers + std::size_t(f)] = std::int32_t(std::lround(pages * share[f]));
    }
  }
  // Every layer's index arrays for the prepared batch (the mirror's journal first), on
  // `stream`, and the decode plan over them.
  result<decode_plan> build(int sm_count, cudaStream_t stream, std::uint64_t& h2d_bytes) {
    if (auto st = mirror_->build(rows_, pages_, lens_, stream); !st) return st;
    h2d_bytes += mirror_->last_upload_bytes();
    return plan_decode<Geometry, Tiers>(cap_, per_format_.data(), int(rows_.size()), sm_count);
  }

 private:
  // Share of each tier among used pages: the plan's estimate of a sequence's pages per tier
  // (it only balances chunks; the kernels read the real formats).
  std::array<double, num_tiers> tier_shares(const Storage& storage) const {
    std::array<double, num_tiers> used{};
    double total = 0;
    for (int f = 0; f < num_tiers; ++f) {
      used[std::size_t(f)] = double(pages_per_tier_[std::size_t(f)] - storage.free_pages(f));
      total += used[std::size_t(f)];
    }
    if (total == 0) return {1.0};  // an empty cache: every page would be new, in tier 0
    for (auto& u : used) u /= total;
    return used;
  }

  std::unique_ptr<mirror_type> mirror_;
  decode_capacity cap_{};
  int layers_ = 0;
  std::array<std::uint32_t, num_tiers> pages_per_tier_{};
  std::vector<std::uint32_t> known_gen_;  // per block: generation + 1 the mirror holds (0: none)
  std::unordered_map<std::uint32_t, std::int32_t> row_of_;  // seq_id value -> mirror row
  std::vector<std::int32_t> free_rows_;
  std::vector<std::int32_t> rows_, pages_, lens_;  // the step's batch: row, pages, tokens
  std::vector<std::int32_t> per_format_;           // [batch][tier]: the plan's page estimate
};

}  // namespace tierkv::cuda::detail
