// SPDX-License-Identifier: Apache-2.0
// A cuda::tiered_cache's centring means on the device (options::center): per layer the
// per-KV-head channel means of keys and values, [layer][keys, values][kv_heads][head_dim]
// floats, and whether each layer's are known yet (set by set_centering or estimated from the
// first tokens appended). Zeros until then: a decode captured before that reads them.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/append/append.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/device_buffer.cuh"

namespace tierkv::cuda::detail {

template <class Geometry>
class device_centering_means {
 public:
  // Floats of one layer's key (or value) means.
  static constexpr std::size_t floats = std::size_t(Geometry::kv_heads) * Geometry::head_dim;

  // Zeroed on `stream`, every layer unknown.
  status allocate(int layers, cudaStream_t stream) {
    const std::size_t n = 2 * std::size_t(layers) * floats;
    if (auto st = dev_.allocate(n); !st) return st;
    TIERKV_CUDA_TRY(cudaMemsetAsync(dev_.get(), 0, n * sizeof(float), stream));
    known_.assign(std::size_t(layers), 0);
    return {};
  }

  float* keys(int layer) const { return dev_.get() + 2 * std::size_t(layer) * floats; }
  float* values(int layer) const { return keys(layer) + floats; }
  bool known(int layer) const { return known_[std::size_t(layer)] != 0; }
  void mark_known(int layer) { known_[std::size_t(layer)] = 1; }

  // Appends the layer's first tokens (`in`: their inputs, its means named) after estimating
  // the means from them, on `stream`; refused while `stream` captures a graph, whose replays
  // would estimate again. The means are known once the append was enqueued.
  template <class AppendTier>
  status estimate_and_append(const append_inputs& in, int layer, cudaStream_t stream) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TIERKV_CUDA_TRY(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone)
      return status::make(errc::invalid_argument, "append: layer ", layer,
                          "'s centring means are not known yet and a graph capture would "
                          "estimate them at every replay; append once outside the capture "
                          "or call set_centering first");
    if (auto st = estimate_means<Geometry>(in, keys(layer), values(layer), stream); !st) return st;
    auto st = cuda::append<Geometry, AppendTier>(in, stream);
    if (st) mark_known(layer);  // else the next append estimates again
    return st;
  }

  // Copies layer's means from the host once no kernel on `stream` reads the old ones; returns
  // the bytes copied.
  result<std::size_t> set(int layer, std::span<const float> mu_k, std::span<const float> mu_v,
                          cudaStream_t stream) {
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));  // no kernel reads the old means any more
    TIERKV_CUDA_TRY(
        cudaMemcpy(keys(layer), mu_k.data(), floats * sizeof(float), cudaMemcpyHostToDevice));
    TIERKV_CUDA_TRY(
        cudaMemcpy(values(layer), mu_v.data(), floats * sizeof(float), cudaMemcpyHostToDevice));
    mark_known(layer);
    return 2 * floats * sizeof(float);
  }

 private:
  device_buffer<float> dev_;
  std::vector<std::uint8_t> known_;  // per layer: set or estimated
};

}  // namespace tierkv::cuda::detail
