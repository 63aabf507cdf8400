// SPDX-License-Identifier: Apache-2.0
// The prebuilt set: the instantiation units register their combinations at load time; a
// cache is made by resolving the format names (formats.hpp) and looking the combination up.
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

#include "formats.hpp"
#include "runtime.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv_py {
namespace {

std::map<combo, factory>& table() {
  static std::map<combo, factory> t;  // filled during static initialisation of the module
  return t;
}

template <class C>
std::string join(const C& values) {
  std::ostringstream out;
  const char* sep = "";
  for (const auto& v : values) out << sep << v, sep = ", ";
  return out.str();
}

std::string describe_built() {
  std::set<int> sets, d, kv, g, p;
  for (const auto& [c, f] : table()) {
    sets.insert(c.tier_set);
    d.insert(c.head_dim), kv.insert(c.kv_heads), g.insert(c.group_size), p.insert(c.page_size);
  }
  std::ostringstream out;
  out << table().size() << " combinations; tier sets (recent/cache_type_k/cache_type_v) {";
  const char* sep = "";
  for (int s : sets) {
    const auto& n = tier_set_names[std::size_t(s)];
    out << sep << n.recent << "/" << n.k << "/" << n.v;
    sep = ", ";
  }
  out << "}, head_dim {" << join(d) << "}, kv_heads {" << join(kv) << "}, group_size {" << join(g)
      << "}, page_size {" << join(p) << "}";
  const std::size_t product = sets.size() * d.size() * kv.size() * g.size() * p.size();
  if (product != table().size()) out << " (not every product of these; tierkv.built() lists them)";
  return out.str();
}

}  // namespace

void register_combo(const combo& c, factory f) { table().emplace(c, f); }

std::vector<combo> built_combos() {
  std::vector<combo> v;
  for (const auto& [c, f] : table()) v.push_back(c);
  return v;
}

std::unique_ptr<runtime_cache> make_cache(const cache_config& cfg) {
  for (const std::string* name : {&cfg.recent, &cfg.cache_type_k, &cfg.cache_type_v}) {
    bool known = false;
    for (auto n : format_names) known = known || n == *name;
    if (!known)
      throw tierkv::error(tierkv::status::make(
          tierkv::errc::invalid_argument, "unknown cache format name \"", *name,
          "\" (recent / cache_type_k / cache_type_v); known names: ", join(format_names)));
  }
  int set = -1;
  for (std::size_t i = 0; i < tier_set_names.size(); ++i) {
    const auto& n = tier_set_names[i];
    if (n.recent == cfg.recent && n.k == cfg.cache_type_k && n.v == cfg.cache_type_v) set = int(i);
  }
  const combo want{set, cfg.head_dim, cfg.kv_heads, cfg.group_size, cfg.page_size};
  const auto it = set < 0 ? table().end() : table().find(want);
  if (it == table().end())
    throw tierkv::error(tierkv::status::make(
        tierkv::errc::invalid_argument, "no prebuilt tierkv cache for recent=", cfg.recent,
        ", cache_type_k=", cfg.cache_type_k, ", cache_type_v=", cfg.cache_type_v,
        ", head_dim=", cfg.head_dim, ", kv_heads=", cfg.kv_heads, ", group_size=", cfg.group_size,
        ", page_size=", cfg.page_size, ". Built: ", describe_built(),
        ". Other combinations: rebuild with TIERKV_PYTHON_SET=full or TIERKV_PYTHON_EXTRA "
        "(docs/python.md), or compose tierkv::tiered_cache in C++"));
  return it->second(cfg);
}

}  // namespace tierkv_py
