// SPDX-License-Identifier: Apache-2.0
// The policy registry (tierkv/policies.hpp): every knob of a registered policy set by name
// equals the same knob set in C++; unknown names, unknown or repeated knobs, values a knob
// cannot hold and knobs the policy refuses are errors naming them; the run-time choice drives
// the controller to exactly the plans of the policy chosen at compile time.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "catch.hpp"
#include "incremental_run.hpp"
#include "policy_knobs.hpp"
#include "tiering_test_support.hpp"
#include "tierkv/policies.hpp"

using namespace tiering_test;
using tierkv::policy::recency_anchor;

namespace {

std::string message_of(std::string_view name, std::vector<policy_knob> knobs) {
  auto p = make_policy(name, knobs);
  REQUIRE_FALSE(p.has_value());
  CHECK(p.code() == errc::invalid_argument);
  return p.error_status().message();
}

std::unique_ptr<storage3> make_storage3() {
  storage3::options o;
  o.num_layers = 3;
  o.max_sequences = 8;
  o.pages_per_tier = {60, 120, 120};
  o.codec_seed = 23;
  return std::move(storage3::create(o).value());
}

}  // namespace

TEST_CASE("policies: every recency_anchor knob set by name", "[tiering][policy]") {
  const std::vector<policy_knob> knobs = {
      {"recent_pages", 3},       {"sink_pages", 2},       {"ema_alpha", 0.5},
      {"enter_mass", 5},         {"leave_mass", 2.5},     {"min_dwell_steps", 12},
      {"keep_first_layers", 0},  {"keep_last_layers", 2}, {"cold_enter_mass", 0.25},
      {"cold_leave_mass", 0.75}, {"cold_after_pages", 6}, {"cold_layers", 5}};
  auto p = make_policy("recency_anchor", knobs);
  REQUIRE(p.has_value());
  CHECK(p->name() == "recency_anchor");
  REQUIRE(p->get_if<recency_anchor>() != nullptr);
  const recency_anchor::options& o = p->get_if<recency_anchor>()->knobs();
  CHECK(o.recent_pages == 3);
  CHECK(o.sink_pages == 2);
  CHECK(o.ema_alpha == 0.5f);
  CHECK(o.enter_mass == 5.0f);
  CHECK(o.leave_mass == 2.5f);
  CHECK(o.min_dwell_steps == 12);
  CHECK(o.keep_first_layers == 0);
  CHECK(o.keep_last_layers == 2);
  CHECK(o.cold_enter_mass == 0.25f);
  CHECK(o.cold_leave_mass == 0.75f);
  CHECK(o.cold_after_pages == 6);
  CHECK(o.cold_layers == 5u);
  CHECK(p->min_dwell_steps() == 12);
  // every knob the policy lists was given above: the listing and the test agree
  int listed = 0;
  recency_anchor::options d;
  recency_anchor::knobs(d, [&](std::string_view, const auto&) { ++listed; });
  CHECK(listed == int(knobs.size()));
  // no knobs: the defaults, the first registered policy is the default-made one
  auto def = make_policy("recency_anchor");
  REQUIRE(def.has_value());
  CHECK(def->get_if<recency_anchor>()->knobs().recent_pages ==
        recency_anchor::options{}.recent_pages);
  CHECK(registered_policy{}.name() == "recency_anchor");
  CHECK(registered_policy_names().find("recency_anchor") != std::string::npos);
  CHECK(registered_policy_knobs("recency_anchor").find("ema_alpha=0.25") != std::string::npos);
  CHECK(registered_policy_knobs("nope").empty());
}

TEST_CASE("policies: bad names and values are errors naming them", "[tiering][policy]") {
  CHECK(message_of("lru", {}).find("unknown tier policy \"lru\"; known policies: recency_anchor") !=
        std::string::npos);
  const std::string unknown = message_of("recency_anchor", {{"recent_page", 4}});
  CHECK(unknown.find("no knob \"recent_page\"") != std::string::npos);
  CHECK(unknown.find("recent_pages=4") != std::string::npos);  // the knobs, with defaults
  CHECK(message_of("recency_anchor", {{"sink_pages", 1}, {"sink_pages", 2}}).find("given twice") !=
        std::string::npos);
  CHECK(message_of("recency_anchor", {{"recent_pages", 2.5}}).find("must be an integer") !=
        std::string::npos);
  CHECK(message_of("recency_anchor", {{"recent_pages", 3e9}}).find("2147483647") !=
        std::string::npos);
  CHECK(message_of("recency_anchor", {{"min_dwell_steps", -1}}).find("must be an integer in [0") !=
        std::string::npos);
  CHECK(message_of("recency_anchor", {{"ema_alpha", std::nan("")}}).find("NaN") !=
        std::string::npos);
  // values a knob holds but the policy refuses: its own validate() message
  CHECK(message_of("recency_anchor", {{"enter_mass", 1}, {"leave_mass", 2}}).find("hysteresis") !=
        std::string::npos);
  CHECK(message_of("recency_anchor", {{"ema_alpha", std::numeric_limits<double>::infinity()}})
            .find("ema_alpha") != std::string::npos);
}

TEST_CASE(
    "policies: a policy chosen by name plans what the same policy chosen at compile time does",
    "[tiering][policy][controller]") {
  // Cold knobs on so the Cold role's state (cold flag) is forwarded too
  auto k = tierkv_test::recency_knobs(2, 1, 0.5f, 2.0f, 1.0f, 2);
  k.cold_enter_mass = 0.6f;
  k.cold_leave_mass = 0.9f;
  const std::vector<policy_knob> by_name = {{"recent_pages", 2},      {"sink_pages", 1},
                                            {"ema_alpha", 0.5},       {"enter_mass", 2},
                                            {"leave_mass", 1},        {"min_dwell_steps", 2},
                                            {"keep_first_layers", 0}, {"keep_last_layers", 0},
                                            {"cold_enter_mass", 0.6}, {"cold_leave_mass", 0.9}};
  using direct_c = tier_controller<storage3, recency_anchor, roles3>;
  using named_c = tier_controller<storage3, registered_policy, roles3>;
  auto s1 = make_storage3();
  auto s2 = make_storage3();
  tier_controller_options full;
  full.incremental_plan = false;
  auto named = named_c::create(*s1, make_policy("recency_anchor", by_name).value()).value();
  auto direct = direct_c::create(*s2, recency_anchor(k), full).value();
  // the named controller plans incrementally (through the forwarded same_choice /
  // same_state_choice), the direct one by the full scan: the same plans step by step
  CHECK(incremental_equals_full_run(*s1, *s2, *named, *direct, 7) > 200);
  // under a bit budget (a full scan each plan): the forwarded budget_exempt keeps the same pages
  // out of the budget, so the same plans again
  tier_controller_options budget;
  budget.bits_per_scalar_target = 4.0;
  auto s3 = make_storage3();
  auto s4 = make_storage3();
  auto named_b =
      named_c::create(*s3, make_policy("recency_anchor", by_name).value(), budget).value();
  auto direct_b = direct_c::create(*s4, recency_anchor(k), budget).value();
  CHECK(incremental_equals_full_run(*s3, *s4, *named_b, *direct_b, 8) > 200);
}
