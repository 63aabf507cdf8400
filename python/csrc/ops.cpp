// SPDX-License-Identifier: Apache-2.0
// torch custom ops (namespace tierkv) over the run-time caches of registry.cpp.
//
// A cache is named by a `state` tensor, int64 [2] on the CPU: {handle, mutation count}. Ops
// that change the cache take it as `Tensor(a!)` and bump the count, so torch.compile /
// functionalization orders them before the attention ops that read it (a data dependence,
// not a hidden side effect), and the fake implementations (tierkv/_fake.py) need no C++
// object: they only shape outputs. Every argument is checked here, naming the value and
// the limit; the cache's own refusals (tierkv::error) become Python ValueError /
// RuntimeError with the library's message.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache_options.hpp"
#include "formats.hpp"
#include "runtime.hpp"

namespace tierkv_py {
namespace {

std::mutex registry_mutex;
std::unordered_map<std::int64_t, std::shared_ptr<runtime_cache>>& caches() {
  static std::unordered_map<std::int64_t, std::shared_ptr<runtime_cache>> c;
  return c;
}
std::atomic<std::int64_t> next_handle{1};

// Refusal messages are built by tierkv::concat, never by c10::str's stream: on the device
// image (g++ 13.3, torch 2.11) this extension crashes streaming any number
// (tierkv/core/text.hpp). Shapes, devices and dtypes are written as torch writes them.
std::string text_of(at::IntArrayRef v) { return "[" + join(v) + "]"; }
std::string text_of(const c10::Device& d) { return d.str(); }
const char* text_of(at::ScalarType t) { return c10::toString(t); }
template <class T>
const T& text_of(const T& v) {
  return v;
}
template <class... Parts>
std::string message(const Parts&... parts) {
  return tierkv::concat(text_of(parts)...);
}
#define TIERKV_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, message(__VA_ARGS__))
#define TIERKV_CHECK(cond, ...) TORCH_CHECK(cond, message(__VA_ARGS__))

// Rethrows a library error as the Python exception that fits its code. corrupt_data is a
// ValueError where the op's argument is the data checked (import_pages' buffer), a RuntimeError
// elsewhere (the cache's own bookkeeping).
template <class F>
auto guarded(const char* op, F&& f, bool corrupt_argument = false) -> decltype(f()) {
  try {
    return f();
  } catch (const tierkv::error& e) {
    const std::string msg = std::string("tierkv.") + op + ": " + e.what();
    switch (e.code()) {
      case tierkv::errc::invalid_argument:
      case tierkv::errc::out_of_range:
      case tierkv::errc::non_finite_input:
      case tierkv::errc::geometry_mismatch:
      case tierkv::errc::stale_id:
        TIERKV_CHECK_VALUE(false, msg);
      case tierkv::errc::corrupt_data:
        TIERKV_CHECK_VALUE(!corrupt_argument, msg);
        TIERKV_CHECK(false, msg);
      default:
        TIERKV_CHECK(false, msg);
    }
  }
}

void check_state(const at::Tensor& state) {
  TIERKV_CHECK_VALUE(state.device().is_cpu() && state.scalar_type() == at::kLong &&
                         state.dim() == 1 && state.numel() == 2,
                     "tierkv: state must be the int64 CPU tensor of 2 elements that "
                     "tierkv.ops.create returned, got ",
                     state.scalar_type(), " ", state.sizes(), " on ", state.device());
}

std::shared_ptr<runtime_cache> find(const at::Tensor& state) {
  check_state(state);
  const std::int64_t h = state.data_ptr<std::int64_t>()[0];
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = caches().find(h);
  TIERKV_CHECK_VALUE(it != caches().end(), "tierkv: no cache with handle ", h,
                     " (destroyed, or not made by tierkv.ops.create)");
  return it->second;
}

void bump(at::Tensor& state) { state.data_ptr<std::int64_t>()[1] += 1; }

// Sequence ids: a 1-D int64 CPU tensor (so a compiled graph is not specialised on them).
std::vector<std::int64_t> seq_list(const at::Tensor& seqs, const char* name) {
  TIERKV_CHECK_VALUE(seqs.device().is_cpu(), "tierkv: ", name, " must be a CPU tensor, got ",
                     seqs.device());
  TIERKV_CHECK_VALUE(seqs.scalar_type() == at::kLong, "tierkv: ", name, " must be int64, got ",
                     seqs.scalar_type());
  TIERKV_CHECK_VALUE(seqs.dim() == 1, "tierkv: ", name, " must be 1-D, got shape ", seqs.sizes());
  const at::Tensor c = seqs.contiguous();
  const std::int64_t* p = c.data_ptr<std::int64_t>();
  return std::vector<std::int64_t>(p, p + c.numel());
}

// A float tensor of an exact shape on the host path; returned as contiguous float32.
at::Tensor host_floats(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TIERKV_CHECK_VALUE(t.device().is_cpu(), "tierkv: ", name, " is on ", t.device(),
                     "; this package's ops run the host path on CPU tensors (the CUDA path is "
                     "not built into these ops)");
  const auto s = t.scalar_type();
  TIERKV_CHECK_VALUE(s == at::kFloat || s == at::kBFloat16 || s == at::kHalf, "tierkv: ", name,
                     " must be float32, bfloat16 or float16, got ", s);
  TIERKV_CHECK_VALUE(t.sizes() == shape, "tierkv: ", name, " must have shape ", shape, ", got ",
                     t.sizes());
  TIERKV_CHECK_VALUE(t.is_contiguous(), "tierkv: ", name, " must be contiguous (shape ", t.sizes(),
                     ", strides ", t.strides(), "); call .contiguous()");
  return t.to(at::kFloat).contiguous();
}

int to_int(std::int64_t v, const char* name) {
  TIERKV_CHECK_VALUE(v >= INT32_MIN && v <= INT32_MAX, "tierkv: ", name, " = ", v,
                     " does not fit int32");
  return int(v);
}

// ---- lifetime -------------------------------------------------------------------------------

at::Tensor create(std::string recent, std::string cache_type_k, std::string cache_type_v,
                  std::string cold_type_k, std::string cold_type_v, std::int64_t head_dim,
                  std::int64_t kv_heads, std::int64_t group_size, std::int64_t page_size,
                  std::int64_t num_layers, at::IntArrayRef pages_per_tier,
                  std::int64_t max_sequences, std::int64_t max_batch, std::int64_t max_pages,
                  std::int64_t threads, double softmax_scale, double soft_cap,
                  std::int64_t codec_seed, std::string policy,
                  std::vector<std::string> policy_knob_names,
                  std::vector<double> policy_knob_values, bool center, double bits_per_scalar) {
  TIERKV_CHECK_VALUE(codec_seed >= 0, "tierkv.create: codec_seed = ", codec_seed, " is negative");
  cache_config cfg;
  cfg.recent = std::move(recent);
  cfg.cache_type_k = std::move(cache_type_k);
  cfg.cache_type_v = std::move(cache_type_v);
  cfg.cold_type_k = std::move(cold_type_k);
  cfg.cold_type_v = std::move(cold_type_v);
  cfg.head_dim = to_int(head_dim, "head_dim");
  cfg.kv_heads = to_int(kv_heads, "kv_heads");
  cfg.group_size = to_int(group_size, "group_size");
  cfg.page_size = to_int(page_size, "page_size");
  cfg.num_layers = to_int(num_layers, "num_layers");
  cfg.pages_per_tier.assign(pages_per_tier.begin(), pages_per_tier.end());
  cfg.max_sequences = max_sequences;
  cfg.max_batch = to_int(max_batch, "max_batch");
  cfg.max_pages = to_int(max_pages, "max_pages");
  cfg.threads = to_int(threads, "threads");
  cfg.softmax_scale = softmax_scale;
  cfg.soft_cap = soft_cap;
  cfg.codec_seed = std::uint64_t(codec_seed);
  cfg.policy = std::move(policy);
  cfg.policy_knob_names = std::move(policy_knob_names);
  cfg.policy_knob_values = std::move(policy_knob_values);
  cfg.center = center;
  cfg.bits_per_scalar = bits_per_scalar;
  std::shared_ptr<runtime_cache> c = guarded("create", [&] { return make_cache(cfg); });
  const std::int64_t h = next_handle++;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    caches().emplace(h, std::move(c));
  }
  at::Tensor state = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  state.data_ptr<std::int64_t>()[0] = h;
  state.data_ptr<std::int64_t>()[1] = 0;
  return state;
}

void destroy(at::Tensor& state) {
  check_state(state);
  const std::int64_t h = state.data_ptr<std::int64_t>()[0];
  std::lock_guard<std::mutex> lock(registry_mutex);
  TIERKV_CHECK_VALUE(caches().erase(h) == 1, "tierkv.destroy: no cache with handle ", h);
  bump(state);
}

// One row per prebuilt combination: {tier set, head_dim, kv_heads, group_size, page_size}.
at::Tensor built() {
  const auto v = built_combos();
  at::Tensor t = at::empty({std::int64_t(v.size()), 5}, at::TensorOptions().dtype(at::kLong));
  auto a = t.accessor<std::int64_t, 2>();
  for (std::size_t i = 0; i < v.size(); ++i) {
    a[i][0] = v[i].tier_set, a[i][1] = v[i].head_dim, a[i][2] = v[i].kv_heads;
    a[i][3] = v[i].group_size, a[i][4] = v[i].page_size;
  }
  return t;
}

// "recent/cache_type_k/cache_type_v" of a tier set index (built()'s first column).
std::string tier_set_name_op(std::int64_t index) {
  return index < 0 || index > std::numeric_limits<int>::max() ? std::string()
                                                              : tier_set_name(int(index));
}

// The registered tier policies (tierkv/policies.hpp) as "name: knob=default, ...", one a line.
std::string policies_op() { return tierkv::registered_policy_table(); }

// ---- sequences ------------------------------------------------------------------------------

std::int64_t create_sequence(at::Tensor& state) {
  auto c = find(state);
  bump(state);
  return guarded("create_sequence", [&] { return c->create_sequence(); });
}
std::int64_t fork(at::Tensor& state, std::int64_t parent) {
  auto c = find(state);
  bump(state);
  return guarded("fork", [&] { return c->fork(parent); });
}
void release(at::Tensor& state, std::int64_t seq) {
  auto c = find(state);
  bump(state);
  guarded("release", [&] { c->release(seq); });
}
std::int64_t length(const at::Tensor& state, std::int64_t seq) {
  auto c = find(state);
  return guarded("length", [&] { return c->length(seq); });
}
std::int64_t reserved(const at::Tensor& state, std::int64_t seq) {
  auto c = find(state);
  return guarded("reserved", [&] { return c->reserved(seq); });
}

// ---- writes ---------------------------------------------------------------------------------

void reserve(at::Tensor& state, const at::Tensor& seqs, const at::Tensor& counts) {
  auto c = find(state);
  const auto s = seq_list(seqs, "seqs");
  const auto n = seq_list(counts, "counts");
  TIERKV_CHECK_VALUE(s.size() == n.size(), "tierkv.reserve: ", s.size(), " sequences but ",
                     n.size(), " counts");
  bump(state);
  guarded("reserve", [&] { c->reserve(s, n); });
}

void write(at::Tensor& state, std::int64_t layer, const at::Tensor& seqs, const at::Tensor& k,
           const at::Tensor& v) {
  auto c = find(state);
  const auto& cfg = c->config();
  const auto s = seq_list(seqs, "seqs");
  TIERKV_CHECK_VALUE(k.dim() == 3, "tierkv.write: k must be [tokens, kv_heads, head_dim], got ",
                     k.sizes());
  const std::int64_t n = k.size(0);
  const at::Tensor kf = host_floats(k, "k", {n, cfg.kv_heads, cfg.head_dim});
  const at::Tensor vf = host_floats(v, "v", {n, cfg.kv_heads, cfg.head_dim});
  bump(state);
  guarded("write", [&] {
    c->write_layer(s, to_int(layer, "layer"), kf.data_ptr<float>(), vf.data_ptr<float>(), n);
  });
}

void commit(at::Tensor& state, const at::Tensor& seqs) {
  auto c = find(state);
  const auto s = seq_list(seqs, "seqs");
  bump(state);
  guarded("commit", [&] { c->commit(s); });
}
void cancel(at::Tensor& state, const at::Tensor& seqs) {
  auto c = find(state);
  const auto s = seq_list(seqs, "seqs");
  bump(state);
  guarded("cancel", [&] { c->cancel(s); });
}

void append(at::Tensor& state, std::int64_t seq, const at::Tensor& k, const at::Tensor& v) {
  auto c = find(state);
  const auto& cfg = c->config();
  TIERKV_CHECK_VALUE(k.dim() == 4,
                     "tierkv.append: k must be [num_layers, tokens, kv_heads, head_dim], got ",
                     k.sizes());
  const std::int64_t n = k.size(1);
  const at::Tensor kf = host_floats(k, "k", {cfg.num_layers, n, cfg.kv_heads, cfg.head_dim});
  const at::Tensor vf = host_floats(v, "v", {cfg.num_layers, n, cfg.kv_heads, cfg.head_dim});
  bump(state);
  guarded("append", [&] { c->append(seq, n, kf.data_ptr<float>(), vf.data_ptr<float>()); });
}

// ---- attention ------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> decode(const at::Tensor& state, std::int64_t layer,
                                          const at::Tensor& seqs, const at::Tensor& q,
                                          std::int64_t window) {
  auto c = find(state);
  const auto& cfg = c->config();
  const auto s = seq_list(seqs, "seqs");
  const std::int64_t B = std::int64_t(s.size()), QH = cfg.kv_heads * cfg.group_size;
  const at::Tensor qf = host_floats(q, "q", {B, QH, cfg.head_dim});
  at::Tensor out = at::empty({B, QH, cfg.head_dim}, qf.options());
  at::Tensor lse = at::empty({B, QH}, qf.options());
  guarded("decode", [&] {
    c->decode(to_int(layer, "layer"), s, qf.data_ptr<float>(), out.data_ptr<float>(),
              lse.data_ptr<float>(), to_int(window, "window"));
  });
  return {out.to(q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor> prefill(const at::Tensor& state, std::int64_t layer,
                                           const at::Tensor& seqs, const at::Tensor& q,
                                           const at::Tensor& q_indptr, std::int64_t window) {
  auto c = find(state);
  const auto& cfg = c->config();
  const auto s = seq_list(seqs, "seqs");
  TIERKV_CHECK_VALUE(
      q_indptr.device().is_cpu() && q_indptr.dim() == 1 &&
          (q_indptr.scalar_type() == at::kInt || q_indptr.scalar_type() == at::kLong),
      "tierkv.prefill: q_indptr must be a 1-D int32 or int64 CPU tensor, got ",
      q_indptr.scalar_type(), " ", q_indptr.sizes(), " on ", q_indptr.device());
  TIERKV_CHECK_VALUE(q_indptr.numel() == std::int64_t(s.size()) + 1,
                     "tierkv.prefill: q_indptr has ", q_indptr.numel(),
                     " entries, batch + 1 = ", s.size() + 1, " needed");
  const at::Tensor ip64 = q_indptr.to(at::kLong).contiguous();
  const std::int64_t* ip = ip64.data_ptr<std::int64_t>();
  TIERKV_CHECK_VALUE(ip[0] == 0, "tierkv.prefill: q_indptr[0] = ", ip[0], " must be 0");
  std::vector<std::int32_t> indptr(s.size() + 1);
  for (std::size_t b = 0; b <= s.size(); ++b) {
    if (b > 0)
      TIERKV_CHECK_VALUE(ip[b] >= ip[b - 1], "tierkv.prefill: q_indptr decreases at ", b, ": ",
                         ip[b - 1], " > ", ip[b]);
    indptr[b] = to_int(ip[b], "q_indptr entry");
  }
  const std::int64_t total = ip[s.size()], QH = cfg.kv_heads * cfg.group_size;
  TIERKV_CHECK_VALUE(q.dim() == 3 && q.size(0) == total,
                     "tierkv.prefill: q must be [q_indptr[-1] = ", total,
                     ", q_heads, head_dim], got ", q.sizes());
  const at::Tensor qf = host_floats(q, "q", {total, QH, cfg.head_dim});
  at::Tensor out = at::empty({total, QH, cfg.head_dim}, qf.options());
  at::Tensor lse = at::empty({total, QH}, qf.options());
  guarded("prefill", [&] {
    c->prefill(to_int(layer, "layer"), s, indptr, qf.data_ptr<float>(), out.data_ptr<float>(),
               lse.data_ptr<float>(), to_int(window, "window"));
  });
  return {out.to(q.scalar_type()), lse};
}

// ---- tiering and accounting -----------------------------------------------------------------

// {planned, converted, promoted, demoted, pressure_demoted, deferred, deferred_full, failed}
at::Tensor retier(at::Tensor& state, std::int64_t step) {
  auto c = find(state);
  TIERKV_CHECK_VALUE(step >= 0, "tierkv.retier: step = ", step, " is negative");
  bump(state);
  const auto r = guarded("retier", [&] { return c->retier(std::uint64_t(step)); });
  TIERKV_CHECK(r.first_error.is_ok(), "tierkv.retier: ", r.first_error.message());
  at::Tensor t = at::empty({8}, at::TensorOptions().dtype(at::kLong));
  std::int64_t* p = t.data_ptr<std::int64_t>();
  const std::uint64_t v[8] = {r.planned,          r.converted, r.promoted,      r.demoted,
                              r.pressure_demoted, r.deferred,  r.deferred_full, r.failed};
  for (int i = 0; i < 8; ++i) p[i] = std::int64_t(v[i]);
  return t;
}

// Global lines then, per tier, {page_bytes, capacity_pages, live_pages, live_bytes,
// free_page_bytes, token_layers, bits_per_scalar}; float64 (byte counts are exact to 2^53).
at::Tensor report(const at::Tensor& state) {
  auto c = find(state);
  return at::tensor(report_values(c->report()), at::TensorOptions().dtype(at::kDouble));
}

std::string report_text(const at::Tensor& state) {
  auto c = find(state);
  return tierkv::to_string(c->report());
}

void pin(at::Tensor& state, std::int64_t seq, std::int64_t first_page, std::int64_t pages,
         bool pinned) {
  auto c = find(state);
  bump(state);
  guarded("pin", [&] { c->pin(seq, first_page, pages, pinned); });
}

std::tuple<at::Tensor, at::Tensor> read_layer(const at::Tensor& state, std::int64_t seq,
                                              std::int64_t layer, std::int64_t first,
                                              std::int64_t n) {
  auto c = find(state);
  const auto& cfg = c->config();
  TIERKV_CHECK_VALUE(n >= 0, "tierkv.read_layer: n = ", n, " is negative");
  at::Tensor k = at::empty({n, cfg.kv_heads, cfg.head_dim}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor v = at::empty_like(k);
  guarded("read_layer", [&] {
    c->read_layer(seq, to_int(layer, "layer"), first, n, k.data_ptr<float>(), v.data_ptr<float>());
  });
  return {k, v};
}

at::Tensor page_tiers(const at::Tensor& state, std::int64_t seq, std::int64_t layer) {
  auto c = find(state);
  const auto t = guarded("page_tiers", [&] { return c->page_tiers(seq, to_int(layer, "layer")); });
  return at::tensor(t, at::TensorOptions().dtype(at::kLong));
}

// ---- prefix reuse ---------------------------------------------------------------------------

// Token ids: a 1-D integer tensor on the CPU, each in int32.
std::vector<std::int32_t> token_ids(const at::Tensor& t, const char* op) {
  TIERKV_CHECK_VALUE(t.device().is_cpu(), "tierkv.", op, ": tokens must be on the CPU, got ",
                     t.device());
  TIERKV_CHECK_VALUE(t.dim() == 1, "tierkv.", op, ": tokens must be 1-D, got shape ", t.sizes());
  TIERKV_CHECK_VALUE(!at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool,
                     "tierkv.", op, ": tokens must be integer ids, got ", t.scalar_type());
  const at::Tensor l = t.to(at::kLong).contiguous();
  std::vector<std::int32_t> ids(std::size_t(l.numel()));
  const std::int64_t* p = l.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    TIERKV_CHECK_VALUE(p[i] >= INT32_MIN && p[i] <= INT32_MAX, "tierkv.", op, ": tokens[", i,
                       "] = ", p[i], " does not fit int32");
    ids[i] = std::int32_t(p[i]);
  }
  return ids;
}
std::int64_t prefix_insert(at::Tensor& state, std::int64_t seq, std::int64_t salt,
                           const at::Tensor& tokens) {
  auto c = find(state);
  const auto ids = token_ids(tokens, "prefix_insert");
  bump(state);
  return guarded("prefix_insert", [&] { return c->prefix_insert(seq, std::uint64_t(salt), ids); });
}
std::vector<std::int64_t> prefix_start(at::Tensor& state, std::int64_t salt,
                                       const at::Tensor& tokens) {
  auto c = find(state);
  const auto ids = token_ids(tokens, "prefix_start");
  bump(state);
  return guarded("prefix_start", [&] {
    const auto r = c->prefix_start(std::uint64_t(salt), ids);
    return std::vector<std::int64_t>{r[0], r[1]};
  });
}
std::int64_t prefix_evict(at::Tensor& state, std::int64_t n) {
  auto c = find(state);
  bump(state);
  return guarded("prefix_evict", [&] { return c->prefix_evict(n); });
}
std::int64_t prefix_entries(const at::Tensor& state) {
  auto c = find(state);
  return guarded("prefix_entries", [&] { return c->prefix_entries(); });
}

// ---- page transfer --------------------------------------------------------------------------

// The export of logical pages [first, first + count) of seq (count < 0: to the end), all layers,
// KV heads [head_begin, head_begin + head_count) (head_count < 0: to the end), as a 1-D uint8
// CPU tensor holding paging/page_transfer.hpp's buffer. The cache is not changed.
at::Tensor export_pages(const at::Tensor& state, std::int64_t seq, std::int64_t first,
                        std::int64_t count, std::int64_t head_begin, std::int64_t head_count) {
  auto c = find(state);
  const int hb = to_int(head_begin, "head_begin"), hc = to_int(head_count, "head_count");
  const std::int64_t n =
      guarded("export_pages", [&] { return c->export_size(seq, first, count, hb, hc); });
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  guarded("export_pages", [&] {
    c->export_pages(seq, first, count, hb, hc,
                    std::span<std::uint8_t>(out.data_ptr<std::uint8_t>(), std::size_t(n)));
  });
  return out;
}

// Imports a buffer of export_pages (of this cache, another, or CudaCache's: the same bytes) as
// a NEW sequence, all or nothing; returns its id.
std::int64_t import_pages(at::Tensor& state, const at::Tensor& buf) {
  auto c = find(state);
  TIERKV_CHECK_VALUE(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.dim() == 1,
                     "tierkv.import_pages: buf must be a 1-D uint8 CPU tensor, got ",
                     buf.scalar_type(), " ", buf.sizes(), " on ", buf.device());
  const at::Tensor b = buf.contiguous();
  bump(state);
  return guarded(
      "import_pages",
      [&] {
        return c->import_pages(
            std::span<const std::uint8_t>(b.data_ptr<std::uint8_t>(), std::size_t(b.numel())));
      },
      true);
}

// Geometry and formats of a cache: {head_dim, kv_heads, group_size, page_size, num_layers,
// num_tiers, max_batch, max_pages}.
at::Tensor info(const at::Tensor& state) {
  auto c = find(state);
  const auto& g = c->config();
  return at::tensor(
      std::vector<std::int64_t>{g.head_dim, g.kv_heads, g.group_size, g.page_size, g.num_layers,
                                c->num_tiers(), g.max_batch, g.max_pages},
      at::TensorOptions().dtype(at::kLong));
}

}  // namespace
}  // namespace tierkv_py

TORCH_LIBRARY(tierkv, m) {
  m.def(
      "create(str recent, str cache_type_k, str cache_type_v, str cold_type_k, str cold_type_v, "
      "int head_dim, int kv_heads, "
      "int group_size, int page_size, int num_layers, int[] pages_per_tier, int max_sequences, "
      "int max_batch, int max_pages, int threads, float softmax_scale, float soft_cap, "
      "int codec_seed, str policy, str[] policy_knob_names, float[] policy_knob_values, "
      "bool center=False, float bits_per_scalar=0.0) -> Tensor");
  m.def("destroy(Tensor(a!) state) -> ()");
  m.def("built() -> Tensor");
  m.def("tier_set_name(int index) -> str");
  m.def("policies() -> str");
  m.def("create_sequence(Tensor(a!) state) -> int");
  m.def("fork(Tensor(a!) state, int parent) -> int");
  m.def("release(Tensor(a!) state, int seq) -> ()");
  m.def("length(Tensor state, int seq) -> int");
  m.def("reserved(Tensor state, int seq) -> int");
  m.def("reserve(Tensor(a!) state, Tensor seqs, Tensor counts) -> ()");
  m.def("write(Tensor(a!) state, int layer, Tensor seqs, Tensor k, Tensor v) -> ()");
  m.def("commit(Tensor(a!) state, Tensor seqs) -> ()");
  m.def("cancel(Tensor(a!) state, Tensor seqs) -> ()");
  m.def("append(Tensor(a!) state, int seq, Tensor k, Tensor v) -> ()");
  m.def("decode(Tensor state, int layer, Tensor seqs, Tensor q, int window=0) -> (Tensor, Tensor)");
  m.def(
      "prefill(Tensor state, int layer, Tensor seqs, Tensor q, Tensor q_indptr, int window=0) -> "
      "(Tensor, Tensor)");
  m.def("retier(Tensor(a!) state, int step) -> Tensor");
  m.def("report(Tensor state) -> Tensor");
  m.def("report_text(Tensor state) -> str");
  m.def("pin(Tensor(a!) state, int seq, int first_page, int pages, bool pinned) -> ()");
  m.def("read_layer(Tensor state, int seq, int layer, int first, int n) -> (Tensor, Tensor)");
  m.def("page_tiers(Tensor state, int seq, int layer) -> Tensor");
  m.def("info(Tensor state) -> Tensor");
  m.def("prefix_insert(Tensor(a!) state, int seq, int salt, Tensor tokens) -> int");
  m.def("prefix_start(Tensor(a!) state, int salt, Tensor tokens) -> int[]");
  m.def("prefix_evict(Tensor(a!) state, int n) -> int");
  m.def("prefix_entries(Tensor state) -> int");
  m.def(
      "export_pages(Tensor state, int seq, int first=0, int count=-1, int head_begin=0, "
      "int head_count=-1) -> Tensor");
  m.def("import_pages(Tensor(a!) state, Tensor buf) -> int");
}

// Ops without tensor arguments dispatch to their CompositeExplicitAutograd kernel.
TORCH_LIBRARY_IMPL(tierkv, CompositeExplicitAutograd, m) {
  m.impl("create", &tierkv_py::create);
  m.impl("built", &tierkv_py::built);
  m.impl("tier_set_name", &tierkv_py::tier_set_name_op);
  m.impl("policies", &tierkv_py::policies_op);
}

TORCH_LIBRARY_IMPL(tierkv, CPU, m) {
  m.impl("destroy", &tierkv_py::destroy);
  m.impl("create_sequence", &tierkv_py::create_sequence);
  m.impl("fork", &tierkv_py::fork);
  m.impl("release", &tierkv_py::release);
  m.impl("length", &tierkv_py::length);
  m.impl("reserved", &tierkv_py::reserved);
  m.impl("reserve", &tierkv_py::reserve);
  m.impl("write", &tierkv_py::write);
  m.impl("commit", &tierkv_py::commit);
  m.impl("cancel", &tierkv_py::cancel);
  m.impl("append", &tierkv_py::append);
  m.impl("decode", &tierkv_py::decode);
  m.impl("prefill", &tierkv_py::prefill);
  m.impl("retier", &tierkv_py::retier);
  m.impl("report", &tierkv_py::report);
  m.impl("report_text", &tierkv_py::report_text);
  m.impl("pin", &tierkv_py::pin);
  m.impl("read_layer", &tierkv_py::read_layer);
  m.impl("page_tiers", &tierkv_py::page_tiers);
  m.impl("info", &tierkv_py::info);
  m.impl("prefix_insert", &tierkv_py::prefix_insert);
  m.impl("prefix_start", &tierkv_py::prefix_start);
  m.impl("prefix_evict", &tierkv_py::prefix_evict);
  m.impl("prefix_entries", &tierkv_py::prefix_entries);
  m.impl("export_pages", &tierkv_py::export_pages);
  m.impl("import_pages", &tierkv_py::import_pages);
}

#ifndef TIERKV_PY_CUDA
// Without the CUDA build a CUDA tensor reaches the host kernels, whose device check names the
// tensor, instead of the dispatcher's generic "no kernel for the CUDA backend".
TORCH_LIBRARY_IMPL(tierkv, CUDA, m) {
  m.impl("write", &tierkv_py::write);
  m.impl("append", &tierkv_py::append);
  m.impl("decode", &tierkv_py::decode);
  m.impl("prefill", &tierkv_py::prefill);
}
#endif

// Importing tierkv._C loads this library, which registers the ops above.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
