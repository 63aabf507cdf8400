// SPDX-License-Identifier: Apache-2.0
// Device builder of the format-partitioned index arrays (batch_index_view) for one
// layer, from a device-resident page table (page_table_arrays, see
// paging/index_builder.hpp), and the FlashInfer/vLLM-style table adapter on the device.
//
// Fixed shapes for CUDA graph capture: every launch covers the capacity
// (max_batch x max_pages entries), the real counts are read on the device, and the
// CUB scan's temporary storage is sized ahead by scratch_bytes(), so one plan serves
// every step with any mix of formats.
//
// Per format f: flag[e] = (format[e] == f) over the capacity (+1 slot for the end),
// exclusive scan -> rank[e]; since entries are ordered by sequence then logical page,
// rank[e] is the entry's position in f's CSR, indptr_f[b] = rank[indptr[b]], and the
// logical page of e is e - indptr[b] (b found by binary search).
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include <cub/device/device_scan.cuh>

#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/index_builder.hpp"

namespace tierkv::cuda {

namespace detail {

// Device-side error word: 0 = ok, else an errc value (first error wins).
__device__ inline void raise(int* error, errc code) { atomicCAS(error, 0, int(code)); }

// b such that indptr[b] <= e < indptr[b + 1] (indptr non-decreasing, e < indptr[batch]).
__device__ inline int owner_of(const std::int32_t* indptr, int batch, std::int32_t e) {
  int lo = 0;
  int hi = batch;  // invariant: indptr[lo] <= e < indptr[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (indptr[mid] <= e)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

template <int = 0>  // a template, so a header included by many translation units links once
__global__ void flag_format(page_table_arrays in, int f, int num_formats, int capacity,
                            std::int32_t* flags, int* error) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e > capacity) return;
  const int total = in.batch > 0 ? in.indptr[in.batch] : 0;
  int flag = 0;
  if (e < total) {
    const int fmt = in.format[e];
    if (fmt < 0 || fmt >= num_formats) raise(error, errc::out_of_range);
    if (in.slot[e] < 0) raise(error, errc::out_of_range);
    flag = fmt == f;
  }
  flags[e] = flag;
}

template <int = 0>  // a template, so a header included by many translation units links once
__global__ void scatter_format(page_table_arrays in, int f, const std::int32_t* rank,
                               std::int32_t* slot_out, std::int32_t* logical_out, int capacity) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  const int total = in.batch > 0 ? in.indptr[in.batch] : 0;
  if (e >= total || e >= capacity || in.format[e] != f) return;
  const int b = owner_of(in.indptr, in.batch, e);
  slot_out[rank[e]] = in.slot[e];
  logical_out[rank[e]] = e - in.indptr[b];
}

template <int = 0>  // a template, so a header included by many translation units links once
__global__ void indptr_and_lengths(page_table_arrays in, const std::int32_t* rank,
                                   std::int32_t* indptr_out, std::int32_t* seq_len_out,
                                   int max_pages, bool write_len, int* error) {
  const int b = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (b > in.batch) return;
  indptr_out[b] = rank[in.indptr[b]];
  if (write_len && b < in.batch) {
    seq_len_out[b] = in.seq_len[b];
    const int pages = in.indptr[b + 1] - in.indptr[b];
    if (pages < 0 || pages > max_pages) raise(error, errc::capacity_exhausted);
  }
}

// indptr of format f lives at out + indptr0 + f * format_stride (index_layout).
template <int = 0>  // a template, so a header included by many translation units links once
__global__ void from_paged_kv(paged_kv_table t, int format, int num_formats, std::int32_t* seq_len,
                              std::uint8_t* out, std::size_t indptr0, std::size_t format_stride,
                              std::int32_t* slot, std::int32_t* logical, int capacity) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  const int total = t.batch > 0 ? t.indptr[t.batch] : 0;
  if (e < total && e < capacity) {
    const int b = owner_of(t.indptr, t.batch, e);
    slot[e] = t.indices[e];
    logical[e] = e - t.indptr[b];
  }
  if (e <= t.batch) {
    for (int f = 0; f < num_formats; ++f) {
      auto* indptr =
          reinterpret_cast<std::int32_t*>(out + indptr0 + std::size_t(f) * format_stride);
      indptr[e] = (f == format) ? t.indptr[e] : 0;
    }
    if (e < t.batch) {
      const int n = t.indptr[e + 1] - t.indptr[e];
      seq_len[e] = n == 0 ? 0 : (n - 1) * t.page_tokens + t.last_page_len[e];
    }
  }
}

inline status cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return status::make(errc::cuda_error, what, ": ", cudaGetErrorString(e));
}

}  // namespace detail

/// Builds a layer's batch_index_view on the device from a device page table (see above);
/// fixed shapes (the capacity of `layout`), so one builder serves every captured step.
template <int NumFormats>
class device_index_builder {
 public:
  static constexpr int threads = 256;  ///< threads per block of its kernels

  /// A builder for the capacity and byte layout `layout`.
  explicit device_index_builder(index_layout<NumFormats> layout) : layout_(layout) {}
  /// The capacity and byte layout of the index it builds.
  const index_layout<NumFormats>& layout() const noexcept { return layout_; }

  /// Scratch (flags, ranks, the CUB temporary storage, an error word): query once, allocate once.
  result<std::size_t> scratch_bytes() const {
    if (auto st = layout_.validate(); !st) return st;
    std::size_t cub_bytes = 0;
    const int n = scan_items();
    if (auto st = detail::cuda_check(
            cub::DeviceScan::ExclusiveSum(nullptr, cub_bytes, static_cast<std::int32_t*>(nullptr),
                                          static_cast<std::int32_t*>(nullptr), n),
            "cub::DeviceScan::ExclusiveSum (size query)");
        !st)
      return st;
    return 2 * ints(std::size_t(n)) + align(cub_bytes) + 16;
  }

