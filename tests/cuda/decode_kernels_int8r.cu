// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side, int8_rotated Recent tiers (no Catch2 here).
#include "decode_kernels.cuh"

CUDA_TEST_DECODE(decode_qwen, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_llama, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_smol, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_small_pages, decode_int8r, decode_stale)
CUDA_TEST_DECODE(decode_qwen, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_llama, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_smol, decode_int8r, decode_stale_k4)
CUDA_TEST_DECODE(decode_small_pages, decode_int8r, decode_stale_k4)
