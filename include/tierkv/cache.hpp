// SPDX-License-Identifier: Apache-2.0
// tiered_cache: the façade an engine uses. It composes the paged storage (pools per
// tier, page tables, fork), the tier controller (policy state, conversions, memory
// pressure) and host decode attention, whose per-page attention mass feeds the
// controller directly (no dense view). Thin on purpose: each part stays usable alone.
//
//   using cache = tierkv::tiered_cache<geometry, tierkv::tiers<fp8, tq3>>;
//   auto c = cache::create(opts).value();
//   auto s = c->create_sequence().value();
//   c->append(s, n, keys, values);              // [layer][token][kv_head][dim]
//   // or layer by layer: c->reserve(s, n, mapping); c->write_layer(s, l, k, v) (or a
//   // kernel into the mapped slots) for every layer; c->commit(s, n)
//   for (int l = 0; l < layers; ++l) c->attend(l, batch, queries, out);
//   c->retier(step);                            // once per scheduler step
//   std::cout << c->report();
//
// or a step in the GPU façade's verbs (cuda::tiered_cache), so an engine drives both alike:
//   c->begin_step(batch, new_tokens);           // reserve, all or none
//   for (int l = 0; l < layers; ++l) {
//     c->append(l, k, v);                       // the step's tokens of layer l, batch order
//     c->decode(l, q, out);                     // or c->prefill(l, q, out) for chunks
//   }
//   c->end_step(step);                          // commit, retier
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "tierkv/attention/host_decode.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/attention/host_workspace.hpp"
#include "tierkv/centering.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/counted_allocator.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/report.hpp"
#include "tierkv/tiering/conversion.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"
#include "tierkv/tiering/tier_policy.hpp"
#include "tierkv/tiering/tier_roles.hpp"

namespace tierkv {

/// The options of a tiered_cache (tiered_cache::options); tiered_cache::validate checks them all.
template <class Policy, int NumTiers>
struct tiered_cache_options {
  storage_options<NumTiers> storage{};  ///< layers, sequences, pages per tier, codec seed
  Policy policy{};                      ///< the tier policy's knobs (a copy is kept)
  tier_controller_options
      tiering{};         ///< the controller's knobs (memory pressure, incremental plan)
  int max_batch = 64;    ///< sequences per attend() call
  int max_pages = 4096;  ///< logical pages per sequence: attend() reads, append() grows up to this
  unsigned threads = 1;  ///< host attention workers (the caller included; 0 = all cores), <= 1024
  float softmax_scale = 0.f;  ///< 0: 1 / sqrt(head_dim)
  float soft_cap = 0.f;       ///< logit soft cap (0 = off)
  /// Centring (centering.hpp): each layer's per-(KV head) channel means of keys and values are
  /// subtracted before encoding and added back to attend()'s outputs and LSE, exactly. The
  /// means are set_centering()'s, or else those of the first tokens appended to (or written
  /// to) the layer. Not with soft_cap (not exact there).
  bool center = false;
};

/// The host façade: paged storage (a pool per tier, page tables, fork), the tier controller
/// (policy state, conversions, memory pressure) and host decode attention over the mixed pages.
/// Driven by one thread at a time (docs/threading.md).
template <class Geometry, class Tiers, tier_policy Policy = policy::recency_anchor,
          allocator_policy PageAlloc = host_allocator,
          host_allocator_policy MetaAlloc = host_allocator, class Roles = tier_roles<Tiers>,
          conversion_fault_hook Faults = no_faults>
class tiered_cache {
  static_assert(
      PageAlloc::host_accessible,
      "tiered_cache: this façade attends and converts on the host, so its pages must be host "
      "accessible (host_allocator or pinned_host_allocator); device caches compose cuda/ kernels");

 public:
  using storage_type =
      paged_storage<Geometry, Tiers, PageAlloc, MetaAlloc>;  ///< the paged storage it owns
  using controller_type =
      tier_controller<storage_type, Policy, Roles>;           ///< the tier controller it owns
  using options = tiered_cache_options<Policy, Tiers::size>;  ///< what create() takes
  static constexpr int num_tiers = Tiers::size;               ///< tiers in the tier list
  static constexpr int head_dim = Geometry::head_dim;         ///< scalars per head vector
  static constexpr int q_heads = Geometry::q_heads;  ///< query heads (kv_heads x group_size)

