// SPDX-License-Identifier: Apache-2.0
// Page export/import: a run of a sequence's logical pages (all layers) as one
// self-describing, versioned, checksummed byte buffer, and its verified import into
// another storage of the same geometry and tier list (another host, or the host side
// of another GPU). This is what disaggregated prefill/decode and offload connectors
// move: compressed pages, never dense tensors. Byte format: docs/multigpu.md.
//
//   auto buf = tierkv::export_pages(src, seq).value();          // std::vector<uint8_t>
//   ... send buf (NCCL, RDMA, file) ...
//   auto dst_seq = tierkv::import_pages(dst, buf).value();      // verified, all or nothing
//
// Storages over device pools (cuda::tiered_cache::export_pages / import_pages) write and read
// the same buffers through the same code: only the page-byte copies differ (detail::
// write_transfer's page source, detail::import_verified's page writer).
#pragma once

#include "tierkv/core/config.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/page_layout.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"
#include "tierkv/paging/paged_storage.hpp"

namespace tierkv {

static_assert(std::endian::native == std::endian::little,
              "page_transfer: the buffer format is little-endian and is written with memcpy");

/// The first 8 bytes of every page-transfer buffer.
inline constexpr std::array<char, 8> page_transfer_magic = {'T', 'K', 'V', 'P', 'A', 'G', 'E', 'S'};
/// 2: TQ3 levels moved onto the int8 grid (codec/tq3.hpp), so a version-1 buffer's TQ3 codes
/// and alpha would decode to other values: refused rather than read.
inline constexpr std::uint32_t page_transfer_version = 2;
inline constexpr std::size_t page_transfer_header_bytes = 80;     ///< bytes of the fixed header
inline constexpr std::size_t page_transfer_tier_entry_bytes = 8;  ///< bytes per tier entry
inline constexpr std::size_t page_transfer_record_bytes = 16;     ///< bytes per page record
inline constexpr std::size_t page_transfer_checksum_bytes = 8;  ///< bytes of the trailing checksum

/// A contiguous slice of KV heads [begin, begin + count); count < 0 means "to the end".
struct head_slice {
  int begin = 0;   ///< first KV head
  int count = -1;  ///< KV heads (< 0: to the end)
};

/// What a buffer says about itself (parsed by inspect_transfer; everything verified).
struct transfer_tier_info {
  storage_format key_format{};    ///< the tier's key format tag
  storage_format value_format{};  ///< the tier's value format tag
  std::uint32_t page_bytes = 0;   ///< bytes of one page (of the buffer's head slice)
};
/// What a page-transfer buffer holds (inspect_transfer).
struct transfer_info {
  std::uint32_t version = 0;      ///< page_transfer_version it was written with
  std::uint64_t total_bytes = 0;  ///< bytes of the whole buffer
  geometry_desc geometry{};       ///< kv_heads = heads in the buffer (the slice)
  std::uint32_t head_begin =
      0;  ///< global index of the slice's first KV head (source head_base + slice begin)
  std::uint32_t source_kv_heads = 0;  ///< KV heads of the source storage
  std::uint32_t num_layers = 0;       ///< layers
  std::uint32_t num_tiers = 0;        ///< tiers of the source
  std::uint64_t codec_seed = 0;       ///< the source's codec seed
  std::uint32_t first_logical = 0;    ///< the run's first logical page in the source sequence
  std::uint32_t logical_pages = 0;    ///< logical pages in the run
  std::uint64_t tokens = 0;           ///< tokens the run holds (sum of the logical pages' fills)
  std::vector<transfer_tier_info> tiers;      ///< one entry per tier
  std::vector<std::uint64_t> pages_per_tier;  ///< records (logical page x layer) per tier
  std::uint32_t last_fill = 0;                ///< fill of the run's last logical page
  std::uint64_t checksum = 0;                 ///< the checksum the buffer carries (verified)
};

namespace detail {

/// FNV-1a-64 over little-endian 8-byte words (then the remaining bytes one by one),
/// finished with the splitmix64 finalizer. Word-wise so checking a GiB-sized transfer
/// costs one multiply per 8 bytes; each step is a bijection of the state, so any
/// single changed word changes the sum. Integrity against corruption, not an adversary.
inline std::uint64_t transfer_checksum(std::span<const std::uint8_t> bytes) noexcept {
  constexpr std::uint64_t prime = 0x100000001b3ull;
  std::uint64_t h = 0xcbf29ce484222325ull;
  const std::size_t words = bytes.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + i * 8, 8);
    h = (h ^ w) * prime;
  }
  for (std::size_t i = words * 8; i < bytes.size(); ++i) h = (h ^ bytes[i]) * prime;
  return mix64(h ^ std::uint64_t(bytes.size()));
}

