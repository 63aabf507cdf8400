// SPDX-License-Identifier: Apache-2.0
// The prebuilt set of one binding (the host ops' or the CUDA library's): instantiation units add
// their combinations at load time; a cache is made by resolving the run-time format names
// (formats.hpp) and looking the combination up. A combination not built is refused with a
// message naming what was built and how to build more.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "formats.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv_py {

// A prebuilt combination: tier set and geometry.
struct combo {
  int tier_set = 0;  // formats.hpp's tier_set_index of the set's 3 or 5 format names
  int head_dim = 0, kv_heads = 0, group_size = 0, page_size = 0;
  friend auto operator<=>(const combo&, const combo&) = default;
};

// No streams here: a torch extension on the device image crashes streaming a number
// (tierkv/core/text.hpp).
template <class C>
std::string join(const C& values) {
  std::string out;
  const char* sep = "";
  for (const auto& v : values)
    tierkv::append_text(out, sep), tierkv::append_text(out, v), sep = ", ";
  return out;
}

template <class Factory>
class combo_registry {
 public:
  void add(const combo& c, Factory f) { table_.emplace(c, f); }

  std::vector<combo> combos() const {
    std::vector<combo> v;
    for (const auto& [c, f] : table_) v.push_back(c);
    return v;
  }

  // The factory of the named combination (cfg's set names and geometry). A missing one is
  // refused with the exact entry that builds it: `variable` (TIERKV_PYTHON_EXTRA,
  // TIERKV_PYTHON_CUDA_SET) = recent+k+v[+cold_k+cold_v]:d:kv:g:p, the form setup.py reads, and
  // `how` (the rest of the command).
  template <class Config>
  Factory find(const Config& cfg, const char* variable, const char* how) const {
    const std::vector<std::string> names =
        set_names(cfg.recent, cfg.cache_type_k, cfg.cache_type_v, cfg.cold_type_k, cfg.cold_type_v);
    const int set = resolve_tier_set(names);
    const auto it =
        table_.find(combo{set, cfg.head_dim, cfg.kv_heads, cfg.group_size, cfg.page_size});
    if (it == table_.end()) {
      static constexpr const char* keys[] = {"recent", "cache_type_k", "cache_type_v",
                                             "cold_type_k", "cold_type_v"};
      std::string named, entry;
      for (std::size_t i = 0; i < names.size(); ++i) {
        named += std::string(i ? ", " : "") + keys[i] + "=" + names[i];
        entry += (i ? "+" : "") + names[i];
      }
      throw tierkv::error(tierkv::status::make(
          tierkv::errc::invalid_argument, "no prebuilt tierkv cache for ", named,
          ", head_dim=", cfg.head_dim, ", kv_heads=", cfg.kv_heads, ", group_size=", cfg.group_size,
          ", page_size=", cfg.page_size, ". Built: ", describe(), ". To build it: ", variable, "=",
          entry, ":", cfg.head_dim, ":", cfg.kv_heads, ":", cfg.group_size, ":", cfg.page_size, " ",
          how, " (docs/python.md)"));
    }
    return it->second;
  }

  std::string describe() const {
    std::set<int> sets, d, kv, g, p;
    for (const auto& [c, f] : table_) {
      sets.insert(c.tier_set);
      d.insert(c.head_dim), kv.insert(c.kv_heads), g.insert(c.group_size), p.insert(c.page_size);
    }
    std::vector<std::string> set_names;
    for (int s : sets) set_names.emplace_back(tier_set_name(s));
    std::string out = tierkv::concat(
        table_.size(),
        " combinations; tier sets (recent/cache_type_k/cache_type_v[/cold_type_k/cold_type_v]) {",
        join(set_names), "}, head_dim {", join(d), "}, kv_heads {", join(kv), "}, group_size {",
        join(g), "}, page_size {", join(p), "}");
    const std::size_t product = sets.size() * d.size() * kv.size() * g.size() * p.size();
    if (product != table_.size()) out += " (not every product of these; built() lists them)";
    return out;
  }

 private:
  std::map<combo, Factory> table_;
};

}  // namespace tierkv_py
