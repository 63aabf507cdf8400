// SPDX-License-Identifier: Apache-2.0
// Mixed-format paged decode attention for one layer over a batch: the API and the launch.
// A step is split over (sequence, KV head, chunk of pages) and merged by log-sum-exp in a
// second kernel (decode/common.cuh). Two split kernels behind one plan / workspace / merge:
// the tensor-core kernel (decode/tensor_core.cuh, the default) and the CUDA-core kernel
// (decode/cuda_core.cuh, the reference GPU path). Each reads a format through its device codec
// (cuda/codec/). Design, instruction counts and measurements: docs/gpu.md.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/arch/pdl.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/decode/cuda_core.cuh"
#include "tierkv/cuda/decode/inputs.cuh"
#include "tierkv/cuda/decode/tensor_core.cuh"
#include "tierkv/cuda/decode_plan.cuh"

namespace tierkv::cuda {

/// Which split kernel runs a decode step (same result up to rounding, same plan/workspace).
/// tensor_core: scores and values on mma.sync (f16 operands, FP8 queries split hi + lo; int8
/// operands for TQ3, TQ4 and int8_rotated keys, queries as int8 digits; f16 probabilities;
/// docs/gpu.md); cuda_core: fp32 FMA per scalar (the reference GPU path).
enum class decode_path : std::uint8_t { tensor_core = 0, cuda_core = 1 };

/// Zeroes a new workspace's error words, once per workspace and plan (a step leaves them
/// zeroed for the next: no memset per step, which cost ~0.8 us of a B = 1 step, H200 A/B in
/// docs/gpu.md).
inline status decode_workspace_init(const decode_plan& plan, void* workspace,
                                    std::size_t workspace_bytes, cudaStream_t stream) {
  if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
    return status::exceeds(errc::capacity_exhausted, "decode_workspace_init: plan.workspace_bytes",
                           plan.workspace_bytes, workspace_bytes);
  TIERKV_CUDA_TRY(cudaMemsetAsync(static_cast<std::uint8_t*>(workspace) + plan.error_offset, 0,
                                  plan.result_offset + sizeof(int) - plan.error_offset, stream));
  return status::ok();
}

/// Enqueues one decode step on `stream`: the split kernel, the merge, and (with page_mass)
/// the per-page mass. Host-side checks only (no synchronization, no allocation): the
/// workspace (plan.workspace_bytes, device memory, decode_workspace_init'ed once for this
/// plan) must not be used by another stream meanwhile. Capturable in a CUDA graph; replaying
/// it reads the index arrays, lengths and queries present at replay time (within the plan's
/// capacity).
template <class Geometry, class TierList, decode_path Path = decode_path::tensor_core>
status decode(const decode_plan& plan, const decode_inputs<TierList::size>& in, void* workspace,
              std::size_t workspace_bytes, cudaStream_t stream) {
  if (in.index.batch < 0 || in.index.batch > plan.max_batch)
    return status::out_of_range("decode: batch", in.index.batch, plan.max_batch + 1);
  if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
    return status::exceeds(errc::capacity_exhausted, "decode: plan.workspace_bytes",
                           plan.workspace_bytes, workspace_bytes);
  if (in.queries == nullptr || in.out == nullptr || in.index.seq_len == nullptr)
    return status::make(errc::invalid_argument,
                        "decode: queries, out and index.seq_len must be set");
  if (!(in.softmax_scale > 0.f) || !std::isfinite(in.softmax_scale))
    return status::make(errc::invalid_argument, "decode: softmax_scale = ", in.softmax_scale,
                        " must be positive and finite");
  if (!(in.soft_cap >= 0.f) || !std::isfinite(in.soft_cap))
    return status::make(errc::invalid_argument, "decode: soft_cap = ", in.soft_cap,
                        " must be finite and >= 0 (0 = off)");
  if (in.window < 0)
    return status::make(errc::invalid_argument, "decode: window = ", in.window,
                        " must be >= 0 (0 = full attention)");
  if ((in.key_mean != nullptr || in.value_mean != nullptr) && in.soft_cap > 0.f)
    return status::make(errc::invalid_argument, "decode: soft_cap = ", in.soft_cap,
                        " with centring means: centring is exact only without a soft-cap");
  if (in.page_mass != nullptr &&
      (!plan.page_mass || in.lse == nullptr || in.page_mass_stride < plan.max_pages))
    return status::make(errc::invalid_argument,
                        "decode: page_mass needs a plan with page_mass, an lse output and "
                        "page_mass_stride (",
                        in.page_mass_stride, ") >= plan.max_pages (", plan.max_pages, ")");
  status bad =
      detail::check_pools<Geometry>("decode", in.index, in.pools, static_cast<TierList*>(nullptr));
  if (!bad) return bad;
  if (in.index.batch == 0) return status::ok();

  std::uint8_t* ws = static_cast<std::uint8_t*>(workspace);
  // KV heads fastest: the blocks dispatched to one SM lie kv_heads x 132 apart in launch order,
  // so by-format chunks (a sequence's FP8 chunks, then its TQ3 ones) mix on an SM rather than
  // chunks 4 apart of one head's run, which were mostly of one format.
  const dim3 grid_split(unsigned(Geometry::kv_heads), unsigned(plan.max_chunks),
                        unsigned(in.index.batch));
  if constexpr (Path == decode_path::tensor_core) {
    using S = detail::mma_smem_size<Geometry, TierList>;
    // a soft-cap or a window takes the kernel built with them; the plain one has none of their
    // registers (spills at the launch bounds cost 3-9% on (24, 4, 256) rows otherwise)
    auto* kernel = in.soft_cap > 0.f || in.window > 0
                       ? detail::decode_mma_split_kernel<Geometry, TierList, true>
                       : detail::decode_mma_split_kernel<Geometry, TierList, false>;
    TIERKV_CUDA_TRY(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::bytes)));
    kernel<<<grid_split, detail::decode_threads, S::bytes, stream>>>(in, plan, ws);
  } else {
    using S = detail::decode_shape<Geometry>;
    TIERKV_CUDA_TRY(cudaFuncSetAttribute(detail::decode_split_kernel<Geometry, TierList>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(S::smem_bytes)));
    detail::decode_split_kernel<Geometry, TierList>
        <<<grid_split, detail::decode_threads, S::smem_bytes, stream>>>(in, plan, ws);
  }
  TIERKV_CUDA_TRY(cudaGetLastError());
  using MK = detail::decode_finish<Geometry, TierList>;
  const dim3 grid_merge(unsigned(Geometry::q_heads), unsigned(in.index.batch),
                        unsigned((Geometry::head_dim + MK::merge_slice - 1) / MK::merge_slice));
  TIERKV_CUDA_TRY(detail::launch_dependent(detail::decode_merge_kernel<Geometry, TierList>,
                                           grid_merge, dim3(detail::decode_threads), stream, in,
                                           plan, ws));
  if (in.page_mass != nullptr) {
    const dim3 grid_mass(
        unsigned((plan.max_pages + detail::decode_threads - 1) / detail::decode_threads),
        unsigned(in.index.batch));
    detail::decode_page_mass_kernel<Geometry, TierList>
        <<<grid_mass, detail::decode_threads, 0, stream>>>(in, plan, ws);
    TIERKV_CUDA_TRY(cudaGetLastError());
  }
  return status::ok();
}

/// The first device-side error of the last decode on this workspace (errc::ok when none):
/// a page slot beyond its pool or a logical page beyond plan.max_pages. Synchronizes `stream`.
inline result<errc> decode_device_error(const decode_plan& plan, const void* workspace,
                                        cudaStream_t stream) {
  int code = 0;
  TIERKV_CUDA_TRY(cudaMemcpyAsync(&code,
                                  static_cast<const std::uint8_t*>(workspace) + plan.result_offset,
                                  sizeof(int), cudaMemcpyDeviceToHost, stream));
  TIERKV_CUDA_TRY(cudaStreamSynchronize(stream));
  if (code != int(errc::ok) && code != int(errc::out_of_range))  // the only code the kernels report
    return status::make(
        errc::invalid_argument, "decode_device_error: the workspace holds ", code,
        ", no error code of a decode step: it was not decode_workspace_init'ed for this plan");
  return static_cast<errc>(code);
}

}  // namespace tierkv::cuda
