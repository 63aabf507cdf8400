// SPDX-License-Identifier: Apache-2.0
// Umbrella header: everything host code needs. CUDA kernels live under tierkv/cuda/.
#pragma once

#include "tierkv/core/config.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/dense.hpp"
