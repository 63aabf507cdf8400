// SPDX-License-Identifier: Apache-2.0
// Geometries outside the product, from TIERKV_PYTHON_EXTRA: setup.py writes extra.inc, one
// tierkv_py::register_one<set, head_dim, kv_heads, group_size, page_size>(); line each.
#include "instantiate.hpp"

namespace {
[[maybe_unused]] const bool registered = [] {
#include "extra.inc"
  return true;
}();
}  // namespace
