// SPDX-License-Identifier: Apache-2.0
// What an instantiation unit expands: cache_impl for one tier set, head_dim and page size,
// over formats.hpp's group sizes and KV-head counts, registered when the module loads.
#pragma once

#include "cache_impl.hpp"
#include "formats.hpp"

namespace tierkv_py {
#if defined(TIERKV_PY_FULL) && TIERKV_PY_FULL
using kv_list = kv_heads_full;
#else
using kv_list = kv_heads_default;
#endif
}  // namespace tierkv_py

// SET: TIERKV_PY_SET("recent", "k", "v") (formats.hpp).
#define TIERKV_PY_INSTANTIATE(SET, HEAD_DIM, PAGE)                                              \
  namespace {                                                                                   \
  [[maybe_unused]] const bool registered = (tierkv_py::register_product<SET, HEAD_DIM, PAGE>(   \
                                                tierkv_py::kv_list{}, tierkv_py::group_list{}), \
                                            true);                                              \
  }

// One combination (setup.py's TIERKV_PYTHON_EXTRA units).
#define TIERKV_PY_INSTANTIATE_ONE(SET, HEAD_DIM, KV_HEADS, GROUP, PAGE)        \
  namespace {                                                                  \
  [[maybe_unused]] const bool registered =                                     \
      (tierkv_py::register_one<SET, HEAD_DIM, KV_HEADS, GROUP, PAGE>(), true); \
  }