  tiered_cache(const tiered_cache&) = delete;
  tiered_cache& operator=(const tiered_cache&) = delete;
  ~tiered_cache() {
    // Members that hold storage bookkeeping go first, the storage last.
    mass_.reset();
    means_.reset();
    index_.reset();
    controller_.reset();
  }

  static constexpr unsigned max_threads = 1024;  ///< largest options::threads

  /// Every option is checked (invalid_argument naming it, its value and the limit) before
  /// anything is allocated; allocation failures after that are returned, nothing leaks.
  static result<std::unique_ptr<tiered_cache>> create(const options& opt, PageAlloc page_alloc = {},
                                                      MetaAlloc meta_alloc = {}) {
    if (auto st = validate(opt); !st) return st;
    auto s = storage_type::create(opt.storage, std::move(page_alloc), std::move(meta_alloc));
    if (!s) return s.error_status();
    std::unique_ptr<tiered_cache> c(new tiered_cache(opt, std::move(*s)));
    auto ctl = controller_type::create(*c->storage_, opt.policy, opt.tiering);
    if (!ctl) return ctl.error_status();
    c->controller_ = std::move(*ctl);
    auto idx = index_arrays<storage_type>::create(*c->storage_, opt.max_batch, opt.max_pages);
    if (!idx) return idx.error_status();
    c->index_.emplace(std::move(*idx));
    try {  // per-page masses of one attend() call, charged with the index arrays they go with
      c->mass_.emplace(std::size_t(opt.max_batch) * std::size_t(opt.max_pages), 0.f,
                       counted_allocator<float, MetaAlloc>(c->storage_->meta_alloc(),
                                                           c->storage_->lines().index_arrays));
      if (opt.center)
        c->means_.emplace(opt.storage.num_layers, c->storage_->meta_alloc(),
                          c->storage_->lines().scratch);
    } catch (const allocation_failure& e) {
      return e.get_status();
    }
    return c;
  }

  /// Checks every option without allocating; the status create() would refuse with.
  static status validate(const options& opt) {
    if (auto st = storage_type::validate(opt.storage); !st) return st;
    if (auto st = controller_type::validate(opt.policy, opt.tiering); !st) return st;
    if (opt.max_batch < 1)
      return status::make(errc::invalid_argument, "max_batch = ", opt.max_batch, " must be >= 1");
    if (opt.max_pages < 1)
      return status::make(errc::invalid_argument, "max_pages = ", opt.max_pages, " must be >= 1");
    if (std::int64_t(opt.max_batch) * opt.max_pages > std::numeric_limits<std::int32_t>::max())
      return status::make(errc::invalid_argument,
                          "max_batch * max_pages = ", std::int64_t(opt.max_batch) * opt.max_pages,
                          " exceeds the limit ", std::numeric_limits<std::int32_t>::max(),
                          " (int32 index arrays)");
    if (opt.threads > max_threads)
      return status::make(errc::invalid_argument, "threads = ", opt.threads, " exceeds the limit ",
                          max_threads, " (0 = all cores)");
    if (!(opt.softmax_scale >= 0.f) || !std::isfinite(opt.softmax_scale))
      return status::make(errc::invalid_argument, "softmax_scale = ", opt.softmax_scale,
                          " must be finite and >= 0 (0 = 1 / sqrt(head_dim))");
    if (!(opt.soft_cap >= 0.f) || !std::isfinite(opt.soft_cap))
      return status::make(errc::invalid_argument, "soft_cap = ", opt.soft_cap,
                          " must be finite and >= 0 (0 = off)");
    if (opt.center && opt.soft_cap > 0.f)
      return status::make(errc::invalid_argument, "center = true with soft_cap = ", opt.soft_cap,
                          ": centring is exact only without a soft-cap (tanh is not shift "
                          "invariant); use one or the other");
    return {};
  }