template <class T>
void put(std::uint8_t* base, std::size_t off, T v) noexcept {
  std::memcpy(base + off, &v, sizeof(T));
}
template <class T>
T get(const std::uint8_t* base, std::size_t off) noexcept {
  T v;
  std::memcpy(&v, base + off, sizeof(T));
  return v;
}

/// Byte offsets of the four regions of a page of a head slice, in the source layout
/// and in the slice's own layout (a page_layout with kv_heads = slice count).
template <class Layout>
struct slice_regions {
  std::size_t src[4];
  std::size_t dst[4];
  std::size_t len[4];
  std::size_t slice_page_bytes;

  static slice_regions make(int begin, int count) {
    using K = typename Layout::key_codec;
    using V = typename Layout::value_codec;
    constexpr std::size_t T = std::size_t(Layout::tokens);
    const std::size_t b = std::size_t(begin), n = std::size_t(count);
    slice_regions r{};
    r.len[0] = n * T * K::payload_bytes;
    r.len[1] = n * T * V::payload_bytes;
    r.len[2] = n * T * K::meta_bytes;
    r.len[3] = n * T * V::meta_bytes;
    r.src[0] = Layout::key_payload_offset + b * T * K::payload_bytes;
    r.src[1] = Layout::value_payload_offset + b * T * V::payload_bytes;
    r.src[2] = Layout::key_meta_offset + b * T * K::meta_bytes;
    r.src[3] = Layout::value_meta_offset + b * T * V::meta_bytes;
    // Same rule as page_layout: regions back to back, each 16-byte aligned.
    r.dst[0] = 0;
    r.dst[1] = Layout::align16(r.dst[0] + r.len[0]);
    r.dst[2] = Layout::align16(r.dst[1] + r.len[1]);
    r.dst[3] = Layout::align16(r.dst[2] + r.len[2]);
    r.slice_page_bytes = Layout::align16(r.dst[3] + r.len[3]);
    return r;
  }
};

template <class Storage>
std::size_t slice_page_bytes(int tier, int begin, int count) {
  std::size_t out = 0;
  with_index<Storage::num_tiers>(tier, [&](auto I) {
    out = slice_regions<typename Storage::template layout<I>>::make(begin, count).slice_page_bytes;
  });
  return out;
}

template <class Storage>
storage_format key_format_of(int tier) {
  storage_format f{};
  with_index<Storage::num_tiers>(tier, [&](auto I) { f = Storage::template key_codec<I>::format; });
  return f;
}
/// Whether tier's pages decode only under this storage's codec context (codec.hpp's
/// uses_context: the rotation seed of cache seed, layer, global KV head and role), so they
/// import only into a storage with the same global head index (verify_import).
template <class Storage>
bool tier_uses_codec_context(int tier) {
  bool uses = false;
  with_index<Storage::num_tiers>(tier, [&](auto I) {
    uses = codec_uses_context<typename Storage::template key_codec<I>>() ||
           codec_uses_context<typename Storage::template value_codec<I>>();
  });
  return uses;
}
template <class Storage>
storage_format value_format_of(int tier) {
  storage_format f{};
  with_index<Storage::num_tiers>(tier,
                                 [&](auto I) { f = Storage::template value_codec<I>::format; });
  return f;
}

inline status truncated(std::size_t have, std::size_t need, const char* what) {
  return status::make(errc::corrupt_data, "page transfer: buffer of ", have,
                      " bytes is truncated: ", what, " needs ", need, "; nothing imported");
}

}  // namespace detail

