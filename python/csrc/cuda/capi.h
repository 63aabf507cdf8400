/* SPDX-License-Identifier: Apache-2.0
 * libtierkv_cuda: a C ABI over cuda::tiered_cache's prebuilt set, for bindings that must not
 * depend on one framework's C++ ABI (the Python package loads it with ctypes and registers
 * torch custom ops over it: docs/python.md). Every function returns 0 on success or a
 * tierkv::errc value (1 invalid_argument, 2 out_of_range, 3 capacity_exhausted, 4 stale_id,
 * 6 non_finite_input, 8 geometry_mismatch, 9 corrupt_data, 10 cuda_error, ...);
 * tkv_cuda_last_error() is then the message, which names the value and its limit. Streams are
 * cudaStream_t values. Handles are not thread safe: one thread drives a cache at a time. */
#ifndef TIERKV_PYTHON_CUDA_CAPI_H
#define TIERKV_PYTHON_CUDA_CAPI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TKV_CUDA_ABI_VERSION 7
#define TKV_CUDA_API __attribute__((visibility("default")))

typedef struct tkv_cuda_config {
  const char* recent;       /* Recent / Anchor tier format: "fp8" | "int8_rotated" */
  const char* cache_type_k; /* Stale keys: "tq3" | "tq4" (or the recent name: 8-bit only) */
  const char* cache_type_v; /* Stale values: "tq3" (or the recent name) */
  const char* cold_type_k;  /* Cold tier keys, e.g. "tq3", and */
  const char* cold_type_v;  /* values, e.g. "tq2": both NULL (no Cold tier) or both set */
  int64_t head_dim, kv_heads, group_size, page_size, num_layers;
  int64_t num_tiers;         /* entries of pages_per_tier that are set */
  int64_t pages_per_tier[8]; /* pool capacities, physical pages of one layer each */
  int64_t max_sequences, max_batch, max_pages, max_step_tokens, max_retier_pages;
  int64_t max_chunks_per_seq, mass_layers_per_step;
  double softmax_scale; /* 0: 1 / sqrt(head_dim) */
  uint64_t codec_seed;
  const char* policy;            /* tier policy by registry name (tierkv/policies.hpp) */
  int64_t num_policy_knobs;      /* knobs changed from the policy's defaults: */
  const char* const* knob_names; /*   their names (num_policy_knobs of them) */
  const double* knob_values;     /*   and values */
  int64_t center; /* 1: per-(layer, KV head) channel means subtracted before encoding, added back
                     exactly (cuda::tiered_cache options::center); 0: off */
  double bits_per_scalar;  /* > 0: a bit budget over the movable pages (tier_controller_options::
                              bits_per_scalar_target); 0: off */
  int64_t host_pool_bytes; /* pinned host memory of the host tier (offload / restore); 0: none */
} tkv_cuda_config;

TKV_CUDA_API int tkv_cuda_abi_version(void);
TKV_CUDA_API const char* tkv_cuda_last_error(void);
/* The prebuilt set: rows of 5 int32 {tier set, head_dim, kv_heads, group_size, page_size};
 * writes at most `capacity` rows and returns how many there are. */
TKV_CUDA_API int tkv_cuda_built(int32_t* rows, int capacity);
/* "recent/cache_type_k/cache_type_v[/cold_type_k/cold_type_v]" of tier set i, or NULL. */
TKV_CUDA_API const char* tkv_cuda_tier_set_name(int i);

TKV_CUDA_API int tkv_cuda_create(const tkv_cuda_config* cfg, void* stream, void** cache);
TKV_CUDA_API int tkv_cuda_destroy(void* cache);
TKV_CUDA_API int tkv_cuda_num_tiers(void* cache, int64_t* tiers);
TKV_CUDA_API int tkv_cuda_create_sequence(void* cache, int64_t* seq);
TKV_CUDA_API int tkv_cuda_fork(void* cache, int64_t parent, int64_t* seq);
TKV_CUDA_API int tkv_cuda_release(void* cache, int64_t seq);
TKV_CUDA_API int tkv_cuda_length(void* cache, int64_t seq, int64_t* tokens);
/* prefix reuse, between steps: tokens are n int32 ids; out[2] = {sequence, cached tokens} */
TKV_CUDA_API int tkv_cuda_prefix_insert(void* cache, int64_t seq, uint64_t salt,
                                        const int32_t* tokens, int64_t n, int64_t* added);
TKV_CUDA_API int tkv_cuda_prefix_start(void* cache, uint64_t salt, const int32_t* tokens, int64_t n,
                                       int64_t out[2]);
TKV_CUDA_API int tkv_cuda_prefix_evict(void* cache, int64_t max_entries, int64_t* evicted);
TKV_CUDA_API int tkv_cuda_drain(void* cache);
/* page transfer, between steps (paging/page_transfer.hpp's buffer: the host package's bytes).
 * export_pages: the export of logical pages [first, first + count) of seq (count < 0: to the
 * end), all layers, KV heads [head_begin, head_begin + head_count) (head_count < 0: to the end);
 * *data points at its *bytes bytes, owned by *buffer until tkv_cuda_free_buffer(*buffer).
 * import_pages: the buffer's run as a NEW sequence *seq, all or nothing (a damaged buffer:
 * 9 corrupt_data; a foreign one: 8 geometry_mismatch; too little room: 3 capacity_exhausted). */
