// SPDX-License-Identifier: Apache-2.0
// cuda::tiered_cache: the cache wholly on the GPU, the façade an engine drives. Pages live in
// device memory; the host keeps only metadata (page tables, policy state) and never reads or
// writes page bytes (device_allocator is not host accessible, so no host codec path compiles
// here). It owns the storage, the tier controller, the retier driver (conversions on a side
// stream), a device mirror of the page table (page_table_mirror.cuh), a prefix index (sealed
// pages shared by reference across requests) and the decode plan and workspace.
//
//   auto c = cache::create(opt, stream).value();
//   per scheduler step:
//     c->begin_step(batch, new_tokens);     // reserve + commit the step's tokens, index arrays
//     for (int l = 0; l < layers; ++l) {    // the forward pass, on `stream`
//       c->append(l, k, v, input_type::bf16);            // [new tokens][kv_heads][head_dim]
//       c->decode(l, q, query_type::bf16, out);          // attends to every committed token
//       // or, for steps with chunks: c->prefill(l, q, ...)  // each sequence's new tokens, causal
//     }
//     c->end_step(step);                    // page mass -> policy, retier batch on the side stream
//
// The step's tokens are live from begin_step on: every reader of their pages runs after the
// append kernels in stream order (decode on `stream`; the retier batch waits for `stream`; a
// fork's tail copy runs on `stream`), so the host never waits for a write. Between begin_step
// and end_step, append, decode and prefill are plain kernel launches that read their lengths,
// slots and index arrays from device buffers begin_step fills: a whole forward pass over all
// layers can be captured in one CUDA graph (launches on the capturing stream: the `on`
// argument) and replayed at every later step with the same batch (docs/gpu-cache.md, "CUDA
// graphs").
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tierkv/centering.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/append/append.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/decode.cuh"
#include "tierkv/cuda/decode_plan.cuh"
#include "tierkv/cuda/page_table_mirror.cuh"
#include "tierkv/cuda/prefill.cuh"
#include "tierkv/cuda/prefill/last_rows.cuh"
#include "tierkv/cuda/prefill_plan.cuh"
#include "tierkv/cuda/retier/async.cuh"
#include "tierkv/cuda/retier/driver.cuh"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/paging/prefix_index.hpp"
#include "tierkv/report.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"
#include "tierkv/tiering/tier_policy.hpp"
#include "tierkv/tiering/tier_roles.hpp"

namespace tierkv::cuda {

/// The options of a tiered_cache (tiered_cache::options); tiered_cache::validate checks them.
template <class Policy, int NumTiers>
struct tiered_cache_options {
  storage_options<NumTiers> storage{};  ///< layers, sequences, pages per tier, codec seed
  Policy policy{};                      ///< the tier policy (its parameters)
  tier_controller_options tiering{};    ///< the tier controller's knobs
  int max_batch = 64;                   ///< sequences per step
  int max_pages = 4096;                 ///< logical pages per sequence
  int max_step_tokens = 4096;           ///< new tokens of one step over its batch (prefill chunks)
  int max_retier_pages = 1024;          ///< conversions per GPU batch
  int max_chunks_per_seq = 64;          ///< decode split (decode_capacity)
  int mass_layers_per_step = 0;  ///< layers whose page mass feeds the policy a step (0 = all);
                                 ///< only their decodes compute the mass (a device flag)
  float softmax_scale = 0.f;     ///< 0: 1 / sqrt(head_dim)
  /// Centring (tierkv/centering.hpp, as the host tiered_cache's): each layer's per-KV-head
  /// channel means of keys and values are subtracted before encoding and given back in decode
  /// and prefill (outputs and lse). The means are set_centering()'s, or else those of the first
  /// tokens appended to the layer (estimated on the device; not while a graph is captured).
  /// decode / prefill refuse soft_cap > 0 then.
  bool center = false;
};

/// Host<->device bytes the façade moved: metadata, and page bytes only where pages leave or
/// enter the cache (export_pages, import_pages); no step, fork or conversion moves any.
struct transfer_counters {
  /// Mirror journals, batch rows, slot mappings, retier lists
  std::uint64_t h2d_metadata_bytes = 0;
  std::uint64_t d2h_metadata_bytes = 0;  ///< page masses, error words
  std::uint64_t page_bytes = 0;          ///< host<->device page bytes: export and import only
};

/// Host time the façade spent since create, by part (steady clock, nanoseconds): where a
/// model-level step's host time goes. "waits" are host blocking on the GPU.
struct host_times {
  std::uint64_t steps = 0;          ///< end_step calls
  std::uint64_t begin_step_ns = 0;  ///< all of begin_step, of which:
  std::uint64_t make_room_ns = 0;   ///<   demotions under memory pressure (waits for them)
  std::uint64_t index_ns = 0;       ///<   the index arrays' build and the decode plan
  std::uint64_t end_step_ns = 0;    ///< all of end_step, of which:
  std::uint64_t mass_wait_ns = 0;   ///<   waiting for the previous step's page masses
  std::uint64_t mass_fold_ns = 0;   ///<   feeding the page masses to the policy
  std::uint64_t plan_ns = 0;        ///<   the controller's plan
  std::uint64_t retier_ns = 0;      ///<   publishing and enqueueing retier batches
};

/// The façade (see the top of this header): a KV cache wholly on the GPU over `Tiers`, with
/// tiering by `Policy`, decode kernels of `Path`, the tier roles `Roles` and the conversion
/// fault hook `Faults` (tiering/conversion.hpp: none by default; tests inject through it).
/// Create with create(); not copyable.
template <class Geometry, class Tiers, tier_policy Policy = policy::recency_anchor,
          decode_path Path = decode_path::tensor_core, class Roles = tier_roles<Tiers>,
          conversion_fault_hook Faults = no_faults>
class tiered_cache {
 public:
  /// The paged storage: device pages, host metadata.
  using storage_type = paged_storage<Geometry, Tiers, device_allocator, host_allocator>;
  /// The tier controller.
  using controller_type = tier_controller<storage_type, Policy, Roles>;
  /// The asynchronous retier driver.
  using driver_type = retier_driver<storage_type>;
  /// Number of tiers.
  static constexpr int num_tiers = Tiers::size;
  /// The device mirror of the page table.
  using mirror_type = page_table_mirror<num_tiers>;
  /// The prefix index.
  using prefix_type = prefix_index<storage_type>;
  /// The options of create().
  using options = tiered_cache_options<Policy, num_tiers>;
  /// The tier new tokens are appended to (tier 0).
  using append_tier = tier_at_t<Tiers, 0>;
  /// The host façade's centring means (their checks; the values live on the device here).
  using means_type = channel_means<Geometry::head_dim, Geometry::kv_heads, host_allocator>;
  /// Most layers (num_layers) a cache may have.
  static constexpr int layers_max = 65535;
  /// Observes the page mass the policy is fed: (sequence, layer, mass per logical page).
  using mass_observer = std::function<void(seq_id, int, std::span<const float>)>;

  tiered_cache(const tiered_cache&) = delete;
  tiered_cache& operator=(const tiered_cache&) = delete;
  ~tiered_cache() {
    if (stream_) (void)cudaStreamSynchronize(stream_);
    if (driver_) {  // publish or drop what is in flight, give held pages back
      if (side_) (void)cudaStreamSynchronize(side_);
      retier_stats st;
      (void)driver_->try_publish(*controller_, st);
      (void)driver_->mark_decodes_enqueued(stream_);
      (void)cudaStreamSynchronize(stream_);
      (void)driver_->reclaim();
    }
    driver_.reset();
    controller_.reset();
    mirror_.reset();
    prefixes_.reset();  // its page references, before the storage
    storage_.reset();
    for (void* p : {workspace_, prefill_workspace_, static_cast<void*>(mass_dev_),
                    static_cast<void*>(lse_dev_), static_cast<void*>(slots_dev_),
                    static_cast<void*>(means_dev_), static_cast<void*>(last_rows_)})
      cudaFree(p);
    for (mass_copy& m : mass_copies_) {
      if (m.host) cudaFreeHost(m.host);
      if (m.ready) cudaEventDestroy(m.ready);
    }
    if (slots_host_) cudaFreeHost(slots_host_);
    for (cudaEvent_t e : {slots_uploaded_, handoff_})
      if (e) cudaEventDestroy(e);
    if (side_) cudaStreamDestroy(side_);
  }

