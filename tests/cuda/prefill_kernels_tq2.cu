// SPDX-License-Identifier: Apache-2.0
// test_cuda_prefill's device side, the Cold tier's TQ2 pages.
#include "prefill_kernels.cuh"

CUDA_TEST_PREFILL(decode_qwen, decode_int8r, decode_cold_v2)
CUDA_TEST_PREFILL(decode_llama, decode_recent, decode_cold)
CUDA_TEST_PREFILL(decode_small_pages, decode_int8r, decode_cold)
CUDA_TEST_PREFILL(decode_qwen, decode_recent, decode_cold)
