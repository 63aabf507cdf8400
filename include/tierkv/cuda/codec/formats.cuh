// SPDX-License-Identifier: Apache-2.0
// The device formats the kernels may name in a tier list: the registry's (tierkv/formats.hpp,
// which includes each registered format's device codec when compiled by nvcc).
#pragma once

#include "tierkv/cuda/codec/device_codec.cuh"
#include "tierkv/formats.hpp"
