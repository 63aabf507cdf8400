// SPDX-License-Identifier: Apache-2.0
#include "../instantiate.hpp"
TIERKV_PY_INSTANTIATE(int8r_only, 64, 64)