/// Parses and verifies a buffer on its own (no storage): magic, version, sizes, the
/// checksum, and the record sequence (logical pages 0.. in order, every layer once,
/// tiers inside the tier table, fills in [1, page_tokens], only the last logical page
/// partial). Any failure is errc::corrupt_data with the offending and expected values.
inline result<transfer_info> inspect_transfer(std::span<const std::uint8_t> buf) {
  using detail::get;
  const std::uint8_t* b = buf.data();
  constexpr std::size_t H = page_transfer_header_bytes;
  if (buf.size() < H + page_transfer_checksum_bytes)
    return detail::truncated(buf.size(), H + 8, "the header");
  if (std::memcmp(b, page_transfer_magic.data(), 8) != 0)
    return status::make(errc::corrupt_data, "page transfer: bad magic (first bytes ",
                        std::string(reinterpret_cast<const char*>(b), 8).c_str(),
                        "), expected \"TKVPAGES\"");
  transfer_info t;
  t.version = get<std::uint32_t>(b, 8);
  if (t.version != page_transfer_version)
    return status::make(errc::corrupt_data, "page transfer: version ", t.version,
                        " is not supported (expected ", page_transfer_version, ")");
  const std::uint32_t header_bytes = get<std::uint32_t>(b, 12);
  if (header_bytes != H)
    return status::make(errc::corrupt_data, "page transfer: header_bytes = ", header_bytes,
                        ", expected ", H);
  t.total_bytes = get<std::uint64_t>(b, 16);
  if (t.total_bytes != buf.size()) {
    if (t.total_bytes > buf.size())
      return detail::truncated(buf.size(), std::size_t(t.total_bytes), "total_bytes");
    return status::make(errc::corrupt_data, "page transfer: header says ", t.total_bytes,
                        " bytes, buffer has ", buf.size());
  }
  t.checksum = get<std::uint64_t>(b, buf.size() - 8);
  const std::uint64_t sum = detail::transfer_checksum(buf.first(buf.size() - 8));
  if (sum != t.checksum)
    return status::make(errc::corrupt_data, "page transfer: checksum 0x", hex{sum},
                        " of the content != 0x", hex{t.checksum},
                        " stored; the buffer is corrupt, nothing imported");
  t.geometry.head_dim = int(get<std::uint32_t>(b, 24));
  t.geometry.kv_heads = int(get<std::uint32_t>(b, 28));
  t.geometry.group_size = int(get<std::uint32_t>(b, 32));
  t.geometry.page_tokens = int(get<std::uint32_t>(b, 36));
  t.head_begin = get<std::uint32_t>(b, 40);
  t.source_kv_heads = get<std::uint32_t>(b, 44);
  t.num_layers = get<std::uint32_t>(b, 48);
  t.num_tiers = get<std::uint32_t>(b, 52);
  t.codec_seed = get<std::uint64_t>(b, 56);
  t.first_logical = get<std::uint32_t>(b, 64);
  t.logical_pages = get<std::uint32_t>(b, 68);
  t.tokens = get<std::uint64_t>(b, 72);
  if (t.num_tiers < 1 || t.num_tiers > 255)
    return status::make(errc::corrupt_data, "page transfer: num_tiers = ", t.num_tiers,
                        " outside [1, 255]");
  if (t.num_layers < 1 || t.geometry.page_tokens < 1 || t.geometry.kv_heads < 1)
    return status::make(errc::corrupt_data, "page transfer: num_layers = ", t.num_layers,
                        ", page_tokens = ", t.geometry.page_tokens,
                        ", kv_heads = ", t.geometry.kv_heads, " must all be >= 1");
  std::size_t off = H;
  const std::size_t tier_table = std::size_t(t.num_tiers) * page_transfer_tier_entry_bytes;
  if (buf.size() - 8 < off + tier_table)
    return detail::truncated(buf.size(), off + tier_table + 8, "the tier table");
  for (std::uint32_t i = 0; i < t.num_tiers; ++i, off += page_transfer_tier_entry_bytes)
    t.tiers.push_back(
        {storage_format(b[off]), storage_format(b[off + 1]), get<std::uint32_t>(b, off + 4)});
  t.pages_per_tier.assign(t.num_tiers, 0);
  std::uint64_t tokens = 0;
  for (std::uint32_t j = 0; j < t.logical_pages; ++j) {
    std::uint32_t fill0 = 0;
    for (std::uint32_t l = 0; l < t.num_layers; ++l) {
      if (buf.size() - 8 < off + page_transfer_record_bytes)
        return detail::truncated(buf.size(), off + page_transfer_record_bytes + 8, "a page record");
      const std::uint32_t logical = get<std::uint32_t>(b, off);
      const std::uint32_t layer = get<std::uint32_t>(b, off + 4);
      const std::uint32_t tier = b[off + 8];
      const std::uint32_t fill = get<std::uint32_t>(b, off + 12);
      if (logical != j || layer != l)
        return status::make(errc::corrupt_data, "page transfer: record (logical ", logical,
                            ", layer ", layer, ") out of order, expected (", j, ", ", l, ")");
      if (tier >= t.num_tiers)
        return status::make(errc::corrupt_data, "page transfer: logical page ", j, " layer ", l,
                            " names tier ", tier, ", the tier table has ", t.num_tiers);
      if (fill < 1 || fill > std::uint32_t(t.geometry.page_tokens))
        return status::make(errc::corrupt_data, "page transfer: logical page ", j, " fill = ", fill,
                            " outside [1, ", t.geometry.page_tokens, "]");
      if (l == 0) fill0 = fill;
      if (fill != fill0)
        return status::make(errc::corrupt_data, "page transfer: logical page ", j, " layer ", l,
                            " fill ", fill, " != layer 0's ", fill0);
      if (fill < std::uint32_t(t.geometry.page_tokens) && j + 1 != t.logical_pages)
        return status::make(errc::corrupt_data, "page transfer: logical page ", j,
                            " is partial (fill ", fill, ") but is not the run's last page");
      if (fill < std::uint32_t(t.geometry.page_tokens) && tier != 0)
        return status::make(errc::corrupt_data, "page transfer: partial logical page ", j,
                            " is in tier ", tier, "; open pages are always in tier 0");
      off += page_transfer_record_bytes;
      const std::size_t pb = t.tiers[tier].page_bytes;
      if (buf.size() - 8 < off + pb)
        return detail::truncated(buf.size(), off + pb + 8, "a page's bytes");
      off += pb;
      ++t.pages_per_tier[tier];
    }
    tokens += fill0;
    t.last_fill = fill0;
  }
  if (off + 8 != buf.size())
    return status::make(errc::corrupt_data, "page transfer: records end at byte ", off,
                        ", checksum expected there but ", buf.size() - 8 - off, " bytes follow");
  if (tokens != t.tokens)
    return status::make(errc::corrupt_data, "page transfer: header says ", t.tokens,
                        " tokens, the pages hold ", tokens);
  return t;
}

