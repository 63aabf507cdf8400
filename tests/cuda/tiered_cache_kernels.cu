// SPDX-License-Identifier: Apache-2.0
// test_cuda_tiered_cache's device side: cuda::tiered_cache behind tiered_cache_kernels.hpp.
#include "tiered_cache_kernels.hpp"

#include <algorithm>
#include <utility>

#include "cuda_test.hpp"
#include "tierkv/cuda/tiered_cache.cuh"

namespace cuda_test {

using cache_type =
    tierkv::cuda::tiered_cache<e2e_geometry, e2e_tiers, tierkv::policy::recency_anchor,
                               tierkv::cuda::decode_path::tensor_core,
                               tierkv::tier_roles<e2e_tiers>, e2e_faults>;
static_assert(std::is_same_v<cache_type::storage_type, e2e_storage>);

struct e2e_cache::impl {
  cudaStream_t stream = nullptr;  // the cache's
  std::vector<cudaStream_t> owned;
  std::unique_ptr<cache_type> c;
  std::unique_ptr<device_buffer<float>> k, v, q, out, pq, pout, lse;
  std::unique_ptr<device_buffer<std::uint16_t>> out16;
  // CUDA graph of a step: per-layer inputs and outputs, [layer][max_batch x ...]
  std::unique_ptr<device_buffer<float>> gk, gv, gq, gout;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~impl() {
    c.reset();
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    for (cudaStream_t s : owned) cudaStreamDestroy(s);
  }
};

e2e_cache::e2e_cache(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
e2e_cache::~e2e_cache() = default;

tierkv::result<std::unique_ptr<e2e_cache>> e2e_cache::create(const e2e_options& o) {
  auto p = std::make_unique<impl>();
  CUDA_OK(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
  p->owned.push_back(p->stream);
  cache_type::options opt;
  opt.storage = o.storage;
  opt.policy = o.policy;
  opt.max_batch = o.max_batch;
  opt.max_pages = o.max_pages;
  opt.max_step_tokens = o.max_step_tokens;
  opt.max_retier_pages = o.max_retier_pages;
  opt.mass_layers_per_step = o.mass_layers_per_step;
  opt.center = o.center;
  auto c = cache_type::create(opt, p->stream);
  if (!c) return c.error_status();
  p->c = std::move(*c);
  // Free pages start as a known pattern, so pool_bytes reads initialized memory (initcheck) and
  // a comparison of whole pools also catches a write into a page nobody owns.
  for (const auto& v : p->c->storage().views())
    CUDA_OK(cudaMemsetAsync(v.base, 0xA5, v.page_bytes * v.capacity, p->stream));
  constexpr std::size_t vec = std::size_t(e2e_geometry::kv_heads) * e2e_geometry::head_dim;
  constexpr std::size_t qvec = std::size_t(e2e_geometry::q_heads) * e2e_geometry::head_dim;
  p->k = std::make_unique<device_buffer<float>>(std::size_t(o.max_step_tokens) * vec);
  p->v = std::make_unique<device_buffer<float>>(std::size_t(o.max_step_tokens) * vec);
  p->q = std::make_unique<device_buffer<float>>(std::size_t(o.max_batch) * qvec);
  p->out = std::make_unique<device_buffer<float>>(std::size_t(o.max_batch) * qvec);
  p->pq = std::make_unique<device_buffer<float>>(std::size_t(o.max_step_tokens) * qvec);
  p->pout = std::make_unique<device_buffer<float>>(std::size_t(o.max_step_tokens) * qvec);
  p->out16 = std::make_unique<device_buffer<std::uint16_t>>(std::size_t(o.max_batch) * qvec);
  p->lse = std::make_unique<device_buffer<float>>(
      std::size_t(std::max(o.max_batch, o.max_step_tokens)) * e2e_geometry::q_heads);
  const std::size_t L = std::size_t(o.storage.num_layers);
  p->gk = std::make_unique<device_buffer<float>>(L * std::size_t(o.max_batch) * vec);
  p->gv = std::make_unique<device_buffer<float>>(L * std::size_t(o.max_batch) * vec);
  p->gq = std::make_unique<device_buffer<float>>(L * std::size_t(o.max_batch) * qvec);
  p->gout = std::make_unique<device_buffer<float>>(L * std::size_t(o.max_batch) * qvec);
  return std::unique_ptr<e2e_cache>(new e2e_cache(std::move(p)));
}

tierkv::result<tierkv::seq_id> e2e_cache::create_sequence() { return impl_->c->create_sequence(); }
tierkv::result<tierkv::seq_id> e2e_cache::fork(tierkv::seq_id parent) {
  return impl_->c->fork(parent);
}
tierkv::status e2e_cache::release(tierkv::seq_id s) { return impl_->c->release(s); }
tierkv::result<std::size_t> e2e_cache::insert_prefix(tierkv::seq_id s, std::uint64_t salt,
                                                     std::span<const std::int32_t> tokens) {
  return impl_->c->insert_prefix(s, salt, tokens);
}
tierkv::result<std::pair<tierkv::seq_id, std::int64_t>> e2e_cache::start_from_prefix(
    std::uint64_t salt, std::span<const std::int32_t> tokens) {
  auto st = impl_->c->start_from_prefix(salt, tokens);
  if (!st) return st.error_status();
  return std::pair(st->seq, st->cached_tokens);
}
tierkv::result<std::size_t> e2e_cache::evict_prefixes(std::size_t max_entries) {
  return impl_->c->evict_prefixes(max_entries);
}
tierkv::status e2e_cache::begin_step(std::span<const tierkv::seq_id> batch,
                                     std::span<const std::int32_t> new_tokens) {
  return impl_->c->begin_step(batch, new_tokens);
}

tierkv::status e2e_cache::append(int layer, const std::vector<float>& k,
                                 const std::vector<float>& v) {
  // The previous layer's append must have read the buffers before they are overwritten.
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  impl_->k->put(k);
  impl_->v->put(v);
  return impl_->c->append(layer, impl_->k->p, impl_->v->p, tierkv::cuda::input_type::f32);
}

namespace {
// The lse rows of the `floats` query floats just computed, from the wrapper's lse buffer.
void copy_lse(const float* dev, std::size_t floats, std::vector<float>* lse) {
  if (lse == nullptr) return;
  lse->resize(floats / e2e_geometry::head_dim);
  if (!lse->empty())
    CUDA_OK(cudaMemcpy(lse->data(), dev, lse->size() * sizeof(float), cudaMemcpyDeviceToHost));
}
}  // namespace

tierkv::status e2e_cache::prefill(int layer, const std::vector<float>& q, std::vector<float>& out,
                                  std::vector<float>* lse) {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  impl_->pq->put(q);
  auto st = impl_->c->prefill(layer, impl_->pq->p, tierkv::cuda::query_type::f32, impl_->pout->p,
                              tierkv::cuda::output_type::f32, lse ? impl_->lse->p : nullptr);
  if (!st) return st;
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  out.resize(q.size());
  if (!q.empty())
    CUDA_OK(
        cudaMemcpy(out.data(), impl_->pout->p, q.size() * sizeof(float), cudaMemcpyDeviceToHost));
  copy_lse(impl_->lse->p, q.size(), lse);
  return st;
}

tierkv::status e2e_cache::set_centering(int layer, std::span<const float> mu_k,
                                        std::span<const float> mu_v) {
  return impl_->c->set_centering(layer, mu_k, mu_v);
}
bool e2e_cache::centering_known(int layer) const { return impl_->c->centering_known(layer); }

tierkv::status e2e_cache::decode(int layer, const std::vector<float>& q, std::vector<float>& out,
                                 float soft_cap, int window, std::vector<float>* lse) {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  impl_->q->put(q);
  auto st = impl_->c->decode(layer, impl_->q->p, tierkv::cuda::query_type::f32, impl_->out->p,
                             tierkv::cuda::output_type::f32, lse ? impl_->lse->p : nullptr,
                             soft_cap, window);
  if (!st) return st;
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  out.resize(q.size());
  if (!q.empty())
    CUDA_OK(
        cudaMemcpy(out.data(), impl_->out->p, q.size() * sizeof(float), cudaMemcpyDeviceToHost));
  copy_lse(impl_->lse->p, q.size(), lse);
  return st;
}

tierkv::result<tierkv::retier_stats> e2e_cache::end_step(std::uint64_t step, bool wait) {
  return impl_->c->end_step(step, wait);
}

tierkv::status e2e_cache::decode_bf16(int layer, const std::vector<float>& q,
                                      std::vector<std::uint16_t>& out) {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  impl_->q->put(q);
  auto st = impl_->c->decode(layer, impl_->q->p, tierkv::cuda::query_type::f32, impl_->out16->p,
                             tierkv::cuda::output_type::bf16);
  if (!st) return st;
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  out.resize(q.size());
  if (!q.empty())
    CUDA_OK(cudaMemcpy(out.data(), impl_->out16->p, q.size() * sizeof(std::uint16_t),
                       cudaMemcpyDeviceToHost));
  return st;
}

namespace {
constexpr std::size_t kv_vec = std::size_t(e2e_geometry::kv_heads) * e2e_geometry::head_dim;
constexpr std::size_t q_vec = std::size_t(e2e_geometry::q_heads) * e2e_geometry::head_dim;
}  // namespace

tierkv::status e2e_cache::capture_step() {
  impl& m = *impl_;
  const int layers = m.c->layers();
  const std::size_t B = std::size_t(m.c->config().max_batch);
  cudaStream_t cap = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  m.owned.push_back(cap);
  CUDA_OK(cudaStreamSynchronize(m.stream));
  CUDA_OK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeThreadLocal));
  tierkv::status st;
  for (int l = 0; l < layers && st; ++l) {
    st = m.c->append(l, m.gk->p + std::size_t(l) * B * kv_vec,
                     m.gv->p + std::size_t(l) * B * kv_vec, tierkv::cuda::input_type::f32, cap);
    if (st)
      st = m.c->decode(l, m.gq->p + std::size_t(l) * B * q_vec, tierkv::cuda::query_type::f32,
                       m.gout->p + std::size_t(l) * B * q_vec, tierkv::cuda::output_type::f32,
                       nullptr, 0.f, 0, cap);
  }
  cudaGraph_t g = nullptr;
  CUDA_OK(cudaStreamEndCapture(cap, &g));
  if (!st) {
    cudaGraphDestroy(g);
    return st;
  }
  if (m.exec) cudaGraphExecDestroy(m.exec);
  if (m.graph) cudaGraphDestroy(m.graph);
  m.graph = g;
  CUDA_OK(cudaGraphInstantiate(&m.exec, g, 0));
  return st;
}

tierkv::status e2e_cache::replay_step(const std::vector<std::vector<float>>& k,
                                      const std::vector<std::vector<float>>& v,
                                      const std::vector<std::vector<float>>& q,
                                      std::vector<std::vector<float>>& out) {
  impl& m = *impl_;
  if (m.exec == nullptr) return tierkv::status(tierkv::errc::invalid_argument, "no graph captured");
  const std::size_t B = std::size_t(m.c->config().max_batch);
  const int layers = m.c->layers();
  auto put = [&](float* base, std::size_t per, const std::vector<std::vector<float>>& x) {
    for (int l = 0; l < layers; ++l)
      CUDA_OK(cudaMemcpyAsync(base + std::size_t(l) * B * per, x[std::size_t(l)].data(),
                              x[std::size_t(l)].size() * sizeof(float), cudaMemcpyHostToDevice,
                              m.stream));
  };
  put(m.gk->p, kv_vec, k);
  put(m.gv->p, kv_vec, v);
  put(m.gq->p, q_vec, q);
  CUDA_OK(cudaGraphLaunch(m.exec, m.stream));
  out.resize(std::size_t(layers));
  for (int l = 0; l < layers; ++l) {
    out[std::size_t(l)].resize(q[std::size_t(l)].size());
    CUDA_OK(cudaMemcpyAsync(out[std::size_t(l)].data(), m.gout->p + std::size_t(l) * B * q_vec,
                            out[std::size_t(l)].size() * sizeof(float), cudaMemcpyDeviceToHost,
                            m.stream));
  }
  CUDA_OK(cudaStreamSynchronize(m.stream));
  return {};
}

tierkv::status e2e_cache::decode_on_other_stream(int layer) {
  cudaStream_t other = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  impl_->owned.push_back(other);
  return impl_->c->decode(layer, impl_->q->p, tierkv::cuda::query_type::f32, impl_->out->p,
                          tierkv::cuda::output_type::f32, nullptr, 0.f, 0, other);
}

tierkv::status e2e_cache::move_to_new_stream() {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  impl_->owned.push_back(s);
  auto st = impl_->c->set_stream(s);
  if (st) impl_->stream = s;
  return st;
}
tierkv::status e2e_cache::check_invariants() const { return impl_->c->check_invariants(); }
tierkv::status e2e_cache::device_error() { return impl_->c->device_error(); }
void e2e_cache::set_mass_observer(
    std::function<void(tierkv::seq_id, int, std::span<const float>)> f) {
  impl_->c->set_mass_observer(std::move(f));
}
e2e_storage& e2e_cache::storage() { return impl_->c->storage(); }
e2e_ctl& e2e_cache::controller() { return impl_->c->controller(); }

e2e_faults& e2e_cache::faults() { return impl_->c->faults(); }

e2e_counters e2e_cache::counters() const {
  e2e_counters c;
  const auto& t = impl_->c->transfers();
  c.h2d = t.h2d_metadata_bytes;
  c.d2h = t.d2h_metadata_bytes;
  c.page_bytes = t.page_bytes;
  const auto& r = impl_->c->retier_totals();
  c.pressure_demoted = r.pressure_demoted;
  c.converted = r.converted;
  c.failed = r.failed;
  return c;
}

std::vector<std::uint8_t> e2e_cache::pool_bytes(int tier) const {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  CUDA_OK(cudaStreamSynchronize(impl_->c->side_stream()));
  const auto v = impl_->c->storage().views()[std::size_t(tier)];
  std::vector<std::uint8_t> h(v.page_bytes * v.capacity);
  CUDA_OK(cudaMemcpy(h.data(), v.base, h.size(), cudaMemcpyDeviceToHost));
  return h;
}

std::vector<std::uint8_t> e2e_cache::index_bytes(int layer) const {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  const auto& m = impl_->c->mirror();
  std::vector<std::uint8_t> h(m.layer_bytes());
  CUDA_OK(cudaMemcpy(h.data(), m.index_bytes(layer), h.size(), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace cuda_test