  /// Every option is checked first (invalid_argument naming it); then the device buffers are
  /// allocated. `stream` is the engine's stream: appends, decodes, fork copies run on it.
  static result<std::unique_ptr<tiered_cache>> create(const options& opt, cudaStream_t stream) {
    if (auto st = validate(opt); !st) return st;
    std::unique_ptr<tiered_cache> c(new tiered_cache(opt, stream));
    if (auto st = c->init(); !st) return st;
    return result<std::unique_ptr<tiered_cache>>(std::move(c));
  }

  /// Checks every option of `opt` (invalid_argument naming the first bad one); create()
  /// calls it first.
  static status validate(const options& opt) {
    if (auto st = storage_type::validate(opt.storage); !st) return st;
    if (auto st = controller_type::validate(opt.policy, opt.tiering); !st) return st;
    if (opt.storage.num_layers > layers_max)
      return status::exceeds(errc::invalid_argument, "num_layers", opt.storage.num_layers,
                             layers_max);
    for (int f = 0; f < num_tiers; ++f)
      if (opt.storage.pages_per_tier[std::size_t(f)] > packed_page::max_slots)
        return status::exceeds(errc::invalid_argument, "pages_per_tier",
                               opt.storage.pages_per_tier[std::size_t(f)], packed_page::max_slots);
    const int values[] = {opt.max_batch, opt.max_pages, opt.max_step_tokens, opt.max_retier_pages,
                          opt.max_chunks_per_seq};
    const char* names[] = {"max_batch", "max_pages", "max_step_tokens", "max_retier_pages",
                           "max_chunks_per_seq"};
    for (int i = 0; i < 5; ++i)
      if (values[i] < 1)
        return status::make(errc::invalid_argument, names[i], " = ", values[i], " must be >= 1");
    if (opt.max_pages > 65535)
      return status::exceeds(errc::invalid_argument, "max_pages", opt.max_pages, 65535);
    if (opt.mass_layers_per_step < 0)
      return status::make(errc::invalid_argument,
                          "mass_layers_per_step = ", opt.mass_layers_per_step,
                          " must be >= 0 (0 = every layer)");
    if (!(opt.softmax_scale >= 0.f) || !std::isfinite(opt.softmax_scale))
      return status::make(errc::invalid_argument, "softmax_scale = ", opt.softmax_scale,
                          " must be finite and >= 0 (0 = 1 / sqrt(head_dim))");
    return {};
  }

  // ---- sequences -----------------------------------------------------------------------------
  /// A new, empty sequence (and its mirror row).
  result<seq_id> create_sequence() {
    auto s = storage_->create_sequence();
    if (!s) return s;
    open_row(*s);
    return s;
  }
  /// Shares every sealed page; the open tail page is copied on the stream (device to device).
  /// Refusals come before any demotion, as on the host.
  result<seq_id> fork(seq_id parent) {
    if (stepping_)
      return status(errc::invalid_argument, "fork: not between begin_step and end_step");
    if (auto st = refuse_poisoned(parent, "fork"); !st) return st;
    auto s = storage_->fork(parent, room());
    if (!s) return s;
    open_row(*s);
    sync_rows(*s, 0);
    return s;
  }
  /// Releases s: its pages go back to their pools once nothing else holds them. Between
  /// steps only.
  status release(seq_id s) {
    if (stepping_)
      return status(errc::invalid_argument, "release: not between begin_step and end_step");
    if (auto st = storage_->release(s); !st) return st;
    close_row(s);
    poisoned_.erase(s.value);
    return {};
  }
  /// Committed tokens of s.
  result<std::int64_t> length(seq_id s) const { return storage_->length(s); }

  // ---- prefix reuse: sealed pages shared by reference (metadata only, no page bytes move) ---
  /// Caches the full pages of s that tokens (s's first tokens.size() token ids) cover under
  /// `salt` (model, adapter, tenant); returns the new entries. Between steps only.
  result<std::size_t> insert_prefix(seq_id s, std::uint64_t salt,
                                    std::span<const std::int32_t> tokens) {
    if (stepping_)
      return status(errc::invalid_argument, "insert_prefix: not between begin_step and end_step");
    if (auto st = refuse_poisoned(s, "insert_prefix"); !st) return st;
    return prefixes_->insert(s, salt, tokens);
  }
  /// A new sequence holding the longest cached prefix of tokens (whole pages) under `salt`; the
  /// engine adds the rest of its tokens with begin_step. Between steps only; a refusal (no
  /// sequence slot) changes nothing.
  result<typename prefix_type::started> start_from_prefix(std::uint64_t salt,
                                                          std::span<const std::int32_t> tokens) {
    if (stepping_)
      return status(errc::invalid_argument,
                    "start_from_prefix: not between begin_step and end_step");
    auto st = prefixes_->start_sequence(salt, tokens);
    if (!st) return st;
    open_row(st->seq);
    sync_rows(st->seq, 0);
    return st;
  }
  /// Drops up to max_entries least recently used prefix entries that no sequence uses (their
  /// pages go back to the pools once nothing else holds them); returns how many. Between steps.
  result<std::size_t> evict_prefixes(std::size_t max_entries) {
    if (stepping_)
      return status(errc::invalid_argument, "evict_prefixes: not between begin_step and end_step");
    return prefixes_->evict(max_entries);
  }
  /// Prefix entries cached.
  std::size_t prefix_entries() const noexcept { return prefixes_->size(); }
  // ---- page transfer: a run of pages as one verified buffer (paging/page_transfer.hpp) --------
  /// tierkv::export_pages's buffer (the same bytes, docs/multigpu.md: it imports into a host
  /// storage or another cache) of logical pages [first, first + count) of s (count < 0: to
  /// the end, the open tail page included), all layers, KV heads `heads`. The pages are
  /// copied device to host on the stream, after every write enqueued before them, and the
  /// stream is synchronized before returning. Between steps (a step's tokens are written by
  /// appends not yet launched); the cache is not changed. A centred cache's pages are
  /// centred: the destination needs the same means (centering_keys / centering_values).
  result<std::vector<std::uint8_t>> export_pages(seq_id s, std::int64_t first = 0,
                                                 std::int64_t count = -1, head_slice heads = {}) {
    if (stepping_)
      return status(errc::invalid_argument, "export_pages: not between begin_step and end_step");
    auto run = tierkv::detail::export_run(*storage_, s, first, count, heads);
    if (!run) return run.error_status();
    // Whole pages to page-locked memory, one slot per record, then the host's writer.
    const auto views = storage_->views();
    const int L = layers();
    std::vector<std::size_t> at;
    std::size_t staged = 0;
    tierkv::detail::for_each_run_page(*storage_, s, *run, [&](std::int64_t, int, page_id p) {
      at.push_back(staged);
      staged += views[p.format].page_bytes;
    });
    pinned_bytes stage;
    if (staged > 0) TIERKV_CUDA_TRY(cudaMallocHost(&stage.p, staged));
    status copied;
    std::size_t i = 0;
    tierkv::detail::for_each_run_page(*storage_, s, *run, [&](std::int64_t, int, page_id p) {
      const pool_view& v = views[p.format];
      if (copied)
        copied = cuda::check(cudaMemcpyAsync(stage.p + at[i], v.page(p.slot), v.page_bytes,
                                             cudaMemcpyDeviceToHost, stream_),
                             "export_pages: cudaMemcpyAsync (device to host)");
      ++i;
    });
    const status synced =
        cuda::check(cudaStreamSynchronize(stream_), "export_pages: the page copies");
    if (!copied) return copied;
    if (!synced) return synced;
    counters_.page_bytes += staged;
    std::vector<std::uint8_t> out(run->bytes);
    tierkv::detail::write_transfer(
        *storage_, s, *run, std::span<std::uint8_t>(out), [&](std::int64_t j, int l, page_id) {
          return stage.p + at[std::size_t(j - run->first) * std::size_t(L) + std::size_t(l)];
        });
    return out;
  }

