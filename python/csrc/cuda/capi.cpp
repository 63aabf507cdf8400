// SPDX-License-Identifier: Apache-2.0
// capi.h over gpu_cache: argument checks that name the value and its limit, exceptions turned
// into return codes with a thread-local message, and the prebuilt set's registry.
#include "capi.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache_options.hpp"
#include "combo_registry.hpp"
#include "gpu_cache.hpp"

namespace tierkv_py {
namespace {

combo_registry<gpu_factory>& table() {
  static combo_registry<gpu_factory> t;  // filled while the library loads
  return t;
}

thread_local std::string last_error;

// Runs f; a library error (or any exception) becomes its code and the message.
template <class F>
int guarded(const char* what, F&& f) {
  try {
    f();
    return 0;
  } catch (const tierkv::error& e) {
    last_error = std::string(what) + ": " + e.what();
    return int(e.code());
  } catch (const std::exception& e) {
    last_error = std::string(what) + ": " + e.what();
    return int(tierkv::errc::invalid_argument);
  }
}

gpu_cache& cache_of(void* h) {
  if (h == nullptr)
    fail(tierkv::status(tierkv::errc::invalid_argument, "the cache handle is null"));
  return *static_cast<gpu_cache*>(h);
}

int to_int(std::int64_t v, const char* name, std::int64_t lo = 0) {
  if (v < lo || v > std::numeric_limits<int>::max())
    fail(tierkv::status::make(tierkv::errc::invalid_argument, name, " = ", v, " must lie in [", lo,
                              ", 2^31)"));
  return int(v);
}

std::span<const std::int32_t> token_span(const int32_t* tokens, int64_t n, const char* what) {
  if (n < 0 || (n > 0 && tokens == nullptr))
    fail(tierkv::status::make(tierkv::errc::invalid_argument, what, ": ", n,
                              " token ids at a null pointer or a negative count"));
  return {tokens, std::size_t(n)};
}

gpu_dtype to_dtype(int t, const char* name) {
  if (t != int(gpu_dtype::f32) && t != int(gpu_dtype::bf16))
    fail(tierkv::status::make(tierkv::errc::invalid_argument, name, " = ", t,
                              " is no dtype (0 = float32, 1 = bfloat16)"));
  return gpu_dtype(t);
}

const char* text(const char* s, const char* name) {
  if (s == nullptr) fail(tierkv::status::make(tierkv::errc::invalid_argument, name, " is null"));
  return s;
}

gpu_cache_config to_config(const tkv_cuda_config& c) {
  gpu_cache_config g;
  g.recent = text(c.recent, "recent");
  g.cache_type_k = text(c.cache_type_k, "cache_type_k");
  g.cache_type_v = text(c.cache_type_v, "cache_type_v");
  if (c.cold_type_k != nullptr) g.cold_type_k = c.cold_type_k;  // NULL: no Cold tier
  if (c.cold_type_v != nullptr) g.cold_type_v = c.cold_type_v;
  g.head_dim = to_int(c.head_dim, "head_dim", 1);
  g.kv_heads = to_int(c.kv_heads, "kv_heads", 1);
  g.group_size = to_int(c.group_size, "group_size", 1);
  g.page_size = to_int(c.page_size, "page_size", 1);
  g.num_layers = to_int(c.num_layers, "num_layers", 1);
  if (c.num_tiers < 1 || c.num_tiers > 8)
    fail(tierkv::status::make(tierkv::errc::invalid_argument, "num_tiers = ", c.num_tiers,
                              " must lie in [1, 8]"));
  g.pages_per_tier.assign(c.pages_per_tier, c.pages_per_tier + c.num_tiers);
  g.max_sequences = c.max_sequences;
  g.max_batch = to_int(c.max_batch, "max_batch", 1);
  g.max_pages = to_int(c.max_pages, "max_pages", 1);
  g.max_step_tokens = to_int(c.max_step_tokens, "max_step_tokens", 1);
  g.max_retier_pages = to_int(c.max_retier_pages, "max_retier_pages", 1);
  g.max_chunks_per_seq = to_int(c.max_chunks_per_seq, "max_chunks_per_seq", 1);
  g.mass_layers_per_step = to_int(c.mass_layers_per_step, "mass_layers_per_step");
  g.softmax_scale = c.softmax_scale;
  g.codec_seed = c.codec_seed;
  g.policy = text(c.policy, "policy");
  if (c.num_policy_knobs < 0 || c.num_policy_knobs > 64 ||
      (c.num_policy_knobs > 0 && (c.knob_names == nullptr || c.knob_values == nullptr)))
    fail(tierkv::status::make(tierkv::errc::invalid_argument,
                              "num_policy_knobs = ", c.num_policy_knobs,
                              " must lie in [0, 64] with its names and values given"));
  for (std::int64_t i = 0; i < c.num_policy_knobs; ++i) {
    g.policy_knob_names.emplace_back(text(c.knob_names[i], "a policy knob name"));
    g.policy_knob_values.push_back(c.knob_values[i]);
  }
  if (c.center != 0 && c.center != 1)
    fail(tierkv::status::make(tierkv::errc::invalid_argument, "center = ", c.center,
                              " must be 0 or 1"));
  g.center = c.center == 1;
  g.bits_per_scalar = c.bits_per_scalar;  // the controller's validate() names a bad one
  if (c.host_pool_bytes < 0)
    fail(tierkv::status::make(tierkv::errc::invalid_argument, "host_pool_bytes = ",
                              c.host_pool_bytes, " must be >= 0 (0: no host tier)"));
  g.host_pool_bytes = std::uint64_t(c.host_pool_bytes);
  return g;
}

cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void register_gpu_combo(const combo& c, gpu_factory f) { table().add(c, f); }

}  // namespace tierkv_py

using namespace tierkv_py;

extern "C" {

int tkv_cuda_abi_version(void) { return TKV_CUDA_ABI_VERSION; }
const char* tkv_cuda_last_error(void) { return last_error.c_str(); }

int tkv_cuda_built(int32_t* rows, int capacity) {
  const auto combos = table().combos();
  for (std::size_t i = 0; i < combos.size() && int(i) < capacity && rows != nullptr; ++i) {
    const combo& c = combos[i];
    const int32_t r[5] = {c.tier_set, c.head_dim, c.kv_heads, c.group_size, c.page_size};
    std::memcpy(rows + 5 * i, r, sizeof r);
  }
  return int(combos.size());
}

const char* tkv_cuda_tier_set_name(int i) {
  static thread_local std::string name;  // valid until this thread's next call
  name = tier_set_name(i);
  return name.empty() ? nullptr : name.c_str();
}

int tkv_cuda_create(const tkv_cuda_config* cfg, void* stream, void** cache) {
  return guarded("tkv_cuda_create", [&] {
    if (cfg == nullptr || cache == nullptr)
      fail(tierkv::status(tierkv::errc::invalid_argument, "cfg and cache must not be null"));
    const gpu_cache_config g = to_config(*cfg);
    const gpu_factory f =
        table().find(g, "TIERKV_PYTHON_CUDA_SET",
                     "TIERKV_PYTHON_CUDA=1 pip install --no-build-isolation ./python");
    *cache = f(g, stream_of(stream)).release();
  });
}

int tkv_cuda_destroy(void* cache) {
  return guarded("tkv_cuda_destroy", [&] { delete &cache_of(cache); });
}

int tkv_cuda_num_tiers(void* cache, int64_t* tiers) {
  return guarded("tkv_cuda_num_tiers", [&] { *tiers = cache_of(cache).num_tiers(); });
}
int tkv_cuda_create_sequence(void* cache, int64_t* seq) {
  return guarded("create_sequence", [&] { *seq = cache_of(cache).create_sequence(); });
}
int tkv_cuda_fork(void* cache, int64_t parent, int64_t* seq) {
  return guarded("fork", [&] { *seq = cache_of(cache).fork(parent); });
}
int tkv_cuda_release(void* cache, int64_t seq) {
  return guarded("release", [&] { cache_of(cache).release(seq); });
}
int tkv_cuda_length(void* cache, int64_t seq, int64_t* tokens) {
  return guarded("length", [&] { *tokens = cache_of(cache).length(seq); });
}
int tkv_cuda_prefix_insert(void* cache, int64_t seq, uint64_t salt, const int32_t* tokens,
                           int64_t n, int64_t* added) {
  return guarded("prefix_insert", [&] {
    *added = cache_of(cache).prefix_insert(seq, salt, token_span(tokens, n, "prefix_insert"));
  });
}
int tkv_cuda_prefix_start(void* cache, uint64_t salt, const int32_t* tokens, int64_t n,
                          int64_t out[2]) {
  return guarded("prefix_start", [&] {
    const auto r = cache_of(cache).prefix_start(salt, token_span(tokens, n, "prefix_start"));
    out[0] = r[0];
    out[1] = r[1];
  });
}
int tkv_cuda_prefix_evict(void* cache, int64_t max_entries, int64_t* evicted) {
  return guarded("prefix_evict", [&] { *evicted = cache_of(cache).prefix_evict(max_entries); });
}
int tkv_cuda_drain(void* cache) {
  return guarded("drain", [&] { cache_of(cache).drain(); });
}
int tkv_cuda_export_pages(void* cache, int64_t seq, int64_t first, int64_t count,
                          int64_t head_begin, int64_t head_count, void** buffer,
                          const uint8_t** data, int64_t* bytes) {
  return guarded("export_pages", [&] {
    if (buffer == nullptr || data == nullptr || bytes == nullptr)
      fail(tierkv::status(tierkv::errc::invalid_argument,
                          "export_pages: buffer, data and bytes must not be null"));
    constexpr std::int64_t any = std::numeric_limits<int>::min();  // the façade checks the range
    auto out = std::make_unique<std::vector<std::uint8_t>>(
        cache_of(cache).export_pages(seq, first, count, to_int(head_begin, "head_begin", any),
                                     to_int(head_count, "head_count", any)));
    *data = out->data();
    *bytes = std::int64_t(out->size());
    *buffer = out.release();
  });
}
void tkv_cuda_free_buffer(void* buffer) { delete static_cast<std::vector<std::uint8_t>*>(buffer); }
int tkv_cuda_import_pages(void* cache, const uint8_t* data, int64_t bytes, int64_t* seq) {
  return guarded("import_pages", [&] {
    if (bytes < 0 || (bytes > 0 && data == nullptr) || seq == nullptr)
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "import_pages: ", bytes,
                                " bytes at a null pointer, a negative size or a null seq"));
    *seq = cache_of(cache).import_pages({data, std::size_t(bytes)});
  });
}

