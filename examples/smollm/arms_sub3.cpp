// SPDX-License-Identifier: Apache-2.0
// Issue 52's one- and two-tier candidates (tierkv_backend.hpp): every page in one tier
// (uniform_*), or rec's pages and policy (centred) with the Stale tier swapped (stale_*, rec_u).
#include <memory>
#include <string>

#include "tierkv_backend.hpp"

namespace smollm {

std::unique_ptr<kv_backend> arm_family::sub3(const std::string& arm, const std::string& full_arm,
                                             kv_shape s, const tiering_options& opt, int capacity) {
  using namespace arm_tiers;
  const auto uniform = [&]<class T>() {
    return make_arm<default_roles, T>(full_arm, s, opt, capacity);
  };
  const auto rec_like = [&]<class Stale>() {
    return make_arm<default_roles, int8r_tier, Stale>(full_arm, s, opt, capacity);
  };
  if (arm == "uniform_k4v4") return uniform.template operator()<k4v4>();
  if (arm == "uniform_k4v2") return uniform.template operator()<k4v2>();
  if (arm == "uniform_k3v2") return uniform.template operator()<k3v2>();
  if (arm == "uniform_k3v4") return uniform.template operator()<k3v4>();
  if (arm == "uniform_k2v2") return uniform.template operator()<k2v2>();
  if (arm == "uniform_k8v4") return uniform.template operator()<k8v4>();
  if (arm == "stale_k4v2") return rec_like.template operator()<k4v2>();
  if (arm == "stale_k3v2") return rec_like.template operator()<k3v2>();
  if (arm == "stale_k2v2") return rec_like.template operator()<k2v2>();
  if (arm == "stale_k3v2u") return rec_like.template operator()<k3v2u>();
  if (arm == "stale_k4v2u") return rec_like.template operator()<k4v2u>();
  if (arm == "rec_u") return rec_like.template operator()<k4v3u>();
  if (arm == "stale_k3v3u") return rec_like.template operator()<k3v3u>();
  return nullptr;
}

}  // namespace smollm
