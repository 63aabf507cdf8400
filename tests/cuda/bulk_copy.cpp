// SPDX-License-Identifier: Apache-2.0
// The bulk-copy primitives (cuda/arch/bulk_copy.cuh) as prefill uses them: tiles of ranges
// streamed through shared-memory staging areas by cp.async.bulk, each completing on its area's
// mbarrier (expected bytes, then the phase's parity), every area reused many times, in passes
// (pipelines restarted, the barriers' phases carried on; some shorter than the stages). Each landed
// tile must equal its source ranges byte for byte and leave the rest of the area untouched
// (zero): tiles of random ranges, tiles with no bytes at all, a range filling the whole area and
// one ending at the last byte of the source allocation.
#include "catch.hpp"

#include <cstdint>
#include <random>
#include <vector>

#include "bulk_copy_kernels.hpp"
#include "cuda_test.hpp"

namespace {

using cuda_test::device_buffer;

struct plan {
  int ranges = 0, tiles = 0, area_bytes = 0;
  std::vector<std::int32_t> src_off, dst_off, bytes;  // [tiles * ranges]
};

// Random ranges packed into the area with 16-byte-multiple gaps; tile 1 copies nothing, tile 2
// one range filling the area, tile 3 one range (its last) ending at the source's last byte.
plan random_plan(std::mt19937_64& rng, int tiles, int ranges, int area_bytes, int src_bytes) {
  plan p{ranges, tiles, area_bytes, {}, {}, {}};
  const std::size_t n = std::size_t(tiles) * ranges;
  p.src_off.assign(n, 0);
  p.dst_off.assign(n, 0);
  p.bytes.assign(n, 0);
  std::uniform_int_distribution<int> units(0, area_bytes / 16 / ranges);
  for (int t = 0; t < tiles; ++t) {
    int at = 0;
    for (int r = 0; r < ranges; ++r) {
      const std::size_t i = std::size_t(t) * ranges + r;
      const int gap = 16 * (units(rng) / 4);
      int b = 16 * units(rng);
      if (t == 1 || at + gap + b > area_bytes) b = 0;
      if (t == 2) b = r == 0 ? area_bytes : 0;
      if (t == 3) b = r == ranges - 1 ? area_bytes / 2 : 0;
      p.bytes[i] = b;
      p.dst_off[i] = b ? (t == 2 || t == 3 ? 0 : at + gap) : 0;
      if (b) at = p.dst_off[i] + b;
      p.src_off[i] = b ? 16 * std::uniform_int_distribution<int>(0, (src_bytes - b) / 16)(rng) : 0;
      if (t == 3 && b) p.src_off[i] = src_bytes - b;
    }
  }
  return p;
}

// The area's bytes after tile t landed: its ranges' source bytes, zero elsewhere.
std::vector<std::uint8_t> expected(const plan& p, const std::vector<std::uint8_t>& src) {
  std::vector<std::uint8_t> out(std::size_t(p.tiles) * p.area_bytes, 0);
  for (int t = 0; t < p.tiles; ++t)
    for (int r = 0; r < p.ranges; ++r) {
      const std::size_t i = std::size_t(t) * p.ranges + r;
      for (int k = 0; k < p.bytes[i]; ++k)
        out[std::size_t(t) * p.area_bytes + p.dst_off[i] + k] = src[std::size_t(p.src_off[i]) + k];
    }
  return out;
}

}  // namespace

TEST_CASE("bulk_copy: tiles of ranges through reused staging areas land exactly",
          "[cuda][bulk_copy]") {
  if (cuda_test::compute_capability() < 90) {
    WARN("not run: bulk copies need an sm_90 GPU");
    return;
  }
  const int stages = GENERATE(1, 2, 3, 4);
  const int ranges = GENERATE(1, 8, 32);
  constexpr int tiles = 41, area_bytes = 8192, src_bytes = 1 << 20, blocks = 3;
  INFO("stages " << stages << ", ranges " << ranges);
  std::mt19937_64 rng(std::uint64_t(stages * 100 + ranges));
  std::vector<std::uint8_t> src(src_bytes);
  for (auto& b : src) b = std::uint8_t(rng());
  const plan p = random_plan(rng, tiles, ranges, area_bytes, src_bytes);
  const std::vector<std::int32_t> cuts = {0, 1, 6, 7, 9, 22, tiles};  // pass lengths 1 5 1 2 13 19
  device_buffer<std::uint8_t> dsrc(src), out(std::size_t(blocks) * tiles * area_bytes);
  device_buffer<std::int32_t> soff(p.src_off), doff(p.dst_off), bytes(p.bytes), dcuts(cuts);
  cuda_test::bulk_copy_stream(dsrc.p, soff.p, doff.p, bytes.p, ranges, dcuts.p,
                              int(cuts.size()) - 1, stages, area_bytes, blocks, out.p);
  const std::vector<std::uint8_t> want = expected(p, src), got = out.get();
  for (int blk = 0; blk < blocks; ++blk) {
    std::size_t wrong = 0, first = 0;
    for (std::size_t i = 0; i < want.size(); ++i)
      if (got[std::size_t(blk) * want.size() + i] != want[i] && wrong++ == 0) first = i;
    INFO("block " << blk << ": first wrong byte at tile " << first / area_bytes << ", offset "
                  << first % area_bytes);
    CHECK(wrong == 0);
  }
}
