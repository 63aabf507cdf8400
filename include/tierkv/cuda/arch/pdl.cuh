// SPDX-License-Identifier: Apache-2.0
// Programmatic dependent launch (sm_90): the device-side controls and the host launch helper.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <utility>
namespace tierkv::cuda::detail {

// Programmatic dependent launch (sm_90): every split block allows the merge grid to launch
// as soon as all split blocks run, so the merge's launch and chunking overlap the split's
// last blocks; the merge waits for the split grid's completion (and its memory) before it
// reads the workspace. Without the launch attribute (or before sm_90) both are no-ops.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Launches `kernel` on `stream` with programmatic stream serialization: it may start while
// the previous kernel (which calls allow_dependent_launch) still runs, and waits for it with
// wait_for_prerequisite_grid.
template <class... Params, class... Args>
inline cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block,
                                    cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cfg.attrs = pdl;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace tierkv::cuda::detail
