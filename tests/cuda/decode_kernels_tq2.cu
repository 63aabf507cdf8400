// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side, the Cold tier's TQ2 pages (no Catch2 here).
#include "decode_kernels.cuh"

CUDA_TEST_DECODE(decode_qwen, decode_int8r, decode_cold_v2)
CUDA_TEST_DECODE(decode_llama, decode_recent, decode_cold_v2)
CUDA_TEST_DECODE(decode_smol, decode_int8r, decode_cold_v2)
CUDA_TEST_DECODE(decode_qwen, decode_recent, decode_cold)
CUDA_TEST_DECODE(decode_llama, decode_int8r, decode_cold)
CUDA_TEST_DECODE(decode_smol, decode_int8r, decode_cold)
CUDA_TEST_DECODE(decode_small_pages, decode_int8r, decode_cold)
CUDA_TEST_DECODE(decode_pages32, decode_recent, decode_cold)
