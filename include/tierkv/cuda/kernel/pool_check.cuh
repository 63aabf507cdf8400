// SPDX-License-Identifier: Apache-2.0
// The host-side check of an attention launch's pools against its tiers' page layouts (decode and
// prefill alike).
#pragma once

#include "tierkv/core/config.hpp"

#include <cstddef>

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/core/status.hpp"
namespace tierkv::cuda::detail {

// Every pool must be set and hold pages of exactly its tier's layout (`what` names the caller).
template <class Geometry, int N, class... Tiers>
status check_pools(const char* what, const batch_index_view<N>& index, const pool_view (&pools)[N],
                   tiers<Tiers...>*) {
  static_assert(N == int(sizeof...(Tiers)), "check_pools: one pool per tier");
  constexpr std::size_t expect[] = {
      page_layout<Geometry, typename Tiers::template key_codec<Geometry::head_dim>,
                  typename Tiers::template value_codec<Geometry::head_dim>>::page_bytes...};
  for (int f = 0; f < N; ++f) {
    const pool_view& p = pools[f];
    if (p.capacity > 0 && p.base == nullptr)
      return status::make(errc::invalid_argument, what, ": pools[", f, "].base is null");
    if (p.page_bytes != expect[f])
      return status::make(errc::geometry_mismatch, what, ": pools[", f,
                          "].page_bytes = ", p.page_bytes, " but the tier's page_layout needs ",
                          expect[f]);
    if (index.batch > 0 && index.formats[f].indptr == nullptr)
      return status::make(errc::invalid_argument, what, ": index.formats[", f, "].indptr is null");
  }
  return status::ok();
}

}  // namespace tierkv::cuda::detail