namespace detail {

/// An export's run and head slice, its defaults resolved and checked (export_run).
struct export_request {
  std::int64_t first = 0;  ///< first logical page of the run
  std::int64_t count = 0;  ///< logical pages in the run
  head_slice heads{};      ///< the KV heads exported (count resolved)
  std::size_t bytes = 0;   ///< bytes of the buffer
};

/// f(logical, layer, page) for every page of a checked run, in the buffer's record order.
template <class Storage, class F>
void for_each_run_page(const Storage& s, seq_id seq, const export_request& r, F&& f) {
  for (std::int64_t j = r.first; j < r.first + r.count; ++j)
    for (int l = 0; l < s.num_layers(); ++l) f(j, l, *s.page(seq, l, j));
}

/// Checks an export's arguments (the storage's error for an unknown or released sequence;
/// out_of_range naming the value and its limit) and sizes its buffer.
template <class Storage>
result<export_request> export_run(const Storage& s, seq_id seq, std::int64_t first,
                                  std::int64_t count, head_slice heads) {
  auto n = s.logical_pages(seq);
  if (!n) return n.error_status();
  if (first < 0 || first > *n) return status::out_of_range("first logical page", first, *n + 1);
  if (count < 0) count = *n - first;
  if (count > *n - first)
    return status::exceeds(errc::out_of_range, "export page count", count, *n - first);
  if (heads.count < 0) heads.count = Storage::kv_heads - heads.begin;
  if (heads.begin < 0 || heads.count < 1 || heads.begin + heads.count > Storage::kv_heads)
    return status::make(errc::out_of_range, "head slice [", heads.begin, ", ",
                        heads.begin + heads.count, ") is not a non-empty part of the ",
                        Storage::kv_heads, " KV heads");
  export_request r{first, count, heads,
                   page_transfer_header_bytes +
                       std::size_t(Storage::num_tiers) * page_transfer_tier_entry_bytes +
                       page_transfer_checksum_bytes};
  for_each_run_page(s, seq, r, [&](std::int64_t, int, page_id p) {
    r.bytes +=
        page_transfer_record_bytes + slice_page_bytes<Storage>(p.format, heads.begin, heads.count);
  });
  return r;
}

/// Writes the buffer of a checked request into out (exactly r.bytes). bytes_of(logical,
/// layer, page) gives the page's bytes, whole and in its tier's page_layout, in host memory:
/// the pool's own page (host pools) or a copy staged from the device
/// (cuda::tiered_cache::export_pages). That is all an export over device pools does apart.
template <class Storage, class PageBytes>
void write_transfer(const Storage& s, seq_id seq, const export_request& r,
                    std::span<std::uint8_t> out, PageBytes&& bytes_of) {
  const std::int64_t len = *s.length(seq);
  const int heads = r.heads.count;
  std::uint8_t* b = out.data();
  std::memset(b, 0, page_transfer_header_bytes);
  std::memcpy(b, page_transfer_magic.data(), 8);
  put<std::uint32_t>(b, 8, page_transfer_version);
  put<std::uint32_t>(b, 12, std::uint32_t(page_transfer_header_bytes));
  put<std::uint64_t>(b, 16, std::uint64_t(out.size()));
  put<std::uint32_t>(b, 24, std::uint32_t(Storage::head_dim));
  put<std::uint32_t>(b, 28, std::uint32_t(heads));
  put<std::uint32_t>(b, 32, std::uint32_t(Storage::geometry::group_size));
  put<std::uint32_t>(b, 36, std::uint32_t(Storage::page_tokens));
  // Global head index (the source's head_base + the slice's begin): what the rotations of
  // the slice's pages are seeded with, so what the destination's head_base must be.
  put<std::uint32_t>(b, 40, std::uint32_t(s.config().head_base + r.heads.begin));
  put<std::uint32_t>(b, 44, std::uint32_t(Storage::kv_heads));
  put<std::uint32_t>(b, 48, std::uint32_t(s.num_layers()));
  put<std::uint32_t>(b, 52, std::uint32_t(Storage::num_tiers));
  put<std::uint64_t>(b, 56, s.config().codec_seed);
  put<std::uint32_t>(b, 64, std::uint32_t(r.first));
  put<std::uint32_t>(b, 68, std::uint32_t(r.count));
  const std::int64_t end_tok =
      std::min<std::int64_t>(len, (r.first + r.count) * Storage::page_tokens);
  put<std::uint64_t>(
      b, 72, std::uint64_t(std::max<std::int64_t>(0, end_tok - r.first * Storage::page_tokens)));
  std::size_t off = page_transfer_header_bytes;
  for (int t = 0; t < Storage::num_tiers; ++t, off += page_transfer_tier_entry_bytes) {
    b[off] = std::uint8_t(key_format_of<Storage>(t));
    b[off + 1] = std::uint8_t(value_format_of<Storage>(t));
    put<std::uint16_t>(b, off + 2, 0);
    put<std::uint32_t>(b, off + 4,
                       std::uint32_t(slice_page_bytes<Storage>(t, r.heads.begin, heads)));
  }
  for_each_run_page(s, seq, r, [&](std::int64_t j, int l, page_id p) {
    const std::int64_t fill =
        std::min<std::int64_t>(len - j * Storage::page_tokens, Storage::page_tokens);
    put<std::uint32_t>(b, off, std::uint32_t(j - r.first));
    put<std::uint32_t>(b, off + 4, std::uint32_t(l));
    put<std::uint32_t>(b, off + 8, std::uint32_t(p.format));  // tier byte + 3 zero bytes
    put<std::uint32_t>(b, off + 12, std::uint32_t(fill));
    off += page_transfer_record_bytes;
    with_index<Storage::num_tiers>(p.format, [&](auto I) {
      using L = typename Storage::template layout<I>;
      const auto sr = slice_regions<L>::make(r.heads.begin, heads);
      const std::uint8_t* src = bytes_of(j, l, p);
      // Padding and the token slots past a partial page's fill are zero, so an export
      // depends only on the stored tokens (not on what a recycled page held before).
      std::memset(b + off, 0, sr.slice_page_bytes);
      if (fill == Storage::page_tokens) {
        for (int k = 0; k < 4; ++k)
          if (sr.len[k] != 0) std::memcpy(b + off + sr.dst[k], src + sr.src[k], sr.len[k]);
      } else {
        // Each region is [head][token slot][bytes per slot]: copy the first `fill` slots per
        // head.
        for (int k = 0; k < 4; ++k) {
          const std::size_t slot =
              sr.len[k] / (std::size_t(heads) * std::size_t(Storage::page_tokens));
          const std::size_t head_bytes = slot * std::size_t(Storage::page_tokens);
          for (int h = 0; h < heads && slot != 0; ++h) {
            const std::size_t at = std::size_t(h) * head_bytes;
            std::memcpy(b + off + sr.dst[k] + at, src + sr.src[k] + at, slot * std::size_t(fill));
          }
        }
      }
      off += sr.slice_page_bytes;
    });
  });
  put<std::uint64_t>(b, off, transfer_checksum(out.first(off)));
}

}  // namespace detail

