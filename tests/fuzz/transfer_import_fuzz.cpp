// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness over page-transfer import (issue 24). A source storage (FP8 + TQ3 tiers,
// two KV heads, pages of both tiers) exports five buffers once: whole sequences, a run of
// pages, a partial last page, a one-head slice. Each input picks a buffer and damages it:
// bytes flipped, a 32-bit field overwritten at a position, the buffer cut short or extended,
// optionally re-sealed with a correct checksum so the damage reaches the semantic checks
// behind it. It is imported into a fresh destination whose pool sizes and head_base the input
// also picks, beside a resident sequence. The contract (paging/page_transfer.hpp):
//  - a refusal returns a documented code and leaves the destination exactly as it was (free
//    pages per tier, live sequences and blocks, the resident sequence's exported bytes) with
//    its invariants holding;
//  - an accepted import passes the invariants, every token of the new sequence decodes
//    without a fault (ASan / UBSan watch), an undamaged buffer re-exports byte for byte, and
//    releasing the sequence gives back exactly what the import took.
// A broken contract aborts with a message: libFuzzer records the input as a crash.
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "../unit/tiering/tiering_test_support.hpp"
#include "tierkv/paging/page_transfer.hpp"

using namespace tiering_test;

namespace {

using geo2 = geometry<head_dim<64>, kv_heads<2>, group_size<1>, page_tokens<16>>;
using store = paged_storage<geo2, two_tiers, host_allocator, host_allocator>;
constexpr int layers = 2;

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "import contract broken: %s\n", what);
  std::abort();
}

std::unique_ptr<store> make(std::uint32_t t0, std::uint32_t t1, int head_base) {
  storage_options<2> o;
  o.num_layers = layers;
  o.max_sequences = 4;
  o.pages_per_tier = {t0, t1};
  o.codec_seed = 5;
  o.head_base = head_base;
  auto s = store::create(o);
  if (!s) {
    std::fprintf(stderr, "%s\n", s.error_status().message().c_str());
    broken("storage not created");
  }
  return std::move(*s);
}

seq_id filled(store& s, int tokens, std::uint64_t base) {
  const seq_id q = s.create_sequence().value();
  if (!append_seeds(s, q, seeds_from(base, tokens))) broken("source append failed");
  return q;
}

const std::vector<std::vector<std::uint8_t>>& buffers() {
  static const auto out = [] {
    static auto src = make(64, 64, 0);
    const seq_id a = filled(*src, 40, 1), b = filled(*src, 100, 500);
    conversion_counters c;  // pages 1-3 of b to TQ3 at both layers
    for (std::int64_t p = 1; p <= 3; ++p)
      for (int l = 0; l < layers; ++l)
        if (!convert_page(*src, *src->block_of(b, p), l, 1, c)) broken("source conversion failed");
    std::vector<std::vector<std::uint8_t>> v;
    v.push_back(export_pages(*src, a).value());
    v.push_back(export_pages(*src, b).value());
    v.push_back(export_pages(*src, b, 1, 3).value());
    v.push_back(export_pages(*src, a, 2).value());              // the partial last page only
    v.push_back(export_pages(*src, b, 0, -1, {1, 1}).value());  // KV head 1 alone
    return v;
  }();
  return out;
}

struct snapshot {
  std::array<std::uint32_t, 2> free{};
  std::uint32_t seqs = 0, blocks = 0;
  std::vector<std::uint8_t> resident;
  bool operator==(const snapshot&) const = default;
};
snapshot take(const store& s, seq_id resident) {
  return {{s.free_pages(0), s.free_pages(1)},
          s.live_sequences(),
          s.live_blocks(),
          export_pages(s, resident).value()};
}

