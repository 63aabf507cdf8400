# SPDX-License-Identifier: Apache-2.0
"""tierkv.transformers: TieredCache, a transformers (5.x) Cache over a tierkv cache.

    from tierkv.transformers import TieredCache
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tierkv")
    cache = TieredCache(model.config, max_tokens=4096)               # host: int8_rotated + TQ4k/TQ3v
    cache = TieredCache(model.config, max_tokens=4096, device="cuda") # the same, wholly on the GPU
    out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

Every layer's new keys and values (post-RoPE) go into the tierkv cache in update(): the first
layer of a forward pass starts the step (the host cache reserves the step's tokens; the GPU
cache runs begin_step, which commits them), each layer writes its own, and the step ends at the
start of the next forward pass (the host cache commits at the last layer and retiers; the GPU
cache runs end_step). With attn_implementation="tierkv" (registered on import) attention runs
tierkv's decode (one new token) or causal chunked prefill over the mixed-format pages; no dense
copy exists. With any other attention implementation update() returns the host cache's
decoded keys and values (every past token, dequantised), so eager / sdpa work too on the host,
at the cost of that copy. One row of the batch is one tierkv sequence; padded batches are not
supported (the tierkv attention applies no attention mask).

CUDA graphs (GPU cache): call begin_step(n) before the forward pass yourself and end_step()
after it; layer 0 then starts no step, so the forward pass is plain launches that a CUDA graph
captures once and replays at every later step of the same batch (pass position_ids as a static
tensor; bench/gpu/torch_e2e.py does this).
"""

from __future__ import annotations

import threading
import warnings

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import RETIER_FIELDS
from .cache import Cache as HostCache

