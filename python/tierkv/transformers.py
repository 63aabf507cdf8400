# SPDX-License-Identifier: Apache-2.0
"""tierkv.transformers: TieredCache, a transformers (5.x) Cache over a tierkv.Cache.

    from tierkv.transformers import TieredCache
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tierkv")
    cache = TieredCache(model.config, max_tokens=4096)            # int8_rotated + TQ4k/TQ3v
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

Every layer's new keys and values (post-RoPE) go into the tierkv cache in update(): the first
layer of a forward pass reserves the step's tokens of every sequence, each layer writes its
own, the last layer commits them. With attn_implementation="tierkv" (registered on import)
attention runs tierkv's decode (one new token) or causal chunked prefill over the mixed-format
pages; no dense copy exists. With any other attention implementation update() returns the
cache's decoded keys and values (every past token, dequantised), so eager / sdpa work too, at
the cost of that copy. One row of the batch is one tierkv sequence; padded batches are not
supported (the tierkv attention applies no attention mask).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import Cache as TierkvCache

ATTENTION_NAME = "tierkv"
_KEY = "tierkv_cache"  # how update() hands the cache to the attention function


class _TieredLayer(CacheLayerMixin):
    """One model layer's view of the shared tierkv cache (which holds every layer)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "TieredCache", layer: int):
        super().__init__()
        self.owner, self.layer = owner, layer

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._update(key_states, value_states, self.layer, kwargs.get("kwargs"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class TieredCache(Cache):
    """A transformers Cache whose keys and values live in a tierkv tiered cache.

    config: the model's config (layers, heads, head_dim). Format names and capacity are
    tierkv.Cache's: recent ("int8_rotated" | "fp8"), cache_type_k / cache_type_v ("tq4" /
    "tq3" Stale formats, or the recent name three times for an 8-bit-only cache), page_size,
    max_tokens or pages_per_tier; the rest of tierkv.Cache's keywords pass through.
    """

    def __init__(self, config, *, recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", **kwargs):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        if heads % kv_heads:
            raise ValueError(f"TieredCache: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        types = getattr(text, "layer_types", None)
        if types and any(t != "full_attention" for t in types):
            raise ValueError(f"TieredCache: every layer must be full attention, got layer_types {sorted(set(types))}")
        self.config = text
        self.num_layers = text.num_hidden_layers
        kwargs.setdefault("max_tokens", 4096)
        kwargs.setdefault("softmax_scale", head_dim**-0.5)
        self.tierkv = TierkvCache(
            head_dim=head_dim,
            kv_heads=kv_heads,
            group_size=heads // kv_heads,
            num_layers=self.num_layers,
            recent=recent,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            **kwargs,
        )
        self.scale = float(kwargs["softmax_scale"])
        self.seqs: torch.Tensor | None = None
        self.step = 0
        self._tokens = 0  # new tokens of the forward pass in flight (per sequence)
        super().__init__(layers=[_TieredLayer(self, i) for i in range(self.num_layers)])

    # -- transformers' Cache interface
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._update(key_states, value_states, layer_idx, kwargs.get("kwargs"))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.seqs is None else self.tierkv.length(int(self.seqs[0]))

    @property
    def batch_size(self) -> int:
        return -1 if self.seqs is None else int(self.seqs.numel())

    def reset(self):
        if self.seqs is not None:
            for s in self.seqs.tolist():
                self.tierkv.release(s)
        self.seqs, self.step, self._tokens = None, 0, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TieredCache: crop is not supported (tierkv pages are committed; no rollback)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("TieredCache: beam search is not supported (use tierkv.Cache.fork directly)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("TieredCache: batch expansion is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("TieredCache: batch selection is not supported")

    # -- the step
    def _update(self, key_states, value_states, layer, attn_kwargs):
        B, kvh, n, d = key_states.shape
        c = self.tierkv
        if layer == 0:
            if self.seqs is None:
                self.seqs = torch.tensor([c.create_sequence() for _ in range(B)], dtype=torch.int64)
            elif B != self.seqs.numel():
                raise ValueError(f"TieredCache: batch of {B} rows, the cache holds {self.seqs.numel()} sequences")
            if self._tokens:  # a forward pass that did not reach its last layer
                c.cancel(self.seqs)
            if self.step:
                c.retier(self.step)  # between steps: no page of this step is read yet
            self.step += 1
            c.reserve(self.seqs, [n] * B)
            self._tokens = n
        elif self.seqs is None or n != self._tokens:
            raise ValueError(f"TieredCache: layer {layer} got {n} new tokens, layer 0 reserved {self._tokens}")
        c.write(layer, self.seqs, _rows(key_states), _rows(value_states))
        if layer == self.num_layers - 1:
            c.commit(self.seqs)
            self._tokens = 0
        if self.config._attn_implementation == ATTENTION_NAME:
            if attn_kwargs is None:
                raise RuntimeError(
                    "TieredCache: the model did not pass its attention kwargs to Cache.update; "
                    "use an attention implementation other than 'tierkv' with this model"
                )
            attn_kwargs[_KEY] = (self, layer)
            return key_states, value_states
        return self._dense(layer, key_states.dtype)

    def _dense(self, layer, dtype):
        """Every token of every sequence, decoded: [B, kv_heads, tokens, head_dim]."""
        rows = [self.tierkv.read_layer(s, layer) for s in self.seqs.tolist()]
        k = torch.stack([r[0] for r in rows]).transpose(1, 2).to(dtype)
        v = torch.stack([r[1] for r in rows]).transpose(1, 2).to(dtype)
        return k, v


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, n, d] -> [B * n, heads, d], contiguous (tierkv's token-major layout)."""
    B, h, n, d = x.shape
    return x.transpose(1, 2).reshape(B * n, h, d).contiguous()


def tierkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: decode / causal prefill over the tierkv pages."""
    entry = kwargs.get(_KEY)
    if entry is None:
        raise RuntimeError("attn_implementation='tierkv' needs past_key_values=TieredCache(...)")
    cache, layer = entry
    if getattr(module, "layer_idx", layer) != layer:
        raise RuntimeError(f"tierkv attention: module layer {module.layer_idx}, cache layer {layer}")
    if scaling is not None and abs(scaling - cache.scale) > 1e-6 * cache.scale:
        raise ValueError(f"tierkv attention: the model's scaling {scaling} differs from the cache's softmax_scale {cache.scale}")
    if dropout:
        raise ValueError("tierkv attention: dropout is not supported (inference only)")
    B, qh, n, d = query.shape
    q = _rows(query)
    if n == 1:
        out, _ = cache.tierkv.decode(layer, cache.seqs, q)
    else:
        indptr = torch.arange(0, (B + 1) * n, n, dtype=torch.int32)
        out, _ = cache.tierkv.prefill(layer, cache.seqs, q, indptr)
    return out.view(B, n, qh, d), None


AttentionInterface.register(ATTENTION_NAME, tierkv_attention)
