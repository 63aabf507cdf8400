// SPDX-License-Identifier: Apache-2.0
// Per-format attention tiles: one head's token range of one page (read in its stored
// key and value formats) folded into the partial states of a block of query rows.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "tierkv/attention/partial_state.hpp"
#include "tierkv/codec/bf16.hpp"
#include "tierkv/codec/codec.hpp"
#include "tierkv/core/config.hpp"

namespace tierkv {

/// How a raw dot product becomes a logit: s = softmax_scale * (q . k), then, when
/// soft_cap > 0, s = soft_cap * tanh(s / soft_cap) (Gemma-2-style logit capping).
struct logit_params {
  float softmax_scale = 1.f;  ///< multiplies q . k
  float soft_cap = 0.f;       ///< logit soft cap (0 = off)

  /// The logit of a raw dot product.
  TIERKV_HD float apply(float dot) const {
    const float s = softmax_scale * dot;
    return soft_cap > 0.f ? soft_cap * std::tanh(s / soft_cap) : s;
  }
};

/// {m, l} of one row over the tokens of one tile alone (before merging into the row's
/// state): the per-page statistics behind the attention mass l_page * exp(m_page - lse).
struct tile_stats {
  float m = -std::numeric_limits<float>::infinity();  ///< maximum logit
  float l = 0.f;                                      ///< sum of exp(logit - m)

  /// Merge of two disjoint token sets' statistics (same rule as partial_state).
  TIERKV_HD void merge(float om, float ol) {
    if (!(ol > 0.f)) return;
    if (!(l > 0.f)) {
      m = om;
      l = ol;
      return;
    }
    const float nm = m > om ? m : om;
    l = l * std::exp(m - nm) + ol * std::exp(om - nm);
    m = nm;
  }
};

/// One KV head's tokens inside one page, in the page's stored formats (see
/// codec/page_layout.hpp): payloads are contiguous per token, metas are packed arrays.
template <vector_codec KeyCodec, vector_codec ValueCodec>
struct kv_span {
  using key_codec_t = KeyCodec;                 ///< the key codec
  using value_codec_t = ValueCodec;             ///< the value codec
  const std::uint8_t* key_payload = nullptr;    ///< token t at + t * KeyCodec::payload_bytes
  const std::uint8_t* key_meta = nullptr;       ///< token t at + t * KeyCodec::meta_bytes
  const std::uint8_t* value_payload = nullptr;  ///< token t at + t * ValueCodec::payload_bytes
  const std::uint8_t* value_meta = nullptr;     ///< token t at + t * ValueCodec::meta_bytes

