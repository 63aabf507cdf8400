// SPDX-License-Identifier: Apache-2.0
// The host ops' prebuilt set (combo_registry.hpp): the instantiation units register their
// combinations while the module loads.
#include "combo_registry.hpp"
#include "runtime.hpp"

namespace tierkv_py {
namespace {

combo_registry<factory>& table() {
  static combo_registry<factory> t;  // filled during static initialisation of the module
  return t;
}

}  // namespace

void register_combo(const combo& c, factory f) { table().add(c, f); }

std::vector<combo> built_combos() { return table().combos(); }

std::unique_ptr<runtime_cache> make_cache(const cache_config& cfg) {
  const factory f =
      table().find(cfg, "TIERKV_PYTHON_EXTRA", "pip install --no-build-isolation ./python");
  return f(cfg);
}

}  // namespace tierkv_py
