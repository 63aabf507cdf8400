// SPDX-License-Identifier: Apache-2.0
// A kernel's error word in its workspace: the first error of a launch wins.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include "tierkv/core/status.hpp"
namespace tierkv::cuda::detail {

__device__ __forceinline__ void report_error(int* flag, errc e) {
  if (flag) atomicCAS(flag, 0, int(e));
}

}  // namespace tierkv::cuda::detail
