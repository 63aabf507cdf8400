// SPDX-License-Identifier: Apache-2.0
// cuda_test::append's definition (append_kernels.hpp), for the .cu files that instantiate it.
#pragma once

#include "append_kernels.hpp"
#include "tierkv/cuda/append/append.cuh"

namespace cuda_test {

template <class G, class Tier>
tierkv::status append(const append_args& a, cudaStream_t stream) {
  namespace cuda = tierkv::cuda;
  cuda::append_inputs in;
  in.k = a.k;
  in.v = a.v;
  in.type = a.bf16 ? cuda::input_type::bf16 : cuda::input_type::f32;
  in.layer_stride = a.layer_stride;
  in.slot = a.slot;
  in.slot_layer_stride = a.slot_layer_stride;
  in.offset = a.offset;
  in.tokens = a.tokens;
  in.layers = a.layers;
  in.pool = a.pool;
  in.cache_seed = a.cache_seed;
  in.head_base = a.head_base;
  in.layer_base = a.layer_base;
  in.error = a.error;
  return cuda::append<G, Tier>(in, stream);
}

}  // namespace cuda_test
