// SPDX-License-Identifier: Apache-2.0
// test_cuda_prefill's device side, int8_rotated Recent tiers and TQ4 Stale keys.
#include "prefill_kernels.cuh"

CUDA_TEST_PREFILL(decode_qwen, decode_int8r, decode_stale_k4)
CUDA_TEST_PREFILL(decode_llama, decode_int8r, decode_stale_k4)
CUDA_TEST_PREFILL(decode_small_pages, decode_int8r, decode_stale_k4)
CUDA_TEST_PREFILL(decode_qwen, decode_recent, decode_stale_k4)
