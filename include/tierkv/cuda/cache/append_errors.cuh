// SPDX-License-Identifier: Apache-2.0
// The appends' device error record of a cuda::tiered_cache step, read as a status naming the
// sequence, layer, position, KV head and role, and the sequences it poisons: one that was
// appended non-finite K/V is refused by every later operation until it is released.
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>

#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"

namespace tierkv::cuda::detail {

// errc, then layer, token, kv head, role (append_inputs::error, then error_at).
inline constexpr int append_error_ints = 5;

// Sequences whose appended K/V held NaN / Inf (append_error_where), by id.
class poisoned_sequences {
 public:
  // A step's append error record as a status naming the sequence, layer, position, head and
  // role; the sequence is poisoned (refused until released) when `poison` and it is still live.
  template <class Storage>
  status append_error_where(const std::int32_t* rec, std::span<const seq_id> batch,
                            std::span<const std::int32_t> new_tokens,
                            std::span<const std::int64_t> first_pos, bool poison,
                            const Storage& storage) {
    const errc code = static_cast<errc>(rec[0]);
    std::int64_t n = rec[2];
    std::size_t b = 0;
    while (b < new_tokens.size() && n >= new_tokens[b]) n -= new_tokens[b++];
    if (b >= batch.size())  // a token beyond the step's: a bad slot (out_of_range)
      return status::make(code, "append: layer ", rec[1], ", token ", rec[2],
                          " of the step: ", to_string(code));
    const std::int64_t pos = first_pos[b] + n;
    if (poison && code == errc::non_finite_input && storage.length(batch[b]))
      poisoned_.emplace(batch[b].value, poisoned_at{rec[1], pos});
    return status::make(code, "append: ", batch[b], " position ", pos, ", layer ", rec[1],
                        ", KV head ", rec[3], ", ", rec[4] == 0 ? "key" : "value", ": ",
                        to_string(code),
                        code == errc::non_finite_input
                            ? " (the K/V given held NaN or Inf; its attention outputs are NaN; "
                              "the sequence is refused until released)"
                            : "");
  }
  // A sequence holding non-finite K/V is refused by `op`.
  status refuse(seq_id s, const char* op) const {
    const auto it = poisoned_.find(s.value);
    if (it == poisoned_.end()) return {};
    return status::make(errc::non_finite_input, op, ": ", s,
                        " holds non-finite K/V appended at position ", it->second.position,
                        ", layer ", it->second.layer, "; release it");
  }
  // s was released: its id may come back for a new sequence.
  void forget(seq_id s) { poisoned_.erase(s.value); }

 private:
  struct poisoned_at {
    int layer = 0;
    std::int64_t position = 0;
  };
  std::unordered_map<std::uint32_t, poisoned_at> poisoned_;
};

}  // namespace tierkv::cuda::detail
