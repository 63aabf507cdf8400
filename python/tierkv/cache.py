# SPDX-License-Identifier: Apache-2.0
"""tierkv.Cache: a host tiered cache made from run-time format names, over the tierkv ops."""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Sequence

import torch

ops = torch.ops.tierkv

RETIER_FIELDS = (
    "planned",
    "converted",
    "promoted",
    "demoted",
    "pressure_demoted",
    "deferred",
    "deferred_full",
    "failed",
)
_REPORT_FIELDS = (
    "allocator_total",
    "lines_total",
    "live_page_bytes",
    "pool_bookkeeping",
    "page_tables",
    "index_arrays",
    "live_tokens",
    "sequence_tokens",
    "kib_per_token",
    "kib_per_token_allocated",
    "bits_per_scalar",
)
_TIER_FIELDS = (
    "page_bytes",
    "capacity_pages",
    "live_pages",
    "live_bytes",
    "free_page_bytes",
    "token_layers",
    "bits_per_scalar",
)
_INT_FIELDS = set(_REPORT_FIELDS[:8]) | set(_TIER_FIELDS[:6])


def built() -> list[dict]:
    """The prebuilt combinations this package was compiled with."""
    rows = []
    for s, d, kv, g, p in ops.built().tolist():
        rows.append(dict(**set_names(ops.tier_set_name(s)), head_dim=d, kv_heads=kv, group_size=g, page_size=p))
    return rows


_SET_KEYS = ("recent", "cache_type_k", "cache_type_v", "cold_type_k", "cold_type_v")


def set_names(name: str) -> dict:
    """A tier set's name ("recent/k/v" or "recent/k/v/cold_k/cold_v") as keyword arguments."""
    return dict(zip(_SET_KEYS, name.split("/")))


def tier_count(recent: str, cache_type_k: str, cache_type_v: str, cold_type_k, cold_type_v) -> int:
    """Tiers of a set: 1 (one 8-bit format named three times), 2, or 3 with a Cold tier (both
    cold_type_k and cold_type_v given)."""
    if (cold_type_k is None) != (cold_type_v is None):
        raise ValueError("tierkv: a Cold tier needs both cold_type_k and cold_type_v (or neither)")
    if cold_type_k is not None:
        return 3
    return 1 if recent == cache_type_k == cache_type_v else 2


def policies() -> dict[str, dict[str, float]]:
    """The registered tier policies (include/tierkv/policies.hpp) and each one's knobs with their
    defaults: what policy= and policy_options= of Cache, CudaCache and TieredCache accept."""
    out = {}
    for line in ops.policies().splitlines():
        name, _, knobs = line.partition(": ")
        out[name] = {k: float(v) for k, _, v in (kv.partition("=") for kv in knobs.split(", ")) if k}
    return out


# recency_anchor's knobs that are keywords of their own (the rest go in policy_options)
_KNOB_KEYWORDS = ("recent_pages", "sink_pages", "keep_first_layers", "keep_last_layers", "min_dwell_steps")


def policy_knobs(policy: str, policy_options: dict | None, keywords: dict,
                 bits_per_scalar: float = 0.0) -> tuple[list[str], list[float]]:
    """The knob names and values a cache is made with: policy_options plus the knob keywords
    given (not None); a knob given both ways is refused. The library checks the names, the values
    and the policy (an unknown one raises naming what there is). Under a bit budget
    (bits_per_scalar > 0) recency_anchor's keep_first_layers / keep_last_layers default to 0:
    their pages would take the budget first, leaving the other layers at the cheapest tier
    (docs/tiering.md, "A bit budget")."""
    knobs = dict(policy_options or {})
    for k, v in keywords.items():
        if v is None:
            continue
        if k in knobs:
            raise ValueError(f"tierkv: policy knob {k} given both as a keyword and in policy_options")
        knobs[k] = v
    if not isinstance(policy, str):
        raise TypeError(f"tierkv: policy must be a registered policy's name (str), got {policy!r}")
    if bits_per_scalar > 0 and policy == "recency_anchor":
        for k in ("keep_first_layers", "keep_last_layers"):
            knobs.setdefault(k, 0)
    return list(knobs), [float(v) for v in knobs.values()]


def parse_report(v: list) -> dict:
    """The memory report from its numbers (the order of csrc/cache_options.hpp's report_values)."""
    n = len(_REPORT_FIELDS)
    r = {k: (int(x) if k in _INT_FIELDS else x) for k, x in zip(_REPORT_FIELDS, v[:n])}
    r["reconciles"] = r["lines_total"] == r["allocator_total"]
    tiers, m = int(v[n]), len(_TIER_FIELDS)
    r["tiers"] = [
        {k: (int(x) if k in _INT_FIELDS else x) for k, x in zip(_TIER_FIELDS, v[n + 1 + t * m : n + 1 + (t + 1) * m])}
        for t in range(tiers)
    ]
    return r


