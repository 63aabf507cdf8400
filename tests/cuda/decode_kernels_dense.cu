// SPDX-License-Identifier: Apache-2.0
// test_cuda_decode's device side, dense BF16 Recent tiers: the control arm (no Catch2 here).
#include "decode_kernels.cuh"

CUDA_TEST_DECODE(decode_qwen, decode_dense, decode_stale)
CUDA_TEST_DECODE(decode_llama, decode_dense, decode_stale)
CUDA_TEST_DECODE(decode_smol, decode_dense, decode_stale)
CUDA_TEST_DECODE(decode_small_pages, decode_dense, decode_stale_k4)