  /// The span of kv head `head` in a page laid out by Layout, starting at token `first`.
  template <class Layout>
  TIERKV_HD static kv_span in_page(const std::uint8_t* page, int head, int first = 0) {
    static_assert(std::is_same_v<typename Layout::key_codec, KeyCodec> &&
                      std::is_same_v<typename Layout::value_codec, ValueCodec>,
                  "kv_span::in_page: the layout stores other codecs than this span reads");
    return {page + Layout::key_payload(head, first), page + Layout::key_meta(head, first),
            page + Layout::value_payload(head, first), page + Layout::value_meta(head, first)};
  }
};

namespace detail {

/// Meta is read with memcpy: page bytes are raw storage, and a codec without metadata
/// (meta_bytes == 0) has no bytes to read at all.
template <vector_codec C>
TIERKV_HD_INLINE typename C::meta_type load_meta(const std::uint8_t* metas, int t) {
  typename C::meta_type meta{};
  if constexpr (C::meta_bytes > 0) {
    static_assert(sizeof(typename C::meta_type) == C::meta_bytes,
                  "codec meta_type must occupy exactly meta_bytes");
    std::memcpy(&meta, metas + std::size_t(t) * C::meta_bytes, C::meta_bytes);
  } else {
    (void)metas;
    (void)t;
  }
  return meta;
}

/// The per-token scalar a codec keeps in its meta (docs/formats.md: FP8's scale and TQ3's
/// corrected norm, both bf16 bits) or 1 for codecs without meta. When it is known, a
/// stored vector is linear in it: dot = scalar * (q . u) and accumulate adds
/// p * scalar * u, where u = accumulate(1, payload, unit meta) is the vector unpacked in
/// the codec's domain. That lets a tile unpack each key and value ONCE and reuse it for
/// every row, and puts the scalar on the score and on p, never on the elements.
template <vector_codec C>
struct token_scalar {
  static constexpr bool known = false;
};
template <vector_codec C>
requires(C::meta_bytes == 0) struct token_scalar<C> {
  static constexpr bool known = true;
  TIERKV_HD_INLINE static float of(const typename C::meta_type&) { return 1.f; }
  TIERKV_HD_INLINE static typename C::meta_type unit() { return typename C::meta_type{}; }
};
template <vector_codec C>
requires((C::format == storage_format::fp8_e4m3 || C::format == storage_format::fp8_e5m2 ||
          C::format == storage_format::tq3 || C::format == storage_format::tq4 ||
          C::format == storage_format::tq2 || C::format == storage_format::int8_rotated) &&
         std::is_same_v<typename C::meta_type, bf16_bits>) struct token_scalar<C> {
  static constexpr bool known = true;
  TIERKV_HD_INLINE static float of(const typename C::meta_type& m) { return bf16_to_float(m); }
  TIERKV_HD_INLINE static typename C::meta_type unit() { return bf16_bits(0x3F80); }  // 1.0
};

/// Dot product with 8 independent partial sums: the compiler vectorizes it without
/// reassociating a single reduction (no -ffast-math needed).
template <int N>
TIERKV_HD_INLINE float dot8(const float* TIERKV_RESTRICT a, const float* TIERKV_RESTRICT b) {
  static_assert(N % 8 == 0, "dot8: length must be a multiple of 8");
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < N; i += 8)
    for (int u = 0; u < 8; ++u) s[u] += a[i + u] * b[i + u];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace detail

/// The tile function of one (key codec, value codec) pair, i.e. of one tier; chosen at
/// compile time, so there is no per-page format switch in the inner loop.
///
/// Rows are query heads (decode: the group_size heads of one GQA group; prefill: those
/// heads for several query tokens). Every row's query must be PREPARED with the key
/// codec of this tier (KeyCodec::prepare_query with the (layer, kv head, key) context:
/// identity for FP8, the rotation for TQ3), and each row's state accumulates values in
/// the VALUE codec's domain (rotated for TQ3), so a state must only ever see tiles of
/// one value codec and context; finalize it with ValueCodec::finalize (inverse rotation)
/// before merging it with states of other tiers. Per-token scalars (FP8 scale, TQ3 norm)
/// are inside codec.dot / codec.accumulate, i.e. they multiply the score after the dot
/// product and the probability before the value product.
///
/// UnpackOnce (default: whenever both codecs' per-token scalar is known) unpacks each
/// stored key and value once per token into a head_dim float buffer and runs every row
/// on it; otherwise each row calls codec.dot / codec.accumulate itself (the generic
/// path, kept for codecs outside docs/formats.md, and tested against the fast one).
template <vector_codec KeyCodec, vector_codec ValueCodec,
          bool UnpackOnce =
              detail::token_scalar<KeyCodec>::known&& detail::token_scalar<ValueCodec>::known>
struct attention_tile {
  static_assert(KeyCodec::head_dim == ValueCodec::head_dim,
                "attention_tile: key and value codecs must be bound to the same head_dim");
  static_assert(!UnpackOnce || (detail::token_scalar<KeyCodec>::known &&
                                detail::token_scalar<ValueCodec>::known),
                "attention_tile: UnpackOnce needs codecs whose per-token scalar is known "
                "(detail::token_scalar)");
  static_assert(!UnpackOnce || KeyCodec::head_dim % 8 == 0,
                "attention_tile: UnpackOnce needs head_dim % 8 == 0");
  static constexpr int head_dim = KeyCodec::head_dim;  ///< scalars per vector
  using state = partial_state<head_dim>;               ///< a row's running state
  using span = kv_span<KeyCodec, ValueCodec>;          ///< the tokens a run() reads