int tkv_cuda_offload(void* cache, int64_t seq, uint64_t* parked) {
  return guarded("offload", [&] { *parked = cache_of(cache).offload(seq); });
}
int tkv_cuda_restore(void* cache, uint64_t parked, int64_t* seq) {
  return guarded("restore", [&] { *seq = cache_of(cache).restore(parked); });
}
int tkv_cuda_drop_parked(void* cache, uint64_t parked) {
  return guarded("drop_parked", [&] { cache_of(cache).drop_parked(parked); });
}
int tkv_cuda_restore_pending(void* cache, int64_t seq, int* pending) {
  return guarded("restore_pending", [&] {
    if (pending == nullptr)
      fail(tierkv::status(tierkv::errc::invalid_argument, "restore_pending: a null output"));
    *pending = cache_of(cache).restore_pending(seq) ? 1 : 0;
  });
}
int tkv_cuda_host_stats(void* cache, uint64_t out[9]) {
  return guarded("host_stats", [&] {
    const auto h = cache_of(cache).host_stats();
    for (int i = 0; i < 9; ++i) out[i] = h[std::size_t(i)];
  });
}

int tkv_cuda_set_stream(void* cache, void* stream) {
  return guarded("set_stream", [&] { cache_of(cache).set_stream(stream_of(stream)); });
}
int tkv_cuda_begin_step(void* cache, const int64_t* seqs, const int32_t* counts, int64_t n) {
  return guarded("begin_step", [&] {
    if (n < 0 || (n > 0 && (seqs == nullptr || counts == nullptr)))
      fail(tierkv::status::make(tierkv::errc::invalid_argument, "begin_step: ", n,
                                " sequences with a null array"));
    cache_of(cache).begin_step({seqs, std::size_t(n)}, {counts, std::size_t(n)});
  });
}
int tkv_cuda_append(void* cache, int64_t layer, const void* k, const void* v, int dtype,
                    void* stream) {
  return guarded("append", [&] {
    cache_of(cache).append(to_int(layer, "layer"), k, v, to_dtype(dtype, "dtype"),
                           stream_of(stream));
  });
}
int tkv_cuda_decode_ex(void* cache, int64_t layer, const void* q, int q_dtype, void* out,
                       int out_dtype, float* lse, float soft_cap, int64_t window, void* stream) {
  return guarded("decode", [&] {
    cache_of(cache).decode(to_int(layer, "layer"), q, to_dtype(q_dtype, "q_dtype"), out,
                           to_dtype(out_dtype, "out_dtype"), lse, soft_cap,
                           to_int(window, "window"), stream_of(stream));
  });
}
int tkv_cuda_decode(void* cache, int64_t layer, const void* q, int q_dtype, void* out,
                    int out_dtype, float* lse, void* stream) {
  return tkv_cuda_decode_ex(cache, layer, q, q_dtype, out, out_dtype, lse, 0.f, 0, stream);
}
int tkv_cuda_prefill(void* cache, int64_t layer, const void* q, int q_dtype, void* out,
                     int out_dtype, float* lse, float soft_cap, int64_t window, void* stream) {
  return guarded("prefill", [&] {
    cache_of(cache).prefill(to_int(layer, "layer"), q, to_dtype(q_dtype, "q_dtype"), out,
                            to_dtype(out_dtype, "out_dtype"), lse, soft_cap,
                            to_int(window, "window"), stream_of(stream));
  });
}
int tkv_cuda_end_step(void* cache, uint64_t step, int wait, uint64_t stats[8]) {
  return guarded("end_step", [&] {
    const tierkv::retier_stats s = cache_of(cache).end_step(step, wait != 0);
    if (stats != nullptr) {
      const uint64_t v[8] = {s.planned,          s.converted, s.promoted,      s.demoted,
                             s.pressure_demoted, s.deferred,  s.deferred_full, s.failed};
      std::memcpy(stats, v, sizeof v);
    }
  });
}

