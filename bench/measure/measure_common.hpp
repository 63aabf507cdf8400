// SPDX-License-Identifier: Apache-2.0
// Shared output helpers for measure_* programs: a readable table, then the last
// line is one JSON object {"name": ..., "metrics": {...}} (scripts/measure contract).
#pragma once

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tierkv::measure {

class report {
 public:
  explicit report(std::string name) : name_(std::move(name)) {}

  // A metric for the final JSON line (finite numbers only; NaN/Inf become null).
  void metric(const std::string& key, double value) { metrics_.emplace_back(key, value); }

  // Prints the final JSON line. Call last.
  void emit() const {
    std::printf("{\"name\":\"%s\",\"metrics\":{", name_.c_str());
    for (std::size_t i = 0; i < metrics_.size(); ++i) {
      const auto& [k, v] = metrics_[i];
      if (std::isfinite(v))
        std::printf("%s\"%s\":%.9g", i ? "," : "", k.c_str(), v);
      else
        std::printf("%s\"%s\":null", i ? "," : "", k.c_str());
    }
    std::printf("}}\n");
    std::fflush(stdout);
  }

 private:
  std::string name_;
  std::vector<std::pair<std::string, double>> metrics_;
};

}  // namespace tierkv::measure