  // ---- sequences ---------------------------------------------------------------------------
  // Every refusal of fork and append (capacity_exhausted: slots, blocks, bookkeeping memory,
  // what make_room cannot free; out_of_range: max_pages; bad input) comes before make_room
  // demotes anything, so a refused call changes nothing.
  /// A new empty sequence (capacity_exhausted when max_sequences are live).
  result<seq_id> create_sequence() { return storage_->create_sequence(); }
  /// A new sequence sharing every sealed page of parent (refcounted); the open last page is copied.
  result<seq_id> fork(seq_id parent) { return storage_->fork(parent, room()); }
  /// Ends s; its pages return to their pools once no sequence or prefix entry holds them.
  status release(seq_id s) { return storage_->release(s); }
  /// Committed tokens of s.
  result<std::int64_t> length(seq_id s) const { return storage_->length(s); }

  /// Appends n tokens ([layer][token][kv_head][dim] floats) to every layer. When tier 0
  /// is short, first demotes the pages the policy values least (tiering/tier_controller).
  /// A sequence never grows past max_pages logical pages (out_of_range). Buffers whose sizes
  /// disagree with n are refused (invalid_argument), n = 0 with non-empty buffers included.
  status append(seq_id s, std::int64_t n, std::span<const float> keys,
                std::span<const float> values) {
    if (auto st = check_max_pages(s, n, "append", "appended"); !st) return st;
    // Without centring, or input the storage refuses (sizes, NaN / Inf: it names the value),
    // the storage takes the input as it is.
    if (!means_ || n <= 0 || keys.size() != values.size() ||
        keys.size() != std::size_t(n) * std::size_t(storage_->num_layers()) * channel_floats ||
        !all_finite(keys) || !all_finite(values))
      return storage_->append(s, n, keys, values, room());
    const std::size_t layer_floats = std::size_t(n) * channel_floats;
    std::vector<int> estimated;  // layers whose means this call set: unset if it is refused
    status st = scratch_pair(keys.size(), [&](float* kc, float* vc) -> status {
      for (int l = 0; l < storage_->num_layers(); ++l) {
        const float* k = keys.data() + std::size_t(l) * layer_floats;
        const float* v = values.data() + std::size_t(l) * layer_floats;
        if (!means_->known(l)) {
          (void)means_->estimate(l, n, k, v);  // finite input: finite means
          estimated.push_back(l);
        }
        means_->subtract(l, false, n, k, kc + std::size_t(l) * layer_floats);
        means_->subtract(l, true, n, v, vc + std::size_t(l) * layer_floats);
      }
      const std::span<const float> kcs(kc, keys.size()), vcs(vc, keys.size());
      if (!all_finite(kcs) || !all_finite(vcs)) return overflow();
      return storage_->append(s, n, kcs, vcs, room());
    });
    if (!st)
      for (int l : estimated) means_->unset(l);
    return st;
  }

  /// Layer by layer (paged_storage::reserve): reserve room for the next n tokens (the slot
  /// mapping cuda::append_inputs takes goes to `out`), write every layer (write_layer on the
  /// host, or cuda::append / the engine's kernel into the mapped slots), then commit(s, m) the
  /// first m <= n of them (the rest are given back) or cancel(s). Until commit, attend sees
  /// only committed tokens. reserve refuses like append (max_pages, then make_room under
  /// pressure only once every other check passed), changing nothing.
  status reserve(seq_id s, std::int64_t n, slot_mapping out = {}) {
    if (auto st = check_max_pages(s, n, "reserve", "reserved"); !st) return st;
    return storage_->reserve(s, n, out, room());
  }
  /// Writes one layer's keys and values ([token][kv_head][dim]) of the reserved tokens.
  status write_layer(seq_id s, int layer, std::span<const float> keys,
                     std::span<const float> values) {
    auto n = storage_->reserved(s);
    if (!means_ || !n || *n <= 0 || layer < 0 || layer >= storage_->num_layers() ||
        keys.size() != values.size() || keys.size() != std::size_t(*n) * channel_floats ||
        !all_finite(keys) || !all_finite(values))
      return storage_->write_layer(s, layer, keys, values);  // (as append: it refuses those)
    const bool estimate = !means_->known(layer);
    status st = scratch_pair(keys.size(), [&](float* kc, float* vc) -> status {
      if (estimate) (void)means_->estimate(layer, *n, keys.data(), values.data());
      means_->subtract(layer, false, *n, keys.data(), kc);
      means_->subtract(layer, true, *n, values.data(), vc);
      const std::span<const float> kcs(kc, keys.size()), vcs(vc, keys.size());
      if (!all_finite(kcs) || !all_finite(vcs)) return overflow();
      return storage_->write_layer(s, layer, kcs, vcs);
    });
    if (!st && estimate) means_->unset(layer);
    return st;
  }

