// SPDX-License-Identifier: Apache-2.0
// The format registry (tierkv/formats.hpp): names and tags are unique and round-trip, and the
// properties code asks of a format come from its codecs' traits, not from lists kept elsewhere.
#include <string_view>

#include "catch.hpp"
#include "tierkv/attention/tile.hpp"
#include "tierkv/formats.hpp"

using namespace tierkv;

namespace {
template <int I>
void check_one() {
  CHECK(find_format(format_name(I)) == I);
  CHECK(format_name(codec_for<typename format_at<I>::key_family, 64>::format) == format_name(I));
}
template <int... I>
void check_each(std::integer_sequence<int, I...>) {
  (check_one<I>(), ...);  // every descriptor's index, name and tag agree
}
}  // namespace

TEST_CASE("format registry: every name and tag maps back to its descriptor", "[registry]") {
  check_each(std::make_integer_sequence<int, format_count>{});
  CHECK(find_format("tq3") >= 0);
  CHECK(find_format("fp8") >= 0);
  CHECK(find_format("int8_rotated") >= 0);
  CHECK(find_format("no_such_format") == -1);
  CHECK(find_format("") == -1);
  CHECK(format_name(-1).empty());
  CHECK(format_name(format_count).empty());
  CHECK(format_name(storage_format(0xEE)).empty());
  CHECK(format_name(storage_format::tq4) == "tq4");
  CHECK(format_name(storage_format::fp8_e4m3) == "fp8");
  // a descriptor's two families: TQ3's keys unbiased, its values least-squares, one tag
  using tq3 = format_at<find_format("tq3")>;
  STATIC_REQUIRE(std::is_same_v<tq3::key_family, tq3_key>);
  STATIC_REQUIRE(std::is_same_v<tq3::value_family, tq3_value>);
}

TEST_CASE("format registry: format properties are codec traits", "[registry]") {
  // the rotated formats read the codec context (page transfer keeps them on the same head)
  STATIC_REQUIRE(codec_uses_context<tq3_key::bind<128>>());
  STATIC_REQUIRE(codec_uses_context<tq4_value::bind<64>>());
  STATIC_REQUIRE(codec_uses_context<int8_rotated::bind<128>>());
  STATIC_REQUIRE(!codec_uses_context<fp8_e4m3::bind<128>>());
  STATIC_REQUIRE(!codec_uses_context<dense_bf16::bind<128>>());
  // the per-token scale lets a tile unpack a token once; a codec without meta has scale 1
  STATIC_REQUIRE(detail::token_scalar<fp8_e4m3::bind<128>>::known);
  STATIC_REQUIRE(detail::token_scalar<tq3_value::bind<128>>::known);
  STATIC_REQUIRE(detail::token_scalar<tq4_key::bind<128>>::known);
  STATIC_REQUIRE(detail::token_scalar<int8_rotated::bind<128>>::known);
  STATIC_REQUIRE(detail::token_scalar<dense_bf16::bind<128>>::known);
  CHECK(tq3_key::bind<64>::token_scale(bf16_one) == 1.f);
  CHECK(fp8_e4m3::bind<64>::token_scale(tq3_key::bind<64>::unit_meta()) == 1.f);
  // decode work per scalar against an 8-bit format (the GPU planner's balance)
  STATIC_REQUIRE(codec_decode_work_percent<tq3_key::bind<128>>() == 75);
  STATIC_REQUIRE(codec_decode_work_percent<tq4_key::bind<128>>() == 100);
  STATIC_REQUIRE(codec_decode_work_percent<dense_f32::bind<128>>() == 100);  // none declared
}

namespace {
// A codec that declares nothing optional: the defaults hold.
template <int D>
struct bare_codec : dense_f32::bind<D> {
  using meta_type = float;
  static constexpr std::size_t meta_bytes = sizeof(float);
};
}  // namespace

TEST_CASE("format registry: optional codec traits default when absent", "[registry]") {
  STATIC_REQUIRE(!codec_uses_context<bare_codec<64>>());
  STATIC_REQUIRE(!codec_token_scaled<bare_codec<64>>);
  STATIC_REQUIRE(codec_decode_work_percent<bare_codec<64>>() == 100);
}