def pool_pages(max_tokens: int, page_size: int, max_sequences: int, num_layers: int, tiers: int) -> list[int]:
    """pages_per_tier that let every tier hold max_tokens tokens of every layer, plus one open
    page per sequence."""
    if max_tokens < 1:
        raise ValueError(f"tierkv: max_tokens = {max_tokens} must be >= 1")
    return [(math.ceil(max_tokens / page_size) + max_sequences) * num_layers] * tiers


def describe(name: str, cache, extra: str = "") -> str:
    """A cache's repr: its formats and geometry (the host and the GPU cache share it)."""
    names = ", ".join(f"{k}={v!r}" for k, v in zip(_SET_KEYS, cache.formats))
    return (
        f"{name}({names}, head_dim={cache.head_dim}, "
        f"kv_heads={cache.kv_heads}, group_size={cache.group_size}, page_size={cache.page_size}, "
        f"num_layers={cache.num_layers}{extra})"
    )


def _token_ids(tokens) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor (a list, a tuple or a 1-D integer tensor)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tierkv: tokens must be 1-D integer ids, got {tokens.dtype} {tuple(tokens.shape)}")
        return tokens.cpu().to(torch.int64)
    return torch.tensor(list(tokens), dtype=torch.int64)


def transfer_args(count, heads) -> tuple[int, int, int]:
    """export_pages' count and heads as the ops take them: (count, head_begin, head_count), -1
    meaning "to the end"."""
    if count is not None and int(count) < 0:
        raise ValueError(f"tierkv: count = {count} is negative (None: every page from first on)")
    if heads is None:
        begin, n = 0, -1
    else:
        try:
            begin, n = (int(x) for x in heads)
        except (TypeError, ValueError):
            raise ValueError(f"tierkv: heads must be None or (begin, count) of KV heads, got {heads!r}") from None
        if n < 1:
            raise ValueError(f"tierkv: heads = {heads!r}: the slice's head count {n} must be >= 1")
    return -1 if count is None else int(count), begin, n


def transfer_tensor(buf) -> torch.Tensor:
    """A page-transfer buffer (bytes, bytearray, memoryview or a 1-D uint8 CPU tensor) as a 1-D
    uint8 CPU tensor over the same memory (no copy; the import only reads it)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
            got = f"{buf.dtype} {tuple(buf.shape)} on {buf.device}"
            raise ValueError(f"tierkv: buf must be bytes or a 1-D uint8 CPU tensor, got {got}")
        return buf.contiguous()
    try:
        view = memoryview(buf).cast("B")
    except TypeError:
        raise TypeError(f"tierkv: buf must be bytes-like or a 1-D uint8 tensor, got {type(buf).__name__}") from None
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": bytes are read-only, never written
        return torch.frombuffer(view, dtype=torch.uint8)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous uint8 CPU tensor (one copy)."""
    return t.numpy().tobytes()


def seq_tensor(seqs) -> torch.Tensor:
    """Sequence ids as the 1-D int64 CPU tensor the ops take."""
    if isinstance(seqs, torch.Tensor):
        return seqs
    if isinstance(seqs, int):
        seqs = [seqs]
    return torch.tensor(list(seqs), dtype=torch.int64)