  /// Estimates layer's centring means, when not yet known, from a step's keys and values of
  /// every sequence together ([token][kv_head][dim]), so that write_layer, which takes one
  /// sequence at a time and would estimate from the first alone, encodes the batch against the
  /// means the GPU façade estimates from its first append (the whole batch). True when it set
  /// them; false (nothing changed) with center = false, known means, a bad layer, or rows that
  /// are empty, not whole tokens or not finite (write_layer refuses those).
  bool estimate_centering(int layer, std::span<const float> keys, std::span<const float> values) {
    if (!means_ || layer < 0 || layer >= storage_->num_layers() || means_->known(layer))
      return false;
    if (keys.empty() || keys.size() != values.size() || keys.size() % channel_floats != 0 ||
        !all_finite(keys) || !all_finite(values))
      return false;
    return means_->estimate(layer, std::int64_t(keys.size() / channel_floats), keys.data(),
                            values.data());
  }
  /// Sets layer's centring means ([kv_head][head_dim] floats each), e.g. from a calibration
  /// pass, while the cache holds no page (its pages were encoded against the means they have).
  status set_centering(int layer, std::span<const float> mu_k, std::span<const float> mu_v) {
    if (!means_)
      return status(errc::invalid_argument,
                    "set_centering: the cache was created with center = false");
    if (auto st = check_no_pages_for_centering(*storage_); !st) return st;
    return means_->set(layer, mu_k, mu_v);
  }
  /// The centring means (nullptr when center = false): an engine moving pages to another cache
  /// (export / import) gives that cache the same means.
  const channel_means<head_dim, Geometry::kv_heads, MetaAlloc>* centering() const noexcept {
    return means_ ? &*means_ : nullptr;
  }
  /// Makes the first n reserved tokens live and gives back the rest.
  status commit(seq_id s, std::int64_t n) { return storage_->commit(s, n); }
  /// Gives back every reserved token of s.
  status cancel(seq_id s) { return storage_->cancel(s); }
  /// Tokens of s reserved and not yet committed.
  result<std::int64_t> reserved(seq_id s) const { return storage_->reserved(s); }

  /// Structural metadata: pinned pages stay Anchor and are never demoted under pressure.
  status pin(seq_id s, std::int64_t first_page, std::int64_t pages, bool pinned = true) {
    return controller_->pin(s, first_page, pages, pinned);
  }

  // ---- attention -----------------------------------------------------------------------------
  /// Decode of one layer: queries [batch][q_heads][head_dim] (post-RoPE) -> out (same
  /// shape). Feeds each sequence's per-page attention mass to the controller; copies it
  /// to page_mass ([batch][max_pages]) and the LSE to lse ([batch][q_heads]) if given.
  /// A NaN or Inf query is refused (non_finite_input, naming the batch row and query head)
  /// before anything is written or observed: it never turns into a finite output.
  status attend(int layer, std::span<const seq_id> batch, std::span<const float> queries,
                std::span<float> out, std::span<float> page_mass = {}, std::span<float> lse = {}) {
    const std::size_t rows = batch.size() * std::size_t(q_heads) * head_dim;
    if (queries.size() != rows || out.size() != rows)
      return status::make(errc::invalid_argument, "attend: ", batch.size(), " sequences need ",
                          rows, " query and output floats, got ", queries.size(), " and ",
                          out.size());
    const std::size_t stride = std::size_t(opt_.max_pages);
    if (!page_mass.empty() && page_mass.size() < batch.size() * stride)
      return status::make(errc::invalid_argument, "attend: page_mass holds ", page_mass.size(),
                          " floats, ", batch.size() * stride, " needed (batch x max_pages)");
    if (!lse.empty() && lse.size() < batch.size() * std::size_t(q_heads))
      return status::make(errc::invalid_argument, "attend: lse holds ", lse.size(), " floats, ",
                          batch.size() * std::size_t(q_heads), " needed");
    auto view = index_->build(layer, batch);
    if (!view) return view.error_status();
    const auto pools = storage_->views();
    host_decode_args<num_tiers> a;
    a.queries = queries.data();
    a.index = *view;
    a.pools = pools.data();
    a.source = layer_source{storage_->config().codec_seed, layer, storage_->config().head_base};
    a.logits = logits();
    a.out = out.data();
    a.lse = lse.empty() ? nullptr : lse.data();
    a.page_mass = mass_->data();
    a.mass_stride = opt_.max_pages;
    if (auto st = host_decode<Geometry, Tiers>(workspace_, a); !st) return st;
    for (std::size_t b = 0; b < batch.size(); ++b)  // a sequence with no token keeps its zeros
      if (*storage_->length(batch[b]) > 0) restore_centering(layer, b, b + 1, queries, out, lse);
    return observe(layer, batch, page_mass);
  }

