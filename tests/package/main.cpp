// SPDX-License-Identifier: Apache-2.0
// Host consumer of the installed package: includes the umbrella header and uses it.
#include <cstdio>
#include <tierkv/tierkv.hpp>

int main() {
  using G = tierkv::geometry<tierkv::head_dim<128>, tierkv::kv_heads<8>, tierkv::group_size<4>,
                             tierkv::page_tokens<64>>;
  static_assert(G::q_heads == 32);
  const auto s = tierkv::status::out_of_range("layer", 40, 32);
  std::printf("tierkv consumer ok: q_heads=%d, %s\n", G::q_heads, s.message().c_str());
  return s.is_ok() ? 1 : 0;
}