bool documented(errc e) {
  return e == errc::corrupt_data || e == errc::geometry_mismatch || e == errc::capacity_exhausted ||
         e == errc::invalid_argument || e == errc::out_of_range;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const auto& all = buffers();
  const std::size_t which = in.ConsumeIntegralInRange<std::size_t>(0, all.size() - 1);
  std::vector<std::uint8_t> buf = all[which];
  const int mode = in.ConsumeIntegralInRange<int>(0, 4);
  const bool reseal = in.ConsumeBool();
  switch (mode) {
    case 1:  // flip bytes
      for (int k = in.ConsumeIntegralInRange<int>(1, 8); k > 0 && !buf.empty(); --k)
        buf[in.ConsumeIntegralInRange<std::size_t>(0, buf.size() - 1)] ^=
            in.ConsumeIntegralInRange<std::uint8_t>(1, 255);
      break;
    case 2: {  // a 32-bit field (header, tier entry or record) overwritten
      const std::uint32_t v = in.ConsumeIntegral<std::uint32_t>();
      if (buf.size() >= 4) {
        const std::size_t at = in.ConsumeIntegralInRange<std::size_t>(0, buf.size() - 4);
        std::memcpy(buf.data() + at, &v, 4);
      }
      break;
    }
    case 3:  // cut short
      buf.resize(in.ConsumeIntegralInRange<std::size_t>(0, buf.size()));
      break;
    case 4:  // extended
      for (int k = in.ConsumeIntegralInRange<int>(1, 64); k > 0; --k)
        buf.push_back(in.ConsumeIntegral<std::uint8_t>());
      break;
    default:
      break;
  }
  if (reseal && buf.size() >= page_transfer_checksum_bytes) {
    const std::uint64_t sum = detail::transfer_checksum(
        std::span<const std::uint8_t>(buf).first(buf.size() - page_transfer_checksum_bytes));
    std::memcpy(buf.data() + buf.size() - page_transfer_checksum_bytes, &sum, sizeof sum);
  }
  // The destination: pools sized by the input (some too small for the import) around a
  // resident 20-token sequence (2 pages x 2 layers of tier 0).
  const auto t0 = std::uint32_t(4 + in.ConsumeIntegralInRange<int>(0, 24));
  const auto t1 = std::uint32_t(1 + in.ConsumeIntegralInRange<int>(0, 24));
  auto dst = make(t0, t1, in.ConsumeIntegralInRange<int>(0, 1));
  const seq_id resident = filled(*dst, 20, 9000);
  const snapshot before = take(*dst, resident);

  auto imported = import_pages(*dst, std::span<const std::uint8_t>(buf));
  if (!dst->check_invariants()) broken("invariants after an import");
  if (!imported) {
    if (!documented(imported.error_status().code())) broken("a refusal with an undocumented code");
    if (!(take(*dst, resident) == before)) broken("a refused import changed the destination");
    return 0;
  }
  // Every token of every layer and head decodes (whatever bytes the pages hold).
  const std::int64_t n = dst->length(*imported).value();
  std::vector<float> k(geo2::head_dim), v(geo2::head_dim);
  for (int l = 0; l < layers; ++l)
    for (std::int64_t t = 0; t < n; ++t)
      for (int h = 0; h < geo2::kv_heads; ++h)
        if (!dst->read_token(*imported, l, t, h, k.data(), v.data()))
          broken("a token of an imported sequence does not read back");
  if (mode == 0) {
    // Byte for byte, but for the run's first logical page in the source (header offset 64:
    // the imported sequence starts at 0), the slice's first global head (offset 40: this
    // storage's head_base, which context-free pages may differ in) and so the checksum.
    auto again = export_pages(*dst, *imported).value();
    if (again.size() == buf.size()) {
      std::memcpy(again.data() + 40, buf.data() + 40, 4);
      std::memcpy(again.data() + 64, buf.data() + 64, 4);
      std::memcpy(again.data() + again.size() - 8, buf.data() + buf.size() - 8, 8);
    }
    if (again != buf) {
      std::size_t at = 0;
      while (at < again.size() && at < buf.size() && again[at] == buf[at]) ++at;
      std::fprintf(stderr, "buffer %zu (%zu bytes), re-export %zu bytes, first difference at %zu\n",
                   which, buf.size(), again.size(), at);
      broken("an undamaged buffer does not re-export byte for byte");
    }
  }
  if (!dst->release(*imported)) broken("the imported sequence does not release");
  if (!(take(*dst, resident) == before)) broken("release did not give back what import took");
  return 0;
}
