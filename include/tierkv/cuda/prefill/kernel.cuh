// SPDX-License-Identifier: Apache-2.0
// The prefill kernel's one type (prefill/tensor_core.cuh has the design): its compile-time shape,
// the block's and the warp's state, the shared-memory views, and its stages, each defined in the
// header named beside it.
#pragma once

#include "tierkv/core/config.hpp"

#include <cuda_runtime.h>
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "tierkv/codec/tier.hpp"
#include "tierkv/core/index_view.hpp"
#include "tierkv/cuda/arch/warp_roles.cuh"
#include "tierkv/cuda/codec/formats.cuh"
#include "tierkv/cuda/prefill/inputs.cuh"
#include "tierkv/cuda/prefill/layout.cuh"
#include "tierkv/cuda/prefill_plan.cuh"
namespace tierkv::cuda::detail {

template <class Geometry, class TierList>
struct prefill_kernel;

template <class Geometry, class... Tiers>
struct prefill_kernel<Geometry, tiers<Tiers...>> {
  static constexpr int N = int(sizeof...(Tiers));
  static constexpr int D = Geometry::head_dim, G = Geometry::group_size;
  static constexpr int T = Geometry::page_tokens, QH = Geometry::q_heads;
  static constexpr int TL = prefill_tile<D>;  // tokens of a K / V tile
  static constexpr int P = D / 32;            // coordinates per lane of a row
  static constexpr int NT = D / 8;            // 8-column n-tiles of a row of O
  static constexpr int ST = TL / 8;           // 8-token n-tiles of a score row
  static constexpr int TE = T < TL ? T : TL;  // tokens of an entry in a tile
  static constexpr int EPT = TL / TE;         // entries of a tile
  // Built for sm_90a, head_dim 256 runs its products on wgmma (compute_tile_wgmma): one
  // warpgroup a 64-row half of the block, the next tile's decode issued while they run.
#if TIERKV_HAS_WGMMA
  static constexpr bool wgmma_path = D == 256;
#else
  static constexpr bool wgmma_path = false;
#endif
  // Threads of a block. The wgmma path adds a producer warpgroup (warps 8-11) that fetches and
  // decodes the tiles while the two consumer warpgroups (warps 0-7, the block's rows) compute; the
  // producer gives registers to the consumers, whose 64 x 256 O takes 128 a thread.
  static constexpr int threads = wgmma_path ? prefill_threads + 128 : prefill_threads;
  static constexpr int producer_regs = 56, consumer_regs = 224;
  static_assert(!wgmma_path || 128 * producer_regs + prefill_threads * consumer_regs <= 65536,
                "prefill: the warpgroups' registers exceed the register file");
  template <bool Core>
  using smem_layout =
      prefill_smem<Geometry, max_key_payload<D, Tiers...>, max_value_payload<D, Tiers...>, Core>;
  using SM = smem_layout<wgmma_path>;  // the device pass's layout
  // A pass's iteration t fetches tile t + stages's bytes and tile t + entries_ahead's index
  // entries.
  static constexpr int entries_ahead = 2 * SM::stages - 1;
  // what a launch reserves: the larger layout (the host pass does not know the device's path)
  static constexpr std::size_t smem_bytes =
      std::max(smem_layout<false>::bytes, smem_layout<true>::bytes);
  static_assert(D == 64 || D == 128 || D == 256, "prefill: head_dim 64, 128 or 256");
  static_assert(G >= 1 && G <= 8, "prefill: group_size 1..8");
  static_assert(TL % T == 0 || T % TL == 0,
                "prefill: page_tokens must divide 64 or be a multiple of it");
  static_assert(EPT <= prefill_max_entries, "prefill: pages of at least 16 tokens");

  template <int F>
  using tier_t = tier_at_t<tiers<Tiers...>, F>;
  template <int F>
  static constexpr bool value_rotated = rotated_format<typename tier_t<F>::template value_codec<D>>;
  template <int F>
  static constexpr bool key_rotated = rotated_format<typename tier_t<F>::template key_codec<D>>;
  static constexpr prefill_pass_order<N> order = make_prefill_pass_order<D, Tiers...>();

