// SPDX-License-Identifier: Apache-2.0
// An engine's scheduler loop over cuda::tiered_cache, the cache wholly on the GPU: requests
// sharing a system prompt arrive, start from the cached prompt (start_from_prefix), prefill the
// rest of their prompt in chunks under a per-step token budget, decode, and finish (release);
// every step is one begin_step, per layer append + attention, one end_step (page mass to the
// policy, conversions on a side stream). A step that holds prefill chunks runs the chunked
// prefill for the whole batch (a sequence with one new token gets decode's answer); a step of
// single tokens runs decode. A decode step's launches (every layer's append and decode) are
// captured once per batch size as a CUDA graph and replayed at every later step of that size:
// begin_step rewrites the metadata the graph reads in place, and the step's K/V/Q inputs are
// written into fixed per-layer buffers before the replay. The "model" is random bf16 keys,
// values and queries from a hash (the example is the loop, not a model). It checks: every
// request finished, every page back in its pool once the prefix entries are evicted, the cache's
// invariants, no device-side error, no page bytes over PCIe, and that a replayed decode step
// writes the same outputs as the same step run eagerly.
//
//   tierkv_example_06_gpu_engine_loop [--requests 64] [--gen 32] [--layers 4] [--eager 1]
// Exits 77 (skipped) without a CUDA device, 1 if a check fails.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"
#include "tierkv/cuda/tiered_cache.cuh"

namespace {

using geo = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<8>, tierkv::group_size<4>,
                             tierkv::page_tokens<16>>;  // Llama-3-8B's attention shape
using recent = tierkv::tier<tierkv::int8_rotated, tierkv::int8_rotated>;  // Recent / Anchor pages
using stale = tierkv::tier<tierkv::tq4_key, tierkv::tq3_value>;           // Stale pages
using gpu_cache = tierkv::cuda::tiered_cache<geo, tierkv::tiers<recent, stale>>;
constexpr int D = geo::head_dim, KVH = geo::kv_heads, QH = geo::q_heads, T = geo::page_tokens;

// A CUDA call the example cannot go on without: tierkv::cuda::check names the call and the
// runtime's error, and throw_if_error throws it (main prints it and exits 1).
void must(cudaError_t e, const char* what) { tierkv::cuda::check(e, what).throw_if_error(); }

// n pseudo-random bf16 values in [-2, 2) from (salt, index): the stand-in for a model's K/V/Q.
__global__ void fill_random(__nv_bfloat16* x, std::size_t n, std::uint64_t salt) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    std::uint64_t h = (salt + i) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    x[i] = __float2bfloat16(float(h & 0xFFFFFF) / float(1 << 22) - 2.f);
  }
}

struct request {
  std::vector<std::int32_t> prompt;  // token ids: the shared system prompt, then its own
  tierkv::seq_id seq;
  std::int64_t done = 0;  // prompt tokens in the cache
  int generated = 0;
};

int arg(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], name)) return std::atoi(argv[i + 1]);
  return fallback;
}

}  // namespace

