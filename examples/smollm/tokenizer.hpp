// SPDX-License-Identifier: Apache-2.0
// Byte-level BPE (GPT-2 style) from a GGUF vocabulary and merge list, with the
// pre-tokenizer SmolLM2 uses (tokenizer.ggml.pre = "smollm"): every digit is its
// own piece, then the GPT-2 split ('s|'t|'re|'ve|'m|'ll|'d| ?L+| ?N+| ?[^sLN]+|s+(?!S)|s+).
// Character classes are exact for ASCII and approximate above it (common letter,
// digit and space blocks); the texts the tasks use are ASCII.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf.hpp"

namespace smollm {

namespace detail {

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xc0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += char(0xe0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  } else {
    out += char(0xf0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3f));
    out += char(0x80 | ((cp >> 6) & 0x3f));
    out += char(0x80 | (cp & 0x3f));
  }
}

// Decodes one code point at s[i]; invalid bytes decode as themselves (U+0080..U+00FF range
// is avoided: they are returned as 0xFFFD-like singletons with length 1).
inline std::uint32_t next_cp(const std::string& s, std::size_t i, std::size_t& len) {
  const auto c = std::uint8_t(s[i]);
  auto cont = [&](std::size_t k) {
    return i + k < s.size() && (std::uint8_t(s[i + k]) & 0xc0) == 0x80;
  };
  if (c < 0x80) {
    len = 1;
    return c;
  }
  if ((c & 0xe0) == 0xc0 && cont(1)) {
    len = 2;
    return (std::uint32_t(c & 0x1f) << 6) | (std::uint8_t(s[i + 1]) & 0x3fu);
  }
  if ((c & 0xf0) == 0xe0 && cont(1) && cont(2)) {
    len = 3;
    return (std::uint32_t(c & 0x0f) << 12) | (std::uint32_t(std::uint8_t(s[i + 1]) & 0x3f) << 6) |
           (std::uint8_t(s[i + 2]) & 0x3fu);
  }
  if ((c & 0xf8) == 0xf0 && cont(1) && cont(2) && cont(3)) {
    len = 4;
    return (std::uint32_t(c & 0x07) << 18) | (std::uint32_t(std::uint8_t(s[i + 1]) & 0x3f) << 12) |
           (std::uint32_t(std::uint8_t(s[i + 2]) & 0x3f) << 6) | (std::uint8_t(s[i + 3]) & 0x3fu);
  }
  len = 1;
  return 0xfffd;
}

inline bool is_space(std::uint32_t c) {
  return c == ' ' || (c >= 0x09 && c <= 0x0d) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}
inline bool is_digit(std::uint32_t c) {
  return (c >= '0' && c <= '9') || c == 0xb2 || c == 0xb3 || c == 0xb9 ||
         (c >= 0xbc && c <= 0xbe) || (c >= 0x660 && c <= 0x669) || (c >= 0x6f0 && c <= 0x6f9) ||
         (c >= 0x966 && c <= 0x96f) || (c >= 0xff10 && c <= 0xff19);
}
inline bool is_letter(std::uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  if (c == 0xaa || c == 0xb5 || c == 0xba) return true;
  if (c >= 0xc0 && c <= 0x24f) return c != 0xd7 && c != 0xf7;
  if (c >= 0x250 && c <= 0x2c1) return true;
  if (c >= 0x370 && c <= 0x3ff) return c != 0x37e && c != 0x387 && c != 0x375;
  if (c >= 0x400 && c <= 0x52f) return !(c >= 0x482 && c <= 0x489);
  if (c >= 0x531 && c <= 0x587) return true;
  if (c >= 0x5d0 && c <= 0x5ea) return true;
  if (c >= 0x620 && c <= 0x64a) return true;
  if (c >= 0x904 && c <= 0x939) return true;
  if (c >= 0x1e00 && c <= 0x1fff) return true;
  if (c >= 0x3040 && c <= 0x30ff) return true;
  if (c >= 0x3400 && c <= 0x9fff) return true;
  if (c >= 0xac00 && c <= 0xd7a3) return true;
  if (c >= 0xff21 && c <= 0xff3a) return true;
  if (c >= 0xff41 && c <= 0xff5a) return true;
  return false;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 upwards.
inline std::vector<std::string> byte_to_unicode_table() {
  std::vector<std::string> table(256);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    std::uint32_t cp = printable ? std::uint32_t(b) : std::uint32_t(256 + n++);
    append_utf8(table[std::size_t(b)], cp);
  }
  return table;
}

}  // namespace detail

