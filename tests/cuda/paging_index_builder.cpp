// SPDX-License-Identifier: Apache-2.0
// The device index builder and the device page-table adapter against the host ones.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "cuda_test.hpp"
#include "paging_index_builder_kernels.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/paged_storage.hpp"

namespace paging_cuda_test {
using namespace tierkv;
using cuda_test::device_buffer;

namespace {
using G = geometry<head_dim<16>, kv_heads<2>, group_size<1>, page_tokens<16>>;
using T = tiers<tier<dense_f32, dense_f32>, tier<dense_f32, dense_f32>, tier<dense_f32, dense_f32>>;
using S = paged_storage<G, T>;
constexpr int N = cuda_test::index_formats;

std::vector<std::int32_t> ints_at(const std::vector<std::uint8_t>& host, std::size_t off,
                                  std::size_t n) {
  std::vector<std::int32_t> v(n);
  std::memcpy(v.data(), host.data() + off, n * sizeof(std::int32_t));
  return v;
}

// Compares the live parts of two index buffers (host-built and device-built).
void compare(const index_layout<N>& l, const std::vector<std::uint8_t>& a,
             const std::vector<std::uint8_t>& b, int batch) {
  CHECK(ints_at(a, l.seq_len_offset(), std::size_t(batch)) ==
        ints_at(b, l.seq_len_offset(), std::size_t(batch)));
  for (int f = 0; f < N; ++f) {
    const auto ia = ints_at(a, l.indptr_offset(f), std::size_t(batch) + 1);
    const auto ib = ints_at(b, l.indptr_offset(f), std::size_t(batch) + 1);
    REQUIRE(ia == ib);
    const std::size_t n = std::size_t(ia.back());
    CHECK(ints_at(a, l.slot_offset(f), n) == ints_at(b, l.slot_offset(f), n));
    CHECK(ints_at(a, l.logical_offset(f), n) == ints_at(b, l.logical_offset(f), n));
  }
}

std::unique_ptr<S> make_storage(std::vector<seq_id>& seqs, std::mt19937& rng) {
  S::options o;
  o.num_layers = 2;
  o.pages_per_tier = {256, 128, 128};
  o.max_sequences = 32;
  auto created = S::create(o);
  REQUIRE(created);
  auto s = std::move(*created);
  for (int b = 0; b < 12; ++b) {
    const int n = int(rng() % 200);
    auto id = *s->create_sequence();
    std::vector<float> k(std::size_t(n) * 2 * 2 * 16, 0.5f), v = k;
    REQUIRE(s->append(id, n, k, v));
    for (int i = 0; i < n / 16; ++i)
      for (int l = 0; l < 2; ++l)
        if (int t = int(rng() % 3); t != 0) {
          auto p = s->allocate_page(t);
          REQUIRE(p);
          REQUIRE(s->replace_page(id, l, i, *s->page(id, l, i), *p));
        }
    seqs.push_back(id);
  }
  return s;
}
}  // namespace

TEST_CASE("device index builder equals the host builder, also under graph capture",
          "[cuda][paging][index]") {
  std::mt19937 rng(7);
  std::vector<seq_id> seqs;
  auto s = make_storage(seqs, rng);
  const index_layout<N> layout{16, 16};
  const page_table_layout tl{16, 16};
  cuda_test::device_index_builder builder(layout);
  auto scratch_bytes = builder.scratch_bytes();
  REQUIRE(scratch_bytes);
  device_buffer<std::uint8_t> d_table(tl.bytes()), d_out(layout.bytes()), d_scratch(*scratch_bytes);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);