ATTENTION_NAME = "tierkv"
# update() -> the attention function of the same layer: the cache and layer in flight on this
# thread (transformers calls update() and then attention for each layer, and not every version
# passes the attention kwargs to update()).
_in_flight = threading.local()


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
        return self.owner._update(key_states, value_states, self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class _HostSteps:
    """The host cache's step: reserve at layer 0, write per layer, commit at the last layer."""

    def __init__(self, cache: HostCache):
        self.c = cache
        self.pending = 0  # tokens reserved and not committed (a forward pass cut short)
        self.totals = dict.fromkeys(RETIER_FIELDS, 0)  # the host ops return each retier's only
        self.retiered = 0  # the last step whose retier ran

    def begin(self, seqs, n: int, step: int) -> None:
        if self.pending:
            self.c.cancel(seqs)
            self.pending = 0
        self._retier(step - 1)  # the previous step's, unless end_step ran it
        self.c.reserve(seqs, [n] * len(seqs))
        self.pending = n

    def _retier(self, step: int) -> None:
        # between steps (no page of the next one is read yet), once a step
        if step >= 1 and self.retiered < step:
            for k, v in self.c.retier(step).items():
                self.totals[k] += v
            self.retiered = step

    def retier_stats(self) -> dict:
        return dict(self.totals)

    def write(self, layer: int, seqs, k, v) -> None:
        self.c.write(layer, seqs, k, v)

    def layer_done(self, layer: int, last: bool, seqs) -> None:
        if last:
            self.c.commit(seqs)
            self.pending = 0

    def end(self, step: int) -> None:
        # the step's retier now, as the GPU's end_step (a forward pass cut short: at the next begin)
        if not self.pending:
            self._retier(step)

    def attend(self, layer: int, seqs, q, n: int, window: int = 0, soft_cap: float = 0.0):
        # soft_cap is the cache's own (HostCache(soft_cap=...)): TieredCache checks they agree
        if n == 1:
            return self.c.decode(layer, seqs, q, window=window)[0]
        B = len(seqs)
        indptr = torch.arange(0, (B + 1) * n, n, dtype=torch.int32)
        return self.c.prefill(layer, seqs, q, indptr, window=window)[0]

    def length(self, seq: int) -> int:
        return self.c.length(seq)


class _CudaSteps:
    """The GPU cache's step: begin_step (tokens committed), append per layer, end_step."""

    def __init__(self, cache):
        self.c = cache
        self.open = False
        self.wait = False  # end_step finishes the step's retier (TieredCache's sync_retier)
        # the cache's totals count make_room's and drain's conversions too; from here on
        self.base = cache.retier_totals()

    def retier_stats(self) -> dict:
        t = self.c.retier_totals()
        return {k: t[k] - self.base[k] for k in RETIER_FIELDS}

    def begin(self, seqs, n: int, step: int) -> None:
        if self.open:
            self.end(step - 1)
        self.c.begin_step(seqs.tolist(), [n] * len(seqs))
        self.open = True

    def write(self, layer: int, seqs, k, v) -> None:
        self.c.append(layer, k, v)

    def layer_done(self, layer: int, last: bool, seqs) -> None:
        pass

    def end(self, step: int) -> None:
        if self.open:
            self.c.end_step(step, wait=self.wait)
            self.open = False

    def attend(self, layer: int, seqs, q, n: int, window: int = 0, soft_cap: float = 0.0):
        if n == 1:  # sliding-window and soft-capped layers too
            return self.c.decode(layer, q, soft_cap=soft_cap, window=window)
        return self.c.prefill(layer, q, soft_cap=soft_cap, window=window)

    def length(self, seq: int) -> int:
        return self.c.length(seq)


class TieredCache(Cache):
    """A transformers Cache whose keys and values live in a tierkv tiered cache.

    config: the model's config (layers, heads, head_dim). Format names and capacity are
    tierkv.Cache's: recent ("int8_rotated" | "fp8"), cache_type_k / cache_type_v ("tq4" /
    "tq3" Stale formats, or the recent name three times for an 8-bit-only cache), page_size,
    max_tokens or pages_per_tier; device="cuda" keeps the cache on the GPU (tierkv.CudaCache,
    whose keywords pass through too). center (channel-mean centring, tierkv.Cache's) defaults
    to True unless the model has an attention logit soft-cap, which centring refuses.
    On the GPU every layer's page mass feeds the policy each step (mass_layers_per_step=0) and
    each step's retier finishes inside end_step after that step's masses (sync_retier, default
    True): the tiers, step by step, of the host cache and the C++ engine, whose perplexity these
    defaults match (bench/results/quality/paths-2026-12-06.json; one layer a step costs +0.39
    points and the side stream's overlap makes the tiers depend on timing:
    paths-gpu-configs-2026-12-06.json). A serving
    loop that wants the overlap passes sync_retier=False and mass_layers_per_step=1
    (tierkv.CudaCache's own defaults; bench/gpu/torch_e2e.py). sync_retier=True on the host is
    refused (its step is synchronous already).
    from_cache() wraps a cache and sequences made elsewhere.

    Capacity: max_tokens (default 4096 unless pages_per_tier is given) is the tokens of every
    sequence of the batch together; a step past it raises RuntimeError naming max_tokens and the
    size needed, in every tier set. A step the pools cannot hold (pages_per_tier) raises naming
    them, and conversions held back because a target pool is full warn once (RuntimeWarning).
    retier_stats() and bits_per_scalar() say what the tiering did and what it stores.
    """

    def __init__(self, config, *, recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", device=None,
                 sync_retier=None, **kwargs):
        text = self._text_config(config)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        if heads % kv_heads:
            raise ValueError(f"TieredCache: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        if kwargs.get("pages_per_tier") is None:
            kwargs.setdefault("max_tokens", 4096)
        # Gemma-style models scale logits by query_pre_attn_scalar, not head_dim, and cap them
        kwargs.setdefault("softmax_scale", (getattr(text, "query_pre_attn_scalar", None) or head_dim) ** -0.5)
        cap = float(getattr(text, "attn_logit_softcapping", None) or 0.0)
        # Centring by default where the cache allows it (not with a soft-cap): it halves the
        # recommended cache's perplexity cost on Gemma 3 at 32K and is neutral on SmolLM2's
        # needles (bench/results/quality/quality-2026-12-04-gemma.json, docs/model.md)
        kwargs.setdefault("center", cap == 0.0)
        geometry = dict(head_dim=head_dim, kv_heads=kv_heads, group_size=heads // kv_heads, num_layers=text.num_hidden_layers)
        names = dict(recent=recent, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
        if device is not None and torch.device(device).type == "cuda":
            from .cuda import CudaCache

            kwargs.setdefault("mass_layers_per_step", 0)  # every layer's mass, as the host path
            sync_retier = True if sync_retier is None else sync_retier
            cache = CudaCache(**geometry, **names, device=device, **kwargs)
            cap = None  # the GPU attention takes the model's soft-cap per call
        else:
            if sync_retier:
                raise ValueError("TieredCache: sync_retier is for the GPU cache (the host path's step is synchronous)")
            kwargs.setdefault("soft_cap", cap)
            cache = HostCache(**geometry, **names, **kwargs)
            cap = float(kwargs["soft_cap"])
        self._setup(text, cache, None, float(kwargs["softmax_scale"]), cap, kwargs.get("max_tokens"))
        if self.on_gpu:
            self.steps.wait = bool(sync_retier)

    @classmethod
    def from_cache(cls, config, cache, seqs=None, softmax_scale=None) -> "TieredCache":
        """Wraps an existing tierkv.Cache or tierkv.CudaCache; seqs (one per batch row) may hold
        tokens already (a prompt written through the cache's own API)."""
        self = cls.__new__(cls)
        text = cls._text_config(config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self._setup(text, cache, seqs, float(softmax_scale or head_dim**-0.5), None)
        return self

    @staticmethod
    def _text_config(config):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        types = getattr(text, "layer_types", None)
        supported = {"full_attention", "sliding_attention"}
        if types and any(t not in supported for t in types):
            raise ValueError(
                f"TieredCache: layer_types {sorted(set(types) - supported)} are not supported "
                f"(full and sliding-window attention are)"
            )
        return text

    def _setup(self, text, cache, seqs, scale: float, soft_cap, max_tokens=None) -> None:
        self.config = text
        self.num_layers = text.num_hidden_layers
        self.tierkv = cache
        self.on_gpu = not isinstance(cache, HostCache)
        self.steps = _CudaSteps(cache) if self.on_gpu else _HostSteps(cache)
        self.scale = scale
        self.soft_cap = soft_cap  # the host cache's logit soft-cap (None: not checked)
        self.seqs = None if seqs is None else torch.tensor(list(seqs), dtype=torch.int64)
        self.step = 0
        self._tokens = 0  # new tokens per sequence of the step in flight
        self._explicit = False  # a step begun by begin_step() (CUDA graphs)
        # the tokens of every sequence together that a step may bring the cache to (None: the
        # pools' own limit, for a cache made elsewhere); the pools are sized for it
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self._warned_full = False
        super().__init__(layers=[_TieredLayer(self, i) for i in range(self.num_layers)])

    # -- transformers' Cache interface
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self._update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.seqs is None else self.steps.length(int(self.seqs[0]))

    @property
    def batch_size(self) -> int:
        return -1 if self.seqs is None else int(self.seqs.numel())

    def reset(self):
        if self.seqs is not None:
            self.end_step()
            for s in self.seqs.tolist():
                self.tierkv.release(s)
        self.seqs, self.step, self._tokens = None, 0, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TieredCache: crop is not supported (tierkv pages are committed; no rollback)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("TieredCache: beam search is not supported (use the tierkv cache's fork directly)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("TieredCache: batch expansion is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("TieredCache: batch selection is not supported")

    # -- what the tiering did
    def retier_stats(self) -> dict:
        """The retier counters (tierkv.RETIER_FIELDS) summed over every step since this
        TieredCache was made; deferred_full counts conversions held back because the target
        tier's pool was full (those pages keep more bits than configured)."""
        return self.steps.retier_stats()

    def bits_per_scalar(self) -> float:
        """Stored bits per key or value scalar of the live pages: their bytes over every
        token's scalars (the cache's memory report; 0 while it holds no token)."""
        return float(self.tierkv.report()["bits_per_scalar"])

    # -- explicit steps (CUDA graphs)
    def begin_step(self, new_tokens: int = 1, batch_size: int | None = None) -> None:
        """Starts a step of new_tokens per sequence before the forward pass (layer 0 then
        starts none): the forward pass is plain launches a CUDA graph can capture."""
        self._begin(new_tokens, batch_size)
        self._explicit = True

    def end_step(self) -> None:
        """Ends the step in flight (GPU: page mass to the policy, retier on the side stream)."""
        self.steps.end(self.step)
        self._explicit = False
        self._warn_if_held_back()

    # -- the step
    def _begin(self, n: int, batch_size: int | None) -> None:
        if self.seqs is None:
            if batch_size is None:
                raise ValueError("TieredCache.begin_step: the cache holds no sequences yet; pass batch_size")
            self.seqs = torch.tensor([self.tierkv.create_sequence() for _ in range(batch_size)], dtype=torch.int64)
        elif batch_size is not None and batch_size != self.seqs.numel():
            raise ValueError(f"TieredCache: batch of {batch_size} rows, the cache holds {self.seqs.numel()} sequences")
        B = self.seqs.numel()
        held = sum(self.steps.length(s) for s in self.seqs.tolist())
        # max_tokens is a limit, the same for every tier set: past it an 8-bit-only cache would
        # fail later and a tiered one would first hold back demotions (its Stale pool full)
        if self.max_tokens is not None and held + B * n > self.max_tokens:
            raise RuntimeError(
                f"TieredCache: {held + B * n} tokens needed ({held} held + {B} x {n} new), "
                f"max_tokens={self.max_tokens}; pass max_tokens>={held + B * n} (the tokens of "
                "every sequence of the batch together)"
            )
        self.step += 1
        try:
            self.steps.begin(self.seqs, n, self.step)
        except RuntimeError as e:
            if "capacity_exhausted" not in str(e):
                raise
            raise RuntimeError(
                f"TieredCache: no room for {B} x {n} new tokens ({held} held): the pools hold "
                f"pages_per_tier={self._pool_pages()} pages (one layer each); pass a larger "
                f"pages_per_tier or max_tokens ({e})"
            ) from e
        self._tokens = n
        self._warn_if_held_back()

    def _pool_pages(self) -> list[int]:
        return [t["capacity_pages"] for t in self.tierkv.report()["tiers"]]

    def _warn_if_held_back(self) -> None:
        """Warns once when retier held back conversions for a full target pool: never silent
        extra bits."""
        if self._warned_full:
            return
        full = self.steps.retier_stats()["deferred_full"]
        if full:
            self._warned_full = True
            sizing = "" if self.max_tokens is None else f", max_tokens={self.max_tokens}"
            warnings.warn(
                f"TieredCache: {full} page conversions held back because their target tier's pool "
                f"was full (retier_stats()['deferred_full']): those pages keep more bits than "
                f"configured ({self.bits_per_scalar():.2f} bits per scalar now). The pools hold "
                f"pages_per_tier={self._pool_pages()}{sizing}; pass a larger pages_per_tier or "
                "max_tokens. (Warned once per cache.)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _update(self, key_states, value_states, layer):
        B, kvh, n, d = key_states.shape
        if layer == 0 and not self._explicit:
            self._begin(n, B)
        elif self.seqs is None or n != self._tokens or B != self.seqs.numel():
            raise ValueError(
                f"TieredCache: layer {layer} got {B} x {n} new tokens, the step holds "
                f"{self.batch_size} x {self._tokens}"
            )
        self.steps.write(layer, self.seqs, _rows(key_states), _rows(value_states))
        self.steps.layer_done(layer, layer == self.num_layers - 1, self.seqs)
        if self.config._attn_implementation == ATTENTION_NAME:
            _in_flight.entry = (self, layer)
            return key_states, value_states
        if self.on_gpu:
            raise NotImplementedError("TieredCache on the GPU needs attn_implementation='tierkv' (no dense copy exists)")
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
    entry = getattr(_in_flight, "entry", None)
    if entry is None:
        raise RuntimeError("attn_implementation='tierkv' needs past_key_values=TieredCache(...)")
    cache, layer = entry
    _in_flight.entry = None
    if getattr(module, "layer_idx", layer) != layer:
        raise RuntimeError(f"tierkv attention: module layer {module.layer_idx}, cache layer {layer}")
    if scaling is not None and abs(scaling - cache.scale) > 1e-6 * cache.scale:
        raise ValueError(f"tierkv attention: the model's scaling {scaling} differs from the cache's softmax_scale {cache.scale}")
    if dropout:
        raise ValueError("tierkv attention: dropout is not supported (inference only)")
    window = int(kwargs.get("sliding_window") or 0)  # transformers: a query at p sees (p - window, p]
    soft_cap = float(kwargs.get("softcap") or 0.0)
    if cache.soft_cap is not None and abs(soft_cap - cache.soft_cap) > 1e-6 * max(1.0, soft_cap):
        raise ValueError(
            f"tierkv attention: the model's softcap {soft_cap} differs from the cache's soft_cap "
            f"{cache.soft_cap} (TieredCache reads attn_logit_softcapping from the config)"
        )
    B, qh, n, d = query.shape
    out = cache.steps.attend(layer, cache.seqs, _rows(query), n, window, soft_cap)
    return out.view(B, n, qh, d), None


AttentionInterface.register(ATTENTION_NAME, tierkv_attention)