  struct block {
    int b, kvh, row0, rows_total, n, len, q0;
    int pos_min, pos_max;  // positions of the block's first and last real rows
    int split;
    int* err;
  };
  // Shared-memory views; the double buffers are addressed from their first (kv, st: 0 or 1).
  struct smem {
    std::uint8_t* base;
    std::uint8_t* q;    // SM::q_at
    std::int32_t* ent;  // [buffer][slot, logical][prefill_max_entries]
    float* rscale;
    int* rbad;
    float* scratch;                             // over q, k, v and the staging areas
    __device__ std::uint8_t* k(int kv) const {  // f16, SM::k_at
      return base + SM::k_off + kv * SM::kv_bytes;
    }
    __device__ std::uint8_t* v(int kv) const {  // bf16, SM::v_at
      return base + SM::v_off + kv * SM::kv_bytes;
    }
    __device__ float* kscale(int kv) const {
      return reinterpret_cast<float*>(base + SM::kscale_off) + kv * TL;
    }
    __device__ float* vscale(int kv) const {
      return reinterpret_cast<float*>(base + SM::vscale_off) + kv * TL;
    }
    __device__ int* kpos(int kv) const {
      return reinterpret_cast<int*>(base + SM::kpos_off) + kv * TL;
    }
    __device__ std::uint8_t* stage_k(int st) const {
      return base + SM::stage_off + st * SM::stage_bytes;
    }
    __device__ std::uint8_t* stage_v(int st) const { return stage_k(st) + SM::stage_k_bytes; }
    __device__ std::uint64_t* bar(int st) const {  // staging area st's mbarrier
      return reinterpret_cast<std::uint64_t*>(base + SM::bar_off) + st;
    }
    // wgmma path: decoded buffer kv holds a tile (producer -> consumers), is free again
    // (consumers -> producer)
    __device__ std::uint64_t* full(int kv) const { return bar(SM::stages + kv); }
    __device__ std::uint64_t* vacant(int kv) const { return bar(SM::stages + 2 + kv); }
    __device__ std::uint16_t* stage_kmeta(int st) const {
      return reinterpret_cast<std::uint16_t*>(stage_v(st) + SM::stage_v_bytes);
    }
    __device__ std::uint16_t* stage_vmeta(int st) const { return stage_kmeta(st) + TL; }
    __device__ std::int32_t* slots(int buf) const { return ent + buf * 2 * prefill_max_entries; }
    __device__ std::int32_t* logicals(int buf) const {
      return ent + (buf * 2 + 1) * prefill_max_entries;
    }
  };
  // One warp's running state of its 16 rows: lane l holds rows l / 4 and l / 4 + 8 (index 0, 1),
  // O columns 8 nt + 2 (l % 4) + {0, 1}; l is this lane's partial sum (its quad adds them last).
  struct warp_state {
    float o[NT][4];
    float m[2], l[2];
    float rq[2];  // row scale: the query's power-of-two factor x softmax_scale
    int rpos[2];
    unsigned phases;     // bit s: the parity of staging area s's next mbarrier phase (portable)
    unsigned kv_phases;  // wgmma path: pipe_phases::kv
  };

  // Entries of tier F's tile t that belong to the tier (the rest of the tile is past them).
  static __device__ __forceinline__ int present(int e_begin, int e_end, int t) {
    return min(EPT, e_end - (e_begin + (t * TL) / T));
  }
  // Every fetched tile of a pass is decoded, so every bulk copy has landed: staging area s served
  // ceil((n - s) / stages) of the pass's n tiles, each one phase of its barrier.
  static __device__ __forceinline__ void advance_stage_phases(unsigned& phases, int n) {
#pragma unroll
    for (int s = 0; s < SM::stages; ++s)
      if (n > s) phases ^= unsigned(((n - s + SM::stages - 1) / SM::stages) & 1) << s;
  }
  // The wgmma path's barrier phases, carried from pass to pass (both roles count alike): bit s of
  // stage, the parity of staging area s's next phase (producer); bit k of kv, the parity of the
  // uses decoded buffer k has served (tile t of a pass is buffer (t - a) % 2).
  struct pipe_phases {
    unsigned stage = 0, kv = 0;
  };
  static __device__ __forceinline__ void advance_kv_phases(unsigned& kv, int n) {
    kv ^= unsigned(((n + 1) / 2) & 1) | (unsigned((n / 2) & 1) << 1);
  }
  static constexpr int consumer_barrier = 1, producer_barrier = 2;  // named barrier ids
  // A barrier among the threads that hold rows: the consumer warpgroups on the wgmma path, the
  // whole block otherwise.
  static __device__ __forceinline__ void rows_sync() {
    if constexpr (wgmma_path)
      named_barrier_sync(consumer_barrier, prefill_threads);
    else
      __syncthreads();
  }

  // Pass I's tiles of tier F: this split's share [split_lo, split_hi) of the tiers' concatenated
  // tile line, less the `skip` tiles of the passes before it, within the tier's [lo, hi).
  template <int F>
  static __device__ __forceinline__ int pass_begin(const int (&lo)[N], int split_lo, int skip) {
    return max(lo[F], lo[F] + split_lo - skip);
  }
  template <int F>
  static __device__ __forceinline__ int pass_end(const int (&lo)[N], const int (&hi)[N],
                                                 int split_hi, int skip) {
    return min(hi[F], lo[F] + split_hi - skip);
  }

  // The kernel's body (prefill/tensor_core.cuh): the queries in a tier's key domain, the
  // passes over the tiers, the block's run.
  template <bool Rotated>
  static __device__ __forceinline__ void prepare_queries(const prefill_inputs<N>& in,
                                                         const block& bk, std::uint64_t key_seed,
                                                         const smem& sm, int warp, int lane);
  template <int I>
  static __device__ __forceinline__ void passes(const prefill_inputs<N>& in, const block& bk,
                                                const smem& sm, warp_state& st, const int (&lo)[N],
                                                const int (&hi)[N], int split_lo, int split_hi,
                                                int skip, int& q_domain, bool& o_rotated, int warp,
                                                int lane);
  static __device__ __forceinline__ void run(const prefill_inputs<N>& in, const prefill_plan& plan,
                                             std::uint8_t* workspace);

