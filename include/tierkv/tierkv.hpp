// SPDX-License-Identifier: Apache-2.0
// Umbrella header: everything host code needs. CUDA kernels live under tierkv/cuda/ and are
// included explicitly by CUDA translation units.
#pragma once

#include "tierkv/core/config.hpp"
#include "tierkv/core/geometry.hpp"
#include "tierkv/core/ids.hpp"
#include "tierkv/core/status.hpp"

#include "tierkv/codec/codec.hpp"
#include "tierkv/codec/dense.hpp"
#include "tierkv/codec/dense_bf16.hpp"
#include "tierkv/codec/error_traits.hpp"
#include "tierkv/codec/fp8.hpp"
#include "tierkv/codec/int8_rotated.hpp"
#include "tierkv/codec/tier.hpp"
#include "tierkv/codec/tq2.hpp"
#include "tierkv/codec/tq3.hpp"
#include "tierkv/codec/tq4.hpp"

#include "tierkv/codec/page_layout.hpp"
#include "tierkv/memory/allocators.hpp"
#include "tierkv/memory/page_pool.hpp"

#include "tierkv/core/index_view.hpp"
#include "tierkv/paging/index_builder.hpp"
#include "tierkv/paging/paged_storage.hpp"
#include "tierkv/paging/prefix_index.hpp"

#include "tierkv/attention/host_decode.hpp"
#include "tierkv/attention/host_prefill.hpp"
#include "tierkv/attention/int8_query.hpp"
#include "tierkv/attention/partial_state.hpp"

#include "tierkv/tiering/recency_anchor.hpp"
#include "tierkv/tiering/tier_controller.hpp"

#include "tierkv/cache.hpp"
#include "tierkv/report.hpp"
