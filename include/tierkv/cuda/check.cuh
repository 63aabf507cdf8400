// SPDX-License-Identifier: Apache-2.0
// CUDA runtime errors as tierkv::status: every runtime call in tierkv is checked and a
// failure names the call that failed and the runtime's own message.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>

#include <string_view>

#include "tierkv/core/status.hpp"

namespace tierkv::cuda {

/// status::ok() for cudaSuccess, else errc::cuda_error "what: <cuda name>: <cuda message>".
inline status check(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return status::ok();
  return status::make(errc::cuda_error, what, ": ", cudaGetErrorName(err), ": ",
                      cudaGetErrorString(err));
}

/// The launch error of the kernel just queued (configuration, missing image), without
/// synchronizing: asynchronous faults surface at the caller's next synchronization.
inline status check_launch(std::string_view kernel) { return check(cudaGetLastError(), kernel); }

}  // namespace tierkv::cuda

// Returns the status from the enclosing function when a CUDA call fails.
#define TIERKV_CUDA_TRY(call)                                                        \
  do {                                                                               \
    ::tierkv::status tierkv_cuda_try_status_ = ::tierkv::cuda::check((call), #call); \
    if (!tierkv_cuda_try_status_.is_ok()) return tierkv_cuda_try_status_;            \
  } while (0)
