// SPDX-License-Identifier: Apache-2.0
// The Catch2 main for every test executable, built once (twice: the GPU tests' main, with
// TIERKV_GPU_TEST_MAIN, first looks for a CUDA device).
#if defined(TIERKV_CATCH3)
#include <catch2/catch_session.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#if defined(TIERKV_GPU_TEST_MAIN)
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#endif

int main(int argc, char* argv[]) {
#if defined(TIERKV_GPU_TEST_MAIN)
  // Without a device a GPU test exits with TIERKV_TEST_SKIP_CODE (ctest's SKIP_RETURN_CODE),
  // so a build machine without a GPU passes ctest with them skipped; TIERKV_REQUIRE_GPU=1
  // (scripts/gpu-check, on the device) makes a missing device a failure instead.
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    const char* require = std::getenv("TIERKV_REQUIRE_GPU");
    const bool required = require != nullptr && std::strcmp(require, "1") == 0;
    std::printf("no CUDA device: %s (cudaGetDeviceCount: %s)\n",
                required ? "failed, TIERKV_REQUIRE_GPU=1" : "skipped",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return required ? 1 : TIERKV_TEST_SKIP_CODE;
  }
#endif
  return Catch::Session().run(argc, argv);
}
