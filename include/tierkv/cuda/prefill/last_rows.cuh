// SPDX-License-Identifier: Apache-2.0
// The last query row of each sequence's prefill chunk, gathered as a decode step's queries: the
// façade decodes them to sample the page mass a prefill step gives the policy, as the host
// cache's prefill does (tiered_cache::prefill's last-row pass; docs/tiering.md "Attention mass").
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/kernel/io_types.cuh"

namespace tierkv::cuda {

namespace detail {

// Block b writes row b of out: the row q_indptr[b + 1] - 1 of queries as floats, or NaN for a
// sequence with no new token this step (its page mass then reads NaN: not fed). A template (Q:
// float or __nv_bfloat16), so that every unit including this header may define it.
template <class Q>
__global__ void gather_last_rows_kernel(const Q* queries, const std::int32_t* q_indptr,
                                        int row_floats, float* out) {
  const int b = int(blockIdx.x);
  const std::int32_t first = q_indptr[b], end = q_indptr[b + 1];
  float* dst = out + std::size_t(b) * std::size_t(row_floats);
  if (end == first) {
    for (int i = int(threadIdx.x); i < row_floats; i += int(blockDim.x))
      dst[i] = __int_as_float(0x7fc00000);  // quiet NaN
    return;
  }
  const Q* src = queries + std::size_t(end - 1) * std::size_t(row_floats);
  for (int i = int(threadIdx.x); i < row_floats; i += int(blockDim.x)) {
    if constexpr (std::is_same_v<Q, float>)
      dst[i] = src[i];
    else
      dst[i] = __bfloat162float(src[i]);
  }
}

}  // namespace detail

/// Enqueues the gather of `batch` sequences' last chunk rows (q_indptr [batch + 1], device) of
/// `queries` ([step tokens][row_floats], qtype) into out ([batch][row_floats] floats).
inline status gather_last_rows(const void* queries, query_type qtype, const std::int32_t* q_indptr,
                               int batch, int row_floats, float* out, cudaStream_t stream) {
  if (queries == nullptr || q_indptr == nullptr || out == nullptr)
    return status(errc::invalid_argument, "gather_last_rows: a null pointer");
  if (batch <= 0 || row_floats <= 0) return status::ok();
  if (qtype == query_type::bf16)
    detail::gather_last_rows_kernel<<<unsigned(batch), 128, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(queries), q_indptr, row_floats, out);
  else
    detail::gather_last_rows_kernel<<<unsigned(batch), 128, 0, stream>>>(
        static_cast<const float*>(queries), q_indptr, row_floats, out);
  TIERKV_CUDA_TRY(cudaGetLastError());
  return status::ok();
}

}  // namespace tierkv::cuda