  std::vector<std::uint64_t> host_table((tl.bytes() + 7) / 8), host_index((layout.bytes() + 7) / 8);
  auto table_span =
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(host_table.data()), tl.bytes());
  auto index_span =
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(host_index.data()), layout.bytes());

  for (int layer = 0; layer < 2; ++layer) {
    for (int batch : {0, 1, 5, 12}) {
      std::span<const seq_id> sub(seqs.data(), std::size_t(batch));
      REQUIRE(export_page_tables(*s, layer, sub, tl, table_span));
      REQUIRE(build_batch_index(*s, layer, sub, layout, index_span));
      REQUIRE(cudaMemcpy(d_table.p, table_span.data(), tl.bytes(), cudaMemcpyHostToDevice) ==
              cudaSuccess);
      auto v =
          builder.build(tl.view_of(d_table.p, batch), d_out.p, d_scratch.p, d_scratch.n, stream);
      REQUIRE(v);
      REQUIRE(builder.error(d_scratch.p, stream));
      std::vector<std::uint8_t> got(layout.bytes());
      REQUIRE(cudaMemcpy(got.data(), d_out.p, layout.bytes(), cudaMemcpyDeviceToHost) ==
              cudaSuccess);
      compare(layout, std::vector<std::uint8_t>(index_span.begin(), index_span.end()), got, batch);
    }
  }

  // Capture once, replay over new table contents of another batch (fixed shapes).
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  const int batch = 12;
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(builder.build(tl.view_of(d_table.p, batch), d_out.p, d_scratch.p, d_scratch.n, stream));
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<seq_id> shuffled = seqs;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    REQUIRE(export_page_tables(*s, layer, std::span<const seq_id>(shuffled), tl, table_span));
    REQUIRE(build_batch_index(*s, layer, std::span<const seq_id>(shuffled), layout, index_span));
    REQUIRE(cudaMemcpyAsync(d_table.p, table_span.data(), tl.bytes(), cudaMemcpyHostToDevice,
                            stream) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
    std::vector<std::uint8_t> got(layout.bytes());
    REQUIRE(cudaMemcpyAsync(got.data(), d_out.p, layout.bytes(), cudaMemcpyDeviceToHost, stream) ==
            cudaSuccess);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    compare(layout, std::vector<std::uint8_t>(index_span.begin(), index_span.end()), got, batch);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // A corrupt table (format beyond the tier list) is reported.
  REQUIRE(export_page_tables(*s, 0, std::span<const seq_id>(seqs), tl, table_span));
  const auto fmt_at = tl.format_offset();
  std::int32_t bad = 7;
  std::memcpy(table_span.data() + fmt_at, &bad, sizeof bad);
  REQUIRE(cudaMemcpy(d_table.p, table_span.data(), tl.bytes(), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  REQUIRE(builder.build(tl.view_of(d_table.p, 12), d_out.p, d_scratch.p, d_scratch.n, stream));
  CHECK(builder.error(d_scratch.p, stream).code() == errc::out_of_range);
  CHECK(builder.build(tl.view_of(d_table.p, 12), d_out.p, d_scratch.p, 8, stream).code() ==
        errc::capacity_exhausted);
  cudaStreamDestroy(stream);
}

TEST_CASE("device page-table adapter equals the host adapter", "[cuda][paging][interop]") {
  std::mt19937 rng(9);
  const index_layout<N> layout{8, 12};
  device_buffer<std::uint8_t> d_out(layout.bytes());
  std::vector<std::uint64_t> host_index((layout.bytes() + 7) / 8);
  auto index_span =
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(host_index.data()), layout.bytes());
  for (int trial = 0; trial < 50; ++trial) {
    const int batch = int(rng() % 9);
    std::vector<std::int32_t> indptr{0}, indices, last;
    for (int b = 0; b < batch; ++b) {
      const int n = int(rng() % 13);
      for (int i = 0; i < n; ++i) indices.push_back(std::int32_t(rng() % 500));
      indptr.push_back(indptr.back() + n);
      last.push_back(n == 0 ? 0 : 1 + std::int32_t(rng() % 16));
    }
    indices.push_back(0);  // never empty, for cudaMalloc
    const int fmt = int(rng() % N);
    const paged_kv_table host_t{batch, 16, indptr.data(), indices.data(), last.data()};
    REQUIRE(index_from_paged_kv_table<N>(host_t, fmt, 500, layout, index_span));
    device_buffer<std::int32_t> d_indptr(indptr), d_indices(indices), d_last(last);
    const paged_kv_table dev_t{batch, 16, d_indptr.p, d_indices.p, d_last.p};
    REQUIRE(cuda_test::index_from_paged_kv_table_device(dev_t, fmt, layout, d_out.p, nullptr));
    std::vector<std::uint8_t> got(layout.bytes());
    REQUIRE(cudaMemcpy(got.data(), d_out.p, layout.bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
    compare(layout, std::vector<std::uint8_t>(index_span.begin(), index_span.end()), got, batch);
  }
}

// A 2-layer storage of 8 + 4 + 4 pages and 2 sequences over allocator A.
template <class A>
std::unique_ptr<paged_storage<G, T, A>> small_storage() {
  typename paged_storage<G, T, A>::options o;
  o.num_layers = 2;
  o.pages_per_tier = {8, 4, 4};
  o.max_sequences = 2;
  auto made = paged_storage<G, T, A>::create(o);
  REQUIRE(made);
  return std::move(*made);
}

TEST_CASE("storage over device and pinned memory", "[cuda][paging][allocator]") {
  using D = paged_storage<G, T, device_allocator>;
  auto d = small_storage<device_allocator>();
  auto& s = *d;
  CHECK(s.page_alloc().bytes_allocated() == 16 * D::layout<0>::page_bytes);
  const auto views = s.views();
  cudaPointerAttributes attr{};
  REQUIRE(cudaPointerGetAttributes(&attr, views[0].base) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeDevice);
  auto p = s.allocate_page(1);
  REQUIRE(p);
  REQUIRE(s.release_page(*p));
  const seq_id a = *s.create_sequence();
  auto f = s.fork(a);
  REQUIRE(f);
  REQUIRE(s.check_invariants());

  auto h = small_storage<pinned_host_allocator>();
  const seq_id b = *h->create_sequence();
  std::vector<float> k(std::size_t(20) * 2 * 2 * 16, 1.25f), v(k.size(), -0.5f);
  REQUIRE(h->append(b, 20, k, v));
  auto c = h->fork(b);
  REQUIRE(c);
  float kk[16], vv[16];
  REQUIRE(h->read_token(*c, 1, 19, 1, kk, vv));
  CHECK(kk[3] == 1.25f);
  CHECK(vv[15] == -0.5f);
  REQUIRE(cudaPointerGetAttributes(&attr, h->views()[0].base) == cudaSuccess);
  CHECK(attr.type == cudaMemoryTypeHost);
}

// Stands in for an engine's kernel that is still writing a page when the host forks: the stream
// holds here for a while, then the tail pages get their bytes.
void CUDART_CB hold_stream(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }

TEST_CASE("fork on device pools copies the open tail page on the allocator's stream, in order",
          "[cuda][paging][allocator]") {
  using D = paged_storage<G, T, device_allocator>;
  auto d = small_storage<device_allocator>();
  auto& s = *d;
  const seq_id a = *s.create_sequence();
  REQUIRE(s.reserve(a, 20));  // 2 logical pages, the second open (4 of 16 tokens)
  REQUIRE(s.commit(a, 20));

  cudaStream_t st = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));  // no order with legacy
  s.page_alloc().set_stream(st);
  constexpr std::size_t bytes = D::layout<0>::page_bytes;
  std::uint8_t* pattern = nullptr;
  CUDA_OK(cudaMallocHost(reinterpret_cast<void**>(&pattern), 2 * bytes));
  for (std::size_t i = 0; i < 2 * bytes; ++i) pattern[i] = std::uint8_t(i * 7 + 3);
  auto address = [&](page_id p) { return s.pool<0>().device_page(p); };  // tails are tier 0
  // The writes of the parent's tail pages are still queued on st when fork runs.
  CUDA_OK(cudaLaunchHostFunc(st, hold_stream, nullptr));
  for (int l = 0; l < 2; ++l)
    CUDA_OK(cudaMemcpyAsync(address(*s.page(a, l, 1)), pattern + std::size_t(l) * bytes, bytes,
                            cudaMemcpyHostToDevice, st));
  auto c = s.fork(a);
  REQUIRE(c);
  CUDA_OK(cudaStreamSynchronize(st));
  for (int l = 0; l < 2; ++l) {
    CHECK(*s.page(*c, l, 0) == *s.page(a, l, 0));  // the sealed page is shared
    const page_id tail = *s.page(*c, l, 1);
    CHECK(!(tail == *s.page(a, l, 1)));  // the open tail is the child's own copy
    std::vector<std::uint8_t> got(bytes);
    CUDA_OK(cudaMemcpy(got.data(), address(tail), bytes, cudaMemcpyDeviceToHost));
    CHECK(std::memcmp(got.data(), pattern + std::size_t(l) * bytes, bytes) == 0);
  }
  REQUIRE(s.check_invariants());
  s.page_alloc().set_stream(nullptr);
  CUDA_OK(cudaFreeHost(pattern));
  CUDA_OK(cudaStreamDestroy(st));
}

}  // namespace paging_cuda_test
