// SPDX-License-Identifier: Apache-2.0
// A cuda::tiered_cache's pages leaving or entering the GPU as the host's transfer buffer
// (paging/page_transfer.hpp): the only page bytes the façade moves over PCIe. export copies a
// run's pages device to host through page-locked staging and writes the buffer on the host;
// import verifies on the host, makes room in tier 0 if that alone is short, then copies the
// pages host to device on the stream. Both synchronize the stream before returning.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/cache/options.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/device_buffer.cuh"
#include "tierkv/paging/page_transfer.hpp"

namespace tierkv::cuda::detail {

// The buffer of logical pages [first, first + count) of s, KV heads `heads` (export_pages).
template <class Storage>
result<std::vector<std::uint8_t>> export_device_pages(const Storage& storage, seq_id s,
                                                      std::int64_t first, std::int64_t count,
                                                      head_slice heads, cudaStream_t stream,
                                                      transfer_counters& counters) {
  auto run = tierkv::detail::export_run(storage, s, first, count, heads);
  if (!run) return run.error_status();
  // Whole pages to page-locked memory, one slot per record, then the host's writer.
  const auto views = storage.views();
  const int L = storage.config().num_layers;
  std::vector<std::size_t> at;
  std::size_t staged = 0;
  tierkv::detail::for_each_run_page(storage, s, *run, [&](std::int64_t, int, page_id p) {
    at.push_back(staged);
    staged += views[p.format].page_bytes;
  });
  pinned_buffer<std::uint8_t> stage;
  if (staged > 0)
    if (auto st = stage.allocate(staged); !st) return st;
  status copied;
  std::size_t i = 0;
  tierkv::detail::for_each_run_page(storage, s, *run, [&](std::int64_t, int, page_id p) {
    const pool_view& v = views[p.format];
    if (copied)
      copied = cuda::check(cudaMemcpyAsync(stage.get() + at[i], v.page(p.slot), v.page_bytes,
                                           cudaMemcpyDeviceToHost, stream),
                           "export_pages: cudaMemcpyAsync (device to host)");
    ++i;
  });
  const status synced = cuda::check(cudaStreamSynchronize(stream), "export_pages: the page copies");
  if (!copied) return copied;
  if (!synced) return synced;
  counters.page_bytes += staged;
  std::vector<std::uint8_t> out(run->bytes);
  tierkv::detail::write_transfer(
      storage, s, *run, std::span<std::uint8_t>(out), [&](std::int64_t j, int l, page_id) {
        return stage.get() + at[std::size_t(j - run->first) * std::size_t(L) + std::size_t(l)];
      });
  return out;
}

// Whether a new sequence needing `need` fits (an import, a host-tier restore), making room in
// tier 0 (make_room(pages), a status) when only tier 0 is short and demoting its `Stale` role's
// pages would make it fit: every refusal comes before any change. `what` names the operation.
template <int Stale, class Storage, class MakeRoom>
status fit_new_sequence(Storage& storage, const import_need& need, const char* what,
                        MakeRoom&& make_room) {
  const std::uint64_t free0 = storage.free_pages(0);
  const std::uint64_t short0 = need.pages_per_tier[0] > free0 ? need.pages_per_tier[0] - free0 : 0;
  if (auto st = check_import_capacity(storage, need, Stale != 0 ? short0 : 0, Stale, what); !st)
    return st;
  if (short0 > 0) {
    if (auto st =
            make_room(std::uint32_t(std::min<std::uint64_t>(need.pages_per_tier[0], UINT32_MAX)));
        !st)
      return status::make(st.code(), what, ": ", st.message(), "; nothing ",
                          tierkv::detail::past(what));
    if (auto st = check_import_capacity(storage, need, 0, 0, what); !st) return st;
  }
  return {};
}

// A verified import that fits as a new sequence, its pages copied host to device on `stream`;
// a CUDA error once the copies began releases the sequence.
template <class Storage>
result<seq_id> copy_import(Storage& storage, const transfer_info& info,
                           std::span<const std::uint8_t> buf, cudaStream_t stream,
                           transfer_counters& counters) {
  const auto views = storage.views();
  std::uint64_t moved = 0;
  auto seq = tierkv::detail::import_verified(
      storage, info, buf, [&](page_id p, const std::uint8_t* src, std::size_t n) {
        moved += n;
        return cuda::check(
            cudaMemcpyAsync(views[p.format].page(p.slot), src, n, cudaMemcpyHostToDevice, stream),
            "import_pages: cudaMemcpyAsync (host to device)");
      });
  // The copies read `buf` and write pages of the sequence (or, after a rollback, of the
  // pools): they finish before the caller may free the one or anyone reuse the other.
  const status synced = cuda::check(cudaStreamSynchronize(stream), "import_pages: the page copies");
  counters.page_bytes += moved;
  if (!seq) return seq;
  if (!synced) {
    (void)storage.release(*seq);
    return status::make(synced.code(), synced.message(), "; import rolled back");
  }
  return seq;
}

}  // namespace tierkv::cuda::detail
