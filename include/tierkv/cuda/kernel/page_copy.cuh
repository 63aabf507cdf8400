// SPDX-License-Identifier: Apache-2.0
// Many page-sized copies between device pools and pinned host memory as one operation: the host
// tier's offload (device to host) and restore (host to device), cuda/cache/host_tier.cuh. A
// 128K-token sequence of 16 layers is ~130K pages of 10-40 KB; one cudaMemcpyAsync each would
// cost ~2 us of host time per page, longer than the bytes take over PCIe. Two ways, chosen by
// the caller and measured against each other (bench/cuda/host_tier.cu):
//   - kernel: the SMs read one side through the unified address space (pinned host memory is
//     device-addressable) and write the other, 16-byte accesses where the ends and sizes allow;
//   - copy_engines: cudaMemcpyBatchAsync (CUDA 12.8+), the copy engines, no SM time.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/core/status.hpp"
#include "tierkv/cuda/check.cuh"

namespace tierkv::cuda {

/// One copy of a batch: `bytes` from src to dst (device or pinned host pointers).
struct page_copy {
  const std::uint8_t* src = nullptr;  ///< where the bytes are
  std::uint8_t* dst = nullptr;        ///< where they go
  std::uint64_t bytes = 0;            ///< how many
};

/// How a batch of page copies runs.
enum class copy_path : std::uint8_t {
  kernel = 0,        ///< an SM kernel over the unified address space
  copy_engines = 1,  ///< cudaMemcpyBatchAsync on the copy engines
};

namespace detail {

// Block i takes copies i, i + gridDim.x, ...; a copy whose ends and size are 16-byte aligned
// moves in uint4s, four in flight per thread (PCIe reads need many bytes in flight), else bytes.
// A template so that every unit including this header may define it.
template <int Block>
__global__ void __launch_bounds__(Block) copy_pages_kernel(const page_copy* list, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const page_copy c = list[i];
    const bool wide = ((reinterpret_cast<std::uintptr_t>(c.src) |
                        reinterpret_cast<std::uintptr_t>(c.dst) | c.bytes) &
                       15u) == 0;
    if (wide) {
      const uint4* s = reinterpret_cast<const uint4*>(c.src);
      uint4* d = reinterpret_cast<uint4*>(c.dst);
      const std::uint64_t words = c.bytes / 16;
      std::uint64_t k = threadIdx.x;
      for (; k + 3 * Block < words; k += 4 * Block) {
        const uint4 a = s[k], b = s[k + Block], e = s[k + 2 * Block], f = s[k + 3 * Block];
        d[k] = a;
        d[k + Block] = b;
        d[k + 2 * Block] = e;
        d[k + 3 * Block] = f;
      }
      for (; k < words; k += Block) d[k] = s[k];
    } else {
      for (std::uint64_t k = threadIdx.x; k < c.bytes; k += Block) c.dst[k] = c.src[k];
    }
  }
}

}  // namespace detail

/// Enqueues the copies of `list` on `stream`. With copy_path::kernel the list itself must be
/// device-readable until the kernel has run (pinned host or device memory; the host tier keeps
/// it in pinned memory); with copy_engines the runtime reads it before returning. The copies
/// must not overlap one another. `blocks` bounds the kernel's grid (the SMs it takes from
/// whatever runs beside it); 0 = four per SM of the stream's device.
inline status copy_pages(std::span<const page_copy> list, copy_path path, cudaStream_t stream,
                         int blocks = 0) {
  if (list.empty()) return status::ok();
  if (path == copy_path::copy_engines) {
#if CUDART_VERSION >= 12080
    // The batch API takes parallel arrays; one attribute set for every copy: the sources are
    // read in stream order (they may be written by work enqueued before this call).
    constexpr std::size_t chunk = 4096;
    std::vector<void*> dsts(chunk);
    std::vector<const void*> srcs(chunk);
    std::vector<std::size_t> sizes(chunk);
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attr_index = 0;
    for (std::size_t at = 0; at < list.size(); at += chunk) {
      const std::size_t n = list.size() - at < chunk ? list.size() - at : chunk;
      for (std::size_t i = 0; i < n; ++i) {
        dsts[i] = list[at + i].dst;
        srcs[i] = list[at + i].src;
        sizes[i] = std::size_t(list[at + i].bytes);
      }
      TIERKV_CUDA_TRY(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr,
                                           &attr_index, 1, stream));
    }
    return status::ok();
#else
    return status(
        errc::invalid_argument,
        "copy_pages: copy_path::copy_engines needs CUDA 12.8 or later (cudaMemcpyBatchAsync)");
#endif
  }
  constexpr int block = 256;
  if (blocks <= 0) {
    int device = 0, sms = 0;
    TIERKV_CUDA_TRY(cudaGetDevice(&device));
    TIERKV_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    blocks = 4 * sms;
  }
  const std::uint64_t grid =
      list.size() < std::uint64_t(blocks) ? list.size() : std::uint64_t(blocks);
  detail::copy_pages_kernel<block><<<unsigned(grid), block, 0, stream>>>(list.data(), list.size());
  return check_launch("copy_pages_kernel");
}

}  // namespace tierkv::cuda