/// Bytes of the export of logical pages [first, first + count) of seq (count < 0: to the
/// end), all layers, KV heads `heads`.
template <class Storage>
result<std::size_t> export_size(const Storage& s, seq_id seq, std::int64_t first = 0,
                                std::int64_t count = -1, head_slice heads = {}) {
  auto r = detail::export_run(s, seq, first, count, heads);
  if (!r) return r.error_status();
  return r->bytes;
}

/// Writes logical pages [first, first + count) of seq (all layers; KV heads of `heads`)
/// into out, which must hold exactly export_size(...) bytes (a pinned or registered
/// buffer, say). The storage is not changed.
template <class Storage>
status export_pages_into(const Storage& s, seq_id seq, std::span<std::uint8_t> out,
                         std::int64_t first = 0, std::int64_t count = -1,
                         head_slice heads = {}) requires Storage::page_allocator::host_accessible {
  auto r = detail::export_run(s, seq, first, count, heads);
  if (!r) return r.error_status();
  if (out.size() != r->bytes)
    return status::make(errc::invalid_argument, "export: buffer holds ", out.size(),
                        " bytes, the export needs ", r->bytes);
  detail::write_transfer(s, seq, *r, out, [&s](std::int64_t, int, page_id p) {
    const std::uint8_t* src = nullptr;
    detail::with_index<Storage::num_tiers>(
        p.format, [&](auto I) { src = s.template pool<I>().host_page(p); });
    return src;
  });
  return {};
}

