// SPDX-License-Identifier: Apache-2.0
// Issue 52's Cold and 4-bit-Anchor candidates (tierkv_backend.hpp): rec's tiers plus a Cold
// tier (cold_*), Anchors in a 4-bit tier with only Recent pages 8-bit (a4_*), and Anchors with
// one role at 8 bits (a84_*, a48_*).
#include <memory>
#include <string>

#include "tierkv_backend.hpp"

namespace smollm {

std::unique_ptr<kv_backend> arm_family::cold(const std::string& arm, const std::string& full_arm,
                                             kv_shape s, const tiering_options& opt, int capacity) {
  using namespace arm_tiers;
  tiering_options cold_opt = opt;
  cold_arm_defaults(cold_opt);
  cold_opt.policy.cold_enter_mass = cold_opt.cold_enter_mass;
  cold_opt.policy.cold_leave_mass = cold_opt.cold_leave_mass;
  cold_opt.policy.cold_after_pages = cold_opt.cold_after_pages;
  // Recent / Anchor int8_rotated, Stale the given tier, Cold the given tier.
  const auto with_cold = [&]<class Stale, class Cold>() {
    return make_arm<role_map<0, 1, 2>, int8r_tier, Stale, Cold>(full_arm, s, cold_opt, capacity);
  };
  // Anchors (sinks, sensitive layers, high-mass pages) in a 4-bit tier instead of 8 bits: only
  // Recent pages stay int8_rotated.
  const auto anchors4 = [&]<class Anchor, class Stale, class Cold>() {
    return make_arm<role_map<1, 2, 3>, int8r_tier, Anchor, Stale, Cold>(full_arm, s, cold_opt,
                                                                        capacity);
  };
  // Anchors in tier 1, Stale = Cold in tier 2.
  const auto anchors_in = [&]<class Anchor, class Stale>(const tiering_options& o) {
    return make_arm<role_map<1, 2, 2>, int8r_tier, Anchor, Stale>(full_arm, s, o, capacity);
  };
  if (arm == "cold_k4v2") return with_cold.template operator()<stale_k4_tier, k4v2>();
  if (arm == "cold_k3v2") return with_cold.template operator()<stale_k4_tier, k3v2>();
  if (arm == "cold_k2v2") return with_cold.template operator()<stale_k4_tier, k2v2>();
  if (arm == "cold_k3v2u") return with_cold.template operator()<stale_k4_tier, k3v2u>();
  // Unbiased values in both compressed tiers: Stale TQ4 (u4) or TQ3 (u3) keys + TQ3 values.
  if (arm == "cold_u4_k3v2u") return with_cold.template operator()<k4v3u, k3v2u>();
  if (arm == "cold_u3_k3v2u") return with_cold.template operator()<k3v3u, k3v2u>();
  // Stale TQ4 keys + TQ2 values (unbiased), Cold TQ3 keys + TQ2 values: under a bit budget
  // the pages choose between key precisions, every old value at 2 bits.
  if (arm == "cold_u42_k3v2u") return with_cold.template operator()<k4v2u, k3v2u>();
  // Four tiers for a bit budget (the key weight bkw >= 8 puts TQ4 / TQ2 on its ladder): Stale
  // TQ4 keys + TQ3 values, TQ4 keys + TQ2 values, Cold TQ3 keys + TQ2 values, values unbiased.
  if (arm == "ladder4_u")
    return make_arm<role_map<0, 1, 3>, int8r_tier, k4v3u, k4v2u, k3v2u>(full_arm, s, cold_opt,
                                                                        capacity);
  // Anchors (tier 1) TQ4 keys + TQ3 values; a4_S_C: Stale S, Cold C.
  if (arm == "a4_k3v2_k2v2") return anchors4.template operator()<stale_k4_tier, k3v2, k2v2>();
  if (arm == "a4_k4v2_k3v2") return anchors4.template operator()<stale_k4_tier, k4v2, k3v2>();
  // Anchors TQ4 keys + TQ3 (a4) or TQ4 (a44) values, Stale = Cold TQ3 keys + TQ2 values.
  if (arm == "a4_k3v2") return anchors_in.template operator()<stale_k4_tier, k3v2>(opt);
  if (arm == "a44_k3v2") return anchors_in.template operator()<k4v4, k3v2>(opt);
  // Anchors with one role at 8 bits: int8_rotated keys + TQ4 values (a84), or TQ4 keys +
  // int8_rotated values (a48), 6.25 bits; Stale = Cold TQ3 keys + TQ2 values.
  if (arm == "a84_k3v2") return anchors_in.template operator()<k8v4, k3v2>(opt);
  if (arm == "a48_k3v2") return anchors_in.template operator()<k4v8, k3v2>(opt);
  // Anchors and Stale TQ4 keys + TQ3 values (one tier), Cold TQ3 keys + TQ2 values.
  if (arm == "a4_cold_k3v2")
    return make_arm<role_map<1, 1, 2>, int8r_tier, stale_k4_tier, k3v2>(full_arm, s, cold_opt,
                                                                        capacity);
  return nullptr;
}

}  // namespace smollm
