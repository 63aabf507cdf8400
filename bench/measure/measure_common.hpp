// SPDX-License-Identifier: Apache-2.0
// Shared output helpers for measure_* programs: a readable table, then the last
// line is one JSON object {"name": ..., "metrics": {...}} (scripts/measure contract).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace tierkv::measure {

// Ranks of x (ties get their average rank), for Spearman correlations of page masses.
inline std::vector<double> ranks(const std::vector<double>& x) {
  std::vector<std::size_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < idx.size();) {  // average ranks of ties
    std::size_t j = i;
    while (j + 1 < idx.size() && x[idx[j + 1]] == x[idx[i]]) ++j;
    for (std::size_t u = i; u <= j; ++u) r[idx[u]] = 0.5 * double(i + j);
    i = j + 1;
  }
  return r;
}
inline double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const auto ra = ranks(a), rb = ranks(b);
  const double n = double(a.size()), mean = (n - 1) / 2;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    sab += (ra[i] - mean) * (rb[i] - mean);
    saa += (ra[i] - mean) * (ra[i] - mean);
    sbb += (rb[i] - mean) * (rb[i] - mean);
  }
  return sab / std::sqrt(saa * sbb);
}

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