template <class Storage>
result<std::vector<std::uint8_t>> export_pages(
    const Storage& s, seq_id seq, std::int64_t first = 0, std::int64_t count = -1,
    head_slice heads = {}) requires Storage::page_allocator::host_accessible {
  auto size = export_size(s, seq, first, count, heads);
  if (!size) return size.error_status();
  std::vector<std::uint8_t> out(*size);
  if (auto st = export_pages_into(s, seq, std::span<std::uint8_t>(out), first, count, heads); !st)
    return st;
  return out;
}

/// Everything import_pages checks before it changes anything: the buffer on its own
/// (inspect_transfer), then that it fits this storage: geometry, layer count, tier list
/// and formats, page sizes, codec seed, and that no rotation-dependent page would be
/// decoded with another head's rotation (the slice's first global head must be this
/// storage's head_base; context-free formats import at any head_base).
template <class Storage>
result<transfer_info> verify_import(const Storage& s, std::span<const std::uint8_t> buf) {
  auto info = inspect_transfer(buf);
  if (!info) return info;
  const transfer_info& t = *info;
  const auto mismatch = [](const char* what, auto got, auto want) {
    return status::make(errc::geometry_mismatch, "page transfer: buffer ", what, " = ", got,
                        ", this storage has ", want, "; nothing imported");
  };
  if (t.geometry.head_dim != Storage::head_dim)
    return mismatch("head_dim", t.geometry.head_dim, Storage::head_dim);
  if (t.geometry.kv_heads != Storage::kv_heads)
    return mismatch("kv_heads", t.geometry.kv_heads, Storage::kv_heads);
  if (t.geometry.group_size != Storage::geometry::group_size)
    return mismatch("group_size", t.geometry.group_size, Storage::geometry::group_size);
  if (t.geometry.page_tokens != Storage::page_tokens)
    return mismatch("page_tokens", t.geometry.page_tokens, Storage::page_tokens);
  if (t.num_layers != std::uint32_t(s.num_layers()))
    return mismatch("num_layers", t.num_layers, s.num_layers());
  if (t.num_tiers != std::uint32_t(Storage::num_tiers))
    return mismatch("num_tiers", t.num_tiers, Storage::num_tiers);
  for (int i = 0; i < Storage::num_tiers; ++i) {
    const transfer_tier_info& ti = t.tiers[std::size_t(i)];
    const storage_format kf = detail::key_format_of<Storage>(i),
                         vf = detail::value_format_of<Storage>(i);
    if (ti.key_format != kf || ti.value_format != vf)
      return status::make(errc::geometry_mismatch, "page transfer: tier ", i, " formats (key ",
                          unsigned(ti.key_format), ", value ", unsigned(ti.value_format),
                          ") != this storage's (key ", unsigned(kf), ", value ", unsigned(vf),
                          "); storage_format tags, nothing imported");
    const std::size_t pb = detail::slice_page_bytes<Storage>(i, 0, Storage::kv_heads);
    if (ti.page_bytes != pb)
      return status::make(errc::geometry_mismatch, "page transfer: tier ", i,
                          " page_bytes = ", ti.page_bytes, ", this storage's pages have ", pb,
                          "; nothing imported");
  }
  if (t.codec_seed != s.config().codec_seed)
    return status::make(errc::geometry_mismatch, "page transfer: codec seed 0x", hex{t.codec_seed},
                        " != this storage's 0x", hex{s.config().codec_seed},
                        " (rotations would differ); nothing imported");
  const int head_base = s.config().head_base;
  if (t.head_begin != std::uint32_t(head_base))
    for (int i = 0; i < Storage::num_tiers; ++i) {
      // the tier formats equal this storage's (checked above)
      if (t.pages_per_tier[std::size_t(i)] != 0 && detail::tier_uses_codec_context<Storage>(i))
        return status::make(
            errc::geometry_mismatch, "page transfer: ", t.pages_per_tier[std::size_t(i)],
            " pages of tier ", i,
            " use a rotation seeded by the global KV head index; the buffer's ",
            "slice starts at global head ", t.head_begin,
            ", this storage's head_base = ", head_base,
            " (they must be equal: docs/multigpu.md, head-sharded caches); nothing imported");
    }
  return info;
}

