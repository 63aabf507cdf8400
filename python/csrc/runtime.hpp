// SPDX-License-Identifier: Apache-2.0
// The run-time face of a compile-time tiered cache: one abstract class the torch binding
// (ops.cpp) talks to, implemented once per prebuilt instantiation (cache_impl.hpp). Plain
// pointers and spans only, so the instantiation translation units compile without torch's
// headers. Errors are thrown as tierkv::error carrying the library's status message.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "combo_registry.hpp"
#include "tierkv/report.hpp"
#include "tierkv/tiering/tier_controller.hpp"

namespace tierkv_py {

// Everything a cache is made from, as run-time values (names resolved in formats.hpp).
struct cache_config {
  std::string recent = "int8_rotated";  // Recent / Anchor tier (tier 0)
  std::string cache_type_k = "tq4";     // Stale tier keys
  std::string cache_type_v = "tq3";     // Stale tier values
  std::string cold_type_k;              // Cold tier keys and values (tier 2; issue 52), both
  std::string cold_type_v;              // or neither: empty = no Cold tier
  int head_dim = 0;
  int kv_heads = 0;
  int group_size = 0;
  int page_size = 0;
  int num_layers = 1;
  std::vector<std::int64_t> pages_per_tier;  // one pool capacity per tier of the set
  std::int64_t max_sequences = 1024;
  int max_batch = 64;
  int max_pages = 4096;
  int threads = 1;             // host attention workers, the caller included (0 = all cores)
  double softmax_scale = 0.0;  // 0: 1 / sqrt(head_dim)
  double soft_cap = 0.0;
  std::uint64_t codec_seed = 0;
  // the tier policy by its registry name and the knobs changed from its defaults, by name
  // (tierkv/policies.hpp: an unknown name or knob is refused naming what there is)
  std::string policy = "recency_anchor";
  std::vector<std::string> policy_knob_names;
  std::vector<double> policy_knob_values;
  // channel means out before encoding, back into outputs and LSE (tierkv/centering.hpp)
  bool center = false;
  // a bit budget over the movable pages (tier_controller_options::bits_per_scalar_target; 0 off)
  double bits_per_scalar = 0.0;
};

class runtime_cache {
 public:
  virtual ~runtime_cache() = default;
  virtual const cache_config& config() const = 0;
  virtual int num_tiers() const = 0;

  virtual std::int64_t create_sequence() = 0;
  virtual std::int64_t fork(std::int64_t parent) = 0;
  virtual void release(std::int64_t seq) = 0;
  virtual std::int64_t length(std::int64_t seq) const = 0;    // committed tokens
  virtual std::int64_t reserved(std::int64_t seq) const = 0;  // outstanding reservation

  // One step, layer by layer: reserve counts[b] tokens for seqs[b] (all or none), write each
  // layer of them (keys/values [sum(counts)][kv_heads][head_dim], batch order), commit.
  // Attention between reserve and commit reads committed and reserved tokens.
  virtual void reserve(std::span<const std::int64_t> seqs,
                       std::span<const std::int64_t> counts) = 0;
  virtual void write_layer(std::span<const std::int64_t> seqs, int layer, const float* keys,
                           const float* values, std::int64_t tokens) = 0;
  virtual void commit(std::span<const std::int64_t> seqs) = 0;
  virtual void cancel(std::span<const std::int64_t> seqs) = 0;
  // Every layer at once: keys/values [num_layers][n][kv_heads][head_dim].
  virtual void append(std::int64_t seq, std::int64_t n, const float* keys, const float* values) = 0;

  // queries [batch][q_heads][head_dim] -> out (same), lse [batch][q_heads] (may be null).
  // window > 0: each query attends its sequence's last `window` positions only.
  virtual void decode(int layer, std::span<const std::int64_t> seqs, const float* queries,
                      float* out, float* lse, int window) = 0;
  // queries [q_indptr[batch]][q_heads][head_dim]; sequence b's chunk is its last
  // q_indptr[b+1] - q_indptr[b] tokens, causal (window > 0: a query at p sees (p - window, p]).
  virtual void prefill(int layer, std::span<const std::int64_t> seqs,
                       std::span<const std::int32_t> q_indptr, const float* queries, float* out,
                       float* lse, int window) = 0;

  virtual tierkv::retier_stats retier(std::uint64_t step) = 0;
  virtual tierkv::memory_report report() const = 0;
  virtual void pin(std::int64_t seq, std::int64_t first_page, std::int64_t pages, bool pinned) = 0;
  // Decoded tokens [first, first + n) of one layer (committed or reserved): [n][kv_heads][dim].
  virtual void read_layer(std::int64_t seq, int layer, std::int64_t first, std::int64_t n,
                          float* keys, float* values) const = 0;
  // The tier of each committed logical page of seq at one layer.
  virtual std::vector<std::int64_t> page_tiers(std::int64_t seq, int layer) const = 0;

  // Prefix reuse (tierkv::prefix_index over the cache's storage): sealed pages shared by
  // reference. insert: the new entries for seq's full pages its first tokens.size() token ids
  // cover; start: a new sequence and the tokens of the longest cached prefix it holds; evict:
  // up to n least recently used entries no sequence uses, how many went.
  virtual std::int64_t prefix_insert(std::int64_t seq, std::uint64_t salt,
                                     std::span<const std::int32_t> tokens) = 0;
  virtual std::array<std::int64_t, 2> prefix_start(std::uint64_t salt,
                                                   std::span<const std::int32_t> tokens) = 0;
  virtual std::int64_t prefix_evict(std::int64_t n) = 0;
  virtual std::int64_t prefix_entries() const = 0;

  // Page transfer (paging/page_transfer.hpp's buffer, docs/multigpu.md): export_size is the
  // bytes of the export of logical pages [first, first + count) of seq (count < 0: to the end),
  // all layers, KV heads [head_begin, head_begin + head_count) (head_count < 0: to the end);
  // export_pages writes it into out (exactly export_size bytes); import_pages makes a NEW
  // sequence of a buffer's run, all or nothing (every check before any change).
  virtual std::int64_t export_size(std::int64_t seq, std::int64_t first, std::int64_t count,
                                   int head_begin, int head_count) const = 0;
  virtual void export_pages(std::int64_t seq, std::int64_t first, std::int64_t count,
                            int head_begin, int head_count, std::span<std::uint8_t> out) const = 0;
  virtual std::int64_t import_pages(std::span<const std::uint8_t> buf) = 0;
};

using factory = std::unique_ptr<runtime_cache> (*)(const cache_config&);

// registry.cpp: the prebuilt set. Instantiation units add themselves at load time.
void register_combo(const combo& c, factory f);
std::vector<combo> built_combos();
// Resolves the names and the geometry to a prebuilt instantiation and creates it; a
// combination not built is refused with a message naming what was built.
std::unique_ptr<runtime_cache> make_cache(const cache_config& cfg);

}  // namespace tierkv_py
