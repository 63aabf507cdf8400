// SPDX-License-Identifier: Apache-2.0
// Mixed-format chunked prefill attention for one layer over a batch, on the tensor cores: the
// API and the launch. Each sequence's chunk of queries (causal inside the chunk) attends the
// sequence's cached pages in every format, the chunk itself included, read where they lie
// (prefill/tensor_core.cuh). Semantics of host_prefill (attention/host_prefill.hpp); design and
// measurements: docs/gpu-prefill.md.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/tier.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/prefill/inputs.cuh"
#include "tierkv/cuda/prefill/tensor_core.cuh"
#include "tierkv/cuda/prefill_plan.cuh"

namespace tierkv::cuda {

/// Zeroes a new workspace's error word (once; prefill_device_error re-zeroes it when read).
inline status prefill_workspace_init(const prefill_plan& plan, void* workspace,
                                     std::size_t workspace_bytes, cudaStream_t stream) {
  if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
    return status::exceeds(errc::capacity_exhausted, "prefill_workspace_init: plan.workspace_bytes",
                           plan.workspace_bytes, workspace_bytes);
  TIERKV_CUDA_TRY(cudaMemsetAsync(static_cast<std::uint8_t*>(workspace) + plan.error_offset, 0,
                                  sizeof(int), stream));
  return status::ok();
}

/// Enqueues one layer's prefill on `stream`. Host-side checks only (no synchronization, no
/// allocation); q_indptr, seq_len and the index are read on the device: a chunk longer than its
/// sequence or than plan.max_chunk_tokens, or a page slot beyond its pool, is reported through
/// prefill_device_error (that sequence's outputs are then unspecified). A query row holding a NaN
/// or an infinity gets NaN output and lse. Capturable in a CUDA graph.
template <class Geometry, class TierList>
status prefill(const prefill_plan& plan, const prefill_inputs<TierList::size>& in, void* workspace,
               std::size_t workspace_bytes, cudaStream_t stream) {
  if (in.index.batch < 0 || in.index.batch > plan.max_batch)
    return status::out_of_range("prefill: batch", in.index.batch, plan.max_batch + 1);
  if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
    return status::exceeds(errc::capacity_exhausted, "prefill: plan.workspace_bytes",
                           plan.workspace_bytes, workspace_bytes);
  if (in.index.batch == 0) return status::ok();
  if (in.queries == nullptr || in.out == nullptr || in.index.seq_len == nullptr ||
      in.q_indptr == nullptr)
    return status::make(errc::invalid_argument,
                        "prefill: queries, out, q_indptr and index.seq_len must be set");
  if (!(in.softmax_scale > 0.f) || !std::isfinite(in.softmax_scale))
    return status::make(errc::invalid_argument, "prefill: softmax_scale = ", in.softmax_scale,
                        " must be positive and finite");
  if (!(in.soft_cap >= 0.f) || !std::isfinite(in.soft_cap))
    return status::make(errc::invalid_argument, "prefill: soft_cap = ", in.soft_cap,
                        " must be finite and >= 0 (0 = off)");
  if (in.window < 0)
    return status::make(errc::invalid_argument, "prefill: window = ", in.window,
                        " must be >= 0 (0 = full attention)");
  if ((in.key_mean != nullptr || in.value_mean != nullptr) && in.soft_cap > 0.f)
    return status::make(errc::invalid_argument, "prefill: soft_cap = ", in.soft_cap,
                        " with centring means: centring is exact only without a soft-cap");
  if (status bad = detail::check_pools<Geometry>("prefill", in.index, in.pools,
                                                 static_cast<TierList*>(nullptr));
      !bad)
    return bad;
  if (plan.kv_splits < 1 || plan.kv_splits > prefill_max_splits || plan.row_blocks < 1)
    return status::make(errc::invalid_argument, "prefill: the plan is not one of plan_prefill");
  using K = detail::prefill_kernel<Geometry, TierList>;
  constexpr std::size_t smem = K::smem_bytes;
  auto* kernel = detail::prefill_kernel_entry<Geometry, TierList>;
  TIERKV_CUDA_TRY(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  std::uint8_t* ws = static_cast<std::uint8_t*>(workspace);
  const dim3 grid{unsigned(plan.row_blocks) * unsigned(plan.kv_splits),
                  unsigned(Geometry::kv_heads), unsigned(in.index.batch)};
  // the device code's block size, which its __launch_bounds__ report: 384 where it was built for
  // sm_90a at head_dim 256 (a producer warpgroup beside the two of rows), 256 otherwise
  cudaFuncAttributes attr{};
  TIERKV_CUDA_TRY(cudaFuncGetAttributes(&attr, kernel));
  kernel<<<grid, unsigned(attr.maxThreadsPerBlock), smem, stream>>>(in, plan, ws);
  TIERKV_CUDA_TRY(cudaGetLastError());
  if (plan.kv_splits > 1) {
    const std::size_t rows = std::size_t(plan.max_total_q) * Geometry::q_heads;
    const unsigned blocks = unsigned((rows + detail::prefill_warps - 1) / detail::prefill_warps);
    detail::prefill_merge_kernel<Geometry, TierList>
        <<<blocks, detail::prefill_threads, 0, stream>>>(in, plan, ws);
    TIERKV_CUDA_TRY(cudaGetLastError());
  }
  return status::ok();
}

/// The first device-side error of the prefills on this workspace since the last call (errc::ok
/// when none), then zeroes it. Synchronizes `stream`.
inline result<errc> prefill_device_error(const prefill_plan& plan, void* workspace,
                                         cudaStream_t stream) {
  int code = 0;
  int* word = reinterpret_cast<int*>(static_cast<std::uint8_t*>(workspace) + plan.error_offset);
  TIERKV_CUDA_TRY(cudaMemcpyAsync(&code, word, sizeof(int), cudaMemcpyDeviceToHost, stream));
  TIERKV_CUDA_TRY(cudaMemsetAsync(word, 0, sizeof(int), stream));
  TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));
  if (code != int(errc::ok) && code != int(errc::out_of_range))
    return status::make(errc::invalid_argument, "prefill_device_error: the workspace holds ", code,
                        ", no error code of a prefill: it was not prefill_workspace_init'ed");
  return static_cast<errc>(code);
}

}  // namespace tierkv::cuda
