// SPDX-License-Identifier: Apache-2.0
// Host-side helpers of the GPU tests, shared by their Catch2 .cpp files and their nvcc-compiled
// *_kernels.cu files (no Catch2 here: it stays out of nvcc, see tests/CMakeLists.txt).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace cuda_test {

// Throws "file:line: call: <cuda name>: <cuda message>" unless err is cudaSuccess; Catch2
// reports the exception as a failure of the running test case.
inline void cuda_ok(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call + ": " +
                           cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// The current device's compute capability as 10 x major + minor (90: an H100 / H200).
inline int compute_capability() {
  int dev = 0, major = 0, minor = 0;
  cuda_ok(cudaGetDevice(&dev), "cudaGetDevice", __FILE__, __LINE__);
  cuda_ok(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
          "cudaDeviceGetAttribute", __FILE__, __LINE__);
  cuda_ok(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev),
          "cudaDeviceGetAttribute", __FILE__, __LINE__);
  return 10 * major + minor;
}

// `n` elements of T in device memory, freed with the buffer; put/get copy synchronously. New
// memory is poisoned with 0xFF bytes (NaN floats, NaN FP8 codes and bf16 metas, slot -1): a kernel
// that reads what nobody wrote gets NaN into the test's comparison, and a capacity tail that get()
// copies back is defined (compute-sanitizer initcheck then reports only kernel reads).
template <class T>
struct device_buffer {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count) : n(count) {
    if (n) {
      cuda_ok(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)), "cudaMalloc", __FILE__,
              __LINE__);
      cuda_ok(cudaMemset(p, 0xFF, n * sizeof(T)), "cudaMemset", __FILE__, __LINE__);
    }
  }
  // A device copy of `h` (at least one element, so an empty vector still has a valid pointer).
  explicit device_buffer(const std::vector<T>& h)
      : device_buffer(std::max<std::size_t>(1, h.size())) {
    put(h);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (p) (void)cudaFree(p);
  }
  void put(const std::vector<T>& h) {
    if (h.size() > n)
      throw std::length_error("device_buffer::put: " + std::to_string(h.size()) +
                              " elements into " + std::to_string(n));
    if (h.empty()) return;
    cuda_ok(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy",
            __FILE__, __LINE__);
    // From pageable memory cudaMemcpy returns once the bytes are staged, before the DMA has
    // landed (CUDA runtime API, "API synchronization behavior"), and a kernel on a non-blocking
    // stream does not wait for it: under a loaded GPU the tests' kernels read the previous
    // contents (a prefill from the last layer's queries; NaN from the poisoned first fill).
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n)
      cuda_ok(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy",
              __FILE__, __LINE__);
    return h;
  }
};

}  // namespace cuda_test

#define CUDA_OK(call) ::cuda_test::cuda_ok((call), #call, __FILE__, __LINE__)
