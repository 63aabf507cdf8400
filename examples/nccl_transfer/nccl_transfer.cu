// SPDX-License-Identifier: Apache-2.0
// Disaggregated prefill -> decode over NCCL: a 32K-token sequence is prefilled into a
// tiered cache (FP8 anchor + recent pages, TQ3 stale pages), its pages are exported as
// one verified buffer (tierkv/paging/page_transfer.hpp), sent from GPU 0 to GPU 1 with
// ncclSend/ncclRecv, imported into a second cache and decoded; the outputs must equal
// the source cache's bit for bit. The same transfer of the BF16-equivalent bytes is
// timed as the control.
//
// What runs where: prefill (append + retier), import and decode run on the host
// (tierkv's host path: paged_storage + host_decode); the GPUs carry the transfer. The
// CUDA append/decode kernels read pools of a device storage, which cannot be imported
// into yet (import_pages works through the storage's host-side hooks; docs/multigpu.md).
//
//   nccl_transfer [--tokens 32768] [--layers 32] [--reps 5] [--out multigpu.json]
// Needs two GPUs. NVLink SHARP / multicast stays off (NCCL_NVLS_ENABLE=0, set here).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tierkv/attention/host_decode.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/page_transfer.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/tiering/conversion.hpp"

namespace {

using geo = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<8>, tierkv::group_size<4>,
                             tierkv::page_tokens<64>>;  // Llama-3-8B's attention shape
using tier_list = tierkv::tiers<tierkv::tier<tierkv::fp8_e4m3, tierkv::fp8_e4m3>,
                                tierkv::tier<tierkv::tq3_key, tierkv::tq3_value>>;
using storage_t = tierkv::paged_storage<geo, tier_list>;

#define CUDA_OK(x)                                                                             \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define NCCL_OK(x)                                                                             \
  do {                                                                                         \
    ncclResult_t r_ = (x);                                                                     \
    if (r_ != ncclSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(r_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

void require(const tierkv::status& s, const char* what) {
  if (!s) {
    std::fprintf(stderr, "%s: %s\n", what, s.message().c_str());
    std::exit(1);
  }
}

// Decode of every layer for one query token; returns outputs [layer][q_heads][head_dim].
std::vector<float> decode_all_layers(const storage_t& s, tierkv::seq_id seq,
                                     const std::vector<float>& q) {
  const int L = s.num_layers();
  std::vector<float> out(std::size_t(L) * geo::q_heads * geo::head_dim);
  const tierkv::index_layout<storage_t::num_tiers> layout{1, 1024};
  std::vector<std::uint8_t> buf(layout.bytes());
  tierkv::host_attention_workspace ws{0};
  const tierkv::seq_id batch[1] = {seq};
  const auto pools = s.views();
  for (int l = 0; l < L; ++l) {
    auto view = tierkv::build_batch_index(s, l, std::span<const tierkv::seq_id>(batch, 1), layout,
                                          std::span<std::uint8_t>(buf));
    require(view.error_status(), "index");
    tierkv::host_decode_args<storage_t::num_tiers> a;
    a.queries = q.data() + std::size_t(l) * geo::q_heads * geo::head_dim;
    a.index = *view;
    a.pools = pools.data();
    a.source = tierkv::layer_source{s.config().codec_seed, l, s.config().head_base};
    a.logits.softmax_scale = 1.f / std::sqrt(float(geo::head_dim));
    a.out = out.data() + std::size_t(l) * geo::q_heads * geo::head_dim;
    require(tierkv::host_decode<geo, tier_list>(ws, a), "host_decode");
  }
  return out;
}

// Median time (ms) of sending `bytes` from GPU 0 to GPU 1 in one NCCL group.
double time_transfer(ncclComm_t comms[2], cudaStream_t streams[2], const void* send, void* recv,
                     std::size_t bytes, int reps) {
  std::vector<double> ms;
  cudaEvent_t start, stop;
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int r = 0; r < reps + 1; ++r) {  // the first run warms up connections
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaSetDevice(1));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaEventRecord(start, streams[1]));
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(send, bytes, ncclUint8, 1, comms[0], streams[0]));
    NCCL_OK(ncclRecv(recv, bytes, ncclUint8, 0, comms[1], streams[1]));
    NCCL_OK(ncclGroupEnd());
    CUDA_OK(cudaEventRecord(stop, streams[1]));  // the receive completing ends the transfer
    CUDA_OK(cudaEventSynchronize(stop));
    float t = 0.f;
    CUDA_OK(cudaEventElapsedTime(&t, start, stop));
    if (r > 0) ms.push_back(double(t));
  }
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t tokens = 32768;
  int layers = 32, reps = 5;
  std::string out_path = "multigpu.json";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens")
      tokens = std::atoll(argv[i + 1]);
    else if (a == "--layers")
      layers = std::atoi(argv[i + 1]);
    else if (a == "--reps")
      reps = std::atoi(argv[i + 1]);
    else if (a == "--out")
      out_path = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (tokens < 1 || layers < 1 || reps < 1) {
    std::fprintf(stderr, "--tokens, --layers and --reps must be >= 1\n");
    return 2;
  }
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // no NVLink SHARP multicast objects
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    std::fprintf(stderr, "nccl_transfer needs 2 GPUs, found %d\n", devices);
    return 2;
  }

  // ---- prefill on the "GPU 0" side (host path), tiered: page 0 and the newest 27% FP8 --------
  const std::int64_t pages = (tokens + geo::page_tokens - 1) / geo::page_tokens;
  storage_t::options o;
  o.num_layers = layers;
  o.max_sequences = 2;
  o.pages_per_tier = {std::uint32_t(pages * layers), std::uint32_t(pages * layers)};
  o.codec_seed = 0x7e57ull;
  auto src = storage_t::create(o);
  require(src.error_status(), "source storage");
  auto dst = storage_t::create(o);
  require(dst.error_status(), "destination storage");
  const tierkv::seq_id s0 = (*src)->create_sequence().value();
  std::mt19937_64 rng(1);
  std::normal_distribution<float> g(0.f, 1.f);
  const auto t0 = std::chrono::steady_clock::now();
  const std::int64_t chunk = 1024;
  for (std::int64_t done = 0; done < tokens; done += chunk) {
    const std::int64_t n = std::min(chunk, tokens - done);
    std::vector<float> k(std::size_t(layers) * std::size_t(n) * geo::kv_heads * geo::head_dim),
        v(k.size());
    for (auto& x : k) x = g(rng);
    for (auto& x : v) x = g(rng);
    require((*src)->append(s0, n, k, v), "append");
  }
  const std::int64_t full = tokens / geo::page_tokens;
  const std::int64_t keep_recent = (pages * 27 + 99) / 100;
  tierkv::conversion_counters counters;
  for (std::int64_t j = 1; j < full && j < pages - keep_recent; ++j)
    for (int l = 0; l < layers; ++l) {
      auto b = (*src)->block_of(s0, j).value();
      require(tierkv::convert_page(**src, b, l, 1, counters).error_status(), "retier");
    }
  const double prefill_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<float> q(std::size_t(layers) * geo::q_heads * geo::head_dim);
  for (auto& x : q) x = g(rng);
  const std::vector<float> reference = decode_all_layers(**src, s0, q);

  auto exported = tierkv::export_pages(**src, s0);
  require(exported.error_status(), "export");
  const std::size_t bytes_tiered = exported->size();
  const std::size_t bytes_bf16 =
      std::size_t(tokens) * std::size_t(layers) * geo::kv_heads * geo::head_dim * 2 * 2;

  // ---- NCCL: one process, two communicators ---------------------------------------------------
  ncclComm_t comms[2];
  const int devs[2] = {0, 1};
  NCCL_OK(ncclCommInitAll(comms, 2, devs));
  cudaStream_t streams[2];
  void* send_buf = nullptr;
  void* recv_buf = nullptr;
  const std::size_t cap = std::max(bytes_tiered, bytes_bf16);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaStreamCreate(&streams[0]));
  CUDA_OK(cudaMalloc(&send_buf, cap));
  CUDA_OK(cudaMemset(send_buf, 0x3c, cap));  // BF16-equivalent control: any bytes of that size
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamCreate(&streams[1]));
  CUDA_OK(cudaMalloc(&recv_buf, cap));

  const double ms_bf16 = time_transfer(comms, streams, send_buf, recv_buf, bytes_bf16, reps);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaMemcpy(send_buf, exported->data(), bytes_tiered, cudaMemcpyHostToDevice));
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaMemset(recv_buf, 0, cap));
  const double ms_tiered = time_transfer(comms, streams, send_buf, recv_buf, bytes_tiered, reps);

  // ---- the "GPU 1" side: import what arrived, decode, compare
  // ------------------------------------
  std::vector<std::uint8_t> received(bytes_tiered);
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaMemcpy(received.data(), recv_buf, bytes_tiered, cudaMemcpyDeviceToHost));
  auto s1 = tierkv::import_pages(**dst, received);
  require(s1.error_status(), "import");
  const std::vector<float> decoded = decode_all_layers(**dst, *s1, q);
  const bool equal =
      std::memcmp(decoded.data(), reference.data(), decoded.size() * sizeof(float)) == 0;

  const double gbps_bf16 = double(bytes_bf16) / (ms_bf16 * 1e-3) / 1e9;
  const double gbps_tiered = double(bytes_tiered) / (ms_tiered * 1e-3) / 1e9;
  std::printf("tokens %lld, layers %d, pages %lld (prefill on host %.1f s)\n",
              static_cast<long long>(tokens), layers, static_cast<long long>(pages), prefill_s);
  std::printf("%-8s %14s %10s %10s\n", "form", "bytes", "ms", "GB/s");
  std::printf("%-8s %14zu %10.3f %10.1f\n", "bf16", bytes_bf16, ms_bf16, gbps_bf16);
  std::printf("%-8s %14zu %10.3f %10.1f\n", "tiered", bytes_tiered, ms_tiered, gbps_tiered);
  std::printf("bytes ratio bf16/tiered %.2f, time ratio %.2f, outputs equal: %s\n",
              double(bytes_bf16) / double(bytes_tiered), ms_bf16 / ms_tiered, equal ? "yes" : "NO");

  std::ofstream out(out_path);
  out << "{\"name\": \"multigpu\", \"tokens\": " << tokens << ", \"layers\": " << layers
      << ", \"geometry\": \"d128 kv8 g4 page64\", \"nccl_nvls_enable\": 0, \"metrics\": "
         "{\"outputs_equal\": "
      << (equal ? 1 : 0) << ", \"transfer_gbps_bf16\": " << gbps_bf16
      << ", \"transfer_gbps_tiered\": " << gbps_tiered << ", \"transfer_ms_bf16\": " << ms_bf16
      << ", \"transfer_ms_tiered\": " << ms_tiered << ", \"bytes_bf16\": " << bytes_bf16
      << ", \"bytes_tiered\": " << bytes_tiered << "}}\n";

  for (int i = 0; i < 2; ++i) {
    CUDA_OK(cudaSetDevice(i));
    CUDA_OK(cudaStreamDestroy(streams[i]));
    NCCL_OK(ncclCommDestroy(comms[i]));
  }
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(send_buf));
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaFree(recv_buf));
  return equal ? 0 : 1;
}