  /// Builds into out (index_layout bytes, device memory) from a device page table of
  /// `in.batch` sequences. Asynchronous on stream; error() reads the device check.
  result<batch_index_view<NumFormats>> build(const page_table_arrays& in, void* out, void* scratch,
                                             std::size_t scratch_size, cudaStream_t stream) const {
    auto need = scratch_bytes();
    if (!need) return need.error_status();
    if (scratch_size < *need)
      return status::make(errc::capacity_exhausted, "device index builder scratch holds ",
                          scratch_size, " bytes, needs ", *need, " (scratch_bytes())");
    if (in.batch < 0 || in.batch > layout_.max_batch)
      return status::exceeds(errc::capacity_exhausted, "batch", in.batch, layout_.max_batch);
    const int n = scan_items();
    auto* base = static_cast<std::uint8_t*>(scratch);
    auto* flags = reinterpret_cast<std::int32_t*>(base);
    auto* rank = reinterpret_cast<std::int32_t*>(base + ints(std::size_t(n)));
    void* cub_temp = base + 2 * ints(std::size_t(n));
    std::size_t cub_bytes = *need - 2 * ints(std::size_t(n)) - 16;
    int* error = reinterpret_cast<int*>(base + *need - 16);
    auto* o = static_cast<std::uint8_t*>(out);
    if (auto st =
            detail::cuda_check(cudaMemsetAsync(error, 0, sizeof(int), stream), "cudaMemsetAsync");
        !st)
      return st;
    for (int f = 0; f < NumFormats; ++f) {
      detail::flag_format<>
          <<<blocks(n), threads, 0, stream>>>(in, f, NumFormats, n - 1, flags, error);
      if (auto st = detail::cuda_check(
              cub::DeviceScan::ExclusiveSum(cub_temp, cub_bytes, flags, rank, n, stream),
              "cub::DeviceScan::ExclusiveSum");
          !st)
        return st;
      detail::scatter_format<><<<blocks(n), threads, 0, stream>>>(
          in, f, rank, reinterpret_cast<std::int32_t*>(o + layout_.slot_offset(f)),
          reinterpret_cast<std::int32_t*>(o + layout_.logical_offset(f)), n - 1);
      detail::indptr_and_lengths<><<<blocks(in.batch + 1), threads, 0, stream>>>(
          in, rank, reinterpret_cast<std::int32_t*>(o + layout_.indptr_offset(f)),
          reinterpret_cast<std::int32_t*>(o + layout_.seq_len_offset()), layout_.max_pages, f == 0,
          error);
    }
    if (auto st = detail::cuda_check(cudaGetLastError(), "index builder launch"); !st) return st;
    return layout_.view_of(out, in.batch);
  }

  /// Reads the device check of the last build on stream (synchronizes the stream).
  status error(const void* scratch, cudaStream_t stream) const {
    auto need = scratch_bytes();
    if (!need) return need.error_status();
    int code = 0;
    const auto* word = static_cast<const std::uint8_t*>(scratch) + *need - 16;
    if (auto st = detail::cuda_check(
            cudaMemcpyAsync(&code, word, sizeof(int), cudaMemcpyDeviceToHost, stream),
            "cudaMemcpyAsync");
        !st)
      return st;
    if (auto st = detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); !st)
      return st;
    if (code != 0)
      return status::make(
          errc(code),
          "device index builder: a page table entry has a format or slot out of range, "
          "or a sequence exceeds max_pages = ",
          layout_.max_pages);
    return {};
  }

 private:
  static constexpr std::size_t align(std::size_t n) { return (n + 255) / 256 * 256; }
  static constexpr std::size_t ints(std::size_t n) { return align(n * sizeof(std::int32_t)); }
  int scan_items() const { return int(layout_.entries()) + 1; }
  static unsigned blocks(int n) { return unsigned((n + threads - 1) / threads); }

  index_layout<NumFormats> layout_;
};

/// The FlashInfer/vLLM adapter on the device: t's arrays are device pointers (validate
/// them on the host with validate_paged_kv_table before upload when they are untrusted).
template <int NumFormats>
result<batch_index_view<NumFormats>> index_from_paged_kv_table_device(
    const paged_kv_table& t, int format, const index_layout<NumFormats>& layout, void* out,
    cudaStream_t stream) {
  if (auto st = layout.validate(); !st) return st;
  if (format < 0 || format >= NumFormats) return status::out_of_range("format", format, NumFormats);
  if (t.batch < 0 || t.batch > layout.max_batch)
    return status::exceeds(errc::capacity_exhausted, "batch", t.batch, layout.max_batch);
  auto* o = static_cast<std::uint8_t*>(out);
  const int n = int(layout.entries()) + 1;
  detail::from_paged_kv<><<<unsigned((n + 255) / 256), 256, 0, stream>>>(
      t, format, NumFormats, reinterpret_cast<std::int32_t*>(o + layout.seq_len_offset()), o,
      layout.indptr_offset(0), layout.format_bytes(),
      reinterpret_cast<std::int32_t*>(o + layout.slot_offset(format)),
      reinterpret_cast<std::int32_t*>(o + layout.logical_offset(format)), int(layout.entries()));
  if (auto st = detail::cuda_check(cudaGetLastError(), "index_from_paged_kv_table_device launch");
      !st)
    return st;
  return layout.view_of(out, t.batch);
}

}  // namespace tierkv::cuda
