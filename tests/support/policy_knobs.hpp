// SPDX-License-Identifier: Apache-2.0
// recency_anchor knobs the controller and GPU tests share: every knob given, no layer kept
// (keep_first_layers = keep_last_layers = 0), so the tests' few layers are all tiered.
#pragma once

#include <cstdint>

#include "tierkv/tiering/recency_anchor.hpp"

namespace tierkv_test {

inline tierkv::policy::recency_anchor::options recency_knobs(int recent, int sink, float ema_alpha,
                                                             float enter, float leave,
                                                             std::uint64_t dwell) {
  tierkv::policy::recency_anchor::options o;
  o.recent_pages = recent;
  o.sink_pages = sink;
  o.ema_alpha = ema_alpha;
  o.enter_mass = enter;
  o.leave_mass = leave;
  o.min_dwell_steps = dwell;
  o.keep_first_layers = 0;
  o.keep_last_layers = 0;
  return o;
}

}  // namespace tierkv_test
