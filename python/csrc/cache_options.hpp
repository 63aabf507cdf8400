// SPDX-License-Identifier: Apache-2.0
// What every cache of a binding's prebuilt set shares, from run-time values to the library's
// types: errors as exceptions, sequence ids, the storage and policy options of a cache_config
// (checked first, each check naming the value and its limit) and the memory report as numbers.
// The host impl (cache_impl.hpp) and the CUDA impl (cuda/gpu_cache_impl.cuh) both use it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "runtime.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/storage_types.hpp"
#include "tierkv/policies.hpp"
#include "tierkv/report.hpp"

namespace tierkv_py {

[[noreturn]] inline void fail(tierkv::status st) { throw tierkv::error(std::move(st)); }
inline void check(const tierkv::status& st) {
  if (!st) fail(st);
}
template <class T>
T value(tierkv::result<T> r) {
  if (!r) fail(r.error_status());
  return std::move(*r);
}

// Prefix reuse as the bindings return it: {sequence, cached tokens} of a started sequence (a
// prefix_index::started), and evict's count, refused when negative.
template <class Started>
std::array<std::int64_t, 2> started_sequence(tierkv::result<Started> r) {
  const Started st = value(std::move(r));
  return {std::int64_t(st.seq.value), st.cached_tokens};
}
inline std::size_t evict_count(std::int64_t n) {
  if (n < 0)
    fail(tierkv::status::make(tierkv::errc::invalid_argument, "prefix_evict: n = ", n,
                              " is negative"));
  return std::size_t(n);
}

// Page transfer in the bindings: a centred cache's export and import are refused (its pages are
// centred against channel means the bindings cannot move, so an import elsewhere, or into a
// cache that estimated its own means, would decode them wrongly). `nothing`: "nothing exported".
inline void refuse_centred_transfer(const cache_config& cfg, const char* op, const char* nothing) {
  if (cfg.center)
    fail(tierkv::status::make(tierkv::errc::invalid_argument, op,
                              ": the cache was made with center = true; its pages are centred "
                              "against channel means the Python binding cannot move "
                              "(set_centering is not exposed); ",
                              nothing));
}

inline tierkv::seq_id to_seq(std::int64_t s) {
  if (s < 0 || s >= std::int64_t(tierkv::seq_id::invalid_value))
    fail(tierkv::status::out_of_range("sequence id", s, tierkv::seq_id::invalid_value));
  return tierkv::seq_id(std::uint32_t(s));
}

// The tier policy `cfg` names, with its knobs (tierkv/policies.hpp's registry).
inline tierkv::registered_policy policy_of(const cache_config& cfg) {
  if (cfg.policy_knob_names.size() != cfg.policy_knob_values.size())
    fail(tierkv::status::make(tierkv::errc::invalid_argument,
                              "policy knobs: ", cfg.policy_knob_names.size(), " names but ",
                              cfg.policy_knob_values.size(), " values"));
  std::vector<tierkv::policy_knob> knobs;
  for (std::size_t i = 0; i < cfg.policy_knob_names.size(); ++i)
    knobs.push_back({cfg.policy_knob_names[i], cfg.policy_knob_values[i]});
  return value(tierkv::make_policy(cfg.policy, knobs));
}

// The storage options (pools, layers, sequences, codec seed) and the tier policy of `cfg`, for
// a tier set of N tiers. The cache's create() checks everything else.
template <int N>
std::pair<tierkv::storage_options<N>, tierkv::registered_policy> common_options(
    const cache_config& cfg) {
  if (cfg.pages_per_tier.size() != std::size_t(N))
    fail(tierkv::status::make(tierkv::errc::invalid_argument, "pages_per_tier has ",
                              cfg.pages_per_tier.size(), " entries; this tier set has ", N, " tier",
                              N == 1 ? "" : "s"));
  tierkv::storage_options<N> storage;
  for (int t = 0; t < N; ++t) {
    const std::int64_t p = cfg.pages_per_tier[std::size_t(t)];
    if (p < 1 || p > std::numeric_limits<std::int32_t>::max())
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "pages_per_tier[", t, "] = ", p,
                                " must lie in [1, 2^31)"));
    storage.pages_per_tier[std::size_t(t)] = std::uint32_t(p);
  }
  if (cfg.max_sequences < 1 || cfg.max_sequences > std::numeric_limits<std::int32_t>::max())
    fail(tierkv::status::make(tierkv::errc::invalid_argument, "max_sequences = ", cfg.max_sequences,
                              " must lie in [1, 2^31)"));
  storage.num_layers = cfg.num_layers;
  storage.max_sequences = std::uint32_t(cfg.max_sequences);
  storage.codec_seed = cfg.codec_seed;
  return {storage, policy_of(cfg)};
}

// The report as numbers, in the order tierkv/cache.py names them (_REPORT_FIELDS, the tier
// count, then _TIER_FIELDS per tier).
inline std::vector<double> report_values(const tierkv::memory_report& r) {
  std::vector<double> v = {
      double(r.allocator_total),  double(r.lines_total()),   double(r.live_page_bytes()),
      double(r.pool_bookkeeping), double(r.page_tables),     double(r.index_arrays),
      double(r.live_tokens),      double(r.sequence_tokens), r.kib_per_token,
      r.kib_per_token_allocated,  r.bits_per_scalar,         double(r.tiers.size())};
  for (const auto& t : r.tiers) {
    v.insert(v.end(), {double(t.page_bytes), double(t.capacity_pages), double(t.live_pages),
                       double(t.live_bytes()), double(t.free_page_bytes), double(t.token_layers),
                       t.bits_per_scalar});
  }
  return v;
}

}  // namespace tierkv_py
