// SPDX-License-Identifier: Apache-2.0
// Reusable state of the host attention paths: the thread pool and per-worker scratch,
// grown on demand and kept, so steady-state decode steps allocate nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tierkv/attention/thread_pool.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// One host_decode / host_prefill call at a time per workspace (the call itself runs in
/// parallel on the pool); give each concurrent caller its own workspace.
class host_attention_workspace {
 public:
  /// `threads` workers, the caller included; 0 = hardware concurrency.
  explicit host_attention_workspace(unsigned threads = 0) : pool_(threads) {
    scratch_.resize(pool_.size());
  }

  /// The workers.
  thread_pool& pool() { return pool_; }
  /// Workers, the caller included.
  unsigned threads() const { return pool_.size(); }

  /// Makes every worker's scratch at least `bytes` (64-byte aligned); call before a
  /// parallel_for, never inside one.
  void reserve_per_worker(std::size_t bytes) {
    const std::size_t lines = (bytes + 63) / 64;
    for (auto& s : scratch_)
      if (s.size() < lines) s.resize(lines);
  }
  /// Worker `worker`'s scratch (reserve_per_worker bytes, 64-byte aligned).
  std::byte* worker_scratch(unsigned worker) {
    return reinterpret_cast<std::byte*>(scratch_[worker].data());
  }

  /// Shared buffers of the calling pass (validation bitmaps, per-head page masses).
  std::vector<std::uint8_t>& bitmap() { return bitmap_; }
  /// Shared float buffer of the calling pass.
  std::vector<float>& shared_floats() { return shared_; }
  /// Shared int buffer of the calling pass.
  std::vector<int>& shared_ints() { return ints_; }

  /// Bytes held by the workspace (for accounting reports).
  std::size_t bytes() const {
    std::size_t n =
        bitmap_.capacity() + shared_.capacity() * sizeof(float) + ints_.capacity() * sizeof(int);
    for (const auto& s : scratch_) n += s.capacity() * sizeof(line);
    return n;
  }

 private:
  struct alignas(64) line {
    std::byte b[64];
  };
  thread_pool pool_;
  std::vector<std::vector<line>> scratch_;
  std::vector<std::uint8_t> bitmap_;
  std::vector<float> shared_;
  std::vector<int> ints_;
};

}  // namespace tierkv
