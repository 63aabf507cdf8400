// SPDX-License-Identifier: Apache-2.0
// test_cuda_user_format's device side (user_format_kernels.cu): the same steps on a
// cuda::tiered_cache whose Stale tier is the user format int8_twin and on one whose Stale tier
// is int8_rotated.
#pragma once

#include <cstdint>
#include <vector>

#include "tierkv/core/status.hpp"

namespace cuda_test {

struct user_format_run {
  std::vector<float> outputs;             // every decode's outputs, step by step, layer by layer
  std::uint64_t converted = 0;            // published conversions (demotions into the Stale tier)
  std::uint32_t stale_used = 0;           // pages in the Stale tier at the end
  std::vector<std::uint8_t> export_blob;  // the sequence's pages, exported (transfer tags)
};

// twin: the Stale tier is int8_twin (tag 200), else int8_rotated.
tierkv::result<user_format_run> run_user_format(bool twin);

}  // namespace cuda_test
