// SPDX-License-Identifier: Apache-2.0
// Text without iostreams: status messages, the memory report and the Python refusals write
// numbers with std::to_chars. The bytes are what a default stream writes, under any global
// locale, with no locale facet: every torch C++ extension built on the H100 image (g++ 13.3,
// torch 2.11) crashes in ostream's num_put on the first number it streams, even a one-line
// load_inline (bench/results/tests/gpu-knob-segfault-2026-12-07.txt), so nothing a Python
// extension calls streams a number.
#pragma once

#include <charconv>
#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace tierkv {

/// An unsigned integer written in hexadecimal (lower case, no prefix).
struct hex {
  std::uint64_t value = 0;  ///< the number
};

/// A floating-point number written with a fixed number of decimals (printf's "%.*f").
struct fixed {
  double value = 0;  ///< the number
  int digits = 3;    ///< decimals after the point
};

namespace detail {

template <class T>
inline constexpr bool is_text_integer_v =
    std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char> &&
    !std::is_same_v<T, signed char> && !std::is_same_v<T, unsigned char> &&
    !std::is_same_v<T, char8_t>;

// A type with a to_string found by argument-dependent lookup (tier_role, errc, the ids).
template <class T>
concept has_adl_to_string = requires(const T& v) {
  { to_string(v) } -> std::convertible_to<std::string_view>;
};

}  // namespace detail

/// Appends one part as operator<< on a default stream writes it: integers in decimal,
/// floating point as "%g" with 6 digits, bool as 1 / 0, characters as themselves, strings,
/// pointers as 0x... (0 when null);
/// hex and fixed as their names say; a type of tierkv's own by its to_string.
template <class T>
void append_text(std::string& out, const T& part) {
  using U = std::remove_cvref_t<T>;
  static_assert(!std::is_function_v<U>,
                "tierkv::append_text: no stream manipulators (std::hex ...); write tierkv::hex{n}");
  if constexpr (std::is_same_v<U, hex>) {
    char buf[24];
    out.append(buf, std::to_chars(buf, buf + sizeof(buf), part.value, 16).ptr);
  } else if constexpr (std::is_same_v<U, fixed>) {
    char buf[400];  // DBL_MAX has 309 integer digits
    const int digits = part.digits < 0 ? 0 : (part.digits > 60 ? 60 : part.digits);
    const auto r =
        std::to_chars(buf, buf + sizeof(buf), part.value, std::chars_format::fixed, digits);
    out.append(buf, r.ptr);
  } else if constexpr (std::is_same_v<U, bool>) {
    out += part ? '1' : '0';
  } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> ||
                       std::is_same_v<U, unsigned char>) {
    out += char(part);
  } else if constexpr (detail::is_text_integer_v<U>) {
    char buf[24];
    out.append(buf, std::to_chars(buf, buf + sizeof(buf), part).ptr);
  } else if constexpr (std::is_floating_point_v<U>) {
    char buf[64];
    out.append(buf, std::to_chars(buf, buf + sizeof(buf), part, std::chars_format::general, 6).ptr);
  } else if constexpr (std::is_null_pointer_v<U>) {
    out += '0';
  } else if constexpr (std::is_convertible_v<const U&, std::string_view>) {
    if constexpr (std::is_pointer_v<U>) {  // a null C string: named, never dereferenced
      if (part == nullptr) {
        out += "(null)";
        return;
      }
    }
    out.append(std::string_view(part));
  } else if constexpr (std::is_pointer_v<U>) {  // as a stream writes it: 0x..., or 0
    if (part == nullptr) {
      out += '0';
    } else {
      char buf[24];
      out += "0x";
      out.append(
          buf,
          std::to_chars(buf, buf + sizeof(buf), reinterpret_cast<std::uintptr_t>(part), 16).ptr);
    }
  } else {
    static_assert(detail::has_adl_to_string<U>,
                  "tierkv::append_text: a number, a string, hex, fixed or a type with to_string");
    out.append(std::string_view(to_string(part)));
  }
}

/// The parts in one string, each written as append_text writes it.
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append_text(out, parts), ...);
  return out;
}

}  // namespace tierkv