int tkv_cuda_report(void* cache, double* values, int capacity) {
  int n = -1;
  const int rc = guarded("report", [&] {
    const std::vector<double> v = report_values(cache_of(cache).report());
    for (std::size_t i = 0; i < v.size() && int(i) < capacity && values != nullptr; ++i)
      values[i] = v[i];
    n = int(v.size());
  });
  return rc == 0 ? n : -rc;
}
int64_t tkv_cuda_report_text(void* cache, char* text, int64_t capacity) {
  std::int64_t n = -1;
  const int rc = guarded("report_text", [&] {
    const std::string s = tierkv::to_string(cache_of(cache).report());
    if (text != nullptr && capacity > 0) {
      const std::size_t m = std::min<std::size_t>(s.size(), std::size_t(capacity - 1));
      std::memcpy(text, s.data(), m);
      text[m] = '\0';
    }
    n = std::int64_t(s.size());
  });
  return rc == 0 ? n : -rc;
}
int tkv_cuda_pin(void* cache, int64_t seq, int64_t first_page, int64_t pages, int pinned) {
  return guarded("pin", [&] { cache_of(cache).pin(seq, first_page, pages, pinned != 0); });
}
int64_t tkv_cuda_page_tiers(void* cache, int64_t seq, int64_t layer, int64_t* tiers,
                            int64_t capacity) {
  std::int64_t n = -1;
  const int rc = guarded("page_tiers", [&] {
    const auto t = cache_of(cache).page_tiers(seq, to_int(layer, "layer"));
    for (std::size_t i = 0; i < t.size() && std::int64_t(i) < capacity && tiers != nullptr; ++i)
      tiers[i] = t[i];
    n = std::int64_t(t.size());
  });
  return rc == 0 ? n : -rc;
}
int tkv_cuda_check_invariants(void* cache) {
  return guarded("check_invariants", [&] { cache_of(cache).check_invariants(); });
}
int tkv_cuda_device_error(void* cache) {
  return guarded("device_error", [&] { cache_of(cache).device_error(); });
}
int tkv_cuda_transfers(void* cache, uint64_t out[3]) {
  return guarded("transfers", [&] {
    const auto t = cache_of(cache).transfers();
    for (int i = 0; i < 3; ++i) out[i] = t[std::size_t(i)];
  });
}

int tkv_cuda_host_times(void* cache, uint64_t out[9]) {
  return guarded("host_times", [&] {
    const auto t = cache_of(cache).host_times();
    for (int i = 0; i < 9; ++i) out[i] = t[std::size_t(i)];
  });
}
int tkv_cuda_retier_totals(void* cache, uint64_t out[8]) {
  return guarded("retier_totals", [&] {
    const auto t = cache_of(cache).retier_totals();
    for (int i = 0; i < 8; ++i) out[i] = t[std::size_t(i)];
  });
}

}  // extern "C"