class tokenizer {
 public:
  static tierkv::result<tokenizer> from_gguf(const gguf_file& f) {
    tokenizer t;
    const meta_value* tokens = f.find("tokenizer.ggml.tokens");
    const meta_value* merges = f.find("tokenizer.ggml.merges");
    const meta_value* types = f.find("tokenizer.ggml.token_type");
    if (!tokens || !std::holds_alternative<std::vector<std::string>>(*tokens) || !merges ||
        !std::holds_alternative<std::vector<std::string>>(*merges))
      return tierkv::status::make(tierkv::errc::invalid_argument,
                                  "tokenizer: the GGUF has no tokenizer.ggml.tokens/merges arrays");
    if (f.get_string("tokenizer.ggml.model") != "gpt2")
      return tierkv::status::make(tierkv::errc::invalid_argument, "tokenizer: model '",
                                  f.get_string("tokenizer.ggml.model"),
                                  "' is not byte-level BPE (gpt2)");
    t.vocab_ = std::get<std::vector<std::string>>(*tokens);
    for (std::size_t i = 0; i < t.vocab_.size(); ++i) t.ids_[t.vocab_[i]] = std::int32_t(i);
    const auto& m = std::get<std::vector<std::string>>(*merges);
    for (std::size_t r = 0; r < m.size(); ++r) t.ranks_[m[r]] = int(r);
    if (types && std::holds_alternative<std::vector<std::int64_t>>(*types)) {
      const auto& ty = std::get<std::vector<std::int64_t>>(*types);
      for (std::size_t i = 0; i < ty.size() && i < t.vocab_.size(); ++i)
        if (ty[i] == 3 || ty[i] == 4)
          t.specials_.push_back(std::int32_t(i));  // control, user-defined
    }
    // Longest special first, so "<|im_start|>" wins over any shorter prefix.
    std::sort(t.specials_.begin(), t.specials_.end(), [&](std::int32_t a, std::int32_t b) {
      return t.vocab_[std::size_t(a)].size() > t.vocab_[std::size_t(b)].size();
    });
    t.bos_ = std::int32_t(f.get_int("tokenizer.ggml.bos_token_id", -1));
    t.eos_ = std::int32_t(f.get_int("tokenizer.ggml.eos_token_id", -1));
    t.byte_map_ = detail::byte_to_unicode_table();
    for (int b = 0; b < 256; ++b) t.unicode_to_byte_[t.byte_map_[std::size_t(b)]] = std::uint8_t(b);
    return t;
  }

  std::int32_t eos() const { return eos_; }
  std::int32_t bos() const { return bos_; }
  std::size_t vocab_size() const { return vocab_.size(); }
  std::int32_t id_of(const std::string& piece) const {
    auto it = ids_.find(piece);
    return it == ids_.end() ? -1 : it->second;
  }

