// SPDX-License-Identifier: Apache-2.0
// A GGUF (v2/v3) reader: metadata, tensor infos, and dequantization of the
// block formats a small Llama file uses (F32, F16, BF16, Q4_0, Q4_1, Q8_0) into float.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "tierkv/core/status.hpp"

namespace smollm {

// ggml tensor types this reader dequantizes (values as in ggml.h).
enum class ggml_type : std::uint32_t { f32 = 0, f16 = 1, q4_0 = 2, q4_1 = 3, q8_0 = 8, bf16 = 30 };

inline const char* type_name(std::uint32_t t) {
  switch (t) {
    case 0:
      return "F32";
    case 1:
      return "F16";
    case 2:
      return "Q4_0";
    case 3:
      return "Q4_1";
    case 8:
      return "Q8_0";
    case 30:
      return "BF16";
    default:
      return "unsupported";
  }
}

// IEEE half -> float, exact for every bit pattern (subnormals, Inf, NaN).
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (std::uint32_t(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Bytes of one block and elements per block of a type; 0 when unsupported.
struct block_shape {
  std::size_t bytes = 0;
  std::size_t elems = 0;
};
inline block_shape block_of(std::uint32_t type) {
  switch (type) {
    case 0:
      return {4, 1};
    case 1:
      return {2, 1};
    case 30:
      return {2, 1};
    case 2:
      return {18, 32};  // f16 d, 16 bytes of nibbles
    case 3:
      return {20, 32};  // f16 d, f16 m, 16 bytes of nibbles
    case 8:
      return {34, 32};  // f16 d, 32 int8
    default:
      return {0, 0};
  }
}

// Dequantizes n elements (a multiple of the block size) of `type` from src into dst.
// Q4 layouts (ggml): element j < 16 is the low nibble of byte j, element j + 16 the high one.
inline tierkv::status dequantize(std::uint32_t type, const std::uint8_t* src, std::size_t n,
                                 float* dst) {
  const block_shape b = block_of(type);
  if (b.bytes == 0)
    return tierkv::status::make(tierkv::errc::invalid_argument, "dequantize: ggml type ", type,
                                " is not supported (F32, F16, BF16, Q4_0, Q4_1, Q8_0 are)");
  if (n % b.elems != 0)
    return tierkv::status::make(tierkv::errc::invalid_argument, "dequantize: n = ", n,
                                " is not a multiple of the block size ", b.elems);
  auto rd16 = [](const std::uint8_t* p) {
    std::uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  };
  switch (type) {
    case 0:
      std::memcpy(dst, src, n * 4);
      break;
    case 1:
      for (std::size_t i = 0; i < n; ++i) dst[i] = half_to_float(rd16(src + 2 * i));
      break;
    case 30:
      for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(rd16(src + 2 * i));
      break;
    case 2:
      for (std::size_t blk = 0; blk < n / 32; ++blk, src += 18, dst += 32) {
        const float d = half_to_float(rd16(src));
        for (int j = 0; j < 16; ++j) {
          dst[j] = float(int(src[2 + j] & 0x0f) - 8) * d;
          dst[j + 16] = float(int(src[2 + j] >> 4) - 8) * d;
        }
      }
      break;
    case 3:
      for (std::size_t blk = 0; blk < n / 32; ++blk, src += 20, dst += 32) {
        const float d = half_to_float(rd16(src));
        const float m = half_to_float(rd16(src + 2));
        for (int j = 0; j < 16; ++j) {
          dst[j] = float(src[4 + j] & 0x0f) * d + m;
          dst[j + 16] = float(src[4 + j] >> 4) * d + m;
        }
      }
      break;
    case 8:
      for (std::size_t blk = 0; blk < n / 32; ++blk, src += 34, dst += 32) {
        const float d = half_to_float(rd16(src));
        for (int j = 0; j < 32; ++j) dst[j] = float(std::int8_t(src[2 + j])) * d;
      }
      break;
    default:
      break;
  }
  return tierkv::status::ok();
}

struct tensor_info {
  std::string name;
  std::vector<std::uint64_t> dims;  // ggml order: dims[0] is the contiguous (row) length
  std::uint32_t type = 0;
  std::uint64_t offset = 0;  // from the start of the data section

  std::uint64_t elements() const {
    std::uint64_t n = 1;
    for (auto d : dims) n *= d;
    return n;
  }
};

using meta_value = std::variant<std::int64_t, double, bool, std::string, std::vector<std::string>,
                                std::vector<std::int64_t>, std::vector<double>>;

class gguf_file {
 public:
  static tierkv::result<gguf_file> open(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in)
      return tierkv::status::make(tierkv::errc::invalid_argument, "gguf: cannot open ", path);
    in.seekg(0, std::ios::end);
    const auto size = std::size_t(in.tellg());
    in.seekg(0);
    gguf_file f;
    f.bytes_.resize(size);
    in.read(reinterpret_cast<char*>(f.bytes_.data()), std::streamsize(size));
    if (!in) return tierkv::status::make(tierkv::errc::corrupt_data, "gguf: short read of ", path);
    if (auto s = f.parse(); !s) return s;
    return f;
  }

  // Parses an in-memory image (tests build small files by hand).
  static tierkv::result<gguf_file> from_bytes(std::vector<std::uint8_t> bytes) {
    gguf_file f;
    f.bytes_ = std::move(bytes);
    if (auto s = f.parse(); !s) return s;
    return f;
  }

  std::uint32_t version() const { return version_; }
  const std::map<std::string, meta_value>& metadata() const { return meta_; }
  const std::vector<tensor_info>& tensors() const { return tensors_; }

  const meta_value* find(const std::string& key) const {
    auto it = meta_.find(key);
    return it == meta_.end() ? nullptr : &it->second;
  }
  std::int64_t get_int(const std::string& key, std::int64_t fallback) const {
    const meta_value* v = find(key);
    if (v && std::holds_alternative<std::int64_t>(*v)) return std::get<std::int64_t>(*v);
    return fallback;
  }
  double get_float(const std::string& key, double fallback) const {
    const meta_value* v = find(key);
    if (v && std::holds_alternative<double>(*v)) return std::get<double>(*v);
    if (v && std::holds_alternative<std::int64_t>(*v)) return double(std::get<std::int64_t>(*v));
    return fallback;
  }
  std::string get_string(const std::string& key, const std::string& fallback = "") const {
    const meta_value* v = find(key);
    if (v && std::holds_alternative<std::string>(*v)) return std::get<std::string>(*v);
    return fallback;
  }

  const tensor_info* tensor(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

  // The tensor dequantized into floats (row-major, dims[0] contiguous).
  tierkv::result<std::vector<float>> load(const std::string& name) const {
    const tensor_info* t = tensor(name);
    if (!t)
      return tierkv::status::make(tierkv::errc::invalid_argument, "gguf: no tensor named ", name);
    const block_shape b = block_of(t->type);
    if (b.bytes == 0)
      return tierkv::status::make(tierkv::errc::invalid_argument, "gguf: tensor ", name,
                                  " has type ", t->type, ", which is not supported");
    const std::uint64_t n = t->elements();
    const std::uint64_t nbytes = n / b.elems * b.bytes;
    if (data_offset_ + t->offset + nbytes > bytes_.size())
      return tierkv::status::make(tierkv::errc::corrupt_data, "gguf: tensor ", name,
                                  " ends at byte ", data_offset_ + t->offset + nbytes,
                                  " beyond the file size ", bytes_.size());
    std::vector<float> out(n);
    if (auto s = dequantize(t->type, bytes_.data() + data_offset_ + t->offset, n, out.data()); !s)
      return s;
    return out;
  }

 private:
  tierkv::status fail(const char* what) const {
    return tierkv::status::make(tierkv::errc::corrupt_data, "gguf: ", what, " at byte ", pos_,
                                " of ", bytes_.size());
  }
  bool take(void* out, std::size_t n) {
    if (pos_ + n > bytes_.size()) return false;
    std::memcpy(out, bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  template <class T>
  bool take(T& v) {
    return take(&v, sizeof(T));
  }
  bool take_string(std::string& s) {
    std::uint64_t n = 0;
    if (!take(n) || n > bytes_.size() - pos_) return false;
    s.assign(reinterpret_cast<const char*>(bytes_.data() + pos_), std::size_t(n));
    pos_ += std::size_t(n);
    return true;
  }
  bool take_scalar(std::uint32_t type, meta_value& v) {
    switch (type) {
      case 0: {
        std::uint8_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 1: {
        std::int8_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 2: {
        std::uint16_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 3: {
        std::int16_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 4: {
        std::uint32_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 5: {
        std::int32_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 6: {
        float x;
        if (!take(x)) return false;
        v = double(x);
        return true;
      }
      case 7: {
        std::uint8_t x;
        if (!take(x)) return false;
        v = x != 0;
        return true;
      }
      case 8: {
        std::string s;
        if (!take_string(s)) return false;
        v = std::move(s);
        return true;
      }
      case 10: {
        std::uint64_t x;
        if (!take(x)) return false;
        v = std::int64_t(x);
        return true;
      }
      case 11: {
        std::int64_t x;
        if (!take(x)) return false;
        v = x;
        return true;
      }
      case 12: {
        double x;
        if (!take(x)) return false;
        v = x;
        return true;
      }
      default:
        return false;
    }
  }
  bool take_value(std::uint32_t type, meta_value& v) {
    if (type != 9) return take_scalar(type, v);
    std::uint32_t item = 0;
    std::uint64_t n = 0;
    if (!take(item) || !take(n) || item == 9 || n > bytes_.size()) return false;
    if (item == 8) {
      std::vector<std::string> arr(n);
      for (auto& s : arr)
        if (!take_string(s)) return false;
      v = std::move(arr);
    } else if (item == 6 || item == 12) {
      std::vector<double> arr(n);
      for (auto& x : arr) {
        meta_value e;
        if (!take_scalar(item, e)) return false;
        x = std::get<double>(e);
      }
      v = std::move(arr);
    } else {
      std::vector<std::int64_t> arr(n);
      for (auto& x : arr) {
        meta_value e;
        if (!take_scalar(item, e)) return false;
        x = std::holds_alternative<bool>(e) ? std::int64_t(std::get<bool>(e))
                                            : std::get<std::int64_t>(e);
      }
      v = std::move(arr);
    }
    return true;
  }

  tierkv::status parse() {
    char magic[4];
    if (!take(magic, 4) || std::memcmp(magic, "GGUF", 4) != 0) return fail("missing GGUF magic");
    if (!take(version_)) return fail("truncated header");
    if (version_ < 2 || version_ > 3)
      return tierkv::status::make(tierkv::errc::invalid_argument, "gguf: version ", version_,
                                  " is not supported (2 and 3 are)");
    std::uint64_t n_tensors = 0, n_kv = 0;
    if (!take(n_tensors) || !take(n_kv)) return fail("truncated header");
    if (n_tensors > bytes_.size() || n_kv > bytes_.size()) return fail("implausible counts");
    for (std::uint64_t i = 0; i < n_kv; ++i) {
      std::string key;
      std::uint32_t type = 0;
      meta_value v;
      if (!take_string(key) || !take(type) || !take_value(type, v))
        return fail("bad metadata entry");
      meta_[key] = std::move(v);
    }
    for (std::uint64_t i = 0; i < n_tensors; ++i) {
      tensor_info t;
      std::uint32_t nd = 0;
      if (!take_string(t.name) || !take(nd) || nd > 4) return fail("bad tensor info");
      t.dims.resize(nd);
      for (auto& d : t.dims)
        if (!take(d)) return fail("bad tensor dims");
      if (!take(t.type) || !take(t.offset)) return fail("bad tensor info");
      const block_shape b = block_of(t.type);
      if (b.elems != 0 && (t.dims.empty() || t.dims[0] % b.elems != 0))
        return fail("tensor row not a multiple of its block size");
      tensors_.push_back(std::move(t));
    }
    const auto align = std::size_t(get_int("general.alignment", 32));
    if (align == 0) return fail("zero alignment");
    data_offset_ = (pos_ + align - 1) / align * align;
    if (data_offset_ > bytes_.size()) return fail("data section beyond the file");
    return tierkv::status::ok();
  }

  std::vector<std::uint8_t> bytes_;
  std::size_t pos_ = 0;
  std::size_t data_offset_ = 0;
  std::uint32_t version_ = 0;
  std::map<std::string, meta_value> meta_;
  std::vector<tensor_info> tensors_;
};

}  // namespace smollm