class Cache:
    """A host tiered KV cache (tierkv::tiered_cache) chosen by run-time names.

    recent: the Recent/Anchor tier's format ("fp8" or "int8_rotated"); cache_type_k /
    cache_type_v: the Stale tier's key / value formats ("tq3", "tq4" keys). Naming the recent
    format three times gives an 8-bit-only cache. cold_type_k / cold_type_v (both or neither)
    add a Cold tier (tier 2, issue 52: e.g. "tq3" / "tq2") for Stale pages of little attention
    mass (the policy's cold knobs, policy_options=dict(cold_enter_mass=...)) and for demotions
    once the Stale tier is full. The combination must be prebuilt (tierkv.built()); otherwise
    construction fails with a message naming what was built.

    policy: the tier policy by its registered name (tierkv.policies() lists them and their knobs
    with defaults); policy_options: knobs changed from its defaults, by name. recent_pages,
    sink_pages, keep_first_layers, keep_last_layers and min_dwell_steps are recency_anchor knobs
    that may also be given as keywords.

    Capacity: pages_per_tier (physical pages, one layer each, per tier), or max_tokens, which
    sizes every tier to hold max_tokens tokens of every layer (plus one open page per sequence).

    center=True subtracts per-(layer, KV head) channel means from keys and values before they are
    encoded (estimated from a layer's first write) and adds them back to decode's and prefill's
    outputs and LSE exactly (tierkv/centering.hpp); refused with a soft_cap.

    bits_per_scalar > 0: a bit budget (issue 52, docs/tiering.md "A bit budget"): each retier
    places the pages it may move (all but the Recent window, open and pinned pages) so that they
    store at most this many bits per key / value scalar, the pages of most attention mass in the
    better tiers; 0 (the default): the policy's tiers as they are. A value outside [0, 64] is
    refused. With a budget keep_first_layers / keep_last_layers default to 0 (given, they hold).
    """

    def __init__(
        self,
        *,
        head_dim: int,
        kv_heads: int,
        group_size: int,
        num_layers: int,
        page_size: int = 16,
        recent: str = "int8_rotated",
        cache_type_k: str = "tq4",
        cache_type_v: str = "tq3",
        cold_type_k: str | None = None,
        cold_type_v: str | None = None,
        pages_per_tier: Sequence[int] | None = None,
        max_tokens: int | None = None,
        max_sequences: int = 64,
        max_batch: int = 64,
        max_pages: int = 4096,
        threads: int = 0,
        softmax_scale: float = 0.0,
        soft_cap: float = 0.0,
        codec_seed: int = 0,
        policy: str = "recency_anchor",
        policy_options: dict | None = None,
        recent_pages: int | None = None,
        sink_pages: int | None = None,
        keep_first_layers: int | None = None,
        keep_last_layers: int | None = None,
        min_dwell_steps: int | None = None,
        center: bool = False,
        bits_per_scalar: float = 0.0,
    ):
        tiers = tier_count(recent, cache_type_k, cache_type_v, cold_type_k, cold_type_v)
        if pages_per_tier is None:
            if max_tokens is None:
                raise ValueError("tierkv.Cache: give pages_per_tier or max_tokens")
            pages_per_tier = pool_pages(max_tokens, page_size, max_sequences, num_layers, tiers)
        if threads == 0:
            threads = torch.get_num_threads()
        knob_names, knob_values = policy_knobs(
            policy, policy_options, dict(recent_pages=recent_pages, sink_pages=sink_pages,
                                         keep_first_layers=keep_first_layers, keep_last_layers=keep_last_layers,
                                         min_dwell_steps=min_dwell_steps), bits_per_scalar)  # fmt: skip
        self.state = ops.create(
            recent,
            cache_type_k,
            cache_type_v,
            cold_type_k or "",
            cold_type_v or "",
            head_dim,
            kv_heads,
            group_size,
            page_size,
            num_layers,
            list(pages_per_tier),
            max_sequences,
            max_batch,
            max_pages,
            threads,
            float(softmax_scale),
            float(soft_cap),
            codec_seed,
            policy,
            knob_names,
            knob_values,
            bool(center),
            float(bits_per_scalar),
        )
        self.head_dim, self.kv_heads, self.group_size = head_dim, kv_heads, group_size
        self.q_heads = kv_heads * group_size
        self.page_size, self.num_layers = page_size, num_layers
        self.formats = (recent, cache_type_k, cache_type_v) + ((cold_type_k, cold_type_v) if tiers == 3 else ())
        self.center = bool(center)
        self.policy = policy
        self.num_tiers = int(ops.info(self.state)[5])
        self._finalizer = weakref.finalize(self, ops.destroy, self.state)

    def close(self) -> None:
        """Frees the cache now (otherwise when the object is collected)."""
        self._finalizer()

    # sequences
    def create_sequence(self) -> int:
        return ops.create_sequence(self.state)

    def fork(self, parent: int) -> int:
        return ops.fork(self.state, parent)

    def release(self, seq: int) -> None:
        ops.release(self.state, seq)

    def length(self, seq: int) -> int:
        """Committed tokens."""
        return ops.length(self.state, seq)

    def reserved(self, seq: int) -> int:
        return ops.reserved(self.state, seq)

    # prefix reuse: sealed pages shared by reference (tierkv::prefix_index)
    def insert_prefix(self, seq: int, tokens, salt: int = 0) -> int:
        """Caches seq's full pages that tokens (its first len(tokens) token ids) cover, under
        salt (model, adapter, tenant). Returns the new entries."""
        return ops.prefix_insert(self.state, seq, salt, _token_ids(tokens))

    def start_from_prefix(self, tokens, salt: int = 0) -> tuple[int, int]:
        """A new sequence holding the longest cached prefix of tokens (whole pages): returns
        (sequence, cached tokens); write the rest of the prompt's tokens to it."""
        seq, cached = ops.prefix_start(self.state, salt, _token_ids(tokens))
        return seq, cached

    def evict_prefixes(self, n: int) -> int:
        """Drops up to n least recently used prefix entries no sequence uses; how many went."""
        return ops.prefix_evict(self.state, n)

    def prefix_entries(self) -> int:
        return ops.prefix_entries(self.state)

    # page transfer: a run of pages as one verified byte buffer (docs/python.md, "Page transfer")
    def export_pages(self, seq: int, first: int = 0, count: int | None = None, heads=None) -> bytes:
        """The bytes of logical pages [first, first + count) of seq (count None: to the end, the
        open last page included), every layer, KV heads heads = (begin, count) (None: all), in
        tierkv's page-transfer format (docs/multigpu.md): compressed pages as stored, never
        dense tensors. Versioned and checksummed; CudaCache.import_pages reads the same bytes.
        The cache is not changed; a sequence with reserved, uncommitted tokens is refused."""
        count, hb, hc = transfer_args(count, heads)
        return tensor_bytes(ops.export_pages(self.state, seq, first, count, hb, hc))

    def import_pages(self, buf) -> int:
        """A NEW sequence holding the run of an export_pages buffer (bytes, bytearray, memoryview
        or a 1-D uint8 CPU tensor; of this cache, another Cache or a CudaCache of the same
        formats, geometry, layers and codec_seed): returns its id, its logical page 0 the run's
        first page. All or nothing: a damaged buffer (ValueError), a foreign one (ValueError) or
        too little room (RuntimeError) changes nothing."""
        return ops.import_pages(self.state, transfer_tensor(buf))

    # writes: reserve -> write each layer -> commit, or append (all layers at once)
    def reserve(self, seqs, counts) -> None:
        counts = counts if isinstance(counts, torch.Tensor) else torch.tensor(list(counts), dtype=torch.int64)
        ops.reserve(self.state, seq_tensor(seqs), counts)

    def write(self, layer: int, seqs, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [reserved tokens of the batch, kv_heads, head_dim], batch order."""
        ops.write(self.state, layer, seq_tensor(seqs), k, v)

    def commit(self, seqs) -> None:
        ops.commit(self.state, seq_tensor(seqs))

    def cancel(self, seqs) -> None:
        ops.cancel(self.state, seq_tensor(seqs))

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_layers, tokens, kv_heads, head_dim]."""
        ops.append(self.state, seq, k, v)

    # attention
    def decode(self, layer: int, seqs, q: torch.Tensor, *, window: int = 0):
        """q [batch, q_heads, head_dim] -> (out like q, lse float32 [batch, q_heads]); window > 0:
        each query attends its sequence's last `window` positions only (sliding-window layers)."""
        return ops.decode(self.state, layer, seq_tensor(seqs), q, window)

    def prefill(self, layer: int, seqs, q: torch.Tensor, q_indptr, *, window: int = 0):
        """q [total, q_heads, head_dim]; sequence b's chunk is its last q_indptr[b+1]-q_indptr[b]
        tokens (committed or reserved), causal (window > 0: a query at p attends (p - window,
        p]). -> (out like q, lse [total, q_heads])."""
        if not isinstance(q_indptr, torch.Tensor):
            q_indptr = torch.tensor(list(q_indptr), dtype=torch.int32)
        return ops.prefill(self.state, layer, seq_tensor(seqs), q, q_indptr, window)

    # tiering and accounting
    def retier(self, step: int) -> dict:
        return dict(zip(RETIER_FIELDS, ops.retier(self.state, step).tolist()))

    def report(self) -> dict:
        return parse_report(ops.report(self.state).tolist())

    def report_text(self) -> str:
        return ops.report_text(self.state)

    def pin(self, seq: int, first_page: int, pages: int, pinned: bool = True) -> None:
        ops.pin(self.state, seq, first_page, pages, pinned)

    def read_layer(self, seq: int, layer: int, first: int = 0, n: int | None = None):
        """Decoded keys and values [n, kv_heads, head_dim] (float32) of tokens [first, first+n)."""
        if n is None:
            n = self.length(seq) + self.reserved(seq) - first
        return ops.read_layer(self.state, seq, layer, first, n)

    def page_tiers(self, seq: int, layer: int) -> list[int]:
        return ops.page_tiers(self.state, seq, layer).tolist()

    def __repr__(self) -> str:
        return describe("tierkv.Cache", self)

