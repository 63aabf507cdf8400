// SPDX-License-Identifier: Apache-2.0
// The conversion protocol: one physical page (one logical page, one layer) moves to
// another tier without a live page ever being lost.
//
//   1. reserve  a fresh page of the target tier (caller-owned, unpublished);
//   2. fill     it: decode every token vector with the source tier's codecs and encode
//               with the target's (byte copy when both tiers store the same codecs);
//   3. publish  it in the block's page table (paged_storage::replace_page): every
//               holder of the logical page (sequences, prefix index) sees it at once,
//               and the storage then drops its reference to the old page.
//
// Until step 3 succeeds the old page stays published at its old id and tier; any
// failure (allocation, encode status, an injected fault, a concurrent change of the
// page table) releases the reserved page and changes nothing else. Step 3 itself is
// all-or-nothing. The steps are separate functions so the GPU path can run step 2 as a
// batched kernel on a side stream and call publish only after its completion event.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tierkv/codec/codec.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/paged_storage.hpp"

namespace tierkv {

/// Points of the protocol where a fault hook may inject a failure (tests, chaos runs).
enum class conversion_step : std::uint8_t { reserve = 0, fill = 1, publish = 2 };
inline constexpr int conversion_steps = 3;  ///< steps of the protocol

/// The step's name.
constexpr const char* to_string(conversion_step s) noexcept {
  return s == conversion_step::reserve ? "reserve"
         : s == conversion_step::fill  ? "fill"
                                       : "publish";
}

/// A fault hook is called as hook(step, block, layer) before each step and returns
/// errc::ok to proceed or any other code to fail the conversion there.
template <class H>
concept conversion_fault_hook = requires(H& h, conversion_step s, block_ref b, int layer) {
  { h(s, b, layer) } -> std::convertible_to<errc>;
};

/// Copies of the GPU cache's host tier (cuda/cache/host_tier.cuh) where a fault hook may fail
/// the launch: an offload's copy, or the `index`-th chunk of a restore's copies.
enum class transfer_step : std::uint8_t { offload_copy = 0, restore_copy = 1 };

/// The step's name.
constexpr const char* to_string(transfer_step s) noexcept {
  return s == transfer_step::offload_copy ? "offload copy" : "restore copy";
}

/// A conversion fault hook that also takes hook(step, index) before each host-tier copy launch
/// (optional: a hook without it never fails those).
template <class H>
concept transfer_fault_hook = requires(H& h, transfer_step s, std::uint64_t index) {
  { h(s, index) } -> std::convertible_to<errc>;
};

/// The fault hook that never fails (the default).
struct no_faults {
  /// Always errc::ok.
  constexpr errc operator()(conversion_step, block_ref, int) const noexcept { return errc::ok; }
};

/// A conversion between steps 1 and 3: `to` is owned by the caller until published.
struct staged_conversion {
  block_ref block;  ///< the logical page
  int layer = 0;    ///< its layer
  page_id from;     ///< published now; what `to` was filled from
  page_id to;       ///< reserved page of the target tier
};

/// Counters of what conversions did (summed by the controller).
struct conversion_counters {
  std::uint64_t saturated =
      0;  ///< encoder saturations while filling (FP8 clipping, TQ3 norm limit)
};

namespace detail {
inline status injected(conversion_step s, block_ref b, int layer, errc code) {
  return status::make(code == errc::ok ? errc::injected_fault : code, "conversion of block ",
                      b.index, "@", b.generation, " layer ", layer,
                      ": fault injected before step '", to_string(s), "'");
}

/// Decodes one vector with codec S and encodes it with codec T (same context: the
/// rotation seed depends on layer, head and role only, never on the tier).
template <class S, class T>
errc transcode_vector(const std::uint8_t* sp, const std::uint8_t* sm, std::uint8_t* tp,
                      std::uint8_t* tm, const codec_context& ctx, encode_stats& stats) {
  static_assert(S::head_dim == T::head_dim, "transcode: codecs of different head_dim");
  float x[S::head_dim];
  typename S::meta_type smeta{};
  if constexpr (S::meta_bytes > 0) std::memcpy(&smeta, sm, S::meta_bytes);
  S::decode(sp, smeta, x, ctx);
  typename T::meta_type tmeta{};
  const errc e = T::encode(x, tp, tmeta, ctx, &stats);
  if constexpr (T::meta_bytes > 0) std::memcpy(tm, &tmeta, T::meta_bytes);
  return e;
}
}  // namespace detail

/// Step 1: a fresh page of `to_tier` for (block, layer). Fails (changing nothing) when
/// the block is stale or open, the page is already in that tier, or the pool is full.
template <class Storage, conversion_fault_hook Faults = no_faults>
result<staged_conversion> reserve_conversion(Storage& storage, block_ref block, int layer,
                                             int to_tier, Faults&& faults = {}) {
  if (auto st = storage.check_block(block); !st) return st;
  if (layer < 0 || layer >= storage.num_layers())
    return status::out_of_range("layer", layer, storage.num_layers());
  if (to_tier < 0 || to_tier >= Storage::num_tiers)
    return status::out_of_range("target tier", to_tier, Storage::num_tiers);
  if (!storage.block_sealed(block))
    return status::make(errc::not_writable, "conversion of block ", block.index,
                        ": the logical page is open ",
                        "(still being appended); only sealed pages change tier");
  const page_id from = storage.block_page(block, layer);
  if (int(from.format) == to_tier)
    return status::make(errc::invalid_argument, "conversion of block ", block.index, " layer ",
                        layer, ": the page is already in tier ", to_tier);
  if (const errc e = faults(conversion_step::reserve, block, layer); e != errc::ok)
    return detail::injected(conversion_step::reserve, block, layer, e);
  auto to = storage.allocate_page(to_tier);
  if (!to) return to.error_status();
  return staged_conversion{block, layer, from, *to};
}

/// Gives a reserved page back (a conversion that will not be published).
template <class Storage>
void abort_conversion(Storage& storage, staged_conversion& c) {
  if (c.to.valid()) (void)storage.release_page(c.to);
  c.to = page_id{};
}

/// Step 2 on the host: fills c.to from c.from. On failure c.to stays reserved (the
/// caller aborts); the published page is never written.
template <class Storage, conversion_fault_hook Faults = no_faults>
status fill_conversion_on_host(
    Storage& storage, const staged_conversion& c, conversion_counters& counters,
    Faults&& faults = {}) requires Storage::page_allocator::host_accessible {
  if (const errc e = faults(conversion_step::fill, c.block, c.layer); e != errc::ok)
    return detail::injected(conversion_step::fill, c.block, c.layer, e);
  auto src = storage.page_bytes(c.from);
  if (!src) return src.error_status();
  auto dst = storage.page_bytes(c.to);
  if (!dst) return dst.error_status();
  constexpr int H = Storage::kv_heads;
  constexpr int T = Storage::page_tokens;
  const std::uint64_t seed = storage.config().codec_seed;
  const int head_base = storage.config().head_base;  // contexts of the global KV heads
  status out;
  detail::with_index<Storage::num_tiers>(int(c.from.format), [&](auto SI) {
    detail::with_index<Storage::num_tiers>(int(c.to.format), [&](auto TI) {
      using SL = typename Storage::template layout<SI>;
      using TL = typename Storage::template layout<TI>;
      if constexpr (std::is_same_v<typename SL::key_codec, typename TL::key_codec> &&
                    std::is_same_v<typename SL::value_codec, typename TL::value_codec>) {
        // Same codecs, same layout: a lossless byte move.
        out = storage.page_alloc().copy(dst->data(), src->data(), SL::page_bytes);
      } else {
        encode_stats stats{};
        const std::uint8_t* s = src->data();
        std::uint8_t* d = dst->data();
        for (int h = 0; h < H && out; ++h) {
          const codec_context kctx = make_codec_context(seed, c.layer, head_base + h, kv_role::key);
          const codec_context vctx =
              make_codec_context(seed, c.layer, head_base + h, kv_role::value);
          for (int t = 0; t < T; ++t) {
            errc e = detail::transcode_vector<typename SL::key_codec, typename TL::key_codec>(
                s + SL::key_payload(h, t), s + SL::key_meta(h, t), d + TL::key_payload(h, t),
                d + TL::key_meta(h, t), kctx, stats);
            if (e == errc::ok)
              e = detail::transcode_vector<typename SL::value_codec, typename TL::value_codec>(
                  s + SL::value_payload(h, t), s + SL::value_meta(h, t),
                  d + TL::value_payload(h, t), d + TL::value_meta(h, t), vctx, stats);
            if (e != errc::ok) {
              out = status::make(e, "conversion of ", c.from, " (block ", c.block.index, ", layer ",
                                 c.layer, ") to tier ", unsigned(c.to.format), ": kv head ", h,
                                 " token ", t, " does not encode (", to_string(e),
                                 "); the old page stays published");
              break;
            }
          }
        }
        counters.saturated += stats.saturated;
      }
    });
  });
  return out;
}

/// Step 3 split for a caller that publishes several conversions all or none
/// (tier_controller::make_room): check_publish runs the fault hook and every check of
/// publish_conversion, changing nothing; publish_checked then cannot fail, provided nothing
/// touched the storage in between.
template <class Storage, conversion_fault_hook Faults = no_faults>
status check_publish(const Storage& storage, const staged_conversion& c, Faults&& faults = {}) {
  if (const errc e = faults(conversion_step::publish, c.block, c.layer); e != errc::ok)
    return detail::injected(conversion_step::publish, c.block, c.layer, e);
  return storage.can_replace_page(c.block, c.layer, c.from, c.to);
}
/// Publishes a conversion check_publish accepted; the block owns `to` afterwards.
template <class Storage>
void publish_checked(Storage& storage, staged_conversion& c) {
  (void)storage.replace_page(c.block, c.layer, c.from, c.to);
  c.to = page_id{};  // the block owns it now
}

/// Step 3: publishes c.to in place of c.from. On failure (including a page table that
/// no longer names c.from) nothing changed and c.to is still the caller's.
template <class Storage, conversion_fault_hook Faults = no_faults>
status publish_conversion(Storage& storage, staged_conversion& c, Faults&& faults = {}) {
  if (auto st = check_publish(storage, c, faults); !st) return st;
  publish_checked(storage, c);
  return {};
}

/// All three steps on the host; on any failure the reserved page is released and the
/// old page stays published. Returns the newly published page.
template <class Storage, conversion_fault_hook Faults = no_faults>
result<page_id> convert_page(
    Storage& storage, block_ref block, int layer, int to_tier, conversion_counters& counters,
    Faults&& faults = {}) requires Storage::page_allocator::host_accessible {
  auto staged = reserve_conversion(storage, block, layer, to_tier, faults);
  if (!staged) return staged.error_status();
  staged_conversion c = *staged;
  const page_id published = c.to;
  if (auto st = fill_conversion_on_host(storage, c, counters, faults); !st) {
    abort_conversion(storage, c);
    return st;
  }
  if (auto st = publish_conversion(storage, c, faults); !st) {
    abort_conversion(storage, c);
    return st;
  }
  return published;
}

}  // namespace tierkv