  /// Attention of the tokens just written, before commit: sequence b's query rows
  /// [q_indptr[b], q_indptr[b + 1]) (n_b >= 1 of them) are its last n_b readable tokens
  /// (committed, then reserved: reserve and write_layer this layer first), each attending
  /// causally to every token up to its own position in the stored formats, its own chunk
  /// included (host_prefill). A chunked prefill; with n_b = 1, a decode step written layer by
  /// layer. queries / out: [rows][q_heads][head_dim]; lse: [rows][q_heads] if given; window
  /// > 0: a sliding-window layer (each query sees positions (p - window, p]). The per-page
  /// attention mass of each sequence's last query feeds the controller, the chunk's own pages
  /// included (as the GPU façade's, whose step tokens are committed at begin_step).
  /// Every check comes before anything is written or observed.
  status prefill(int layer, std::span<const seq_id> batch, std::span<const std::int32_t> q_indptr,
                 std::span<const float> queries, std::span<float> out, std::span<float> lse = {},
                 int window = 0) {
    if (q_indptr.size() != batch.size() + 1 || q_indptr[0] != 0)
      return status::make(errc::invalid_argument, "prefill: q_indptr holds ", q_indptr.size(),
                          " entries starting at ", q_indptr.empty() ? -1 : q_indptr[0], "; ",
                          batch.size() + 1, " starting at 0 needed (batch + 1)");
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::int64_t n = std::int64_t(q_indptr[b + 1]) - q_indptr[b];
      auto len = storage_->length(batch[b]);
      if (!len) return len.error_status();
      const std::int64_t readable = *len + *storage_->reserved(batch[b]);
      if (n < 1 || n > readable)
        return status::make(errc::invalid_argument, "prefill: sequence ", batch[b],
                            " (batch entry ", b, ") has ", n, " query rows; it holds ", readable,
                            " committed and reserved tokens, and needs 1 to that many");
    }
    const std::size_t rows = batch.empty() ? 0 : std::size_t(q_indptr[batch.size()]);
    const std::size_t row_floats = std::size_t(q_heads) * head_dim;
    if (queries.size() != rows * row_floats || out.size() != rows * row_floats)
      return status::make(errc::invalid_argument, "prefill: ", rows, " query rows need ",
                          rows * row_floats, " query and output floats, got ", queries.size(),
                          " and ", out.size());
    if (!lse.empty() && lse.size() < rows * std::size_t(q_heads))
      return status::make(errc::invalid_argument, "prefill: lse holds ", lse.size(), " floats, ",
                          rows * std::size_t(q_heads), " needed");
    if (window < 0)
      return status::make(errc::invalid_argument, "prefill: window = ", window, " is negative");
    if (layer < 0 || layer >= storage_->num_layers())
      return status::out_of_range("prefill: layer", layer, storage_->num_layers());
    if (batch.empty()) return {};
    auto view = index_->build(layer, batch, index_scope::readable);
    if (!view) return view.error_status();
    const auto pools = storage_->views();
    const layer_source source{storage_->config().codec_seed, layer, storage_->config().head_base};
    const logit_params lp = logits();
    // The last query row of each sequence again as a decode step, for its page masses: one
    // pass when every sequence has one row, else a second (a decode's cost) over gathered rows.
    const auto decode_last = [&](const float* q, float* o, float* l) {
      host_decode_args<num_tiers> a;
      a.queries = q;
      a.index = *view;
      a.pools = pools.data();
      a.source = source;
      a.logits = lp;
      a.out = o;
      a.lse = l;
      a.page_mass = mass_->data();
      a.mass_stride = opt_.max_pages;
      a.window = window;
      return host_decode<Geometry, Tiers>(workspace_, a);
    };
    status st;
    if (rows == batch.size()) {
      st = decode_last(queries.data(), out.data(), lse.empty() ? nullptr : lse.data());
    } else {
      host_prefill_args<num_tiers> a;
      a.queries = queries.data();
      a.q_indptr = q_indptr.data();
      a.index = *view;
      a.pools = pools.data();
      a.source = source;
      a.logits = lp;
      a.out = out.data();
      a.lse = lse.empty() ? nullptr : lse.data();
      a.window = window;
      st = host_prefill<Geometry, Tiers>(workspace_, a);
      if (st)
        st = scratch_pair(batch.size() * row_floats, [&](float* q_last, float* o_last) {
          for (std::size_t b = 0; b < batch.size(); ++b)
            std::copy_n(queries.data() + std::size_t(q_indptr[b + 1] - 1) * row_floats, row_floats,
                        q_last + b * row_floats);
          return decode_last(q_last, o_last, nullptr);
        });
    }
    if (!st) return st;
    restore_centering(layer, 0, rows, queries, out, lse);  // every sequence holds tokens
    return observe(layer, batch, {}, index_scope::readable);
  }

