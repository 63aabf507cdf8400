// SPDX-License-Identifier: Apache-2.0
#include "../instantiate.hpp"
TIERKV_PY_INSTANTIATE(int8r_tq4, 256, 16)
