// SPDX-License-Identifier: Apache-2.0
// test_cuda_tiered_cache_transfer's device side: cuda::tiered_cache behind
// tiered_cache_transfer_kernels.hpp.
#include "tiered_cache_transfer_kernels.hpp"

#include <utility>

#include "cuda_test.hpp"
#include "tierkv/cuda/tiered_cache.cuh"

namespace cuda_test {

using xfer_cache_type =
    tierkv::cuda::tiered_cache<xfer_geometry, xfer_tiers, tierkv::policy::recency_anchor,
                               tierkv::cuda::decode_path::tensor_core,
                               tierkv::tier_roles<xfer_tiers>, xfer_faults>;
static_assert(std::is_same_v<xfer_cache_type::storage_type, xfer_storage>);

namespace {
constexpr std::size_t kv_floats = std::size_t(xfer_geometry::kv_heads) * xfer_geometry::head_dim;
constexpr std::size_t q_floats = std::size_t(xfer_geometry::q_heads) * xfer_geometry::head_dim;
}  // namespace

struct xfer_cache::impl {
  cudaStream_t stream = nullptr;
  std::unique_ptr<xfer_cache_type> c;
  std::unique_ptr<device_buffer<float>> k, v, q, out, lse;
  ~impl() {
    c.reset();  // it synchronizes the stream first
    if (stream) cudaStreamDestroy(stream);
  }
};

xfer_cache::xfer_cache(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
xfer_cache::~xfer_cache() = default;

tierkv::result<std::unique_ptr<xfer_cache>> xfer_cache::create(const xfer_options& o) {
  auto m = std::make_unique<impl>();
  CUDA_OK(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
  xfer_cache_type::options opt;
  opt.storage = o.storage;
  opt.policy = o.policy;
  opt.max_batch = o.max_batch;
  opt.max_pages = o.max_pages;
  opt.max_step_tokens = o.max_step_tokens;
  opt.center = o.center;
  opt.host_pool_bytes = o.host_pool_bytes;
  opt.host_restore_chunk = o.restore_chunk;
  opt.host_copy =
      o.copy_engines ? tierkv::cuda::copy_path::copy_engines : tierkv::cuda::copy_path::kernel;
  auto c = xfer_cache_type::create(opt, m->stream);
  if (!c) return c.error_status();
  m->c = std::move(*c);
  // A known pattern in every free page: whole-pool comparisons read initialized memory and
  // catch a write into a page nobody owns.
  for (const auto& v : m->c->storage().views())
    CUDA_OK(cudaMemsetAsync(v.base, 0x5A, v.page_bytes * v.capacity, m->stream));
  CUDA_OK(cudaStreamSynchronize(m->stream));
  m->k = std::make_unique<device_buffer<float>>(std::size_t(o.max_step_tokens) * kv_floats);
  m->v = std::make_unique<device_buffer<float>>(std::size_t(o.max_step_tokens) * kv_floats);
  m->q = std::make_unique<device_buffer<float>>(std::size_t(o.max_batch) * q_floats);
  m->out = std::make_unique<device_buffer<float>>(std::size_t(o.max_batch) * q_floats);
  m->lse =
      std::make_unique<device_buffer<float>>(std::size_t(o.max_batch) * xfer_geometry::q_heads);
  return std::unique_ptr<xfer_cache>(new xfer_cache(std::move(m)));
}

tierkv::result<tierkv::seq_id> xfer_cache::create_sequence() { return impl_->c->create_sequence(); }
tierkv::status xfer_cache::release(tierkv::seq_id s) { return impl_->c->release(s); }
tierkv::result<tierkv::seq_id> xfer_cache::fork(tierkv::seq_id parent) {
  return impl_->c->fork(parent);
}
tierkv::status xfer_cache::pin(tierkv::seq_id s, std::int64_t first_page, std::int64_t pages,
                               bool pinned) {
  return impl_->c->pin(s, first_page, pages, pinned);
}
tierkv::status xfer_cache::begin_step(std::span<const tierkv::seq_id> batch,
                                      std::span<const std::int32_t> new_tokens) {
  return impl_->c->begin_step(batch, new_tokens);
}

tierkv::status xfer_cache::append(int layer, const std::vector<float>& k,
                                  const std::vector<float>& v) {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));  // the last append has read the buffers
  impl_->k->put(k);
  impl_->v->put(v);
  return impl_->c->append(layer, impl_->k->p, impl_->v->p, tierkv::cuda::input_type::f32);
}

tierkv::status xfer_cache::decode(int layer, const std::vector<float>& q, std::vector<float>& out,
                                  std::vector<float>& lse) {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  impl_->q->put(q);
  auto st = impl_->c->decode(layer, impl_->q->p, tierkv::cuda::query_type::f32, impl_->out->p,
                             tierkv::cuda::output_type::f32, impl_->lse->p);
  if (!st) return st;
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  out.assign(q.size(), 0.f);
  lse.assign(q.size() / xfer_geometry::head_dim, 0.f);
  if (!q.empty()) {
    CUDA_OK(
        cudaMemcpy(out.data(), impl_->out->p, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(
        cudaMemcpy(lse.data(), impl_->lse->p, lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  }
  return st;
}

tierkv::result<tierkv::retier_stats> xfer_cache::end_step(std::uint64_t step, bool wait) {
  return impl_->c->end_step(step, wait);
}
tierkv::status xfer_cache::drain() { return impl_->c->drain(); }
tierkv::status xfer_cache::set_centering(int layer, std::span<const float> mu_k,
                                         std::span<const float> mu_v) {
  return impl_->c->set_centering(layer, mu_k, mu_v);
}

tierkv::result<std::vector<std::uint8_t>> xfer_cache::export_pages(tierkv::seq_id s,
                                                                   std::int64_t first,
                                                                   std::int64_t count,
                                                                   tierkv::head_slice heads) {
  return impl_->c->export_pages(s, first, count, heads);
}
tierkv::result<tierkv::seq_id> xfer_cache::import_pages(std::span<const std::uint8_t> buf) {
  return impl_->c->import_pages(buf);
}

tierkv::result<std::uint64_t> xfer_cache::offload(tierkv::seq_id s) { return impl_->c->offload(s); }
tierkv::result<tierkv::seq_id> xfer_cache::restore(std::uint64_t parked) {
  return impl_->c->restore(parked);
}
tierkv::status xfer_cache::drop_parked(std::uint64_t parked) {
  return impl_->c->drop_parked(parked);
}
tierkv::result<std::int64_t> xfer_cache::parked_length(std::uint64_t parked) const {
  return impl_->c->parked_length(parked);
}
host_figures xfer_cache::host_tier() const {
  const tierkv::cuda::host_tier_stats t = impl_->c->host_stats();
  return {t.capacity_bytes, t.used_bytes, t.largest_free_bytes, t.parked,        t.offloads,
          t.restores,       t.drops,      t.bytes_offloaded,    t.bytes_restored};
}

xfer_faults& xfer_cache::faults() { return impl_->c->faults(); }
bool xfer_cache::restore_pending(tierkv::seq_id s) { return impl_->c->restore_pending(s); }

tierkv::status xfer_cache::check_invariants() const { return impl_->c->check_invariants(); }
tierkv::status xfer_cache::device_error() { return impl_->c->device_error(); }
tierkv::memory_report xfer_cache::report() const { return impl_->c->report(); }
const xfer_storage& xfer_cache::storage() const { return impl_->c->storage(); }
std::uint64_t xfer_cache::page_bytes_moved() const { return impl_->c->transfers().page_bytes; }
std::uint64_t xfer_cache::pressure_demoted() const {
  return impl_->c->retier_totals().pressure_demoted;
}

std::vector<std::uint8_t> xfer_cache::pool_bytes(int tier) const {
  CUDA_OK(cudaStreamSynchronize(impl_->stream));
  CUDA_OK(cudaStreamSynchronize(impl_->c->side_stream()));
  const tierkv::pool_view v = impl_->c->storage().views()[std::size_t(tier)];
  std::vector<std::uint8_t> h(v.page_bytes * v.capacity);
  CUDA_OK(cudaMemcpy(h.data(), v.base, h.size(), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace cuda_test