/// What importing a verified buffer takes from a storage at its peak: a sequence slot, one
/// block per logical page, and per tier the pages of its pool (import_needs).
struct import_need {
  std::uint32_t blocks = 0;                   ///< logical pages of the run (a block each)
  std::vector<std::uint64_t> pages_per_tier;  ///< peak pages of each tier's pool
};

/// The need of a buffer that verify_import accepted (t: its result): a block per logical page
/// and, per tier, the buffer's pages of it (build_sequence allocates each page in its own tier
/// and opens no other).
inline import_need import_needs(const transfer_info& t) {
  import_need n;
  n.blocks = t.logical_pages;
  n.pages_per_tier.assign(t.pages_per_tier.begin(), t.pages_per_tier.end());
  return n;
}

namespace detail {
// "imported" for "import", "restored" for "restore": the refusal messages' last words.
inline std::string past(const char* what) {
  std::string w(what);
  return w + (w.empty() || w.back() != 'e' ? "ed" : "d");
}
}  // namespace detail

/// capacity_exhausted, naming what is short, what is free and what the import needs, unless s
/// holds the import now: a sequence slot, the blocks, every tier's pages. A caller that would
/// first demote `demoted` sealed tier-0 pages into tier `into` (cuda::tiered_cache's
/// make_room) counts them as moved, so that its refusal comes before any demotion. `what`
/// names the operation in the message ("import"; the GPU host tier's "restore").
template <class Storage>
status check_import_capacity(const Storage& s, const import_need& n, std::uint64_t demoted = 0,
                             int into = 0, const char* what = "import") {
  if (s.live_sequences() >= s.max_sequences())
    return status::make(errc::capacity_exhausted, what, ": all ", s.max_sequences(),
                        " sequence slots are in use; nothing ", detail::past(what));
  if (std::uint64_t(s.block_capacity() - s.live_blocks()) < n.blocks)
    return status::make(errc::capacity_exhausted, what, ": ", n.blocks,
                        " logical pages need blocks, ", s.block_capacity() - s.live_blocks(),
                        " are free; nothing ", detail::past(what));
  for (int i = 0; i < Storage::num_tiers; ++i) {
    const std::uint64_t free = s.free_pages(i);
    std::uint64_t have = free;
    if (i == 0)
      have += demoted;
    else if (i == into)
      have -= std::min(free, demoted);
    const std::uint64_t need = n.pages_per_tier[std::size_t(i)];
    if (have < need) {
      if (have == free)
        return status::make(errc::capacity_exhausted, what, ": tier ", i, " pool has ", free,
                            " free pages, the ", what, " needs ", need, " at its peak; nothing ",
                            detail::past(what));
      return status::make(errc::capacity_exhausted, what, ": tier ", i, " pool has ", free,
                          " free pages, ", have, " once ", demoted,
                          " tier-0 pages are demoted to make room, the ", what, " needs ", need,
                          " at its peak; nothing ", detail::past(what));
    }
  }
  return {};
}

