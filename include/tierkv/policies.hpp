// SPDX-License-Identifier: Apache-2.0
// The policy registry: the one list of tier policies an engine or binding can choose at run
// time by name, with their knobs set by name. A policy is its header (tiering/: the concept of
// tiering/tier_policy.hpp plus a `name` and a `knobs(options, visitor)` listing) and one entry
// of builtin_policies below; Python's `policy=` / `policy_options=` and the C ABI's names are
// derived from it. C++ engines that fix their policy at compile time use the policy type
// directly; registered_policy is for the bindings, which choose it per cache at run time (one
// branch on the active policy per call of the controller, not per token).
#pragma once

#include "tierkv/core/config.hpp"

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "tierkv/core/status.hpp"
#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_policy.hpp"

namespace tierkv {

/// A tier policy nameable at run time: a tier_policy with
///   static constexpr std::string_view name;     its run-time name
///   typename P::options;                         its knobs (default-constructible), and
///                                                a constructor P(const options&)
///   static void knobs(Options& o, F&& f);        calls f(knob name, o.field) for every knob
///                                                (int, float, double, bool or unsigned fields)
namespace detail {
struct knob_probe {  // a knobs() visitor that accepts any field (the concept's check)
  template <class T>
  void operator()(std::string_view, T&) const {}
};
}  // namespace detail

template <class P>
concept named_policy = tier_policy<P> && std::convertible_to<decltype(P::name), std::string_view> &&
    std::default_initializable<typename P::options> &&
    std::constructible_from<P, const typename P::options&> && requires(typename P::options& o) {
  P::knobs(o, detail::knob_probe{});
};

/// One knob setting: a knob's name and its value (integer knobs take integral values).
struct policy_knob {
  std::string_view name;  ///< the knob, as the policy's knobs() names it
  double value = 0.0;     ///< its value
};

/// A list of named policies.
template <named_policy... Policies>
struct policy_list {
  static constexpr int size = int(sizeof...(Policies));  ///< number of policies
};

/// tierkv's own policies; the first is the default.
using builtin_policies = policy_list<policy::recency_anchor>;

namespace detail {

// value -> one knob field, refusing what the field cannot hold exactly
template <class T>
status set_knob_field(T& field, std::string_view policy_name, std::string_view knob, double v) {
  if constexpr (std::is_same_v<T, bool>) {
    if (v != 0.0 && v != 1.0)
      return status::make(errc::invalid_argument, policy_name, " knob ", knob, " = ", v,
                          " must be 0 or 1");
    field = v != 0.0;
  } else if constexpr (std::is_integral_v<T>) {
    // the bounds T and a double both hold exactly: integers of magnitude up to 2^53
    constexpr long long exact = 1LL << 53;
    constexpr long long lo =
        std::is_signed_v<T> ? std::max<long long>(std::numeric_limits<T>::min(), -exact) : 0;
    constexpr long long hi =
        static_cast<long long>(std::min<unsigned long long>(std::numeric_limits<T>::max(), exact));
    if (!(v >= double(lo) && v <= double(hi)) || v != std::floor(v))
      return status::make(errc::invalid_argument, policy_name, " knob ", knob, " = ", v,
                          " must be an integer in [", lo, ", ", hi, "]");
    field = T(v);
  } else {
    static_assert(std::is_floating_point_v<T>, "a policy knob is bool, integral or floating");
    if (std::isnan(v))
      return status::make(errc::invalid_argument, policy_name, " knob ", knob, " is NaN");
    field = T(v);
  }
  return {};
}

// P::choice_reads_time, false where P does not declare it
template <class P>
constexpr bool reads_time() {
  if constexpr (requires { P::choice_reads_time; })
    return bool(P::choice_reads_time);
  else
    return false;
}

// A knob's value as Python reads it back: bool 1 / 0, integers in decimal, floating point
// in the shortest form that round-trips (0.25, 1e-07; no locale, core/text.hpp).
template <class T>
void append_knob_value(std::string& out, const T& field) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    out.append(buf, std::to_chars(buf, buf + sizeof(buf), double(field)).ptr);
  } else {
    append_text(out, field);
  }
}

}  // namespace detail