  /// Imports a buffer of export_pages (this cache's, another's, or tierkv::export_pages of a
  /// host storage) as a NEW sequence holding its run, all or nothing. The whole buffer is
  /// verified on the host first (verify_import: format, checksum, geometry, tier list, codec
  /// seed, head_base), then max_pages and the capacity (a sequence slot, blocks, every pool at
  /// the import's peak). When only tier 0 is short it makes room as begin_step does
  /// (make_room: sealed tier-0 pages demoted on the GPU, blocking), after checking that the
  /// demotions would make the import fit: every refusal comes before any change. The pages are
  /// copied host to device on the stream, which is synchronized before returning; the mirror
  /// holds the sequence's row, and the controller sees it at its next plan. Between steps. A
  /// CUDA error once the copies began releases the sequence (demotions made for it stay: they
  /// lose nothing). With centring, every layer's means must be set first (set_centering with
  /// the source's means), since the pages were encoded against them.
  result<seq_id> import_pages(std::span<const std::uint8_t> buf) {
    if (stepping_)
      return status(errc::invalid_argument, "import_pages: not between begin_step and end_step");
    auto info = verify_import(*storage_, buf);
    if (!info) return info.error_status();
    if (opt_.center)
      for (int l = 0; l < layers(); ++l)
        if (!means_known_[std::size_t(l)])
          return status::make(errc::invalid_argument, "import_pages: layer ", l,
                              "'s centring means are not set; the pages are centred with their "
                              "source's means: set_centering with those first; nothing imported");
    if (info->logical_pages > std::uint32_t(opt_.max_pages))
      return status::make(errc::out_of_range, "import_pages: the buffer holds ",
                          info->logical_pages, " logical pages, max_pages = ", opt_.max_pages,
                          "; nothing imported");
    const import_need need = import_needs(*info, buf);
    const std::uint64_t free0 = storage_->free_pages(0);
    const std::uint64_t short0 =
        need.pages_per_tier[0] > free0 ? need.pages_per_tier[0] - free0 : 0;
    constexpr int stale = Roles::stale;
    if (auto st = check_import_capacity(*storage_, need, stale != 0 ? short0 : 0, stale); !st)
      return st;
    if (short0 > 0) {
      const scoped_time room_timed{times_.make_room_ns};
      if (auto st =
              make_room(std::uint32_t(std::min<std::uint64_t>(need.pages_per_tier[0], UINT32_MAX)));
          !st)
        return status::make(st.code(), "import_pages: ", st.message(), "; nothing imported");
      if (auto st = check_import_capacity(*storage_, need); !st) return st;
    }
    const auto views = storage_->views();
    std::uint64_t moved = 0;
    auto seq = tierkv::detail::import_verified(
        *storage_, *info, buf, [&](page_id p, const std::uint8_t* src, std::size_t n) {
          moved += n;
          return cuda::check(cudaMemcpyAsync(views[p.format].page(p.slot), src, n,
                                             cudaMemcpyHostToDevice, stream_),
                             "import_pages: cudaMemcpyAsync (host to device)");
        });
    // The copies read `buf` and write pages of the sequence (or, after a rollback, of the
    // pools): they finish before the caller may free the one or anyone reuse the other.
    const status synced =
        cuda::check(cudaStreamSynchronize(stream_), "import_pages: the page copies");
    counters_.page_bytes += moved;
    if (!seq) return seq;
    if (!synced) {
      (void)storage_->release(*seq);
      return status::make(synced.code(), synced.message(), "; import rolled back");
    }
    open_row(*seq);
    sync_rows(*seq, 0);
    return seq;
  }

  /// Pins (or, with pinned = false, unpins) `pages` logical pages of s from `first_page`:
  /// pinned pages are Anchor and never demoted under pressure (tier_controller::pin).
  status pin(seq_id s, std::int64_t first_page, std::int64_t pages, bool pinned = true) {
    return controller_->pin(s, first_page, pages, pinned);
  }

  // ---- a step ------------------------------------------------------------------------------
  /// Adds new_tokens[b] tokens to batch[b] (0 for a plain decode step; a prefill chunk; several
  /// sequences of any mix), uploads their slot mapping, and builds the index arrays of every
  /// layer and the decode plan for `batch`. Refusals (a bad sequence, max_pages, capacity that
  /// demotion cannot free) return before any token is added; demotions made for the step stay
  /// (they lose nothing). When tier 0 is short of the step's new pages it demotes once for the
  /// whole step, blocking while the demotions run on the GPU (make_room); otherwise it only
  /// enqueues work.
  status begin_step(std::span<const seq_id> batch, std::span<const std::int32_t> new_tokens) {
    const scoped_time timed{times_.begin_step_ns};
    if (stepping_) return status(errc::invalid_argument, "begin_step: the last step has not ended");
    if (batch.size() != new_tokens.size())
      return status::make(errc::invalid_argument, "begin_step: ", batch.size(), " sequences and ",
                          new_tokens.size(), " token counts");
    if (batch.size() > std::size_t(opt_.max_batch))
      return status::exceeds(errc::capacity_exhausted, "begin_step: batch", batch.size(),
                             opt_.max_batch);
    std::int64_t total = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (new_tokens[b] < 0)
        return status::make(errc::invalid_argument, "begin_step: new_tokens[", b,
                            "] = ", new_tokens[b], " is negative");
      auto len = storage_->length(batch[b]);
      if (!len) return len.error_status();
      if (auto st = refuse_poisoned(batch[b], "begin_step"); !st) return st;
      constexpr std::int64_t T = storage_type::page_tokens;
      if ((*len + new_tokens[b] + T - 1) / T > opt_.max_pages)
        return status::make(errc::out_of_range, "begin_step: ", batch[b], " would have ",
                            (*len + new_tokens[b] + T - 1) / T,
                            " logical pages, max_pages = ", opt_.max_pages, "; nothing added");
      for (std::size_t a = 0; a < b; ++a)
        if (batch[a] == batch[b])
          return status::make(errc::invalid_argument, "begin_step: ", batch[b], " appears twice");
      total += new_tokens[b];
    }
    if (total > opt_.max_step_tokens)
      return status::exceeds(errc::capacity_exhausted, "begin_step: new tokens", total,
                             opt_.max_step_tokens);
    // Publish a finished retier batch first: the index arrays below name its pages.
    if (auto st = collect_retier(/*wait=*/false); !st) return st;
    step_tokens_of_.assign(new_tokens.begin(), new_tokens.end());
    step_first_pos_.resize(batch.size());
    for (std::size_t b = 0; b < batch.size(); ++b) step_first_pos_[b] = *storage_->length(batch[b]);
    if (auto st = reserve_all(batch, new_tokens, total); !st) return st;
    // the appends' error record, for this step's tokens (append_error_where)
    TIERKV_CUDA_TRY(cudaMemsetAsync(slots_dev_ + append_error_offset(), 0,
                                    append_error_ints * sizeof(std::int32_t), stream_));
    // the step's query offsets (prefill's q_indptr): sequence b's chunk is its new tokens
    std::int32_t* qo = slots_host_ + qo_offset();
    qo[0] = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) qo[b + 1] = qo[b] + new_tokens[b];
    TIERKV_CUDA_TRY(cudaMemcpyAsync(slots_dev_ + qo_offset(), qo,
                                    (batch.size() + 1) * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream_));
    counters_.h2d_metadata_bytes += (batch.size() + 1) * sizeof(std::int32_t);
    // the layers whose decode computes the page mass this step (a flag each, read by the kernels)
    choose_mass_layers();
    std::int32_t* on = slots_host_ + mass_on_offset();
    std::fill(on, on + layers(), 0);
    for (int l : mass_layer_) on[l] = 1;
    TIERKV_CUDA_TRY(cudaMemcpyAsync(slots_dev_ + mass_on_offset(), on,
                                    std::size_t(layers()) * sizeof(std::int32_t),
                                    cudaMemcpyHostToDevice, stream_));
    counters_.h2d_metadata_bytes += std::size_t(layers()) * sizeof(std::int32_t);
    TIERKV_CUDA_TRY(cudaEventRecord(slots_uploaded_, stream_));  // the whole slot buffer's copies

