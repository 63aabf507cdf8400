// SPDX-License-Identifier: Apache-2.0
// Element types of the attention kernels' queries and outputs (decode and prefill alike).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstdint>
namespace tierkv::cuda {

/// Element type of the queries: f32 or bf16.
enum class query_type : std::uint8_t { f32 = 0, bf16 = 1 };
/// Attention outputs: f32, or bf16 as models consume them (rounded once, from the f32 result).
enum class output_type : std::uint8_t { f32 = 0, bf16 = 1 };

}  // namespace tierkv::cuda
