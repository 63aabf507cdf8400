// SPDX-License-Identifier: Apache-2.0
#include "../instantiate.hpp"
TIERKV_PY_INSTANTIATE(fp8_tq3, 128, 16)
