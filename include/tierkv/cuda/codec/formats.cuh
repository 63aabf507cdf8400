// SPDX-License-Identifier: Apache-2.0
// The registry of device formats: every cuda/codec/ file with a device_codec specialization.
// Kernels include this, so a tier list may name any registered format.
#pragma once

#include "tierkv/cuda/codec/dense_bf16.cuh"
#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/cuda/codec/fp8_e4m3.cuh"
#include "tierkv/cuda/codec/int8_rotated.cuh"
#include "tierkv/cuda/codec/tq3.cuh"
#include "tierkv/cuda/codec/tq4.cuh"
