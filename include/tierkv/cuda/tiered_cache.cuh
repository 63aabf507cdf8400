// SPDX-License-Identifier: Apache-2.0
// cuda::tiered_cache: the cache wholly on the GPU, the façade an engine drives. Pages live in
// device memory; the host keeps only metadata (page tables, policy state) and never reads or
// writes page bytes (device_allocator is not host accessible, so no host codec path compiles
// here). It owns the storage, the tier controller, the retier driver (conversions on a side
// stream), a device mirror of the page table (page_table_mirror.cuh), a prefix index (sealed
// pages shared by reference across requests) and the decode plan and workspace. Each part it
// owns is a header of cuda/cache/ (docs/gpu-cache.md, "Layout"); its buffers are RAII owners
// (cuda/device_buffer.cuh).
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
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "tierkv/centering.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/cuda/append/append.cuh"
#include "tierkv/cuda/cache/append_errors.cuh"
#include "tierkv/cuda/cache/centering_means.cuh"
#include "tierkv/cuda/cache/host_tier.cuh"
#include "tierkv/cuda/cache/options.cuh"
#include "tierkv/cuda/cache/page_mass.cuh"
#include "tierkv/cuda/cache/page_transfer.cuh"
#include "tierkv/cuda/cache/retier_loop.cuh"
#include "tierkv/cuda/cache/step_index.cuh"
#include "tierkv/cuda/cache/step_slots.cuh"
#include "tierkv/cuda/check.cuh"
#include "tierkv/cuda/decode.cuh"
#include "tierkv/cuda/decode_plan.cuh"
#include "tierkv/cuda/device_buffer.cuh"
#include "tierkv/cuda/page_table_mirror.cuh"
#include "tierkv/cuda/prefill.cuh"
#include "tierkv/cuda/prefill/last_rows.cuh"
#include "tierkv/cuda/prefill_plan.cuh"
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
  // The members go in reverse order: the retier driver, the controller, the mirror, the prefix
  // index (its page references), the storage, then the buffers.
  ~tiered_cache() {
    (void)host_.await_all(stream_);  // restore copies still writing pages, too
    if (stream_) (void)cudaStreamSynchronize(stream_);
    retier_.shutdown(stream_);  // publish or drop what is in flight, give held pages back
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
    return detail::validate_cache_limits(opt, layers_max, packed_page::max_slots);
  }

  // ---- sequences -----------------------------------------------------------------------------
  /// A new, empty sequence (and its mirror row).
  result<seq_id> create_sequence() {
    auto s = storage_->create_sequence();
    if (!s) return s;
    index_.open_row(*s);
    return s;
  }
  /// Shares every sealed page; the open tail page is copied on the stream (device to device).
  /// Refusals come before any demotion, as on the host.
  result<seq_id> fork(seq_id parent) {
    if (stepping_)
      return status(errc::invalid_argument, "fork: not between begin_step and end_step");
    if (auto st = poisoned_.refuse(parent, "fork"); !st) return st;
    if (auto st = host_.await(parent, stream_); !st) return st;
    auto s = storage_->fork(parent, room());
    if (!s) return s;
    mirror_new_sequence(*s);
    return s;
  }
  /// Releases s: its pages go back to their pools once nothing else holds them. Between
  /// steps only.
  status release(seq_id s) {
    if (stepping_)
      return status(errc::invalid_argument, "release: not between begin_step and end_step");
    if (auto st = host_.await(s, stream_); !st) return st;  // its pages are reused after
    if (auto st = storage_->release(s); !st) return st;
    index_.close_row(s);
    poisoned_.forget(s);
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
    if (auto st = poisoned_.refuse(s, "insert_prefix"); !st) return st;
    if (auto st = host_.await(s, stream_); !st) return st;  // new sequences read its pages
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
    mirror_new_sequence(st->seq);
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
    if (auto st = host_.await(s, stream_); !st) return st;
    return detail::export_device_pages(*storage_, s, first, count, heads, stream_, counters_);
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
        if (!means_.known(l))
          return status::make(errc::invalid_argument, "import_pages: layer ", l,
                              "'s centring means are not set; the pages are centred with their "
                              "source's means: set_centering with those first; nothing imported");
    if (info->logical_pages > std::uint32_t(opt_.max_pages))
      return status::make(errc::out_of_range, "import_pages: the buffer holds ",
                          info->logical_pages, " logical pages, max_pages = ", opt_.max_pages,
                          "; nothing imported");
    auto fit = detail::fit_new_sequence<Roles::stale>(*storage_, import_needs(*info), "import",
                                                      timed_room());
    if (!fit) return fit;
    auto seq = detail::copy_import(*storage_, *info, buf, stream_, counters_);
    if (!seq) return seq;
    mirror_new_sequence(*seq);
    return seq;
  }

  // ---- host tier: whole sequences parked in pinned host memory (cache/host_tier.cuh) ---------
  /// Parks every page of s in the host tier (options::host_pool_bytes of pinned memory), in
  /// its tiers' compressed formats, and releases s on the GPU: its pages go back to their pools
  /// once nothing else holds them (pages a prefix entry or a fork shares stay). Returns the
  /// handle restore takes. The device-to-host copy is queued on the stream after every write
  /// queued before it, and no later work can overwrite a page before the copy has read it (it
  /// is reused only by work queued after it): the host does not wait. Between steps. Refusals
  /// change nothing: an unknown or poisoned s, no host tier, the host pool short
  /// (capacity_exhausted naming the bytes needed and the largest free run). Pins are not kept
  /// (pin again after restore); the controller sees a restored sequence at its next plan.
  result<parked_id> offload(seq_id s) {
    if (stepping_)
      return status(errc::invalid_argument, "offload: not between begin_step and end_step");
    if (auto st = poisoned_.refuse(s, "offload"); !st) return st;
    if (auto st = host_.await(s, stream_); !st) return st;
    auto id = host_.park(*storage_, s, stream_, counters_, retier_.faults());
    if (!id) return id;
    if (auto st = release(s); !st) {  // s was checked: only an internal error gets here
      (void)host_.drop(*id);
      return st;
    }
    return id;
  }

  /// A NEW sequence holding parked `id`'s pages byte for byte (same tiers, same length), the
  /// handle consumed. Checked first, as import_pages is: max_pages, then the capacity (a
  /// sequence slot, blocks, every pool at the restore's peak; tier 0 made room for by demotion
  /// when that alone is short); a refusal leaves `id` parked and the cache as it was. The
  /// host-to-device copy runs on the host tier's own stream, after the work queued on the
  /// stream so far, and the host does not wait: steps of other sequences enqueued meanwhile
  /// overlap it (restore ahead of need: a prefetch), and every reader of the new pages waits
  /// for it (the first work on the stream that touches the sequence: a step that includes it,
  /// fork, export_pages, offload, insert_prefix, release; a retier batch). restore_pending says
  /// whether that wait would still find the copy running. Between steps.
  result<seq_id> restore(parked_id id) {
    if (stepping_)
      return status(errc::invalid_argument, "restore: not between begin_step and end_step");
    auto need = host_.need(id);
    if (!need) return need.error_status();
    if (need->blocks > std::uint32_t(opt_.max_pages))
      return status::make(errc::out_of_range, "restore: parked sequence ", id, " holds ",
                          need->blocks, " logical pages, max_pages = ", opt_.max_pages,
                          "; nothing restored");
    auto fit = detail::fit_new_sequence<Roles::stale>(*storage_, *need, "restore", timed_room());
    if (!fit) return fit;
    auto seq = host_.unpark(*storage_, id, stream_, counters_, retier_.faults());
    if (!seq) return seq;
    mirror_new_sequence(*seq);
    return seq;
  }

  /// Whether s's restore copy may still be running (a step that includes s would wait for it
  /// on the GPU; an engine can schedule other sequences meanwhile).
  bool restore_pending(seq_id s) { return host_.restoring(s); }
  /// Makes the stream wait (on the GPU; the host does not) for s's restore copy, as the first
  /// step that includes s would: for work of the caller's own that reads after it.
  status await_restore(seq_id s) { return host_.await(s, stream_); }
  /// Forgets parked `id` (its host memory is reused once its offload copy has run).
  status drop_parked(parked_id id) { return host_.drop(id); }
  /// Tokens of parked `id` (stale_id once restored or dropped).
  result<std::int64_t> parked_length(parked_id id) const { return host_.length(id); }
  /// The host tier's occupancy and traffic.
  host_tier_stats host_stats() { return host_.stats(); }

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
    const detail::scoped_time timed{times_.begin_step_ns};
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
      if (auto st = poisoned_.refuse(batch[b], "begin_step"); !st) return st;
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
    for (const seq_id s : batch)  // a restore still copying its pages
      if (auto st = host_.await(s, stream_); !st) return st;
    // Publish a finished retier batch first: the index arrays below name its pages.
    if (auto st = retier_.collect(/*wait=*/false, stream_); !st) return st;
    step_tokens_of_.assign(new_tokens.begin(), new_tokens.end());
    step_first_pos_.resize(batch.size());
    for (std::size_t b = 0; b < batch.size(); ++b) step_first_pos_[b] = *storage_->length(batch[b]);
    if (auto st = reserve_all(batch, new_tokens, total); !st) return st;
    if (auto st = slots_.upload_offsets(new_tokens, stream_, counters_.h2d_metadata_bytes); !st)
      return st;
    masses_.choose_layers();  // the layers whose decode computes the page mass this step
    if (auto st =
            slots_.upload_flags(masses_.sampled_layers(), stream_, counters_.h2d_metadata_bytes);
        !st)
      return st;

    batch_.assign(batch.begin(), batch.end());
    index_.prepare(batch, *storage_);
    {
      const detail::scoped_time index_timed{times_.index_ns};
      auto plan = index_.build(sm_count_, stream_, counters_.h2d_metadata_bytes);
      if (!plan) return plan.error_status();
      plan_ = *plan;
    }
    if (auto st = masses_.clear(batch_.size(), stream_); !st) return st;
    stepping_ = true;
    return {};
  }

  /// Makes `s` the cache's stream (between steps): later steps, forks and conversions order on
  /// it, after everything already enqueued on the old one (an event hand-off, no host wait).
  status set_stream(cudaStream_t s) {
    if (stepping_)
      return status(errc::invalid_argument, "set_stream: not between begin_step and end_step");
    if (s == stream_) return {};
    TIERKV_CUDA_TRY(cudaEventRecord(handoff_.get(), stream_));
    TIERKV_CUDA_TRY(cudaStreamWaitEvent(s, handoff_.get(), 0));
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
    in.slot = slots_.slots(layer);
    in.offset = slots_.offsets();
    in.tokens = int(step_tokens_);
    in.layers = 1;
    in.pool = storage_->views()[0];
    in.cache_seed = storage_->config().codec_seed;
    in.head_base = storage_->config().head_base;
    in.layer_base = layer;
    in.error = slots_.append_error();
    in.error_at = in.error + 1;
    if (opt_.center) {
      in.key_mean = means_.keys(layer);
      in.value_mean = means_.values(layer);
      if (!means_.known(layer))  // the first tokens of the layer: their means
        return means_.template estimate_and_append<append_tier>(in, layer, *stream);
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
    if (const std::size_t parked = host_.parked_count(); parked != 0)
      return status::make(errc::invalid_argument, "set_centering: ", parked,
                          " parked sequences' pages were encoded against the present means; "
                          "restore or drop them first");
    auto bytes = means_.set(layer, mu_k, mu_v, stream_);
    if (!bytes) return bytes.error_status();
    counters_.h2d_metadata_bytes += *bytes;
    return {};
  }
  /// Whether layer's centring means are set (given or estimated); false without centring.
  bool centering_known(int layer) const {
    return opt_.center && layer >= 0 && layer < layers() && means_.known(layer);
  }
  /// Layer's centring means on the device ([kv_head][head_dim] floats each; nullptr without
  /// centring): an engine moving pages to another cache gives it the same means.
  const float* centering_keys(int layer) const {
    return opt_.center ? means_.keys(layer) : nullptr;
  }
  /// Layer's value means on the device (nullptr without centring).
  const float* centering_values(int layer) const {
    return opt_.center ? means_.values(layer) : nullptr;
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
    in.lse = lse != nullptr ? lse : lse_.get() + lse_offset(layer);
    in.page_mass = masses_.layer_mass(layer);
    in.page_mass_stride = opt_.max_pages;
    in.page_mass_on = slots_.mass_flag(layer);
    return cuda::decode<Geometry, Tiers, Path>(plan_, in, workspace_.get(), plan_.workspace_bytes,
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
    in.q_indptr = slots_.query_offsets();
    in.soft_cap = soft_cap;
    in.window = window;
    in.out = out;
    in.out_type = otype;
    in.lse = lse;
    if (auto st = cuda::prefill<Geometry, Tiers>(prefill_plan_, in, prefill_workspace_.get(),
                                                 prefill_plan_.workspace_bytes, *stream);
        !st)
      return st;
    if (!slots_.mass_flag_set(layer)) return {};
    if (auto st =
            gather_last_rows(queries, qtype, slots_.query_offsets(), int(batch_.size()),
                             Geometry::q_heads * Geometry::head_dim, last_rows_.get(), *stream);
        !st)
      return st;
    float* outputs = last_rows_.get() + last_rows_floats();  // the buffer's second half
    return decode(layer, last_rows_.get(), query_type::f32, outputs, output_type::f32, nullptr,
                  soft_cap, window, *stream);
  }

  /// Ends the step: queues the copy of this step's sampled page masses to the host, feeds the
  /// policy the previous step's (its work came before this step's on the stream, so the host
  /// does not wait for this step: its planning overlaps the GPU's step), and enqueues the
  /// conversions the policy wants at `step` on the side stream (published by a later
  /// begin_step or end_step once complete). wait = true feeds this step's masses too and
  /// finishes the batch, giving the replaced pages back, before returning (tests, shutdown).
  result<retier_stats> end_step(std::uint64_t step, bool wait = false) {
    if (!stepping_) return status(errc::invalid_argument, "end_step: call begin_step first");
    const detail::scoped_time timed{times_.end_step_ns};
    ++times_.steps;
    stepping_ = false;
    auto& now = masses_.take_turn();
    if (auto st = masses_.queue(now, batch_, step_tokens_of_, step_first_pos_,
                                slots_.append_error(), stream_, counters_.d2h_metadata_bytes);
        !st)
      return st;
    if (auto st = feed_masses(masses_.previous()); !st) return st;
    if (wait)
      if (auto st = feed_masses(now); !st) return st;
    retier_stats st;
    {
      const detail::scoped_time retier_timed{times_.retier_ns};
      if (auto c = retier_.collect(wait, stream_); !c) return c;
    }
    std::span<const conversion> todo;
    {
      const detail::scoped_time plan_timed{times_.plan_ns};
      todo = controller_->plan(step);
    }
    {
      const detail::scoped_time retier_timed{times_.retier_ns};
      if (!todo.empty())  // a batch may convert pages a restore is still copying
        if (auto c = host_.await_all(retier_.side_stream()); !c) return c;
      if (auto c = retier_.enqueue(todo, stream_, st); !c) return c;
      if (wait)
        if (auto c = retier_.collect(true, stream_); !c) return c;
    }
    st = retier_.finish_step(st);
    if (!append_report_.is_ok()) return std::exchange(append_report_, status{});
    return st;
  }

  // ---- accounting ----------------------------------------------------------------------------
  /// Exact accounting of the storage's memory (make_report).
  memory_report report() const { return make_report(*storage_); }
  /// The storage's, the controller's and the prefix index's invariants, the retier driver's
  /// pages (a batch in flight, replaced pages not yet back) accounted for.
  status check_invariants() const {
    const std::uint32_t outstanding = retier_.pages_outstanding();
    if (auto st = prefixes_->check_invariants(); !st) return st;
    return controller_->check_invariants(outstanding);
  }
  /// Finishes the retier batch in flight and gives the replaced pages back (blocks on the GPU):
  /// afterwards every live page is one that a block names (before a report meant to show the
  /// steady state, or shutdown). Between steps.
  status drain() {
    if (stepping_)
      return status(errc::invalid_argument, "drain: not between begin_step and end_step");
    if (auto st = retier_.collect(true, stream_); !st) return st;
    retier_.fold_last_batch();
    return {};
  }
  /// The device check of the last begin_step's index build and decodes (synchronizes).
  status device_error() {
    if (auto st = index_.mirror().error(stream_); !st) return st;
    std::int32_t rec[detail::append_error_ints];
    TIERKV_CUDA_TRY(
        cudaMemcpyAsync(rec, slots_.append_error(), sizeof rec, cudaMemcpyDeviceToHost, stream_));
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream_));
    if (rec[0] != 0)
      return poisoned_.append_error_where(rec, batch_, step_tokens_of_, step_first_pos_, false,
                                          *storage_);
    auto e = decode_device_error(plan_, workspace_.get(), stream_);
    if (!e) return e.error_status();
    if (*e != errc::ok)
      return status::make(*e, "decode: a page slot beyond its pool or a page beyond max_pages");
    auto pe = prefill_device_error(prefill_plan_, prefill_workspace_.get(), stream_);
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
  const retier_stats& retier_totals() const noexcept { return retier_.totals(); }
  /// Sets the observer of the page masses the policy is fed (empty: none).
  void set_mass_observer(mass_observer f) { observer_ = std::move(f); }

  /// The paged storage.
  storage_type& storage() noexcept { return *storage_; }
  /// The paged storage (read-only).
  const storage_type& storage() const noexcept { return *storage_; }
  /// The tier controller.
  controller_type& controller() noexcept { return *controller_; }
  /// The conversion fault hook (tiering/conversion.hpp).
  Faults& faults() noexcept { return retier_.faults(); }
  /// The device mirror of the page table.
  const mirror_type& mirror() const noexcept { return index_.mirror(); }
  /// The decode plan of the current step.
  const decode_plan& plan() const noexcept { return plan_; }
  /// The engine's stream (appends, decodes, fork copies).
  cudaStream_t stream() const noexcept { return stream_; }
  /// The side stream of the retier batches.
  cudaStream_t side_stream() const noexcept { return retier_.side_stream(); }
  /// The options the cache was created with.
  const options& config() const noexcept { return opt_; }
  /// Layers of the cache (opt.storage.num_layers).
  int layers() const noexcept { return opt_.storage.num_layers; }

 private:
  tiered_cache(const options& opt, cudaStream_t stream) : opt_(opt), stream_(stream) {}

  // The pieces and buffers in a fixed order: a failure returns the first error.
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
    if (auto st = retier_.create(*storage_, *controller_, index_, counters_, opt_.max_retier_pages);
        !st)
      return st;
    const decode_capacity cap{opt_.max_batch, opt_.max_chunks_per_seq, opt_.max_pages, true};
    if (auto st = index_.create(*storage_, cap, layers()); !st) return st;

    auto plan = plan_decode<Geometry, Tiers>(cap, nullptr, 0, sm_count_);
    if (!plan) return plan.error_status();
    plan_ = *plan;
    if (auto st = workspace_.allocate(plan_.workspace_bytes); !st) return st;
    if (auto st = decode_workspace_init(plan_, workspace_.get(), plan_.workspace_bytes, stream_);
        !st)
      return st;
    // a chunk is at most a step's tokens, and so are all chunks together
    auto pplan = plan_prefill<Geometry>(opt_.max_batch, opt_.max_step_tokens, opt_.max_step_tokens,
                                        sm_count_);
    if (!pplan) return pplan.error_status();
    prefill_plan_ = *pplan;
    if (auto st = prefill_workspace_.allocate(prefill_plan_.workspace_bytes); !st) return st;
    if (auto st = prefill_workspace_init(prefill_plan_, prefill_workspace_.get(),
                                         prefill_plan_.workspace_bytes, stream_);
        !st)
      return st;
    if (auto st =
            masses_.allocate(layers(), opt_.mass_layers_per_step, opt_.max_batch, opt_.max_pages);
        !st)
      return st;
    if (auto st = lse_.allocate(lse_offset(layers())); !st) return st;
    if (auto st = last_rows_.allocate(2 * last_rows_floats()); !st) return st;
    if (opt_.center)
      if (auto st = means_.allocate(layers(), stream_); !st) return st;
    if (auto st = slots_.allocate(layers(), opt_.max_step_tokens, opt_.max_batch); !st) return st;
    if (auto st = handoff_.create(); !st) return st;
    if (auto st = slots_.create_event(); !st) return st;
    if (auto st = host_.init(opt_.host_pool_bytes, opt_.host_copy,
                             std::uint32_t(opt_.host_restore_chunk));
        !st)
      return st;
    TIERKV_CUDA_TRY(cudaStreamSynchronize(stream_));  // pools poisoned, workspace zeroed
    return {};
  }

  static int device() {
    int d = 0;
    (void)cudaGetDevice(&d);
    return d;
  }

  // One half of prefill's mass-pass buffer: a query row per batch slot.
  std::size_t last_rows_floats() const {
    return std::size_t(opt_.max_batch) * std::size_t(Geometry::q_heads) *
           std::size_t(Geometry::head_dim);
  }
  // Decode's own lse, [layer][max_batch][q_heads], when the caller passes none.
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
    in.index = index_.mirror().view(layer);
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
      in.key_mean = means_.keys(layer);
      in.value_mean = means_.values(layer);
    }
  }
  // A sequence new to the cache (forked, started from a prefix, imported): its mirror row.
  void mirror_new_sequence(seq_id s) {
    index_.open_row(s);
    index_.sync_rows(*storage_, s, 0);
  }

  // ---- reservations --------------------------------------------------------------------------
  status reserve_all(std::span<const seq_id> batch, std::span<const std::int32_t> n,
                     std::int64_t total) {
    // The last step's mapping upload must be done before reserve rewrites the buffer.
    if (auto st = slots_.wait_uploaded(); !st) return st;
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
      const detail::scoped_time room_timed{times_.make_room_ns};
      if (auto st = make_room(std::uint32_t(std::min<std::uint64_t>(need, UINT32_MAX))); !st)
        return st;
    }
    if (auto st = slots_.reserve(
            *storage_, batch, n, room(),
            [this](seq_id s, std::int64_t from) { index_.sync_rows(*storage_, s, from); });
        !st)
      return st;
    step_tokens_ = total;
    // its completion event is recorded by begin_step, after the query offsets' copy
    return slots_.upload_mapping(total, stream_, counters_.h2d_metadata_bytes);
  }

  // ---- memory pressure: demotions staged through the retier driver, blocking -----------------
  auto room() {
    return [this](std::uint32_t pages) { return make_room(pages); };
  }
  // make_room for a new sequence (import, restore), its time counted as begin_step's is
  auto timed_room() {
    return [this](std::uint32_t pages) {
      const detail::scoped_time room_timed{times_.make_room_ns};
      return make_room(pages);
    };
  }
  status make_room(std::uint32_t pages) {
    if (storage_->free_pages(0) >= pages) return {};
    if (auto st = host_.await_all(retier_.side_stream()); !st) return st;  // see end_step
    return retier_.make_room(pages, stream_);
  }

  // Feeds a queued copy of page masses to the policy (and its observer); its append error, the
  // first one found, is what end_step returns.
  status feed_masses(detail::page_mass_sampler::sampled_copy& m) {
    return masses_.feed(
        m, *storage_, times_,
        [this](const detail::page_mass_sampler::sampled_copy& c) {
          if (append_report_.is_ok())
            append_report_ = poisoned_.append_error_where(c.append_error, c.batch, c.new_tokens,
                                                          c.first_pos, true, *storage_);
        },
        [this](seq_id s, int layer, std::span<const float> row) {
          if (observer_) observer_(s, layer, row);
          return controller_->observe_mass(s, layer, row);
        });
  }

  options opt_;
  cudaStream_t stream_ = nullptr;
  int sm_count_ = 0;
  decode_plan plan_{};
  device_buffer<std::uint8_t> workspace_;
  prefill_plan prefill_plan_{};
  device_buffer<std::uint8_t> prefill_workspace_;
  device_buffer<float> lse_;
  // prefill's mass pass: the chunks' last rows [max_batch][q_heads][head_dim], then their outputs
  device_buffer<float> last_rows_;
  detail::device_centering_means<Geometry> means_;  // center only
  detail::page_mass_sampler masses_;
  detail::step_slots slots_;
  cuda_event handoff_;  // set_stream's ordering of the new stream after the old
  // The step.
  bool stepping_ = false;
  std::int64_t step_tokens_ = 0;
  std::vector<seq_id> batch_;
  std::vector<std::int32_t> step_tokens_of_;  // the step's new tokens per sequence
  std::vector<std::int64_t> step_first_pos_;  // and the position of its first
  detail::poisoned_sequences poisoned_;       // refused until released
  status append_report_;  // the first append error a feed found, for end_step to return
  mass_observer observer_;
  transfer_counters counters_;
  host_times times_;
  host_tier<storage_type> host_;  // parked sequences (its copies end before the pools go)
  // What holds pages, built in this order by init and destroyed in reverse: the retier driver
  // first, the storage last.
  std::unique_ptr<storage_type> storage_;
  std::unique_ptr<prefix_type> prefixes_;
  using index_type = detail::step_index<storage_type, Geometry, Tiers>;
  index_type index_;
  std::unique_ptr<controller_type> controller_;
  detail::retier_loop<storage_type, controller_type, index_type, Faults> retier_;
};

}  // namespace tierkv::cuda
