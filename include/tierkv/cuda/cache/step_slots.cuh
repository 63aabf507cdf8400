// SPDX-License-Identifier: Apache-2.0
// The per-step buffer a cuda::tiered_cache's launches read instead of arguments, so that a
// forward pass captured in a CUDA graph replays at every later step: the slot mapping of the
// step's tokens (paged_storage::reserve's), the query offsets of prefill, the layers' page-mass
// flags and the appends' error record. Filled on the host (page-locked), uploaded on the stream
// by begin_step; one device buffer of the layout
//   [layers][max_step_tokens] slots, [max_step_tokens] offsets, [max_batch + 1] query offsets,
//   [layers] page-mass flags, [append_error_ints] the appends' error record.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/cache/append_errors.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/device_buffer.cuh"
#include "tierkv/paging/storage_types.hpp"

namespace tierkv::cuda::detail {

class step_slots {
 public:
  status allocate(int layers, int max_step_tokens, int max_batch) {
    layers_ = std::size_t(layers);
    tokens_ = std::size_t(max_step_tokens);
    batch_ = std::size_t(max_batch);
    const std::size_t ints = append_error_offset() + append_error_ints;
    if (auto st = dev_.allocate(ints); !st) return st;
    return host_.allocate(ints);
  }
  status create_event() { return uploaded_.create(); }

  // ---- what the launches read (device) ----
  std::int32_t* slots(int layer) const { return dev_.get() + std::size_t(layer) * tokens_; }
  std::int32_t* offsets() const { return dev_.get() + layers_ * tokens_; }
  std::int32_t* query_offsets() const { return dev_.get() + qo_offset(); }
  std::int32_t* mass_flag(int layer) const {
    return dev_.get() + mass_on_offset() + std::size_t(layer);
  }
  std::int32_t* append_error() const { return dev_.get() + append_error_offset(); }
  // Whether begin_step flagged `layer` as one of the step's sampled layers (the host copy).
  bool mass_flag_set(int layer) const {
    return host_.get()[mass_on_offset() + std::size_t(layer)] != 0;
  }

  // ---- begin_step's uploads ----
  // The last step's uploads must be done before the host copy is rewritten.
  status wait_uploaded() const {
    return check(cudaEventSynchronize(uploaded_.get()), "step_slots: cudaEventSynchronize");
  }
  // The host rows paged_storage::reserve fills for k tokens from the step's token `at`.
  slot_mapping mapping(std::int64_t at, std::int64_t k) const {
    slot_mapping m;
    m.slot = std::span<std::int32_t>(host_.get() + at, (layers_ - 1) * tokens_ + std::size_t(k));
    m.layer_stride = std::int64_t(tokens_);
    m.offset =
        std::span<std::int32_t>(host_.get() + layers_ * tokens_ + std::size_t(at), std::size_t(k));
    return m;
  }
  // begin_step's reservations: n[b] tokens of batch[b] reserved in `storage` (`room`: its
  // room_hook) into the host rows, all or none (a refusal cancels those made), then committed;
  // committed(s, p) mirrors s's pages from logical page p on (its open page, if any, grows).
  template <class Storage, class Room, class Committed>
  status reserve(Storage& storage, std::span<const seq_id> batch, std::span<const std::int32_t> n,
                 const Room& room, Committed&& committed) {
    std::int64_t at = 0;
    std::size_t done = 0;
    status st;
    for (; done < batch.size(); ++done) {
      const std::int64_t k = n[done];
      if (k == 0) continue;
      slot_mapping m = mapping(at, k);
      if (st = storage.reserve(batch[done], k, m, room); !st) break;
      at += k;
    }
    if (!st) {
      for (std::size_t b = 0; b < done; ++b) (void)storage.cancel(batch[b]);
      return st;
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (n[b] == 0) continue;
      const std::int64_t before = *storage.logical_pages(batch[b]);
      (void)storage.commit(batch[b], n[b]);
      committed(batch[b], before > 0 ? before - 1 : 0);
    }
    return {};
  }
  // The first `total` slots of every layer and their offsets.
  status upload_mapping(std::int64_t total, cudaStream_t stream, std::uint64_t& h2d_bytes) {
    if (total == 0) return {};
    for (std::size_t l = 0; l <= layers_; ++l)  // the offsets are row `layers`
      TIERKV_CUDA_TRY(cudaMemcpyAsync(dev_.get() + l * tokens_, host_.get() + l * tokens_,
                                      std::size_t(total) * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, stream));
    h2d_bytes += std::uint64_t(layers_ + 1) * std::uint64_t(total) * 4;
    return {};
  }
  // begin_step's uploads after the mapping's: the appends' error record cleared and the query
  // offsets; then upload_flags.
  status upload_offsets(std::span<const std::int32_t> new_tokens, cudaStream_t stream,
                        std::uint64_t& h2d_bytes) {
    if (auto st = clear_append_error(stream); !st) return st;
    return upload_query_offsets(new_tokens, stream, h2d_bytes);
  }
  // The sampled layers' page-mass flags, then the event wait_uploaded waits for.
  status upload_flags(std::span<const int> sampled, cudaStream_t stream, std::uint64_t& h2d_bytes) {
    if (auto st = upload_mass_flags(sampled, stream, h2d_bytes); !st) return st;
    TIERKV_CUDA_TRY(cudaEventRecord(uploaded_.get(), stream));  // the whole buffer's copies
    return {};
  }

 private:
  // The appends' error record, cleared for this step's tokens (append_error_where).
  status clear_append_error(cudaStream_t stream) {
    TIERKV_CUDA_TRY(
        cudaMemsetAsync(append_error(), 0, append_error_ints * sizeof(std::int32_t), stream));
    return {};
  }
  // The step's query offsets (prefill's q_indptr): sequence b's chunk is its new tokens.
  status upload_query_offsets(std::span<const std::int32_t> new_tokens, cudaStream_t stream,
                              std::uint64_t& h2d_bytes) {
    std::int32_t* qo = host_.get() + qo_offset();
    qo[0] = 0;
    for (std::size_t b = 0; b < new_tokens.size(); ++b) qo[b + 1] = qo[b] + new_tokens[b];
    TIERKV_CUDA_TRY(cudaMemcpyAsync(query_offsets(), qo,
                                    (new_tokens.size() + 1) * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream));
    h2d_bytes += (new_tokens.size() + 1) * sizeof(std::int32_t);
    return {};
  }
  // The layers whose decode computes the page mass this step: a flag each, read by the kernels.
  status upload_mass_flags(std::span<const int> sampled, cudaStream_t stream,
                           std::uint64_t& h2d_bytes) {
    std::int32_t* on = host_.get() + mass_on_offset();
    std::fill(on, on + layers_, 0);
    for (int l : sampled) on[l] = 1;
    TIERKV_CUDA_TRY(cudaMemcpyAsync(mass_flag(0), on, layers_ * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream));
    h2d_bytes += layers_ * sizeof(std::int32_t);
    return {};
  }

  std::size_t qo_offset() const { return (layers_ + 1) * tokens_; }
  std::size_t mass_on_offset() const { return qo_offset() + batch_ + 1; }
  std::size_t append_error_offset() const { return mass_on_offset() + layers_; }

  std::size_t layers_ = 0, tokens_ = 0, batch_ = 0;
  device_buffer<std::int32_t> dev_;
  pinned_buffer<std::int32_t> host_;
  cuda_event uploaded_;
};

}  // namespace tierkv::cuda::detail