  /// Folds tokens [0, ntok) of `kv` into `states[r]` for rows r in [0, rows). Row r sees
  /// only tokens [row_first[r], row_ntok[r]) (each clamped to [0, ntok]; a sliding window's
  /// start and a causal limit); pass row_ntok = nullptr when every row sees up to ntok,
  /// row_first = nullptr when every row sees from token 0.
  ///   queries: [rows][head_dim] prepared queries;
  ///   scores:  scratch of rows * ntok floats (the caller bounds ntok to keep it small);
  ///   stats:   optional [rows]; stats[r] is merged with this tile's own {m, l} of row r
  ///            (so a caller can total a page over several tiles).
  TIERKV_HD static void run(const float* TIERKV_RESTRICT queries, int rows, const int* row_ntok,
                            const span& kv, int ntok, const logit_params& lp,
                            state* TIERKV_RESTRICT states, tile_stats* stats,
                            float* TIERKV_RESTRICT scores, const int* row_first = nullptr) {
    if (ntok <= 0) return;
    const auto hidden = [&](int r, int t) {
      return t >= limit(row_ntok, r, ntok) || t < first(row_first, r, ntok);
    };
    // Scores: each key's stored bytes are visited once per token for all rows, so they
    // stay in L1 while every row of the group reads them.
    [[maybe_unused]] float unpacked[UnpackOnce ? head_dim : 1];
    for (int t = 0; t < ntok; ++t) {
      const std::uint8_t* kp = kv.key_payload + std::size_t(t) * KeyCodec::payload_bytes;
      const auto km = detail::load_meta<KeyCodec>(kv.key_meta, t);
      if constexpr (UnpackOnce) {
        using ts = detail::token_scalar<KeyCodec>;
        for (int i = 0; i < head_dim; ++i) unpacked[i] = 0.f;
        KeyCodec::accumulate(1.f, kp, ts::unit(), unpacked);
        const float scalar = ts::of(km);
        for (int r = 0; r < rows; ++r) {
          if (hidden(r, t)) continue;
          scores[std::size_t(r) * std::size_t(ntok) + std::size_t(t)] = lp.apply(
              scalar * detail::dot8<head_dim>(queries + std::size_t(r) * head_dim, unpacked));
        }
      } else {
        for (int r = 0; r < rows; ++r) {
          if (hidden(r, t)) continue;
          scores[std::size_t(r) * std::size_t(ntok) + std::size_t(t)] =
              lp.apply(KeyCodec::dot(queries + std::size_t(r) * head_dim, kp, km));
        }
      }
    }
    // Per row: the tile's own max and sum, then one rescale of the running state.
    for (int r = 0; r < rows; ++r) {
      const int n = limit(row_ntok, r, ntok), f = first(row_first, r, ntok);
      if (n <= f) continue;
      float* s = scores + std::size_t(r) * std::size_t(ntok);
      float tm = s[f];
      for (int t = f + 1; t < n; ++t) tm = s[t] > tm ? s[t] : tm;
      // Every logit -inf (only from an overflowing dot product): no probability mass,
      // and exp(-inf - -inf) must not be evaluated.
      if (tm == -std::numeric_limits<float>::infinity()) {
        for (int t = f; t < n; ++t) s[t] = 0.f;
        continue;
      }
      float tl = 0.f;
      for (int t = f; t < n; ++t) {
        s[t] = std::exp(s[t] - tm);
        tl += s[t];
      }
      if (stats) stats[r].merge(tm, tl);
      state& st = states[r];
      const float new_m = st.empty() || tm > st.m ? tm : st.m;
      st.rescale_to(new_m);
      const float scale = std::exp(tm - new_m);  // 1 unless the state had a larger max already
      st.l += tl * scale;
      if (scale != 1.f)
        for (int t = f; t < n; ++t) s[t] *= scale;
    }
    // Values: likewise each value is visited once per token for all rows.
    for (int t = 0; t < ntok; ++t) {
      const std::uint8_t* vp = kv.value_payload + std::size_t(t) * ValueCodec::payload_bytes;
      const auto vm = detail::load_meta<ValueCodec>(kv.value_meta, t);
      if constexpr (UnpackOnce) {
        using ts = detail::token_scalar<ValueCodec>;
        for (int i = 0; i < head_dim; ++i) unpacked[i] = 0.f;
        ValueCodec::accumulate(1.f, vp, ts::unit(), unpacked);
        const float scalar = ts::of(vm);
        for (int r = 0; r < rows; ++r) {
          if (hidden(r, t)) continue;
          const float w = scores[std::size_t(r) * std::size_t(ntok) + std::size_t(t)] * scalar;
          float* TIERKV_RESTRICT acc = states[r].acc;
          for (int i = 0; i < head_dim; ++i) acc[i] += w * unpacked[i];
        }
      } else {
        for (int r = 0; r < rows; ++r) {
          if (hidden(r, t)) continue;
          ValueCodec::accumulate(scores[std::size_t(r) * std::size_t(ntok) + std::size_t(t)], vp,
                                 vm, states[r].acc);
        }
      }
    }
  }

 private:
  // row_ntok[r] clamped to [0, ntok] (ntok without limits).
  TIERKV_HD_INLINE static int limit(const int* row_ntok, int r, int ntok) {
    if (!row_ntok) return ntok;
    const int n = row_ntok[r];
    return n < 0 ? 0 : (n > ntok ? ntok : n);
  }
  // row_first[r] clamped to [0, ntok] (0 without a window).
  TIERKV_HD_INLINE static int first(const int* row_first, int r, int ntok) {
    if (!row_first) return 0;
    const int f = row_first[r];
    return f < 0 ? 0 : (f > ntok ? ntok : f);
  }
};

/// The tile of tier T at head_dim D.
template <class Tier, int HeadDim>
using tier_tile = attention_tile<typename Tier::template key_codec<HeadDim>,
                                 typename Tier::template value_codec<HeadDim>>;

}  // namespace tierkv