/// "name=default, ..." of P's knobs (the message of a knob P does not have).
template <named_policy P>
std::string policy_knob_defaults() {
  typename P::options o{};
  std::string out;
  P::knobs(o, [&](std::string_view knob, const auto& field) {
    if (!out.empty()) out += ", ";
    out += knob;
    out += '=';
    detail::append_knob_value(out, field);
  });
  return out;
}

/// P with its default knobs changed by `knobs` (each at most once), validated.
template <named_policy P>
result<P> make_named_policy(std::span<const policy_knob> knobs) {
  typename P::options o{};
  for (std::size_t i = 0; i < knobs.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j)
      if (knobs[j].name == knobs[i].name)
        return status::make(errc::invalid_argument, P::name, " knob ", knobs[i].name,
                            " is given twice");
    bool found = false;
    status st;
    P::knobs(o, [&](std::string_view knob, auto& field) {
      if (found || knob != knobs[i].name) return;
      found = true;
      st = detail::set_knob_field(field, P::name, knob, knobs[i].value);
    });
    if (!found)
      return status::make(errc::invalid_argument, "policy ", P::name, " has no knob \"",
                          knobs[i].name, "\"; its knobs (defaults): ", policy_knob_defaults<P>());
    if (!st.is_ok()) return st;
  }
  P p(o);
  if (status st = p.validate(); !st.is_ok()) return st;
  return p;
}

/// One of Policies, chosen at run time: a tier_policy that forwards to the active one. Pages
/// keep the active policy's state (a page state of another alternative, as a default-made
/// state is when the active policy is not the first, reads as that policy's new-page state).
template <named_policy... Policies>
class any_policy {
  static_assert(sizeof...(Policies) >= 1, "any_policy: at least one policy");
  using first = std::tuple_element_t<0, std::tuple<Policies...>>;

 public:
  /// The active policy's per-page state.
  struct page_state {
    std::variant<typename Policies::page_state...> state;  ///< by policy index
  };
  /// choose() of some alternative reads steps_since_move: the controller scans every page.
  static constexpr bool choice_reads_time = (detail::reads_time<Policies>() || ...);

  /// The first policy with its default knobs.
  any_policy() : active_(std::in_place_index<0>) {}
  /// Policy `p` (one of Policies).
  template <class P>
  requires(std::is_same_v<P, Policies> || ...) explicit any_policy(P p) : active_(std::move(p)) {}

  /// The active policy's index in Policies and its name.
  std::size_t index() const noexcept { return active_.index(); }
  /// The active policy's run-time name.
  std::string_view name() const {
    return visit(
        [](const auto& p, auto) { return std::string_view(std::decay_t<decltype(p)>::name); });
  }
  /// The active policy, when it is P (else nullptr).
  template <class P>
  const P* get_if() const noexcept {
    return std::get_if<P>(&active_);
  }

  status validate() const {
    return visit([](const auto& p, auto) { return p.validate(); });
  }
  void observe(page_state& s, float mass) const {
    visit([&](const auto& p, auto i) { p.observe(state_for(s, i), mass); });
  }
  tier_role choose(const page_state& s, const page_facts& f) const {
    return visit([&](const auto& p, auto i) { return p.choose(read_state(s, i), f); });
  }
  std::uint64_t min_dwell_steps() const {
    return visit([](const auto& p, auto) { return std::uint64_t(p.min_dwell_steps()); });
  }
  float keep_value(const page_state& s, const page_facts& f) const {
    return visit([&](const auto& p, auto i) { return float(p.keep_value(read_state(s, i), f)); });
  }
  /// The active policy's same_choice (false, "re-evaluate", where it has none).
  bool same_choice(const page_facts& a, const page_facts& b) const {
    return visit([&](const auto& p, auto) {
      if constexpr (requires { p.same_choice(a, b); })
        return bool(p.same_choice(a, b));
      else
        return false;
    });
  }
  /// The active policy's budget_exempt (its Recent pages where it has none).
  bool budget_exempt(const page_state& s, const page_facts& f) const {
    return visit(
        [&](const auto& p, auto i) { return tierkv::budget_exempt(p, read_state(s, i), f); });
  }
  /// The active policy's same_state_choice (false where it has none).
  bool same_state_choice(const page_state& a, const page_state& b) const {
    return visit([&](const auto& p, auto i) {
      if constexpr (requires { p.same_state_choice(read_state(a, i), read_state(b, i)); })
        return a.state.index() == b.state.index() &&
               bool(p.same_state_choice(read_state(a, i), read_state(b, i)));
      else
        return false;
    });
  }