namespace detail {

/// One page of a sequence being built (build_sequence): its tier, its logical page's fill (the
/// same for every layer of the page; layer 0's is used) and where its bytes are.
struct page_record {
  int tier = 0;                       ///< the tier (pool) the page goes to
  std::int64_t fill = 0;              ///< tokens of its logical page
  const std::uint8_t* src = nullptr;  ///< its bytes, whole, in the tier's page_layout
  std::size_t bytes = 0;              ///< the tier's page bytes
};

/// A NEW sequence of s holding `logical_pages` pages of `layers` layers, page (j, l) as
/// record_of(j, l) says (called once per page, j-major then l, as a buffer is read): per
/// logical page, each layer's page allocated in the record's tier and written
/// (write(page, record): memcpy for host pools, a copy queued for device ones), then the
/// logical page appended whole (paged_storage::append_pages: no tier-0 page is opened for a
/// page that arrives in another tier). A failure gives back the pages not yet appended and
/// releases the partial sequence, so every pool, block and sequence count is as before (the
/// message says "<what> rolled back"). What import_pages and the GPU host tier's restore share.
template <class Storage, class RecordOf, class WritePage>
result<seq_id> build_sequence(Storage& s, std::uint32_t logical_pages, std::uint32_t layers,
                              const char* what, RecordOf&& record_of, WritePage&& write) {
  auto seq = s.create_sequence();
  if (!seq) return seq.error_status();
  std::vector<page_id> pages;
  const auto fail = [&](const status& st) -> status {
    for (const page_id p : pages) (void)s.release_page(p);
    (void)s.release(*seq);
    return status::make(st.code(), st.message(), "; ", what, " rolled back, nothing ", past(what));
  };
  for (std::uint32_t j = 0; j < logical_pages; ++j) {
    pages.clear();
    std::int64_t fill = 0;
    for (std::uint32_t l = 0; l < layers; ++l) {
      const page_record r = record_of(j, l);
      if (l == 0) fill = r.fill;
      auto fresh = s.allocate_page(r.tier);
      if (!fresh) return fail(fresh.error_status());
      pages.push_back(*fresh);
      if (auto st = write(*fresh, r); !st) return fail(st);
    }
    if (auto st = s.append_pages(*seq, fill, pages); !st) return fail(st);
  }
  pages.clear();
  return *seq;
}

/// The import of a buffer that verify_import and check_import_capacity accepted, as a NEW
/// sequence of s (build_sequence over the buffer's records, in their order).
template <class Storage, class WritePage>
result<seq_id> import_verified(Storage& s, const transfer_info& t,
                               std::span<const std::uint8_t> buf, WritePage&& write) {
  std::size_t off =
      page_transfer_header_bytes + std::size_t(t.num_tiers) * page_transfer_tier_entry_bytes;
  return build_sequence(
      s, t.logical_pages, t.num_layers, "import",
      [&](std::uint32_t, std::uint32_t) {
        page_record r;
        r.tier = buf[off + 8];
        r.fill = get<std::uint32_t>(buf.data(), off + 12);
        off += page_transfer_record_bytes;
        r.src = buf.data() + off;
        r.bytes = t.tiers[std::size_t(r.tier)].page_bytes;
        off += r.bytes;
        return r;
      },
      [&](page_id p, const page_record& r) { return write(p, r.src, r.bytes); });
}

}  // namespace detail

/// Imports a verified buffer as a NEW sequence of s holding the run's pages (its logical
/// page 0 is the run's first page), byte-identical to the source's (a partial last page:
/// its filled token slots; the slots past the fill are zero). All or nothing: the
/// buffer and the capacities (sequence slot, blocks, every tier's pool at its peak use)
/// are checked first; a failure after that (bookkeeping memory) releases the partial
/// sequence, so every pool, block and sequence count is as before.
///
/// Mechanism, through the storage's public hooks only: per logical page, reserve and commit
/// its fill (a tier-0 block), then overwrite each layer's tier-0 page with the buffer's
/// bytes, or publish a page of the buffer's tier with replace_page (detail::import_verified,
/// shared with cuda::tiered_cache::import_pages).
template <class Storage>
result<seq_id> import_pages(Storage& s, std::span<const std::uint8_t> buf) requires
    Storage::page_allocator::host_accessible {
  auto info = verify_import(s, buf);
  if (!info) return info.error_status();
  if (auto st = check_import_capacity(s, import_needs(*info)); !st) return st;
  return detail::import_verified(s, *info, buf,
                                 [&s](page_id p, const std::uint8_t* src, std::size_t n) {
                                   auto dst = s.page_bytes(p);
                                   if (!dst) return dst.error_status();
                                   std::memcpy(dst->data(), src, n);
                                   return status{};
                                 });
}

}  // namespace tierkv
