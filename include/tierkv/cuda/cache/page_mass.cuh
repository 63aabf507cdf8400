// SPDX-License-Identifier: Apache-2.0
// The page mass a cuda::tiered_cache feeds its tier policy: decode (and prefill's mass pass)
// writes every sampled layer's attention mass per logical page on the device; a step samples
// mass_layers_per_step layers in turn; end_step queues their copy to page-locked memory (with
// the appends' error record) and feeds the previous step's copy to the policy, so the host
// never waits for the step it just enqueued. Two copies alternate.
//
// Device: every layer's masses [layer][max_batch][max_pages]. Host, per copy: the sampled
// layers' [slot][max_batch][max_pages], then the appends' error record.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/cache/append_errors.cuh"
#include "tierkv/cuda/cache/options.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/device_buffer.cuh"

namespace tierkv::cuda::detail {

class page_mass_sampler {
 public:
  // A step's sampled page masses on their way to the host.
  struct sampled_copy {
    std::vector<seq_id> batch;  // the step's batch
    std::vector<int> layers;    // per host slot: the layer sampled
    // the step's appends: its error record (pinned, after the masses), new tokens and first
    // positions per sequence
    std::int32_t* append_error = nullptr;
    std::vector<std::int32_t> new_tokens;
    std::vector<std::int64_t> first_pos;
    pinned_buffer<float> host;
    cuda_event ready;
    bool pending = false;  // queued, not fed yet
  };

  status allocate(int layers, int mass_layers_per_step, int max_batch, int max_pages) {
    layers_ = layers;
    max_batch_ = max_batch;
    max_pages_ = max_pages;
    sampled_ = mass_layers_per_step == 0 ? layers : std::min(mass_layers_per_step, layers);
    if (auto st = dev_.allocate(offset(layers)); !st) return st;
    for (sampled_copy& m : copies_) {
      const std::size_t floats = offset(sampled_);
      if (auto st = m.host.allocate(floats + append_error_ints); !st) return st;
      m.append_error = reinterpret_cast<std::int32_t*>(m.host.get() + floats);
      if (auto st = m.ready.create(); !st) return st;
    }
    layer_of_slot_.assign(std::size_t(sampled_), -1);
    return {};
  }

  // Layer `layer`'s masses on the device: [max_batch][max_pages] (the row stride).
  float* layer_mass(int layer) const { return dev_.get() + offset(layer); }
  // The layers sampled this step.
  std::span<const int> sampled_layers() const { return layer_of_slot_; }

  // The layers whose masses end_step feeds this step: sampled_ of them, in turn.
  void choose_layers() {
    for (int j = 0; j < sampled_; ++j)
      layer_of_slot_[std::size_t(j)] =
          int((std::uint64_t(steps_) * std::uint64_t(sampled_) + std::uint64_t(j)) %
              std::uint64_t(layers_));
    ++steps_;
  }
  // The sampled layers' masses start as NaN (all-ones bytes): a row that is still NaN at
  // end_step was not decoded this step (no decode or prefill of the layer, a graph not
  // replayed, a sequence with no new token) or came from a non-finite query, and is not fed.
  // The device says what ran, so a replayed graph that the host never saw call decode feeds
  // the policy too.
  status clear(std::size_t batch, cudaStream_t stream) {
    for (int l : layer_of_slot_)
      TIERKV_CUDA_TRY(cudaMemsetAsync(layer_mass(l), 0xff, batch_bytes(batch), stream));
    return {};
  }

  // The copy this step's masses go to; previous() is then the last step's.
  sampled_copy& take_turn() {
    sampled_copy& now = copies_[std::size_t(turn_)];
    turn_ ^= 1;
    return now;
  }
  sampled_copy& previous() { return copies_[std::size_t(turn_)]; }

  // This step's sampled masses and the appends' error record to page-locked memory, with the
  // batch and layers they belong to.
  status queue(sampled_copy& m, std::span<const seq_id> batch,
               std::span<const std::int32_t> new_tokens, std::span<const std::int64_t> first_pos,
               const std::int32_t* append_error, cudaStream_t stream, std::uint64_t& d2h_bytes) {
    m.pending = false;
    if (batch.empty()) return {};
    const std::size_t bytes = batch_bytes(batch.size());
    for (int j = 0; j < sampled_; ++j)
      TIERKV_CUDA_TRY(cudaMemcpyAsync(m.host.get() + offset(j),
                                      layer_mass(layer_of_slot_[std::size_t(j)]), bytes,
                                      cudaMemcpyDeviceToHost, stream));
    TIERKV_CUDA_TRY(cudaMemcpyAsync(m.append_error, append_error,
                                    append_error_ints * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, stream));
    TIERKV_CUDA_TRY(cudaEventRecord(m.ready.get(), stream));
    d2h_bytes += std::uint64_t(sampled_) * bytes + append_error_ints * sizeof(std::int32_t);
    m.batch.assign(batch.begin(), batch.end());
    m.layers = layer_of_slot_;
    m.new_tokens.assign(new_tokens.begin(), new_tokens.end());
    m.first_pos.assign(first_pos.begin(), first_pos.end());
    m.pending = true;
    return {};
  }

  // Feeds a queued copy: its append error record to on_append_error(copy) when set, then
  // every row to fold(seq, layer, row) (a status). A sequence released since is skipped; one
  // that grew is given a row of its present page count, whose new pages read NaN (no signal).
  template <class Storage, class OnAppendError, class Fold>
  status feed(sampled_copy& m, const Storage& storage, host_times& times,
              OnAppendError&& on_append_error, Fold&& fold) {
    if (!m.pending) return {};
    m.pending = false;
    {
      const scoped_time wait_timed{times.mass_wait_ns};
      TIERKV_CUDA_TRY(cudaEventSynchronize(m.ready.get()));
    }
    const scoped_time fold_timed{times.mass_fold_ns};
    if (m.append_error[0] != 0) on_append_error(m);
    for (std::size_t j = 0; j < m.layers.size(); ++j) {
      const int l = m.layers[j];
      for (std::size_t b = 0; b < m.batch.size(); ++b) {
        const auto pages = storage.logical_pages(m.batch[b]);
        if (!pages) continue;
        const std::span<const float> row(
            m.host.get() + offset(int(j)) + b * std::size_t(max_pages_), std::size_t(*pages));
        if (row.empty() || std::isnan(row[0])) continue;
        if (auto st = fold(m.batch[b], l, row); !st) return st;
      }
    }
    return {};
  }

 private:
  // Layer (device) or host slot j's first float.
  std::size_t offset(int j) const {
    return std::size_t(j) * std::size_t(max_batch_) * std::size_t(max_pages_);
  }
  // One sampled layer's masses of a batch: [batch][max_pages] floats.
  std::size_t batch_bytes(std::size_t batch) const {
    return batch * std::size_t(max_pages_) * sizeof(float);
  }

  int layers_ = 0, max_batch_ = 0, max_pages_ = 0;
  int sampled_ = 0;                 // layers sampled a step
  std::vector<int> layer_of_slot_;  // per host slot: the layer sampled this step
  std::uint64_t steps_ = 0;
  device_buffer<float> dev_;
  std::array<sampled_copy, 2> copies_;
  int turn_ = 0;
};

}  // namespace tierkv::cuda::detail