  // ---- a step, in the GPU façade's verbs (cuda::tiered_cache) ---------------------------------
  /// Opens a step: reserves new_tokens[b] tokens for batch[b], all or none (a refusal, e.g.
  /// tier 0 full or max_pages, cancels the reservations made and names the sequence). Then
  /// append each layer, decode / prefill it, and end_step. One step at a time.
  status begin_step(std::span<const seq_id> batch, std::span<const std::int32_t> new_tokens) {
    if (step_open_)
      return status(errc::invalid_argument, "begin_step: a step is open (end_step first)");
    if (new_tokens.size() != batch.size())
      return status::make(errc::invalid_argument, "begin_step: ", batch.size(), " sequences but ",
                          new_tokens.size(), " token counts");
    for (std::size_t b = 0; b < batch.size(); ++b) {
      for (std::size_t c = 0; c < b; ++c)
        if (batch[c] == batch[b])
          return status::make(errc::invalid_argument, "begin_step: sequence ", batch[b],
                              " is in the batch twice (entries ", c, " and ", b, ")");
      if (new_tokens[b] < 0)
        return status::make(errc::invalid_argument, "begin_step: new_tokens[", b,
                            "] = ", new_tokens[b], " is negative");
    }
    step_indptr_.assign(1, 0);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (status st = reserve(batch[b], new_tokens[b]); !st) {
        for (std::size_t c = 0; c < b; ++c) (void)cancel(batch[c]);
        return st;
      }
      step_indptr_.push_back(step_indptr_.back() + new_tokens[b]);
    }
    step_batch_.assign(batch.begin(), batch.end());
    step_open_ = true;
    return {};
  }
  /// One layer's keys and values of the step's new tokens, batch order
  /// ([sum(new_tokens)][kv_head][dim]); a centred cache estimates a layer's means from the whole
  /// batch's first write (as the GPU façade's first append does).
  status append(int layer, std::span<const float> keys, std::span<const float> values) {
    if (!step_open_) return status(errc::invalid_argument, "append: no step is open (begin_step)");
    const std::size_t floats = std::size_t(step_indptr_.back()) * channel_floats;
    if (keys.size() != floats || values.size() != floats)
      return status::make(errc::invalid_argument, "append: the step's ", step_indptr_.back(),
                          " new tokens need ", floats, " key and value floats, got ", keys.size(),
                          " and ", values.size());
    (void)estimate_centering(layer, keys, values);
    for (std::size_t b = 0; b < step_batch_.size(); ++b) {
      const std::size_t first = std::size_t(step_indptr_[b]) * channel_floats;
      const std::size_t n = std::size_t(step_indptr_[b + 1] - step_indptr_[b]) * channel_floats;
      if (n == 0) continue;
      if (status st =
              write_layer(step_batch_[b], layer, keys.subspan(first, n), values.subspan(first, n));
          !st)
        return st;
    }
    return {};
  }
  /// The step's decode of one layer: one query row per sequence (its newest token, which
  /// attends every token up to itself), queries / out [batch][q_heads][head_dim], lse
  /// [batch][q_heads] if given; page masses feed the policy. Every sequence must have added
  /// exactly one token (prefill takes chunks).
  status decode(int layer, std::span<const float> queries, std::span<float> out,
                std::span<float> lse = {}, int window = 0) {
    if (!step_open_) return status(errc::invalid_argument, "decode: no step is open (begin_step)");
    for (std::size_t b = 0; b < step_batch_.size(); ++b)
      if (step_indptr_[b + 1] - step_indptr_[b] != 1)
        return status::make(errc::invalid_argument, "decode: sequence ", step_batch_[b], " added ",
                            step_indptr_[b + 1] - step_indptr_[b],
                            " tokens this step; decode takes one each (prefill takes chunks)");
    return prefill(layer, step_batch_, step_indptr_, queries, out, lse, window);
  }
  /// The step's prefill of one layer: each sequence's new tokens as causal query rows (batch
  /// order, [sum(new_tokens)][q_heads][head_dim]); the last row's page masses feed the policy.
  status prefill(int layer, std::span<const float> queries, std::span<float> out,
                 std::span<float> lse = {}, int window = 0) {
    if (!step_open_) return status(errc::invalid_argument, "prefill: no step is open (begin_step)");
    return prefill(layer, step_batch_, step_indptr_, queries, out, lse, window);
  }
  /// Closes the step: commits its tokens, then runs the step's retier (the policy's plan over
  /// the masses this step observed).
  result<retier_stats> end_step(std::uint64_t step) {
    if (!step_open_) return status(errc::invalid_argument, "end_step: no step is open");
    for (std::size_t b = 0; b < step_batch_.size(); ++b)
      if (status st = commit(step_batch_[b], step_indptr_[b + 1] - step_indptr_[b]); !st) return st;
    step_open_ = false;
    return retier(step);
  }

  // ---- tiering and accounting -----------------------------------------------------------------
  /// Once per scheduler step: asks the policy for each page's role and converts the pages
  /// whose tier changes (step: the caller's monotonically increasing step number).
  retier_stats retier(std::uint64_t step) { return controller_->retier(step, faults_); }
  /// Every allocated byte on one line, reconciled with the allocators (report.hpp).
  memory_report report() const { return make_report(*storage_); }
  /// Verifies the storage's and the controller's bookkeeping (for tests and debugging).
  status check_invariants() const { return controller_->check_invariants(); }

  /// The paged storage (e.g. for a prefix_index or page transfer).
  storage_type& storage() noexcept { return *storage_; }
  /// The paged storage.
  const storage_type& storage() const noexcept { return *storage_; }
  /// The tier controller.
  controller_type& controller() noexcept { return *controller_; }
  /// The options it was created with.
  const options& config() const noexcept { return opt_; }
  /// The conversion fault hook every conversion of retier and make_room goes through
  /// (tiering/conversion.hpp; no_faults by default, tests and chaos runs inject through it).
  Faults& faults() noexcept { return faults_; }

 private:
  tiered_cache(const options& opt, std::unique_ptr<storage_type> s)
      : opt_(opt), storage_(std::move(s)), workspace_(opt.threads) {}

  /// n more tokens of s must fit in max_pages logical pages (checked before make_room).
  status check_max_pages(seq_id s, std::int64_t n, const char* op, const char* done) const {
    auto len = storage_->length(s);
    if (!len) return len.error_status();
    constexpr std::int64_t T = storage_type::page_tokens;
    if (n > 0 && n <= storage_type::max_sequence_tokens - *len &&
        (*len + n + T - 1) / T > opt_.max_pages)
      return status::make(
          errc::out_of_range, op, ": ", *len, " + ", n, " tokens = ", (*len + n + T - 1) / T,
          " logical pages exceeds the limit max_pages = ", opt_.max_pages, "; nothing ", done);
    return {};
  }

  static constexpr std::size_t channel_floats = std::size_t(Geometry::kv_heads) * head_dim;

  logit_params logits() const {
    return logit_params{
        opt_.softmax_scale > 0.f ? opt_.softmax_scale : 1.f / std::sqrt(float(head_dim)),
        opt_.soft_cap};
  }

  /// Adds back what centring took from query rows [first, last) of an attention pass (outputs
  /// + mu_v, LSE + scale q.mu_k); nothing without centring or before the layer has means.
  void restore_centering(int layer, std::size_t first, std::size_t last,
                         std::span<const float> queries, std::span<float> out,
                         std::span<float> lse) const {
    if (!means_ || !means_->known(layer)) return;
    constexpr std::size_t row = std::size_t(q_heads) * head_dim;
    for (std::size_t r = first; r < last; ++r)
      means_->restore(layer, Geometry::group_size, logits().softmax_scale, queries.data() + r * row,
                      out.data() + r * row,
                      lse.empty() ? nullptr : lse.data() + r * std::size_t(q_heads));
  }

  /// The per-page masses of the last attention pass (mass_, [batch][max_pages]) go to the
  /// controller (the reservation's pages too when the pass read them), and to page_mass if given.
  status observe(int layer, std::span<const seq_id> batch, std::span<float> page_mass,
                 index_scope scope = index_scope::committed) {
    const std::size_t stride = std::size_t(opt_.max_pages);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const std::span<const float> row(mass_->data() + b * stride, stride);
      if (auto st = controller_->observe_mass(batch[b], layer, row, scope); !st) return st;
      if (!page_mass.empty())
        std::copy(row.begin(), row.end(), page_mass.begin() + std::ptrdiff_t(b * stride));
    }
    return {};
  }

  /// Runs fill(a, b) over two arrays of `floats` each, charged to the scratch line for the
  /// call only (capacity_exhausted when the bookkeeping allocator refuses them; nothing else
  /// changed then).
  template <class Fill>
  status scratch_pair(std::size_t floats, Fill&& fill) {
    std::optional<std::vector<float, counted_allocator<float, MetaAlloc>>> buf;
    try {
      buf.emplace(
          2 * floats, 0.f,
          counted_allocator<float, MetaAlloc>(storage_->meta_alloc(), storage_->lines().scratch));
    } catch (const allocation_failure& e) {
      return e.get_status();
    }
    return fill(buf->data(), buf->data() + floats);
  }
  static bool all_finite(std::span<const float> x) {
    for (float e : x)
      if (!std::isfinite(e)) return false;
    return true;
  }
  static status overflow() {
    return status(errc::out_of_range,
                  "centring: an input element minus its channel mean overflows float (inputs "
                  "near +-3.4e38 of opposite signs in one channel); nothing written");
  }

  /// The storage calls it once its own checks passed: tier-0 pages freed by demotion.
  auto room() {
    return [this](std::uint32_t pages) { return controller_->make_room(pages, faults_); };
  }

  options opt_;
  bool step_open_ = false;                 // begin_step ... end_step
  std::vector<seq_id> step_batch_;         // the open step's sequences
  std::vector<std::int32_t> step_indptr_;  // their new tokens' prefix sums (batch + 1)
  std::unique_ptr<storage_type> storage_;
  std::unique_ptr<controller_type> controller_;
  std::optional<index_arrays<storage_type>> index_;
  std::optional<std::vector<float, counted_allocator<float, MetaAlloc>>> mass_;
  std::optional<channel_means<head_dim, Geometry::kv_heads, MetaAlloc>> means_;  // center only
  host_attention_workspace workspace_;
  [[no_unique_address]] Faults faults_{};
};

}  // namespace tierkv