 private:
  // f(active policy, its index as an integral_constant)
  template <class F>
  decltype(auto) visit(F&& f) const {
    return visit_at(std::forward<F>(f), std::make_index_sequence<sizeof...(Policies)>{});
  }
  template <class F, std::size_t I0, std::size_t... I>
  decltype(auto) visit_at(F&& f, std::index_sequence<I0, I...>) const {
    if constexpr (sizeof...(I) == 0) {
      return f(*std::get_if<I0>(&active_), std::integral_constant<std::size_t, I0>{});
    } else {
      if (active_.index() == I0)
        return f(*std::get_if<I0>(&active_), std::integral_constant<std::size_t, I0>{});
      return visit_at(std::forward<F>(f), std::index_sequence<I...>{});
    }
  }
  template <std::size_t I>
  static auto& state_for(page_state& s, std::integral_constant<std::size_t, I>) {
    if (s.state.index() != I) s.state.template emplace<I>();
    return *std::get_if<I>(&s.state);
  }
  template <std::size_t I>
  static auto read_state(const page_state& s, std::integral_constant<std::size_t, I>) {
    using state = std::variant_alternative_t<I, decltype(s.state)>;
    const state* p = std::get_if<I>(&s.state);
    return p ? *p : state{};
  }

  std::variant<Policies...> active_;
};

namespace detail {
template <class List>
struct any_policy_of;
template <class... P>
struct any_policy_of<policy_list<P...>> {
  using type = any_policy<P...>;
};
template <class... P>
std::string policy_names(policy_list<P...>) {
  std::string out;
  ((out += (out.empty() ? "" : ", "), out += P::name), ...);
  return out;
}
template <class Any, class... P>
result<Any> make_policy_in(policy_list<P...>, std::string_view name,
                           std::span<const policy_knob> knobs) {
  result<Any> out = status::make(errc::invalid_argument, "unknown tier policy \"", name,
                                 "\"; known policies: ", policy_names(policy_list<P...>{}));
  (void)((P::name == name ? (
                                out = [&]() -> result<Any> {
                                  result<P> p = make_named_policy<P>(knobs);
                                  if (!p) return p.error_status();
                                  return Any(std::move(p).value());
                                }(),
                                true)
                          : false) ||
         ...);
  return out;
}
}  // namespace detail

/// The run-time choice among tierkv's policies.
using registered_policy = typename detail::any_policy_of<builtin_policies>::type;
static_assert(check_tier_policy<registered_policy>());

/// "recency_anchor, ...": the registered policies' names.
inline std::string registered_policy_names() { return detail::policy_names(builtin_policies{}); }

/// The registered policy named `name` with its default knobs changed by `knobs`; an unknown
/// name or knob, a value its knob cannot hold or knobs its validate() refuses are
/// invalid_argument naming them.
inline result<registered_policy> make_policy(std::string_view name,
                                             std::span<const policy_knob> knobs = {}) {
  return detail::make_policy_in<registered_policy>(builtin_policies{}, name, knobs);
}

/// One line a registered policy, "name: knob=default, ...\n" (what bindings list).
inline std::string registered_policy_table() {
  std::string out;
  [&]<class... P>(policy_list<P...>) {
    ((out += std::string(P::name) + ": " + policy_knob_defaults<P>() + "\n"), ...);
  }(builtin_policies{});
  return out;
}

/// "name=default, ..." of the registered policy `name` ("" for an unknown name).
inline std::string registered_policy_knobs(std::string_view name) {
  std::string out;
  [&]<class... P>(policy_list<P...>) {
    ((P::name == name ? (out = policy_knob_defaults<P>(), 0) : 0), ...);
  }(builtin_policies{});
  return out;
}

}  // namespace tierkv
