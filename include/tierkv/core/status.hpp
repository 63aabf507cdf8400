// SPDX-License-Identifier: Apache-2.0
// Error reporting: a code usable in device code, and a host status whose
// message names the offending value and the limit it broke.
#pragma once

#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

#include "tierkv/core/config.hpp"
#include "tierkv/core/text.hpp"

namespace tierkv {

/// Device code reports with a bare code; the host wraps it into a status with a message.
enum class errc : std::uint8_t {
  ok = 0,              ///< success
  invalid_argument,    ///< a value outside its documented domain
  out_of_range,        ///< an index or id beyond a limit
  capacity_exhausted,  ///< a pool or buffer is full; nothing was changed
  stale_id,            ///< a page id whose slot was freed (or reused) since
  double_release,      ///< a reference dropped more often than taken
  non_finite_input,    ///< NaN or Inf in data to encode or in an attention query
  not_writable,        ///< a write to a sealed or shared page
  geometry_mismatch,   ///< buffers or caches of different shapes
  corrupt_data,        ///< a checksum or format check failed
  cuda_error,          ///< a CUDA runtime call failed
  injected_fault,      ///< a fault the test allocator or a test hook injected
};

/// The code's name ("capacity_exhausted").
constexpr std::string_view to_string(errc c) noexcept {
  switch (c) {
    case errc::ok:
      return "ok";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::out_of_range:
      return "out_of_range";
    case errc::capacity_exhausted:
      return "capacity_exhausted";
    case errc::stale_id:
      return "stale_id";
    case errc::double_release:
      return "double_release";
    case errc::non_finite_input:
      return "non_finite_input";
    case errc::not_writable:
      return "not_writable";
    case errc::geometry_mismatch:
      return "geometry_mismatch";
    case errc::corrupt_data:
      return "corrupt_data";
    case errc::cuda_error:
      return "cuda_error";
    case errc::injected_fault:
      return "injected_fault";
  }
  return "unknown";
}

// [[nodiscard]] on the types: an ignored status is a bug. nvcc (EDG) also applies a class's
// nodiscard to the status& that assignment returns, so CUDA translation units go without it;
// the host compilers still check every caller.
#if defined(__CUDACC__)
#define TIERKV_NODISCARD_TYPE
#else
#define TIERKV_NODISCARD_TYPE [[nodiscard]]
#endif

/// Host-side status: a code and a human-readable message. Cheap when ok (no allocation).
class TIERKV_NODISCARD_TYPE status {
 public:
  status() = default;
  /// A status with a code and a message (ok when code is errc::ok).
  status(errc code, std::string message) : code_(code), message_(std::move(message)) {}

  /// The ok status (no allocation).
  static status ok() { return {}; }

  /// True when the code is errc::ok.
  bool is_ok() const noexcept { return code_ == errc::ok; }
  /// Same as is_ok(): `if (auto st = f(); !st) return st;`.
  explicit operator bool() const noexcept { return is_ok(); }
  /// The code; errc::ok on success.
  errc code() const noexcept { return code_; }
  /// What failed and why, naming the argument, its value and the limit; empty when ok.
  const std::string& message() const noexcept { return message_; }

  /// "what = value is out of range [0, limit)"
  template <class V, class L>
  static status out_of_range(std::string_view what, const V& value, const L& limit) {
    return {errc::out_of_range, format(what, " = ", value, " is out of range [0, ", limit, ")")};
  }
  /// "what = value exceeds the limit limit"
  template <class V, class L>
  static status exceeds(errc code, std::string_view what, const V& value, const L& limit) {
    return {code, format(what, " = ", value, " exceeds the limit ", limit)};
  }
  /// A status whose message streams parts together (as with operator<<).
  template <class... Parts>
  static status make(errc code, const Parts&... parts) {
    return {code, format(parts...)};
  }

  /// Throws tierkv::error unless ok; for callers that prefer exceptions.
  void throw_if_error() const;

  /// The parts in one string, as operator<< writes them (numbers as the default stream
  /// formats them: integers in decimal, floating point in %g with 6 digits; core/text.hpp).
  template <class... Parts>
  static std::string format(const Parts&... parts) {
    return concat(parts...);
  }

 private:
  errc code_ = errc::ok;
  std::string message_;
};

/// Writes the code's name.
inline std::ostream& operator<<(std::ostream& out, errc c) { return out << to_string(c); }
/// "code: message" ("ok" alone when ok).
inline std::string to_string(const status& s) {
  std::string out(to_string(s.code()));
  if (!s.message().empty()) out += concat(": ", s.message());
  return out;
}
/// Writes to_string(s).
inline std::ostream& operator<<(std::ostream& out, const status& s) { return out << to_string(s); }

/// The exception thrown by status::throw_if_error() and result::value() on failure; carries the
/// status.
class error : public std::runtime_error {
 public:
  /// Wraps s; what() is "code: message".
  explicit error(status s)
      : std::runtime_error(std::string(to_string(s.code())) + ": " + s.message()),
        status_(std::move(s)) {}
  /// The status that was thrown.
  const status& get_status() const noexcept { return status_; }
  /// The status's code.
  errc code() const noexcept { return status_.code(); }

 private:
  status status_;
};

inline void status::throw_if_error() const {
  if (!is_ok()) throw error(*this);
}

/// A value or the status that explains why there is none.
template <class T>
class TIERKV_NODISCARD_TYPE result {
  static_assert(!std::is_same_v<T, status>, "result<status> is meaningless; return status");

 public:
  /// Holds a value.
  result(T value) : data_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  /// Holds a failure; an ok status without a value becomes invalid_argument.
  result(status s) : data_(std::move(s)) {  // NOLINT(google-explicit-constructor)
    if (std::get<status>(data_).is_ok())
      data_ =
          status(errc::invalid_argument, "result constructed from an ok status without a value");
  }

  /// True when a value is held.
  bool has_value() const noexcept { return std::holds_alternative<T>(data_); }
  /// Same as has_value().
  explicit operator bool() const noexcept { return has_value(); }

  /// The value; throws tierkv::error with the status when there is none.
  T& value() & {
    if (!has_value()) throw error(std::get<status>(data_));
    return std::get<T>(data_);
  }
  /// The value; throws tierkv::error with the status when there is none.
  const T& value() const& {
    if (!has_value()) throw error(std::get<status>(data_));
    return std::get<T>(data_);
  }
  /// The value, moved out; throws tierkv::error with the status when there is none.
  T&& value() && {
    if (!has_value()) throw error(std::get<status>(data_));
    return std::get<T>(std::move(data_));
  }
  /// value()
  T& operator*() & { return value(); }
  /// value()
  const T& operator*() const& { return value(); }
  /// value(), moved out
  T&& operator*() && { return std::move(*this).value(); }
  /// &value()
  T* operator->() { return &value(); }
  /// &value()
  const T* operator->() const { return &value(); }

  /// The failure; an ok status when a value is held.
  status error_status() const { return has_value() ? status::ok() : std::get<status>(data_); }
  /// errc::ok when a value is held, else the failure's code.
  errc code() const noexcept { return has_value() ? errc::ok : std::get<status>(data_).code(); }

 private:
  std::variant<T, status> data_;
};

}  // namespace tierkv