    batch_.assign(batch.begin(), batch.end());
    rows_.resize(batch.size());
    pages_.resize(batch.size());
    lens_.resize(batch.size());
    std::vector<std::int32_t> per_format(batch.size() * std::size_t(num_tiers));
    const auto share = tier_shares();
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t len = *storage_->length(batch[b]);
      const std::int64_t pages = *storage_->logical_pages(batch[b]);
      rows_[b] = row_of(batch[b]);
      pages_[b] = std::int32_t(pages);
      lens_[b] = std::int32_t(len);
      for (int f = 0; f < num_tiers; ++f)
        per_format[b * num_tiers + std::size_t(f)] = std::int32_t(std::lround(pages * share[f]));
    }
    {
      const scoped_time index_timed{times_.index_ns};
      if (auto st = mirror_->build(rows_, pages_, lens_, stream_); !st) return st;
      counters_.h2d_metadata_bytes += mirror_->last_upload_bytes();
      decode_capacity cap{opt_.max_batch, opt_.max_chunks_per_seq, opt_.max_pages, true};
      auto plan =
          plan_decode<Geometry, Tiers>(cap, per_format.data(), int(batch.size()), sm_count_);
      if (!plan) return plan.error_status();
      plan_ = *plan;
    }
    if (auto st = clear_sampled_masses(); !st) return st;
    stepping_ = true;
    return {};
  }

  /// Makes `s` the cache's stream (between steps): later steps, forks and conversions order on
  /// it, after everything already enqueued on the old one (an event hand-off, no host wait).
  status set_stream(cudaStream_t s) {
    if (stepping_)
      return status(errc::invalid_argument, "set_stream: not between begin_step and end_step");
    if (s == stream_) return {};
    TIERKV_CUDA_TRY(cudaEventRecord(handoff_, stream_));
    TIERKV_CUDA_TRY(cudaStreamWaitEvent(s, handoff_, 0));
    stream_ = s;
    storage_->page_alloc().set_stream(s);
    return {};
  }

  /// Writes layer `layer` of the step's new tokens: k and v hold [tokens][kv_heads][head_dim]
  /// (tokens in begin_step's batch order), device memory, f32 or bf16. Enqueued on the stream,
  /// or on `on`, a stream capturing a graph (see launch_stream).
  status append(int layer, const void* k, const void* v, input_type type = input_type::f32,
                std::optional<cudaStream_t> on = std::nullopt) {
    if (!stepping_) return status(errc::invalid_argument, "append: call begin_step first");
    if (layer < 0 || layer >= layers())
      return status::out_of_range("append: layer", layer, layers());
    auto stream = launch_stream("append", on);
    if (!stream) return stream.error_status();
    if (step_tokens_ == 0) return {};
    append_inputs in;
    in.k = k;
    in.v = v;
    in.type = type;
    in.slot = slots_dev_ + std::size_t(layer) * std::size_t(opt_.max_step_tokens);
    in.offset = slots_dev_ + std::size_t(layers()) * std::size_t(opt_.max_step_tokens);
    in.tokens = int(step_tokens_);
    in.layers = 1;
    in.pool = storage_->views()[0];
    in.cache_seed = storage_->config().codec_seed;
    in.head_base = storage_->config().head_base;
    in.layer_base = layer;
    in.error = slots_dev_ + append_error_offset();
    in.error_at = in.error + 1;
    if (opt_.center) {
      in.key_mean = key_mean(layer);
      in.value_mean = value_mean(layer);
      if (!means_known_[std::size_t(layer)]) {  // the first tokens of the layer: their means
        cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
        TIERKV_CUDA_TRY(cudaStreamIsCapturing(*stream, &capturing));
        if (capturing != cudaStreamCaptureStatusNone)
          return status::make(errc::invalid_argument, "append: layer ", layer,
                              "'s centring means are not known yet and a graph capture would "
                              "estimate them at every replay; append once outside the capture "
                              "or call set_centering first");
        if (auto st = estimate_means<Geometry>(in, key_mean(layer), value_mean(layer), *stream);
            !st)
          return st;
        auto st = cuda::append<Geometry, append_tier>(in, *stream);
        if (st) means_known_[std::size_t(layer)] = 1;  // else the next append estimates again
        return st;
      }
    }
    return cuda::append<Geometry, append_tier>(in, *stream);
  }

  /// Sets layer's centring means ([kv_head][head_dim] host floats each, e.g. from a calibration
  /// pass) while the cache holds no page: its pages are encoded against the means they have.
  /// Copied before returning.
  status set_centering(int layer, std::span<const float> mu_k, std::span<const float> mu_v) {
    if (!opt_.center)
      return status(errc::invalid_argument,
                    "set_centering: the cache was created with center = false");
    if (stepping_)
      return status(errc::invalid_argument, "set_centering: not between begin_step and end_step");
    if (auto st = means_type::check(layer, layers(), mu_k, mu_v); !st) return st;
    if (auto st = check_no_pages_for_centering(*storage_); !st) return st;
    constexpr std::size_t n = mean_floats;
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream_));  // no kernel reads the old means any more
    TIERKV_CUDA_TRY(
        cudaMemcpy(key_mean(layer), mu_k.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    TIERKV_CUDA_TRY(
        cudaMemcpy(value_mean(layer), mu_v.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    counters_.h2d_metadata_bytes += 2 * n * sizeof(float);
    means_known_[std::size_t(layer)] = 1;
    return {};
  }
  /// Whether layer's centring means are set (given or estimated); false without centring.
  bool centering_known(int layer) const {
    return opt_.center && layer >= 0 && layer < layers() && means_known_[std::size_t(layer)] != 0;
  }
  /// Layer's centring means on the device ([kv_head][head_dim] floats each; nullptr without
  /// centring): an engine moving pages to another cache gives it the same means.
  const float* centering_keys(int layer) const { return opt_.center ? key_mean(layer) : nullptr; }
  /// Layer's value means on the device (nullptr without centring).
  const float* centering_values(int layer) const {
    return opt_.center ? value_mean(layer) : nullptr;
  }

  /// Decode attention of layer `layer` for the step's batch: queries [batch][q_heads][head_dim]
  /// (post-RoPE, device memory), out (same shape, f32 or bf16), lse ([batch][q_heads],
  /// optional). The launches are the same at every step (a graph replays them): the layer's
  /// page mass is computed on the device when begin_step's flag for the layer says it is one
  /// of the step's sampled layers (end_step feeds those to the policy). soft_cap > 0 caps the
  /// logits (s -> soft_cap tanh(s / soft_cap)); window > 0 attends the last `window` positions
  /// only (a sliding-window layer; the pages before it get zero mass), as prefill's.
  status decode(int layer, const void* queries, query_type qtype, void* out,
                output_type otype = output_type::f32, float* lse = nullptr, float soft_cap = 0.f,
                int window = 0, std::optional<cudaStream_t> on = std::nullopt) {
    if (!stepping_) return status(errc::invalid_argument, "decode: call begin_step first");
    if (layer < 0 || layer >= layers())
      return status::out_of_range("decode: layer", layer, layers());
    auto stream = launch_stream("decode", on);
    if (!stream) return stream.error_status();
    decode_inputs<num_tiers> in;
    set_layer_inputs(in, layer, queries, qtype);
    in.soft_cap = soft_cap;
    in.window = window;
    in.out = out;
    in.out_type = otype;
    in.lse = lse != nullptr ? lse : lse_dev_ + lse_offset(layer);
    in.page_mass = mass_dev_ + mass_offset(layer);
    in.page_mass_stride = opt_.max_pages;
    in.page_mass_on = slots_dev_ + mass_on_offset() + layer;
    return cuda::decode<Geometry, Tiers, Path>(plan_, in, workspace_, plan_.workspace_bytes,
                                               *stream);
  }

  /// Chunked prefill attention of layer `layer` for the step's batch: sequence b's queries are its
  /// begin_step new_tokens[b] tokens ([step tokens][q_heads][head_dim] in batch order, post-RoPE,
  /// device memory), each attending its whole sequence causally, pages of every tier where they
  /// lie (cuda/prefill.cuh); out has the queries' shape (f32 or bf16), lse [step tokens][q_heads]
  /// (optional). A sequence with new_tokens 1 gets a decode step's answer; with 0, nothing.
  /// When the layer is one of the step's sampled layers (begin_step), each sequence's last chunk
  /// row is decoded again to sample its page mass, as the host cache's prefill does: a run of
  /// prefill chunks (a long prompt, a perplexity pass) makes Anchors by attention before its
  /// pages are demoted. The layer's last decode or prefill of the step gives its mass.
  status prefill(int layer, const void* queries, query_type qtype, void* out,
                 output_type otype = output_type::f32, float* lse = nullptr, float soft_cap = 0.f,
                 int window = 0, std::optional<cudaStream_t> on = std::nullopt) {
    if (!stepping_) return status(errc::invalid_argument, "prefill: call begin_step first");
    if (layer < 0 || layer >= layers())
      return status::out_of_range("prefill: layer", layer, layers());
    auto stream = launch_stream("prefill", on);
    if (!stream) return stream.error_status();
    prefill_inputs<num_tiers> in;
    set_layer_inputs(in, layer, queries, qtype);
    in.q_indptr = slots_dev_ + qo_offset();
    in.soft_cap = soft_cap;
    in.window = window;
    in.out = out;
    in.out_type = otype;
    in.lse = lse;
    if (auto st = cuda::prefill<Geometry, Tiers>(prefill_plan_, in, prefill_workspace_,
                                                 prefill_plan_.workspace_bytes, *stream);
        !st)
      return st;
    if (slots_host_[mass_on_offset() + std::size_t(layer)] == 0) return {};
    if (auto st = gather_last_rows(queries, qtype, slots_dev_ + qo_offset(), int(batch_.size()),
                                   Geometry::q_heads * Geometry::head_dim, last_rows_, *stream);
        !st)
      return st;
    float* outputs = last_rows_ + last_rows_floats();  // the buffer's second half
    return decode(layer, last_rows_, query_type::f32, outputs, output_type::f32, nullptr, soft_cap,
                  window, *stream);
  }

  /// Ends the step: queues the copy of this step's sampled page masses to the host, feeds the
  /// policy the previous step's (its work came before this step's on the stream, so the host
  /// does not wait for this step: its planning overlaps the GPU's step), and enqueues the
  /// conversions the policy wants at `step` on the side stream (published by a later
  /// begin_step or end_step once complete). wait = true feeds this step's masses too and
  /// finishes the batch, giving the replaced pages back, before returning (tests, shutdown).
  result<retier_stats> end_step(std::uint64_t step, bool wait = false) {
    if (!stepping_) return status(errc::invalid_argument, "end_step: call begin_step first");
    const scoped_time timed{times_.end_step_ns};
    ++times_.steps;
    stepping_ = false;
    mass_copy& now = mass_copies_[std::size_t(mass_turn_)];
    mass_turn_ ^= 1;
    if (auto st = queue_masses(now); !st) return st;
    if (auto st = feed_masses(mass_copies_[std::size_t(mass_turn_)]); !st) return st;
    if (wait)
      if (auto st = feed_masses(now); !st) return st;
    retier_stats st;
    {
      const scoped_time retier_timed{times_.retier_ns};
      if (auto c = collect_retier(wait); !c) return c;
    }
    std::span<const conversion> todo;
    {
      const scoped_time plan_timed{times_.plan_ns};
      todo = controller_->plan(step);
    }
    {
      const scoped_time retier_timed{times_.retier_ns};
      const std::size_t n = std::min(todo.size(), std::size_t(opt_.max_retier_pages));
      auto queued = driver_->enqueue(*controller_, todo.first(n), stream_, st, faults_);
      if (!queued) return queued.error_status();
      if (*queued > 0) counters_.h2d_metadata_bytes += driver_->list_bytes();
      if (wait)
        if (auto c = collect_retier(true); !c) return c;
    }
    st.add(last_batch_);
    last_batch_ = retier_stats{};
    totals_.add(st);
    if (!append_report_.is_ok()) return std::exchange(append_report_, status{});
    return st;
  }

  // ---- accounting ----------------------------------------------------------------------------
  /// Exact accounting of the storage's memory (make_report).
  memory_report report() const { return make_report(*storage_); }
  /// The storage's, the controller's and the prefix index's invariants, the retier driver's
  /// pages (a batch in flight, replaced pages not yet back) accounted for.
  status check_invariants() const {
    const auto outstanding = std::uint32_t(driver_->pages_held() + driver_->pages_in_flight());
    if (auto st = prefixes_->check_invariants(); !st) return st;
    return controller_->check_invariants(outstanding);
  }
  /// Finishes the retier batch in flight and gives the replaced pages back (blocks on the GPU):
  /// afterwards every live page is one that a block names (before a report meant to show the
  /// steady state, or shutdown). Between steps.
  status drain() {
    if (stepping_)
      return status(errc::invalid_argument, "drain: not between begin_step and end_step");
    if (auto st = collect_retier(true); !st) return st;
    totals_.add(last_batch_);
    last_batch_ = retier_stats{};
    return {};
  }
  /// The device check of the last begin_step's index build and decodes (synchronizes).
  status device_error() {
    if (auto st = mirror_->error(stream_); !st) return st;
    std::int32_t rec[append_error_ints];
    TIERKV_CUDA_TRY(cudaMemcpyAsync(rec, slots_dev_ + append_error_offset(), sizeof rec,
                                    cudaMemcpyDeviceToHost, stream_));
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream_));
    if (rec[0] != 0)
      return append_error_where(rec, batch_, step_tokens_of_, step_first_pos_, false);
    auto e = decode_device_error(plan_, workspace_, stream_);
    if (!e) return e.error_status();
    if (*e != errc::ok)
      return status::make(*e, "decode: a page slot beyond its pool or a page beyond max_pages");
    auto pe = prefill_device_error(prefill_plan_, prefill_workspace_, stream_);
    if (!pe) return pe.error_status();
    if (*pe != errc::ok)
      return status::make(*pe, "prefill: a page slot beyond its pool or a chunk beyond its limits");
    return {};
  }
  /// Host<->device bytes moved so far.
  const transfer_counters& transfers() const noexcept { return counters_; }
  /// Host time spent so far, by part.
  const host_times& times() const noexcept { return times_; }
  /// Retier totals so far (retier_stats summed over the steps).
  const retier_stats& retier_totals() const noexcept { return totals_; }
  /// Sets the observer of the page masses the policy is fed (empty: none).
  void set_mass_observer(mass_observer f) { observer_ = std::move(f); }

  /// The paged storage.
  storage_type& storage() noexcept { return *storage_; }
  /// The paged storage (read-only).
  const storage_type& storage() const noexcept { return *storage_; }
  /// The tier controller.
  controller_type& controller() noexcept { return *controller_; }
  /// The conversion fault hook (tiering/conversion.hpp).
  Faults& faults() noexcept { return faults_; }
  /// The device mirror of the page table.
  const mirror_type& mirror() const noexcept { return *mirror_; }
  /// The decode plan of the current step.
  const decode_plan& plan() const noexcept { return plan_; }
  /// The engine's stream (appends, decodes, fork copies).
  cudaStream_t stream() const noexcept { return stream_; }
  /// The side stream of the retier batches.
  cudaStream_t side_stream() const noexcept { return side_; }
  /// The options the cache was created with.
  const options& config() const noexcept { return opt_; }
  /// Layers of the cache (opt.storage.num_layers).
  int layers() const noexcept { return opt_.storage.num_layers; }

 private:
  // A step's sampled page masses on their way to the host (end_step feeds the previous step's).
  struct mass_copy {
    std::vector<seq_id> batch;  // the step's batch
    std::vector<int> layers;    // per host slot: the layer sampled
    // the step's appends: its error record (pinned, after the masses), new tokens and first
    // positions per sequence
    std::int32_t* append_error = nullptr;
    std::vector<std::int32_t> new_tokens;
    std::vector<std::int64_t> first_pos;
    float* host = nullptr;
    cudaEvent_t ready = nullptr;
    bool pending = false;  // queued, not fed yet
  };

  // Page-locked staging of export_pages, freed on every return path.
  struct pinned_bytes {
    std::uint8_t* p = nullptr;
    pinned_bytes() = default;
    pinned_bytes(const pinned_bytes&) = delete;
    pinned_bytes& operator=(const pinned_bytes&) = delete;
    ~pinned_bytes() {
      if (p) (void)cudaFreeHost(p);
    }
  };

  tiered_cache(const options& opt, cudaStream_t stream) : opt_(opt), stream_(stream) {}

  status init() {
    TIERKV_CUDA_TRY(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device()));
    device_allocator pages;
    pages.set_stream(stream_);
    auto s = storage_type::create(opt_.storage, std::move(pages));
    if (!s) return s.error_status();
    storage_ = std::move(*s);
    prefixes_ = std::make_unique<prefix_type>(*storage_);
    auto ctl = controller_type::create(*storage_, opt_.policy, opt_.tiering);
    if (!ctl) return ctl.error_status();
    controller_ = std::move(*ctl);
    auto side = create_side_stream();
    if (!side) return side.error_status();
    side_ = *side;
    auto d = driver_type::create(*storage_, opt_.max_retier_pages, side_);
    if (!d) return d.error_status();
    driver_ = std::move(*d);
    auto m = mirror_type::create(int(storage_->max_sequences()), opt_.max_pages,
                                 int(storage_->block_capacity()), layers(), opt_.max_batch);
    if (!m) return m.error_status();
    mirror_ = std::move(*m);
    known_gen_.assign(storage_->block_capacity(), 0);
    free_rows_.resize(storage_->max_sequences());
    for (std::uint32_t r = 0; r < storage_->max_sequences(); ++r)
      free_rows_[r] = std::int32_t(storage_->max_sequences() - 1 - r);

    decode_capacity cap{opt_.max_batch, opt_.max_chunks_per_seq, opt_.max_pages, true};
    auto plan = plan_decode<Geometry, Tiers>(cap, nullptr, 0, sm_count_);
    if (!plan) return plan.error_status();
    plan_ = *plan;
    TIERKV_CUDA_TRY(cudaMalloc(&workspace_, plan_.workspace_bytes));
    if (auto st = decode_workspace_init(plan_, workspace_, plan_.workspace_bytes, stream_); !st)
      return st;
    // a chunk is at most a step's tokens, and so are all chunks together
    auto pplan = plan_prefill<Geometry>(opt_.max_batch, opt_.max_step_tokens, opt_.max_step_tokens,
                                        sm_count_);
    if (!pplan) return pplan.error_status();
    prefill_plan_ = *pplan;
    TIERKV_CUDA_TRY(cudaMalloc(&prefill_workspace_, prefill_plan_.workspace_bytes));
    if (auto st = prefill_workspace_init(prefill_plan_, prefill_workspace_,
                                         prefill_plan_.workspace_bytes, stream_);
        !st)
      return st;
    mass_layers_ =
        opt_.mass_layers_per_step == 0 ? layers() : std::min(opt_.mass_layers_per_step, layers());
    TIERKV_CUDA_TRY(cudaMalloc(&mass_dev_, mass_offset(layers()) * sizeof(float)));
    for (mass_copy& m : mass_copies_) {
      const std::size_t floats = mass_offset(mass_layers_);
      TIERKV_CUDA_TRY(cudaMallocHost(
          &m.host, floats * sizeof(float) + append_error_ints * sizeof(std::int32_t)));
      m.append_error = reinterpret_cast<std::int32_t*>(m.host + floats);
      TIERKV_CUDA_TRY(cudaEventCreateWithFlags(&m.ready, cudaEventDisableTiming));
    }
    TIERKV_CUDA_TRY(cudaMalloc(&lse_dev_, lse_offset(layers()) * sizeof(float)));
    TIERKV_CUDA_TRY(cudaMalloc(&last_rows_, 2 * last_rows_floats() * sizeof(float)));
    if (opt_.center) {  // zeros until set or estimated: a decode captured before that reads them
      const std::size_t bytes = 2 * std::size_t(layers()) * mean_floats * sizeof(float);
      TIERKV_CUDA_TRY(cudaMalloc(&means_dev_, bytes));
      TIERKV_CUDA_TRY(cudaMemsetAsync(means_dev_, 0, bytes, stream_));
      means_known_.assign(std::size_t(layers()), 0);
    }
    mass_layer_.assign(std::size_t(mass_layers_), -1);
    const std::size_t slot_ints = append_error_offset() + append_error_ints;
    TIERKV_CUDA_TRY(cudaMalloc(&slots_dev_, slot_ints * sizeof(std::int32_t)));
    TIERKV_CUDA_TRY(cudaMallocHost(&slots_host_, slot_ints * sizeof(std::int32_t)));
    TIERKV_CUDA_TRY(cudaEventCreateWithFlags(&handoff_, cudaEventDisableTiming));
    TIERKV_CUDA_TRY(cudaEventCreateWithFlags(&slots_uploaded_, cudaEventDisableTiming));
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream_));  // pools poisoned, workspace zeroed
    return {};
  }

  static int device() {
    int d = 0;
    (void)cudaGetDevice(&d);
    return d;
  }

  // Page masses [layer or host slot][max_batch][max_pages]; decode's own lse [layer][max_batch]
  // [q_heads] when the caller passes none.
  // One half of prefill's mass-pass buffer: a query row per batch slot.
  std::size_t last_rows_floats() const {
    return std::size_t(opt_.max_batch) * std::size_t(Geometry::q_heads) *
           std::size_t(Geometry::head_dim);
  }
  std::size_t mass_offset(int j) const {
    return std::size_t(j) * std::size_t(opt_.max_batch) * std::size_t(opt_.max_pages);
  }
  std::size_t lse_offset(int layer) const {
    return std::size_t(layer) * std::size_t(opt_.max_batch) * Geometry::q_heads;
  }
  // The stream a step's launch goes to: the cache's, or `on` when that stream is capturing a
  // CUDA graph (to be replayed in the cache's stream order: a capture runs nothing itself).
  result<cudaStream_t> launch_stream(const char* what, std::optional<cudaStream_t> on) const {
    if (!on || *on == stream_) return stream_;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TIERKV_CUDA_TRY(cudaStreamIsCapturing(*on, &capturing));
    if (capturing != cudaStreamCaptureStatusActive)
      return status::make(errc::invalid_argument, what, ": stream ", static_cast<void*>(*on),
                          " is neither the cache's stream (", static_cast<void*>(stream_),
                          ") nor capturing a graph; set_stream moves the cache between steps");
    return *on;
  }
  // What decode and prefill read alike: layer `layer`'s index arrays, the pools, the queries, the
  // softmax scale and the codec contexts' seed, head base and layer.
  template <class Inputs>
  void set_layer_inputs(Inputs& in, int layer, const void* queries, query_type qtype) const {
    in.index = mirror_->view(layer);
    const auto views = storage_->views();
    for (int f = 0; f < num_tiers; ++f) in.pools[f] = views[std::size_t(f)];
    in.queries = queries;
    in.queries_type = qtype;
    in.softmax_scale =
        opt_.softmax_scale > 0.f ? opt_.softmax_scale : 1.f / std::sqrt(float(Geometry::head_dim));
    in.cache_seed = storage_->config().codec_seed;
    in.head_base = storage_->config().head_base;
    in.layer = layer;
    if (opt_.center) {
      in.key_mean = key_mean(layer);
      in.value_mean = value_mean(layer);
    }
  }
  // Centring means on the device: [layer][keys, values][kv_heads][head_dim].
  static constexpr std::size_t mean_floats = std::size_t(Geometry::kv_heads) * Geometry::head_dim;
  float* key_mean(int layer) const { return means_dev_ + 2 * std::size_t(layer) * mean_floats; }
  float* value_mean(int layer) const { return key_mean(layer) + mean_floats; }

  // The slot buffer: [layers][max_step_tokens] slots, [max_step_tokens] offsets, the step's
  // query offsets [max_batch + 1], the layers' page-mass flags [layers], then the appends' error
  // record (append_inputs::error, error_at).
  std::size_t qo_offset() const {
    return (std::size_t(layers()) + 1) * std::size_t(opt_.max_step_tokens);
  }
  std::size_t mass_on_offset() const { return qo_offset() + std::size_t(opt_.max_batch) + 1; }
  std::size_t append_error_offset() const { return mass_on_offset() + std::size_t(layers()); }
  static constexpr int append_error_ints = 5;  // errc, then layer, token, kv head, role

  // A step's append error record as a status naming the sequence, layer, position, head and
  // role; the sequence is poisoned (refused until released) when `poison`.
  status append_error_where(const std::int32_t* rec, std::span<const seq_id> batch,
                            std::span<const std::int32_t> new_tokens,
                            std::span<const std::int64_t> first_pos, bool poison) {
    const errc code = static_cast<errc>(rec[0]);
    std::int64_t n = rec[2];
    std::size_t b = 0;
    while (b < new_tokens.size() && n >= new_tokens[b]) n -= new_tokens[b++];
    if (b >= batch.size())  // a token beyond the step's: a bad slot (out_of_range)
      return status::make(code, "append: layer ", rec[1], ", token ", rec[2],
                          " of the step: ", to_string(code));
    const std::int64_t pos = first_pos[b] + n;
    if (poison && code == errc::non_finite_input && storage_->length(batch[b]))
      poisoned_.emplace(batch[b].value, poisoned_at{rec[1], pos});
    return status::make(code, "append: ", batch[b], " position ", pos, ", layer ", rec[1],
                        ", KV head ", rec[3], ", ", rec[4] == 0 ? "key" : "value", ": ",
                        to_string(code),
                        code == errc::non_finite_input
                            ? " (the K/V given held NaN or Inf; its attention outputs are NaN; "
                              "the sequence is refused until released)"
                            : "");
  }
  // A sequence holding non-finite K/V (append_error_where) is refused by `op`.
  status refuse_poisoned(seq_id s, const char* op) const {
    const auto it = poisoned_.find(s.value);
    if (it == poisoned_.end()) return {};
    return status::make(errc::non_finite_input, op, ": ", s,
                        " holds non-finite K/V appended at position ", it->second.position,
                        ", layer ", it->second.layer, "; release it");
  }
  // ---- the mirror's rows ---------------------------------------------------------------------
  void open_row(seq_id s) {
    const std::int32_t r = free_rows_.back();
    free_rows_.pop_back();
    row_of_[s.value] = r;
  }
  void close_row(seq_id s) {
    auto it = row_of_.find(s.value);
    free_rows_.push_back(it->second);
    row_of_.erase(it);
  }
  std::int32_t row_of(seq_id s) const { return row_of_.at(s.value); }

  // Mirrors s's committed logical pages from `from` on (their blocks and, for blocks the mirror
  // has not seen at this generation, every layer's page).
  void sync_rows(seq_id s, std::int64_t from) {
    const std::int32_t row = row_of(s);
    const std::int64_t pages = *storage_->logical_pages(s);
    for (std::int64_t p = from; p < pages; ++p) {
      const block_ref b = *storage_->block_of(s, p);
      mirror_->set_row(row, int(p), std::int32_t(b.index));
      if (known_gen_[b.index] == b.generation + 1) continue;
      known_gen_[b.index] = b.generation + 1;
      for (int l = 0; l < layers(); ++l) {
        const page_id pg = storage_->block_page(b, l);
        mirror_->set_page(b.index, l, pg.format, pg.slot);
      }
    }
  }

  // ---- reservations --------------------------------------------------------------------------
  status reserve_all(std::span<const seq_id> batch, std::span<const std::int32_t> n,
                     std::int64_t total) {
    const std::size_t T = std::size_t(opt_.max_step_tokens);
    // The last step's mapping upload must be done before reserve rewrites the buffer.
    TIERKV_CUDA_TRY(cudaEventSynchronize(slots_uploaded_));
    // One make_room for the step's whole need: per reservation, each call that finds tier 0
    // short waits for the retier batch in flight and scans every tier-0 page (the model-level
    // fill paid ~3 s a step that way, bench/results/model-gpu/torch-e2e-2026-12-03-endstep.json).
    std::uint64_t need = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      auto p = storage_->pages_to_open(batch[b], n[b]);
      if (!p) return p.error_status();
      need += *p;
    }
    if (need > 0) {
      const scoped_time room_timed{times_.make_room_ns};
      if (auto st = make_room(std::uint32_t(std::min<std::uint64_t>(need, UINT32_MAX))); !st)
        return st;
    }
    std::int64_t at = 0;
    std::size_t done = 0;
    status st;
    for (; done < batch.size(); ++done) {
      const std::int64_t k = n[done];
      if (k == 0) continue;
      slot_mapping m;
      m.slot = std::span<std::int32_t>(slots_host_ + at,
                                       (std::size_t(layers()) - 1) * T + std::size_t(k));
      m.layer_stride = std::int64_t(T);
      m.offset = std::span<std::int32_t>(slots_host_ + std::size_t(layers()) * T + std::size_t(at),
                                         std::size_t(k));
      if (st = storage_->reserve(batch[done], k, m, room()); !st) break;
      at += k;
    }
    if (!st) {
      for (std::size_t b = 0; b < done; ++b) (void)storage_->cancel(batch[b]);
      return st;
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (n[b] == 0) continue;
      const std::int64_t before = *storage_->logical_pages(batch[b]);
      (void)storage_->commit(batch[b], n[b]);
      sync_rows(batch[b], before > 0 ? before - 1 : 0);
    }
    step_tokens_ = total;
    if (total > 0) {
      for (int l = 0; l < layers(); ++l)
        TIERKV_CUDA_TRY(cudaMemcpyAsync(
            slots_dev_ + std::size_t(l) * T, slots_host_ + std::size_t(l) * T,
            std::size_t(total) * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
      TIERKV_CUDA_TRY(cudaMemcpyAsync(
          slots_dev_ + std::size_t(layers()) * T, slots_host_ + std::size_t(layers()) * T,
          std::size_t(total) * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream_));
      counters_.h2d_metadata_bytes += std::uint64_t(layers() + 1) * std::uint64_t(total) * 4;
    }  // slots_uploaded_ is recorded by begin_step, after the query offsets' copy
    return {};
  }

  // ---- memory pressure: demotions staged through the driver, blocking --------------------------
  auto room() {
    return [this](std::uint32_t pages) { return make_room(pages); };
  }
  // Each batch is published whole or not at all (pressure_plan refuses what demotions cannot
  // free before anything changes), so a refusal changes nothing, the totals included, as long
  // as the need fits one batch (max_retier_pages; a larger one keeps its earlier batches).
  status make_room(std::uint32_t pages) {
    if (storage_->free_pages(0) >= pages) return {};
    if (auto st = collect_retier(true); !st) return st;
    totals_.add(last_batch_);  // the end_step batch just published, before this call's own
    last_batch_ = retier_stats{};
    while (storage_->free_pages(0) < pages) {
      auto todo = controller_->pressure_plan(pages);
      if (!todo) return todo.error_status();
      if (todo->empty()) break;
      const std::size_t n = std::min(todo->size(), std::size_t(opt_.max_retier_pages));
      retier_stats st;
      auto queued = driver_->enqueue(*controller_, todo->first(n), stream_, st, faults_,
                                     /*all_or_none=*/true);
      if (!queued) return queued.error_status();
      if (*queued == 0) break;
      counters_.h2d_metadata_bytes += driver_->list_bytes();
      if (auto c = collect_retier(true); !c) return c;
      st.add(last_batch_);
      last_batch_ = retier_stats{};
      st.pressure_demoted += st.demoted;
      totals_.add(st);
    }
    if (storage_->free_pages(0) >= pages) return {};
    return status::make(errc::capacity_exhausted, "make_room: tier 0 still has ",
                        storage_->free_pages(0), " free pages of ", pages, " needed");
  }

  // Publishes a completed batch (wait: waits for it) and mirrors its pages; marks the decodes
  // enqueued so far as the last readers of the replaced pages; gives those back once idle
  // (wait: waits for the stream).
  status collect_retier(bool wait) {
    if (wait && driver_->batch_in_flight()) TIERKV_CUDA_TRY(cudaStreamSynchronize(side_));
    auto published = driver_->try_publish(*controller_, last_batch_, faults_);
    if (!published) return published.error_status();
    if (*published) {
      counters_.d2h_metadata_bytes += sizeof(int);
      for (const staged_conversion& sc : driver_->last_committed()) {
        if (!storage_->check_block(sc.block)) continue;
        const page_id pg = storage_->block_page(sc.block, sc.layer);
        mirror_->set_page(sc.block.index, sc.layer, pg.format, pg.slot);
      }
      if (auto st = driver_->mark_decodes_enqueued(stream_); !st) return st;
    }
    if (wait && driver_->pages_held() > 0) TIERKV_CUDA_TRY(cudaStreamSynchronize(stream_));
    auto back = driver_->reclaim();
    if (!back) return back.error_status();
    return {};
  }

  // ---- page mass -----------------------------------------------------------------------------
  // The layers whose masses end_step feeds this step: mass_layers_ of them, in turn.
  void choose_mass_layers() {
    for (int j = 0; j < mass_layers_; ++j)
      mass_layer_[std::size_t(j)] =
          int((std::uint64_t(steps_) * std::uint64_t(mass_layers_) + std::uint64_t(j)) %
              std::uint64_t(layers()));
    ++steps_;
  }
  // The sampled layers' masses start as NaN (all-ones bytes): a row that is still NaN at
  // end_step was not decoded this step (no decode or prefill of the layer, a graph not
  // replayed, a sequence with no new token) or came from a non-finite query, and is not fed. The
  // device says what ran, so a replayed graph that the host never saw call decode feeds the policy
  // too.
  status clear_sampled_masses() {
    for (int l : mass_layer_)
      TIERKV_CUDA_TRY(
          cudaMemsetAsync(mass_dev_ + mass_offset(l), 0xff, batch_mass_bytes(), stream_));
    return {};
  }
  // One sampled layer's masses of the step's batch: [batch][max_pages] floats.
  std::size_t batch_mass_bytes() const {
    return batch_.size() * std::size_t(opt_.max_pages) * sizeof(float);
  }
  // This step's sampled masses to page-locked memory, with the batch and layers they belong to.
  status queue_masses(mass_copy& m) {
    m.pending = false;
    if (batch_.empty()) return {};
    const std::size_t bytes = batch_mass_bytes();
    for (int j = 0; j < mass_layers_; ++j)
      TIERKV_CUDA_TRY(cudaMemcpyAsync(m.host + mass_offset(j),
                                      mass_dev_ + mass_offset(mass_layer_[std::size_t(j)]), bytes,
                                      cudaMemcpyDeviceToHost, stream_));
    TIERKV_CUDA_TRY(cudaMemcpyAsync(m.append_error, slots_dev_ + append_error_offset(),
                                    append_error_ints * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, stream_));
    TIERKV_CUDA_TRY(cudaEventRecord(m.ready, stream_));
    counters_.d2h_metadata_bytes +=
        std::uint64_t(mass_layers_) * bytes + append_error_ints * sizeof(std::int32_t);
    m.batch = batch_;
    m.layers = mass_layer_;
    m.new_tokens = step_tokens_of_;
    m.first_pos = step_first_pos_;
    m.pending = true;
    return {};
  }
  // Feeds a queued copy to the policy. A sequence released since is skipped; one that grew is
  // fed a row of its present page count, whose new pages read NaN (no signal).
  status feed_masses(mass_copy& m) {
    if (!m.pending) return {};
    m.pending = false;
    {
      const scoped_time wait_timed{times_.mass_wait_ns};
      TIERKV_CUDA_TRY(cudaEventSynchronize(m.ready));
    }
    const scoped_time fold_timed{times_.mass_fold_ns};
    if (m.append_error[0] != 0 && append_report_.is_ok())  // end_step returns the first
      append_report_ = append_error_where(m.append_error, m.batch, m.new_tokens, m.first_pos, true);
    for (std::size_t j = 0; j < m.layers.size(); ++j) {
      const int l = m.layers[j];
      for (std::size_t b = 0; b < m.batch.size(); ++b) {
        const auto pages = storage_->logical_pages(m.batch[b]);
        if (!pages) continue;
        const std::span<const float> row(
            m.host + mass_offset(int(j)) + b * std::size_t(opt_.max_pages), std::size_t(*pages));
        if (row.empty() || std::isnan(row[0])) continue;
        if (observer_) observer_(m.batch[b], l, row);
        if (auto st = controller_->observe_mass(m.batch[b], l, row); !st) return st;
      }
    }
    return {};
  }

  // Share of each tier among used pages: the plan's estimate of a sequence's pages per tier
  // (it only balances chunks; the kernels read the real formats).
  std::array<double, num_tiers> tier_shares() const {
    std::array<double, num_tiers> used{};
    double total = 0;
    for (int f = 0; f < num_tiers; ++f) {
      used[std::size_t(f)] =
          double(opt_.storage.pages_per_tier[std::size_t(f)] - storage_->free_pages(f));
      total += used[std::size_t(f)];
    }
    if (total == 0) return {1.0};  // an empty cache: every page would be new, in tier 0
    for (auto& u : used) u /= total;
    return used;
  }

  // Adds the nanoseconds its scope lasted to a host_times field (every return path counts).
  struct scoped_time {
    using clock = std::chrono::steady_clock;
    std::uint64_t& ns;
    clock::time_point t0 = clock::now();
    ~scoped_time() {
      ns += std::uint64_t(
          std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count());
    }
  };

  options opt_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;
  int sm_count_ = 0;
  std::unique_ptr<storage_type> storage_;
  std::unique_ptr<controller_type> controller_;
  std::unique_ptr<driver_type> driver_;
  std::unique_ptr<mirror_type> mirror_;
  std::unique_ptr<prefix_type> prefixes_;
  std::vector<std::uint32_t> known_gen_;  // per block: generation + 1 the mirror holds (0: none)
  std::unordered_map<std::uint32_t, std::int32_t> row_of_;  // seq_id value -> mirror row
  std::vector<std::int32_t> free_rows_;
  decode_plan plan_{};
  void* workspace_ = nullptr;
  prefill_plan prefill_plan_{};
  void* prefill_workspace_ = nullptr;
  // The step.
  bool stepping_ = false;
  std::uint64_t steps_ = 0;
  std::int64_t step_tokens_ = 0;
  std::vector<seq_id> batch_;
  std::vector<std::int32_t> rows_, pages_, lens_;
  std::vector<std::int32_t> step_tokens_of_;  // the step's new tokens per sequence
  std::vector<std::int64_t> step_first_pos_;  // and the position of its first
  // Sequences whose appended K/V held NaN / Inf (append_error_where), by id: refused until
  // released.
  struct poisoned_at {
    int layer = 0;
    std::int64_t position = 0;
  };
  std::unordered_map<std::uint32_t, poisoned_at> poisoned_;
  status append_report_;  // the first append error a feed found, for end_step to return
  // Page mass: every layer's on the device, [layer][max_batch][max_pages]; the mass_layers_
  // layers sampled a step are copied to the host, [slot][max_batch][max_pages], two steps'
  // copies in turn (end_step feeds the previous step's).
  int mass_layers_ = 0;
  std::vector<int> mass_layer_;  // per host slot: the layer sampled this step
  float* mass_dev_ = nullptr;
  float* lse_dev_ = nullptr;
  // prefill's mass pass: the chunks' last rows [max_batch][q_heads][head_dim], then their outputs
  float* last_rows_ = nullptr;
  float* means_dev_ = nullptr;             // centring means (center only)
  std::vector<std::uint8_t> means_known_;  // per layer: set or estimated
  std::array<mass_copy, 2> mass_copies_;
  int mass_turn_ = 0;
  cudaEvent_t handoff_ = nullptr;  // set_stream's ordering of the new stream after the old
  // Slot mapping of the step's tokens: [layers][max_step_tokens] slots, then offsets.
  std::int32_t* slots_dev_ = nullptr;
  std::int32_t* slots_host_ = nullptr;
  cudaEvent_t slots_uploaded_ = nullptr;
  mass_observer observer_;
  [[no_unique_address]] Faults faults_{};
  retier_stats last_batch_;  // what try_publish committed, folded into the next step's stats
  retier_stats totals_;
  transfer_counters counters_;
  host_times times_;
};

}  // namespace tierkv::cuda