  // The fetch stage (prefill/fetch.cuh): the tiles a block sees, their index entries and bytes
  // into the staging areas, a landed tile decoded into a K / V buffer.
  static __device__ int entry_position(const format_pages_view& fv, int e_begin, int v);
  template <class Pred>
  static __device__ int tile_search(int n, Pred pred);
  static __device__ void tile_range(const prefill_inputs<N>& in, const block& bk,
                                    const format_pages_view& fv, int e_begin, int e_end, int& lo,
                                    int& hi);
  static __device__ __forceinline__ void fetch_entries(const format_pages_view& fv, int e_begin,
                                                       int e_end, int tile, int buf, const smem& sm,
                                                       int i);
  template <int F>
  static __device__ __forceinline__ void fetch_tile(const prefill_inputs<N>& in, const block& bk,
                                                    int tile, int buf, int stage, const smem& sm,
                                                    int lane);
  template <int F, int NThreads>
  static __device__ __forceinline__ void unpack_tile(const block& bk, int tile, int present,
                                                     int buf, int st, int kv, const pool_view& pool,
                                                     const smem& sm, int thread);
  template <int F, class Sync>
  static __device__ __forceinline__ void pipeline_prologue(const prefill_inputs<N>& in,
                                                           const block& bk, int e_begin, int e_end,
                                                           int a, int b, const smem& sm,
                                                           int fetcher, Sync sync);

  // The portable compute path (prefill/mma_sync.cuh): a warp's 16 rows over a tile on mma.sync,
  // and a tier's tiles through the one-barrier-a-tile pipeline.
  static __device__ __forceinline__ void scores_mma(const smem& sm, int kv, float (&s)[ST][4],
                                                    int warp, int lane);
  template <bool Masked>
  static __device__ __forceinline__ void online_softmax(const prefill_inputs<N>& in, const smem& sm,
                                                        int kv, warp_state& st, float (&s)[ST][4],
                                                        std::uint32_t (&pa)[ST][2], int lane);
  static __device__ __forceinline__ void values_mma(const smem& sm, int kv, warp_state& st,
                                                    const std::uint32_t (&pa)[ST][2], int lane);
  template <bool Masked>
  static __device__ void compute_tile(const prefill_inputs<N>& in, const smem& sm, int kv,
                                      warp_state& st, int warp, int lane);
  template <int F>
  static __device__ __forceinline__ void tier_tiles(const prefill_inputs<N>& in, const block& bk,
                                                    int e_begin, int e_end, int a, int b,
                                                    const smem& sm, warp_state& st, int warp,
                                                    int lane);

  // The wgmma path (prefill/wgmma.cuh, sm_90a at head_dim 256): a warpgroup's 64 rows over a
  // tile, the producer's and the consumers' sides of the pipeline.
  template <bool Masked>
  static __device__ __forceinline__ void compute_tile_wgmma(const prefill_inputs<N>& in,
                                                            const smem& sm, int kv, warp_state& st,
                                                            int warp, int lane);
  template <int F>
  static __device__ __forceinline__ void producer_tiles(const prefill_inputs<N>& in,
                                                        const block& bk, int e_begin, int e_end,
                                                        int a, int b, const smem& sm,
                                                        pipe_phases& ph, int pt);
  template <int F>
  static __device__ __forceinline__ void consumer_tiles(const prefill_inputs<N>& in,
                                                        const block& bk, int a, int b,
                                                        const smem& sm, warp_state& st, int warp,
                                                        int lane);
  template <int I>
  static __device__ __forceinline__ void producer_passes(const prefill_inputs<N>& in,
                                                         const block& bk, const smem& sm,
                                                         const int (&lo)[N], const int (&hi)[N],
                                                         int split_lo, int split_hi, int skip,
                                                         pipe_phases& ph, int pt);

  // The output (prefill/output.cuh): O through the scratch to the output or a split's partial
  // state, and the splits' merge.
  static __device__ void o_store(const warp_state& st, float* slab, int lane);
  static __device__ void o_load(warp_state& st, const float* slab, int lane);
  static __device__ void unrotate_slab(float* slab, std::uint64_t value_seed, int lane);
  static __device__ void store_output(const prefill_inputs<N>& in, std::size_t row, int lane,
                                      const float (&x)[P], bool bad);
  static __device__ float lse_shift(const prefill_inputs<N>& in, std::size_t row);
  static __device__ __forceinline__ void epilogue(const prefill_inputs<N>& in,
                                                  const prefill_plan& plan, std::uint8_t* workspace,
                                                  const block& bk, const smem& sm, warp_state& st,
                                                  bool o_rotated, int warp, int lane);
  static __device__ void merge(const prefill_inputs<N>& in, const prefill_plan& plan,
                               const std::uint8_t* workspace);
};

}  // namespace tierkv::cuda::detail