static int run(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  const int requests = arg(argc, argv, "--requests", 64), gen = arg(argc, argv, "--gen", 32);
  const int layers = arg(argc, argv, "--layers", 4);
  const bool graphs = arg(argc, argv, "--eager", 0) == 0;
  constexpr int system_tokens = 1000, max_running = 16, step_budget = 2048;
  constexpr std::uint64_t salt = 1;  // one model, no adapters

  cudaStream_t stream, capture;  // the cache's stream; a stream that only captures graphs
  must(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  must(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  gpu_cache::options opt;
  opt.storage.num_layers = layers;
  opt.storage.max_sequences = max_running + 1;
  // Tier 0 holds the Recent / Anchor pages and the prompts' pages until they demote; tier 1
  // every page. Short of tier 0, begin_step demotes on the GPU before it would refuse.
  opt.storage.pages_per_tier = {std::uint32_t(layers * 1200), std::uint32_t(layers * 3000)};
  opt.max_batch = max_running;
  opt.max_pages = (system_tokens + 320 + gen + T) / T + 1;
  opt.max_step_tokens = step_budget;
  opt.mass_layers_per_step = 1;
  auto created = gpu_cache::create(opt, stream);
  if (!created) {
    std::fprintf(stderr, "create: %s\n", created.error_status().message().c_str());
    return 1;
  }
  auto& cache = *created.value();

  // Requests: the system prompt's ids, then 64..319 ids of their own.
  std::mt19937 rng(6);
  std::deque<request> waiting;
  for (int r = 0; r < requests; ++r) {
    request q;
    for (int i = 0; i < system_tokens; ++i) q.prompt.push_back(i);
    const int own = 64 + int(rng() % 256);
    for (int i = 0; i < own; ++i) q.prompt.push_back(int(rng() % 32000));
    waiting.push_back(std::move(q));
  }

  // Device buffers for one step's K/V (new tokens), queries and outputs (bf16).
  const std::size_t kv_elems = std::size_t(step_budget) * KVH * D;
  const std::size_t q_elems = std::size_t(step_budget) * QH * D;
  __nv_bfloat16 *k, *v, *q, *out;
  must(cudaMalloc(&k, kv_elems * sizeof(__nv_bfloat16)), "cudaMalloc");
  must(cudaMalloc(&v, kv_elems * sizeof(__nv_bfloat16)), "cudaMalloc");
  must(cudaMalloc(&q, q_elems * sizeof(__nv_bfloat16)), "cudaMalloc");
  must(cudaMalloc(&out, q_elems * sizeof(__nv_bfloat16)), "cudaMalloc");
  // A decode step's inputs and outputs, one slab per layer at fixed addresses (a graph reads
  // them): [layers][max_running][heads][head_dim].
  const std::size_t dkv = std::size_t(max_running) * KVH * D,
                    dq = std::size_t(max_running) * QH * D;
  __nv_bfloat16 *gk, *gv, *gq, *gout;
  must(cudaMalloc(&gk, dkv * layers * sizeof(__nv_bfloat16)), "cudaMalloc");
  must(cudaMalloc(&gv, dkv * layers * sizeof(__nv_bfloat16)), "cudaMalloc");
  must(cudaMalloc(&gq, dq * layers * sizeof(__nv_bfloat16)), "cudaMalloc");
  must(cudaMalloc(&gout, dq * layers * sizeof(__nv_bfloat16)), "cudaMalloc");
  std::map<int, cudaGraphExec_t> decode_graphs;  // by batch size
  std::uint64_t replayed = 0;
  bool replay_checked = false;

  std::vector<request> running;
  std::uint64_t step = 0, reused = 0, prefilled = 0, generated_total = 0, prefill_steps = 0;
  double decode_step_host_ms = 0;
  std::uint64_t decode_steps = 0;
  double peak_bits = 0;
  int finished = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto fail = [&](const char* what, const tierkv::status& st) {
    std::fprintf(stderr, "%s: %s\n", what, st.message().c_str());
    return 1;
  };
  while (finished < requests) {
    // Admit: a new request starts from the longest cached prefix of its prompt.
    while (!waiting.empty() && int(running.size()) < max_running) {
      request r = std::move(waiting.front());
      waiting.pop_front();
      auto s = cache.start_from_prefix(salt, r.prompt);
      if (!s) return fail("start_from_prefix", s.error_status());
      r.seq = s->seq;
      r.done = s->cached_tokens;
      reused += std::uint64_t(s->cached_tokens);
      running.push_back(std::move(r));
    }
    // The step: one token for each decoding request, then prompt chunks for prefilling ones
    // within what is left of the token budget (a request with none left waits a step).
    std::vector<tierkv::seq_id> batch;
    std::vector<std::int32_t> counts;
    int budget = step_budget;
    for (const request& r : running) budget -= r.done == std::int64_t(r.prompt.size()) ? 1 : 0;
    for (request& r : running) {
      const std::int64_t left = std::int64_t(r.prompt.size()) - r.done;
      const int n = left > 0 ? int(std::min<std::int64_t>(left, budget)) : 1;
      if (n == 0) continue;
      batch.push_back(r.seq);
      counts.push_back(n);
      if (left > 0) budget -= n;
    }
    int total = 0;
    for (int n : counts) total += n;
    const bool chunks = std::any_of(counts.begin(), counts.end(), [](int n) { return n > 1; });
    const auto step_t0 = std::chrono::steady_clock::now();
    if (auto st = cache.begin_step(batch, counts); !st) return fail("begin_step", st);
    using namespace tierkv::cuda;
    if (chunks) {
      for (int l = 0; l < layers; ++l) {
        const std::uint64_t salt_l = (step * 131 + std::uint64_t(l)) << 32;
        fill_random<<<256, 256, 0, stream>>>(k, std::size_t(total) * KVH * D, salt_l + 1);
        fill_random<<<256, 256, 0, stream>>>(v, std::size_t(total) * KVH * D, salt_l + 2);
        fill_random<<<256, 256, 0, stream>>>(q, std::size_t(total) * QH * D, salt_l + 3);
        must(cudaGetLastError(), "cudaGetLastError");
        if (auto st = cache.append(l, k, v, input_type::bf16); !st) return fail("append", st);
        auto st = cache.prefill(l, q, query_type::bf16, out, output_type::bf16);
        if (!st) return fail("prefill", st);
      }
    } else {
      // Every layer's inputs first (the model's work), then the cache's launches: replayed
      // from the batch size's graph, captured the first time the size is seen.
      const std::uint64_t salt_s = step << 40;
      fill_random<<<256, 256, 0, stream>>>(gk, dkv * layers, salt_s + 1);
      fill_random<<<256, 256, 0, stream>>>(gv, dkv * layers, salt_s + 2);
      fill_random<<<256, 256, 0, stream>>>(gq, dq * layers, salt_s + 3);
      must(cudaGetLastError(), "cudaGetLastError");
      auto launches = [&](std::optional<cudaStream_t> on) -> tierkv::status {
        for (int l = 0; l < layers; ++l) {
          if (auto st = cache.append(l, gk + dkv * l, gv + dkv * l, input_type::bf16, on); !st)
            return st;
          if (auto st = cache.decode(l, gq + dq * l, query_type::bf16, gout + dq * l,
                                     output_type::bf16, nullptr, 0.f, 0, on);
              !st)
            return st;
        }
        return {};
      };
      const int size = int(batch.size());
      auto it = decode_graphs.find(size);
      const bool capture_now = graphs && it == decode_graphs.end();
      if (capture_now) {
        cudaGraph_t g;
        must(cudaStreamBeginCapture(capture, cudaStreamCaptureModeThreadLocal),
             "cudaStreamBeginCapture");
        const tierkv::status st = launches(capture);
        must(cudaStreamEndCapture(capture, &g), "cudaStreamEndCapture");
        if (!st) return fail("capture", st);
        cudaGraphExec_t exec;
        must(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
        must(cudaGraphDestroy(g), "cudaGraphDestroy");
        it = decode_graphs.emplace(size, exec).first;
      }
      if (graphs) {
        must(cudaGraphLaunch(it->second, stream), "cudaGraphLaunch");
        ++replayed;
      } else if (auto st = launches(std::nullopt); !st) {
        return fail("decode step", st);
      }
      // Once, a graph's first replay against the same launches run eagerly (the same step, so
      // the same decode plan): appending again rewrites the same slots with the same bytes, so
      // the eager decode must write the same outputs, bit for bit.
      if (capture_now && !replay_checked && size > 1) {
        std::vector<std::uint16_t> a(dq * layers), b(dq * layers);
        must(cudaMemcpyAsync(a.data(), gout, a.size() * 2, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync");
        if (auto st = launches(std::nullopt); !st) return fail("eager twin", st);
        must(cudaMemcpyAsync(b.data(), gout, b.size() * 2, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync");
        must(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        const std::size_t used = std::size_t(batch.size()) * QH * D;
        for (int l = 0; l < layers; ++l)
          if (std::memcmp(a.data() + dq * l, b.data() + dq * l, used * 2) != 0) {
            std::fprintf(stderr, "check FAILED: a replayed decode step differs from eager\n");
            return 1;
          }
        replay_checked = true;
      }
    }
    auto stats = cache.end_step(++step);
    if (!stats) return fail("end_step", stats.error_status());
    if (!chunks) {
      decode_step_host_ms +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_t0)
              .count();
      ++decode_steps;
    }
    prefill_steps += chunks ? 1 : 0;
    peak_bits = std::max(peak_bits, cache.report().bits_per_scalar);
    // Bookkeeping: prompts that completed are cached for later requests; finished requests go.
    std::size_t b = 0;
    for (request& r : running) {
      if (b >= batch.size() || batch[b] != r.seq) continue;
      const int n = counts[b++];
      if (r.done < std::int64_t(r.prompt.size())) {
        r.done += n;
        prefilled += std::uint64_t(n);
        if (r.done == std::int64_t(r.prompt.size())) {
          auto added = cache.insert_prefix(r.seq, salt, r.prompt);
          if (!added) return fail("insert_prefix", added.error_status());
        }
      } else {
        ++r.generated;
        ++generated_total;
      }
    }
    for (std::size_t i = 0; i < running.size();) {
      if (running[i].generated >= gen) {
        if (auto st = cache.release(running[i].seq); !st) return fail("release", st);
        running.erase(running.begin() + std::ptrdiff_t(i));
        ++finished;
      } else {
        ++i;
      }
    }
  }
  must(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (auto st = cache.device_error(); !st) return fail("device_error", st);
  if (auto st = cache.drain(); !st) return fail("drain", st);  // the batch in flight, published
  const auto totals = cache.retier_totals();
  const auto moved = cache.transfers();
  const auto times = cache.times();
  const std::size_t entries = cache.prefix_entries();
  if (auto ev = cache.evict_prefixes(SIZE_MAX); !ev)
    return fail("evict_prefixes", ev.error_status());
  if (auto st = cache.check_invariants(); !st) return fail("check_invariants", st);
  const auto rep = cache.report();
  bool ok = moved.page_bytes == 0 && finished == requests && reused > 0 &&
            (replay_checked || decode_graphs.empty() || decode_graphs.rbegin()->first == 1);
  for (const auto& t : rep.tiers) ok = ok && t.live_pages == 0;

  std::printf(
      "engine loop on the GPU: %d requests (a %d-token system prompt + 64..319 tokens of their "
      "own, %d generated each), %d layers, (%d,%d,%d) pages of %d tokens\n",
      requests, system_tokens, gen, layers, QH, KVH, D, T);
  std::printf(
      "  %llu steps (%llu with prefill chunks) in %.2f s; prompt tokens prefilled %llu, "
      "reused from the prefix index %llu; tokens generated %llu\n",
      (unsigned long long)step, (unsigned long long)prefill_steps, secs,
      (unsigned long long)prefilled, (unsigned long long)reused,
      (unsigned long long)generated_total);
  std::printf(
      "  conversions %llu (demoted %llu, promoted %llu, under pressure %llu); peak "
      "%.2f bits per scalar; %zu prefix entries at the end, evicted\n",
      (unsigned long long)totals.converted, (unsigned long long)totals.demoted,
      (unsigned long long)totals.promoted, (unsigned long long)totals.pressure_demoted, peak_bits,
      entries);
  std::printf(
      "  host ms a step: begin_step %.3f, end_step %.3f; metadata h2d %.1f KB a step, "
      "page bytes over PCIe %llu\n",
      1e-6 * double(times.begin_step_ns) / double(step),
      1e-6 * double(times.end_step_ns) / double(step),
      double(moved.h2d_metadata_bytes) / 1024.0 / double(step),
      (unsigned long long)moved.page_bytes);
  const std::string how =
      graphs ? std::to_string(replayed) + " replayed from " + std::to_string(decode_graphs.size()) +
                   " graphs (one per batch size; one replay checked bit-equal to eager)"
             : std::string("eager");
  std::printf("  decode steps %llu, %s; host ms a decode step (begin_step to end_step) %.3f\n",
              (unsigned long long)decode_steps, how.c_str(),
              decode_step_host_ms / double(std::max<std::uint64_t>(decode_steps, 1)));
  std::printf("%s\n", ok ? "check: every request finished, every page back in its pool, 0 page "
                           "bytes over PCIe"
                         : "check FAILED");
  for (auto& [size, exec] : decode_graphs) cudaGraphExecDestroy(exec);
  created.value().reset();  // waits for the stream, gives the pools back
  for (void* p : {static_cast<void*>(gk), static_cast<void*>(gv), static_cast<void*>(gq),
                  static_cast<void*>(gout)})
    cudaFree(p);
  cudaStreamDestroy(capture);
  cudaFree(k);
  cudaFree(v);
  cudaFree(q);
  cudaFree(out);
  cudaStreamDestroy(stream);
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