TKV_CUDA_API int tkv_cuda_export_pages(void* cache, int64_t seq, int64_t first, int64_t count,
                                       int64_t head_begin, int64_t head_count, void** buffer,
                                       const uint8_t** data, int64_t* bytes);
TKV_CUDA_API void tkv_cuda_free_buffer(void* buffer);
TKV_CUDA_API int tkv_cuda_import_pages(void* cache, const uint8_t* data, int64_t bytes,
                                       int64_t* seq);

/* the host tier (cuda/cache/host_tier.cuh), between steps: offload parks every page of seq in
 * pinned host memory and releases seq (*parked: its handle; too little host memory: 3
 * capacity_exhausted, nothing moved); restore makes a NEW sequence *seq of a parked one's pages
 * (too little room: 3, the sequence stays parked); host_stats writes 9 counters: capacity,
 * used, largest free run (bytes), parked, offloads, restores, drops, bytes offloaded, bytes
 * restored. A restore's copy runs on the host tier's own stream, overlapping later steps of other
 * sequences; the first work touching the new sequence waits for it on the GPU. restore_pending
 * sets *pending to 1 while that copy may still be running (version 7). */
TKV_CUDA_API int tkv_cuda_offload(void* cache, int64_t seq, uint64_t* parked);
TKV_CUDA_API int tkv_cuda_restore(void* cache, uint64_t parked, int64_t* seq);
TKV_CUDA_API int tkv_cuda_drop_parked(void* cache, uint64_t parked);
TKV_CUDA_API int tkv_cuda_restore_pending(void* cache, int64_t seq, int* pending);
TKV_CUDA_API int tkv_cuda_host_stats(void* cache, uint64_t out[9]);

TKV_CUDA_API int tkv_cuda_set_stream(void* cache, void* stream);
TKV_CUDA_API int tkv_cuda_begin_step(void* cache, const int64_t* seqs, const int32_t* counts,
                                     int64_t n);
/* dtype: 0 f32, 1 bf16. k, v: [step tokens][kv_heads][head_dim]; q, out: [batch or step
 * tokens][q_heads][head_dim]; lse: [rows][q_heads] f32 or NULL. */
TKV_CUDA_API int tkv_cuda_append(void* cache, int64_t layer, const void* k, const void* v,
                                 int dtype, void* stream);
/* decode_ex: soft_cap > 0 caps the logits (s -> soft_cap tanh(s / soft_cap)), window > 0 attends
 * the last `window` positions only (0, 0: tkv_cuda_decode, kept for callers of ABI 2 before it). */
TKV_CUDA_API int tkv_cuda_decode(void* cache, int64_t layer, const void* q, int q_dtype, void* out,
                                 int out_dtype, float* lse, void* stream);
TKV_CUDA_API int tkv_cuda_decode_ex(void* cache, int64_t layer, const void* q, int q_dtype,
                                    void* out, int out_dtype, float* lse, float soft_cap,
                                    int64_t window, void* stream);
TKV_CUDA_API int tkv_cuda_prefill(void* cache, int64_t layer, const void* q, int q_dtype, void* out,
                                  int out_dtype, float* lse, float soft_cap, int64_t window,
                                  void* stream);
/* stats: planned, converted, promoted, demoted, pressure_demoted, deferred, deferred_full,
 * failed. */
TKV_CUDA_API int tkv_cuda_end_step(void* cache, uint64_t step, int wait, uint64_t stats[8]);

/* The memory report as numbers (tierkv/cache.py's order); returns how many there are and
 * writes at most `capacity`. */
TKV_CUDA_API int tkv_cuda_report(void* cache, double* values, int capacity);
/* The report as text; returns its length and writes at most capacity - 1 bytes and a NUL. */
TKV_CUDA_API int64_t tkv_cuda_report_text(void* cache, char* text, int64_t capacity);
TKV_CUDA_API int tkv_cuda_pin(void* cache, int64_t seq, int64_t first_page, int64_t pages,
                              int pinned);
/* Tiers of seq's committed pages at one layer: returns the page count, writes at most
 * `capacity`. */
TKV_CUDA_API int64_t tkv_cuda_page_tiers(void* cache, int64_t seq, int64_t layer, int64_t* tiers,
                                         int64_t capacity);
TKV_CUDA_API int tkv_cuda_check_invariants(void* cache);
TKV_CUDA_API int tkv_cuda_device_error(void* cache);
/* metadata bytes host to device, device to host, page bytes (0). */
TKV_CUDA_API int tkv_cuda_transfers(void* cache, uint64_t out[3]);
/* host time by part, nanoseconds since create (cuda::host_times, in its field order): steps,
 * begin_step, make_room, index, end_step, mass_wait, mass_fold, plan, retier. */
TKV_CUDA_API int tkv_cuda_host_times(void* cache, uint64_t out[9]);
/* every conversion since create (end_step's, make_room's under memory pressure and drain's), in
 * tkv_cuda_end_step's stats order. */
TKV_CUDA_API int tkv_cuda_retier_totals(void* cache, uint64_t out[8]);

#ifdef __cplusplus
}
#endif
#endif