  // Text -> ids. With parse_special, control-token strings ("<|im_start|>") become their ids.
  std::vector<std::int32_t> encode(const std::string& text, bool parse_special = true) const {
    std::vector<std::int32_t> out;
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t best_pos = text.size();
      std::int32_t best_id = -1;
      if (parse_special) {
        for (std::int32_t id : specials_) {
          const std::string& s = vocab_[std::size_t(id)];
          const std::size_t p = text.find(s, start);
          if (p < best_pos) {
            best_pos = p;
            best_id = id;
          }
        }
      }
      encode_plain(text.substr(start, best_pos - start), out);
      if (best_id < 0) break;
      out.push_back(best_id);
      start = best_pos + vocab_[std::size_t(best_id)].size();
    }
    return out;
  }

  // Ids -> text (bytes), special tokens rendered as their strings.
  std::string decode(const std::vector<std::int32_t>& ids) const {
    std::string out;
    for (std::int32_t id : ids) out += piece(id);
    return out;
  }
  std::string piece(std::int32_t id) const {
    if (id < 0 || std::size_t(id) >= vocab_.size()) return "";
    const std::string& s = vocab_[std::size_t(id)];
    if (std::find(specials_.begin(), specials_.end(), id) != specials_.end()) return s;
    std::string out;
    for (std::size_t i = 0; i < s.size();) {
      std::size_t len = 1;
      detail::next_cp(s, i, len);
      auto it = unicode_to_byte_.find(s.substr(i, len));
      if (it != unicode_to_byte_.end())
        out += char(it->second);
      else
        out += s.substr(i, len);
      i += len;
    }
    return out;
  }

  // The pre-tokenizer's pieces (exposed for tests).
  static std::vector<std::string> pre_split(const std::string& text) {
    std::vector<std::string> out;
    // Stage 1: each digit alone; text between digits is one piece.
    std::vector<std::string> stage1;
    std::string cur;
    for (std::size_t i = 0; i < text.size();) {
      std::size_t len = 1;
      const std::uint32_t c = detail::next_cp(text, i, len);
      if (detail::is_digit(c)) {
        if (!cur.empty()) stage1.push_back(std::move(cur));
        cur.clear();
        stage1.push_back(text.substr(i, len));
      } else {
        cur += text.substr(i, len);
      }
      i += len;
    }
    if (!cur.empty()) stage1.push_back(std::move(cur));
    for (const auto& p : stage1) gpt2_split(p, out);
    return out;
  }

 private:
  static void gpt2_split(const std::string& s, std::vector<std::string>& out) {
    std::vector<std::uint32_t> cps;
    std::vector<std::size_t> at;  // byte offset of each code point, plus the end
    for (std::size_t i = 0; i < s.size();) {
      std::size_t len = 1;
      cps.push_back(detail::next_cp(s, i, len));
      at.push_back(i);
      i += len;
    }
    at.push_back(s.size());
    const std::size_t n = cps.size();
    auto cls = [&](std::size_t k) {  // 0 letter, 1 digit, 2 space, 3 other
      const std::uint32_t c = cps[k];
      return detail::is_letter(c) ? 0 : detail::is_digit(c) ? 1 : detail::is_space(c) ? 2 : 3;
    };
    std::size_t i = 0;
    while (i < n) {
      std::size_t j = i;
      const std::uint32_t c = cps[i];
      if (c == '\'' && i + 1 < n) {
        const std::uint32_t a = cps[i + 1];
        const std::uint32_t b = i + 2 < n ? cps[i + 2] : 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd')
          j = i + 2;
        else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
          j = i + 3;
      }
      if (j == i) {
        std::size_t k = i;
        if (c == ' ' && i + 1 < n && cls(i + 1) != 2) k = i + 1;  // ' ?' prefix
        const int kc = cls(k);
        if (kc != 2) {
          j = k;
          while (j < n && cls(j) == kc) ++j;
        } else {
          // Whitespace: \s+(?!\S) keeps the last space for the next word when one follows.
          j = i;
          while (j < n && cls(j) == 2) ++j;
          if (j < n && j - i > 1) --j;
        }
      }
      out.push_back(s.substr(at[i], at[j] - at[i]));
      i = j;
    }
  }

  void encode_plain(const std::string& text, std::vector<std::int32_t>& out) const {
    if (text.empty()) return;
    for (const std::string& piece_text : pre_split(text)) {
      auto cached = cache_.find(piece_text);
      if (cached != cache_.end()) {
        out.insert(out.end(), cached->second.begin(), cached->second.end());
        continue;
      }
      std::vector<std::string> sym;
      for (char ch : piece_text) sym.push_back(byte_map_[std::uint8_t(ch)]);
      // Merge the adjacent pair of lowest rank (leftmost on ties) until none applies.
      while (sym.size() > 1) {
        int best = std::numeric_limits<int>::max();
        std::size_t at = 0;
        for (std::size_t k = 0; k + 1 < sym.size(); ++k) {
          auto it = ranks_.find(sym[k] + " " + sym[k + 1]);
          if (it != ranks_.end() && it->second < best) {
            best = it->second;
            at = k;
          }
        }
        if (best == std::numeric_limits<int>::max()) break;
        sym[at] += sym[at + 1];
        sym.erase(sym.begin() + std::ptrdiff_t(at) + 1);
      }
      std::vector<std::int32_t> ids;
      for (const auto& s : sym) {
        const std::int32_t id = id_of(s);
        if (id >= 0) {
          ids.push_back(id);
        } else {  // unknown symbol: fall back to its bytes' tokens
          for (std::size_t b = 0; b < s.size();) {
            std::size_t len = 1;
            detail::next_cp(s, b, len);
            const std::int32_t bid = id_of(s.substr(b, len));
            if (bid >= 0) ids.push_back(bid);
            b += len;
          }
        }
      }
      out.insert(out.end(), ids.begin(), ids.end());
      cache_.emplace(piece_text, std::move(ids));
    }
  }

  std::vector<std::string> vocab_;
  std::unordered_map<std::string, std::int32_t> ids_;
  std::unordered_map<std::string, int> ranks_;
  std::vector<std::int32_t> specials_;
  std::vector<std::string> byte_map_;
  std::unordered_map<std::string, std::uint8_t> unicode_to_byte_;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
  std::int32_t bos_ = -1, eos_ = -1;
};

// SmolLM2's chat template for one user turn (with its default system line), ending in
// the assistant header so generation continues as the assistant.
inline std::string chat_prompt(
    const std::string& user,
    const std::string& system =
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face") {
  return "<|im_start|>system\n" + system + "<|im_end|>\n<|im_start|>user\n" + user +
         "<|im_end|>\n<|im_start|>assistant\n";
}

}  // namespace smollm
