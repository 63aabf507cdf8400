# SPDX-License-Identifier: Apache-2.0
"""tierkv.cuda: the cache wholly on the GPU (cuda::tiered_cache) from Python.

The GPU code lives in libtierkv_cuda.so, a C ABI library over the prebuilt set (csrc/cuda/capi.h)
that needs no particular torch build: it is loaded with ctypes, and the ops that run inside a
forward pass are torch custom ops registered here (torch.ops.tierkv.cuda_append, cuda_decode,
cuda_prefill), with fake implementations for torch.compile. They enqueue on torch's current
stream, so a forward pass over every layer can be captured in one CUDA graph and replayed at
every later step of the same batch:

    c = tierkv.CudaCache(head_dim=256, kv_heads=4, group_size=6, num_layers=16, max_tokens=...)
    seqs = [c.create_sequence() for _ in range(B)]
    c.begin_step(seqs, [1] * B)              # host: slots, index arrays (metadata only)
    for layer in range(L):                   # the forward pass (capturable)
        c.append(layer, k, v)                # [B, kv_heads, head_dim] bf16 or f32
        out = c.decode(layer, q)             # [B, q_heads, head_dim] over the mixed pages
    c.end_step()                             # page mass -> policy, retier on a side stream

The library is found next to this file (pip install with TIERKV_PYTHON_CUDA=1 builds it there)
or at $TIERKV_CUDA_LIB. Page bytes leave or enter the GPU only through export_pages /
import_pages (tierkv.Cache's byte format); see docs/gpu-cache.md.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from pathlib import Path
from typing import Sequence

import torch

from .cache import (
    RETIER_FIELDS,
    _token_ids,
    describe,
    parse_report,
    policy_knobs,
    pool_pages,
    set_names,
    tensor_bytes,
    tier_count,
    transfer_args,
    transfer_tensor,
)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_VALUE_ERRORS = {1, 2, 4, 6, 8}  # invalid_argument, out_of_range, stale_id, non_finite_input, geometry_mismatch
_CORRUPT_DATA = 9  # a ValueError where the argument is the data checked (import_pages' buffer)


class _Config(ctypes.Structure):
    _fields_ = [
        ("recent", ctypes.c_char_p),
        ("cache_type_k", ctypes.c_char_p),
        ("cache_type_v", ctypes.c_char_p),
        ("cold_type_k", ctypes.c_char_p),
        ("cold_type_v", ctypes.c_char_p),
        ("head_dim", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("group_size", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("num_layers", ctypes.c_int64),
        ("num_tiers", ctypes.c_int64),
        ("pages_per_tier", ctypes.c_int64 * 8),
        ("max_sequences", ctypes.c_int64),
        ("max_batch", ctypes.c_int64),
        ("max_pages", ctypes.c_int64),
        ("max_step_tokens", ctypes.c_int64),
        ("max_retier_pages", ctypes.c_int64),
        ("max_chunks_per_seq", ctypes.c_int64),
        ("mass_layers_per_step", ctypes.c_int64),
        ("softmax_scale", ctypes.c_double),
        ("codec_seed", ctypes.c_uint64),
        ("policy", ctypes.c_char_p),
        ("num_policy_knobs", ctypes.c_int64),
        ("knob_names", ctypes.POINTER(ctypes.c_char_p)),
        ("knob_values", ctypes.POINTER(ctypes.c_double)),
        ("center", ctypes.c_int64),
        ("bits_per_scalar", ctypes.c_double),
        ("host_pool_bytes", ctypes.c_int64),
    ]


_lib = None


def library_path() -> Path:
    env = os.environ.get("TIERKV_CUDA_LIB")
    return Path(env) if env else Path(__file__).resolve().parent / "libtierkv_cuda.so"


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if not path.is_file():
        raise RuntimeError(
            f"tierkv.cuda: {path} not found: build the package with TIERKV_PYTHON_CUDA=1 "
            "(pip install --no-build-isolation ./python) or point TIERKV_CUDA_LIB at a libtierkv_cuda.so"
        )
    lib = ctypes.CDLL(str(path))
    if lib.tkv_cuda_abi_version() != 7:
        raise RuntimeError(f"tierkv.cuda: {path} has C ABI version {lib.tkv_cuda_abi_version()}, this package speaks 7")
    vp, i64, i32p = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)
    sig = {
        "tkv_cuda_last_error": ([], ctypes.c_char_p),
        "tkv_cuda_built": ([i32p, ctypes.c_int], ctypes.c_int),
        "tkv_cuda_tier_set_name": ([ctypes.c_int], ctypes.c_char_p),
        "tkv_cuda_create": ([ctypes.POINTER(_Config), vp, ctypes.POINTER(vp)], ctypes.c_int),
        "tkv_cuda_destroy": ([vp], ctypes.c_int),
        "tkv_cuda_num_tiers": ([vp, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_create_sequence": ([vp, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_fork": ([vp, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_release": ([vp, i64], ctypes.c_int),
        "tkv_cuda_length": ([vp, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_set_stream": ([vp, vp], ctypes.c_int),
        "tkv_cuda_begin_step": ([vp, vp, vp, i64], ctypes.c_int),
        "tkv_cuda_append": ([vp, i64, vp, vp, ctypes.c_int, vp], ctypes.c_int),
        "tkv_cuda_decode": ([vp, i64, vp, ctypes.c_int, vp, ctypes.c_int, vp, vp], ctypes.c_int),
        "tkv_cuda_decode_ex": (
            [vp, i64, vp, ctypes.c_int, vp, ctypes.c_int, vp, ctypes.c_float, i64, vp],
            ctypes.c_int,
        ),
        "tkv_cuda_prefill": (
            [vp, i64, vp, ctypes.c_int, vp, ctypes.c_int, vp, ctypes.c_float, i64, vp],
            ctypes.c_int,
        ),
        "tkv_cuda_end_step": ([vp, ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
        "tkv_cuda_report": ([vp, ctypes.POINTER(ctypes.c_double), ctypes.c_int], ctypes.c_int),
        "tkv_cuda_report_text": ([vp, ctypes.c_char_p, i64], i64),
        "tkv_cuda_pin": ([vp, i64, i64, i64, ctypes.c_int], ctypes.c_int),
        "tkv_cuda_page_tiers": ([vp, i64, i64, ctypes.POINTER(i64), i64], i64),
        "tkv_cuda_check_invariants": ([vp], ctypes.c_int),
        "tkv_cuda_device_error": ([vp], ctypes.c_int),
        "tkv_cuda_transfers": ([vp, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
        "tkv_cuda_host_times": ([vp, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
        "tkv_cuda_retier_totals": ([vp, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
        "tkv_cuda_prefix_insert": ([vp, i64, ctypes.c_uint64, i32p, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_prefix_start": ([vp, ctypes.c_uint64, i32p, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_prefix_evict": ([vp, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_drain": ([vp], ctypes.c_int),
        "tkv_cuda_export_pages": (
            [vp, i64, i64, i64, i64, i64, ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(i64)],
            ctypes.c_int,
        ),
        "tkv_cuda_free_buffer": ([vp], None),
        "tkv_cuda_import_pages": ([vp, vp, i64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_offload": ([vp, i64, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
        "tkv_cuda_restore": ([vp, ctypes.c_uint64, ctypes.POINTER(i64)], ctypes.c_int),
        "tkv_cuda_drop_parked": ([vp, ctypes.c_uint64], ctypes.c_int),
        "tkv_cuda_restore_pending": ([vp, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
        "tkv_cuda_host_stats": ([vp, ctypes.POINTER(ctypes.c_uint64)], ctypes.c_int),
    }
    for name, (args, res) in sig.items():
        try:
            f = getattr(lib, name)
        except AttributeError:
            raise RuntimeError(f"tierkv.cuda: {path} has no {name}: it predates this package, rebuild it") from None
        f.argtypes, f.restype = args, res
    _lib = lib
    return lib


def _check(rc: int, value_errors=_VALUE_ERRORS) -> None:
    if rc == 0:
        return
    msg = "tierkv.cuda." + _lib.tkv_cuda_last_error().decode()
    raise (ValueError if rc in value_errors else RuntimeError)(msg)


def built() -> list[dict]:
    """The combinations libtierkv_cuda.so was built with."""
    lib = _load()
    n = lib.tkv_cuda_built(None, 0)
    rows = (ctypes.c_int32 * (5 * n))()
    lib.tkv_cuda_built(rows, n)
    out = []
    for i in range(n):
        s, d, kv, g, p = rows[5 * i : 5 * i + 5]
        names = set_names(lib.tkv_cuda_tier_set_name(s).decode())
        out.append(dict(**names, head_dim=d, kv_heads=kv, group_size=g, page_size=p))
    return out


def _int32_ids(tokens):
    """Token ids as a ctypes int32 array and its length (what _token_ids takes)."""
    ids = _token_ids(tokens)
    outside = ((ids < -(2**31)) | (ids >= 2**31)).nonzero()
    if len(outside):
        i = int(outside[0])
        raise ValueError(f"tierkv.cuda: tokens[{i}] = {int(ids[i])} does not fit int32")
    return (ctypes.c_int32 * max(1, len(ids)))(*ids.tolist()), len(ids)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# The live caches, by the handle their state tensor names (the custom ops find them here).
_caches: dict[int, "CudaCache"] = {}


class CudaCache:
    """A tiered KV cache wholly in GPU memory (cuda::tiered_cache), chosen by run-time names.

    Formats, policy and capacity as tierkv.Cache (recent, cache_type_k, cache_type_v, cold_type_k,
    cold_type_v; policy, policy_options and the knob keywords; pages_per_tier or
    max_tokens), plus the GPU façade's capacities: max_batch sequences and max_step_tokens new
    tokens per step, max_pages logical pages per sequence, max_retier_pages conversions per GPU
    batch, mass_layers_per_step layers whose page mass feeds the policy each step. The
    combination must be in built(); otherwise construction fails naming what was built.
    center=True subtracts a per-(layer, KV head) channel mean from keys and values before they
    are encoded (estimated from a layer's first append) and adds it back to decode's and
    prefill's outputs and LSE exactly (docs/gpu-cache.md, Centring); a soft-cap is then refused.
    bits_per_scalar > 0 sets a bit budget as tierkv.Cache's. host_pool_bytes > 0 gives the
    cache a host tier of that much pinned memory: offload() parks a whole sequence there in its
    compressed pages and restore() brings it back (docs/gpu-cache.md, "Host tier").
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
        max_step_tokens: int = 4096,
        max_retier_pages: int = 1024,
        max_chunks_per_seq: int = 64,
        mass_layers_per_step: int = 1,
        softmax_scale: float = 0.0,
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
        host_pool_bytes: int = 0,
        device=None,
    ):
        lib = _load()
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"tierkv.CudaCache: device must be a CUDA device, got {device}")
        # an index always, so tensors' devices compare equal to it
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        tiers = tier_count(recent, cache_type_k, cache_type_v, cold_type_k, cold_type_v)
        if pages_per_tier is None:
            if max_tokens is None:
                raise ValueError("tierkv.CudaCache: give pages_per_tier or max_tokens")
            pages_per_tier = pool_pages(max_tokens, page_size, max_sequences, num_layers, tiers)
        if not 1 <= len(pages_per_tier) <= 8:
            raise ValueError(f"tierkv.CudaCache: pages_per_tier has {len(pages_per_tier)} entries")
        knob_names, knob_values = policy_knobs(
            policy, policy_options, dict(recent_pages=recent_pages, sink_pages=sink_pages,
                                         keep_first_layers=keep_first_layers, keep_last_layers=keep_last_layers,
                                         min_dwell_steps=min_dwell_steps), bits_per_scalar)  # fmt: skip
        names_c = (ctypes.c_char_p * max(1, len(knob_names)))(*[n.encode() for n in knob_names])
        values_c = (ctypes.c_double * max(1, len(knob_values)))(*knob_values)
        cfg = _Config(
            recent.encode(), cache_type_k.encode(), cache_type_v.encode(),
            cold_type_k.encode() if cold_type_k is not None else None,
            cold_type_v.encode() if cold_type_v is not None else None,
            head_dim, kv_heads, group_size, page_size, num_layers, len(pages_per_tier),
            (ctypes.c_int64 * 8)(*pages_per_tier), max_sequences, max_batch, max_pages,
            max_step_tokens, max_retier_pages, max_chunks_per_seq, mass_layers_per_step,
            float(softmax_scale), codec_seed, policy.encode(), len(knob_names), names_c, values_c,
            int(bool(center)), float(bits_per_scalar), int(host_pool_bytes),
        )  # fmt: skip
        handle = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(lib.tkv_cuda_create(ctypes.byref(cfg), _stream(self.device), ctypes.byref(handle)))
        self._h = handle.value
        n = ctypes.c_int64()
        _check(lib.tkv_cuda_num_tiers(self._h, ctypes.byref(n)))
        self.num_tiers = n.value
        self.head_dim, self.kv_heads, self.group_size = head_dim, kv_heads, group_size
        self.q_heads = kv_heads * group_size
        self.page_size, self.num_layers = page_size, num_layers
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        self.formats = (recent, cache_type_k, cache_type_v) + ((cold_type_k, cold_type_v) if tiers == 3 else ())
        self.center = bool(center)
        self.policy = policy
        # ops' state: {handle, mutation count} (the custom ops' ordering under torch.compile)
        self.state = torch.tensor([self._h, 0], dtype=torch.int64)
        self._batch: list[int] = []
        self._step_tokens = 0
        self._stepping = False
        self._steps = 0
        _caches[self._h] = self
        self._finalizer = weakref.finalize(self, CudaCache._destroy, self._h)

    @staticmethod
    def _destroy(h: int) -> None:
        _caches.pop(h, None)
        _lib.tkv_cuda_destroy(h)

    def close(self) -> None:
        """Frees the cache's GPU memory now (otherwise when the object is collected)."""
        self._finalizer()

    # sequences (between steps)
    def create_sequence(self) -> int:
        out = ctypes.c_int64()
        _check(_lib.tkv_cuda_create_sequence(self._h, ctypes.byref(out)))
        return out.value

    def fork(self, parent: int) -> int:
        out = ctypes.c_int64()
        _check(_lib.tkv_cuda_fork(self._h, parent, ctypes.byref(out)))
        return out.value

    def release(self, seq: int) -> None:
        _check(_lib.tkv_cuda_release(self._h, seq))

    # prefix reuse (between steps): sealed pages shared by reference, no page bytes move
    def insert_prefix(self, seq: int, tokens, salt: int = 0) -> int:
        """Caches seq's full pages that tokens (its first len(tokens) token ids) cover, under
        salt (model, adapter, tenant). Returns the new entries."""
        ids, n = _int32_ids(tokens)
        out = ctypes.c_int64()
        _check(_lib.tkv_cuda_prefix_insert(self._h, seq, salt, ids, n, ctypes.byref(out)))
        return out.value

    def start_from_prefix(self, tokens, salt: int = 0) -> tuple[int, int]:
        """A new sequence holding the longest cached prefix of tokens (whole pages): returns
        (sequence, cached tokens); begin_step adds the rest of the prompt."""
        ids, n = _int32_ids(tokens)
        out = (ctypes.c_int64 * 2)()
        _check(_lib.tkv_cuda_prefix_start(self._h, salt, ids, n, out))
        return out[0], out[1]

    def evict_prefixes(self, n: int) -> int:
        """Drops up to n least recently used prefix entries no sequence uses; how many went."""
        out = ctypes.c_int64()
        _check(_lib.tkv_cuda_prefix_evict(self._h, n, ctypes.byref(out)))
        return out.value

    def drain(self) -> None:
        """Finishes the conversion batch in flight and gives replaced pages back (waits for the
        GPU): afterwards report() shows only pages that sequences or prefix entries hold."""
        _check(_lib.tkv_cuda_drain(self._h))

    # page transfer (between steps): tierkv.Cache's bytes, so buffers move between the two
    def export_pages(self, seq: int, first: int = 0, count: int | None = None, heads=None) -> bytes:
        """The bytes of logical pages [first, first + count) of seq (count None: to the end),
        every layer, KV heads heads = (begin, count) (None: all): tierkv.Cache.export_pages's
        format, byte for byte. The pages are copied to the host on the cache's stream after
        every write enqueued before them (blocks until done); the cache is not changed."""
        count, hb, hc = transfer_args(count, heads)
        buffer, data, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int64()
        _check(
            _lib.tkv_cuda_export_pages(
                self._h, seq, first, count, hb, hc, ctypes.byref(buffer), ctypes.byref(data), ctypes.byref(n)
            )
        )
        try:
            return ctypes.string_at(data.value, n.value) if n.value else b""
        finally:
            _lib.tkv_cuda_free_buffer(buffer)

    def import_pages(self, buf) -> int:
        """A NEW sequence holding the run of an export_pages buffer (this cache's, another
        CudaCache's or a tierkv.Cache's of the same formats, geometry, layers and codec_seed;
        bytes-like or a 1-D uint8 CPU tensor): returns its id. Verified on the host, then copied
        to the GPU on the cache's stream (blocks until done). All or nothing: a damaged buffer
        (ValueError), a foreign one (ValueError) or too little room (RuntimeError) changes
        nothing. When only the Recent tier is short it demotes sealed pages first, as begin_step
        does under memory pressure."""
        t = transfer_tensor(buf)
        out = ctypes.c_int64()
        rc = _lib.tkv_cuda_import_pages(self._h, t.data_ptr() if t.numel() else None, t.numel(), ctypes.byref(out))
        _check(rc, _VALUE_ERRORS | {_CORRUPT_DATA})
        return out.value

    # the host tier (between steps): whole sequences parked in pinned host memory
    def offload(self, seq: int) -> int:
        """Parks every page of seq, in its tier's format, in the host tier (host_pool_bytes of
        pinned memory) and releases seq on the GPU; returns the parked id restore() takes. The
        copy is queued on the cache's stream (the host does not wait). Too little host memory
        (RuntimeError naming the bytes needed) or a bad seq changes nothing."""
        out = ctypes.c_uint64()
        _check(_lib.tkv_cuda_offload(self._h, seq, ctypes.byref(out)))
        return out.value

    def restore(self, parked: int) -> int:
        """A NEW sequence holding a parked sequence's pages, byte for byte (same tiers, same
        length); the parked id is consumed. Too little room on the GPU (RuntimeError) leaves it
        parked and the cache as it was; when only the Recent tier is short, sealed pages are
        demoted first, as begin_step does. The copy runs on the host tier's own stream: steps of
        other sequences issued meanwhile overlap it, and the first work that touches the new
        sequence waits for it on the GPU (restore_pending says whether it may still run)."""
        out = ctypes.c_int64()
        _check(_lib.tkv_cuda_restore(self._h, parked, ctypes.byref(out)))
        return out.value

    def restore_pending(self, seq: int) -> bool:
        """Whether seq's restore copy may still be running (a step including seq would wait for
        it on the GPU; a scheduler can step other sequences meanwhile)."""
        out = ctypes.c_int()
        _check(_lib.tkv_cuda_restore_pending(self._h, seq, ctypes.byref(out)))
        return bool(out.value)

    def drop_parked(self, parked: int) -> None:
        """Forgets a parked sequence (its host memory is reused once its copy has run)."""
        _check(_lib.tkv_cuda_drop_parked(self._h, parked))

    def host_stats(self) -> dict:
        """The host tier: capacity, used and largest free run (bytes), parked sequences, offloads,
        restores, drops, and page bytes offloaded and restored since the cache was made."""
        out = (ctypes.c_uint64 * 9)()
        _check(_lib.tkv_cuda_host_stats(self._h, out))
        names = ("capacity_bytes", "used_bytes", "largest_free_bytes", "parked", "offloads",
                 "restores", "drops", "bytes_offloaded", "bytes_restored")  # fmt: skip
        return dict(zip(names, out))

    def length(self, seq: int) -> int:
        """Committed tokens (a step's tokens are committed by begin_step)."""
        out = ctypes.c_int64()
        _check(_lib.tkv_cuda_length(self._h, seq, ctypes.byref(out)))
        return out.value

    # the step
    def begin_step(self, seqs: Sequence[int], counts: Sequence[int]) -> None:
        """Adds counts[b] new tokens to seqs[b] (0: decode only) on torch's current stream, which
        becomes the cache's stream: slots, index arrays and the decode plan (metadata only)."""
        seqs, counts = [int(s) for s in seqs], [int(n) for n in counts]
        _check(_lib.tkv_cuda_set_stream(self._h, _stream(self.device)))
        s = (ctypes.c_int64 * len(seqs))(*seqs)
        n = (ctypes.c_int32 * len(counts))(*counts)
        _check(_lib.tkv_cuda_begin_step(self._h, s, n, len(seqs)))
        self._batch, self._step_tokens, self._stepping = seqs, sum(counts), True

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [step tokens, kv_heads, head_dim] (bf16 or f32, on the cache's device), batch order."""
        torch.ops.tierkv.cuda_append(self.state, layer, k, v)

    def decode(self, layer: int, q: torch.Tensor, *, soft_cap: float = 0.0, window: int = 0, return_lse: bool = False):
        """q [batch, q_heads, head_dim] (bf16 or f32; f16 is computed as f32) -> out like q.
        soft_cap > 0 caps the logits (s -> soft_cap tanh(s / soft_cap)); window > 0 attends the
        last `window` positions only (a sliding-window layer)."""
        out, lse = torch.ops.tierkv.cuda_decode(self.state, layer, q, float(soft_cap), int(window))
        return (out, lse) if return_lse else out

    def prefill(self, layer: int, q: torch.Tensor, *, soft_cap: float = 0.0, window: int = 0, return_lse: bool = False):
        """q [step tokens, q_heads, head_dim]: each sequence's new tokens of this step attend its
        whole sequence causally (window > 0: the last `window` positions) -> out like q."""
        out, lse = torch.ops.tierkv.cuda_prefill(self.state, layer, q, float(soft_cap), int(window))
        return (out, lse) if return_lse else out

    def end_step(self, step: int | None = None, *, wait: bool = False) -> dict:
        """Waits for the step's work, feeds the sampled page masses to the policy and enqueues
        the conversions it asks for on the side stream (wait: finishes them too)."""
        self._steps += 1
        stats = (ctypes.c_uint64 * 8)()
        self._stepping = False
        _check(_lib.tkv_cuda_end_step(self._h, self._steps if step is None else step, int(wait), stats))
        return dict(zip(RETIER_FIELDS, list(stats)))

    def retier_totals(self) -> dict:
        """Every conversion since creation: end_step's, make_room's (begin_step under memory
        pressure) and drain's, in end_step's fields."""
        t = (ctypes.c_uint64 * 8)()
        _check(_lib.tkv_cuda_retier_totals(self._h, t))
        return dict(zip(RETIER_FIELDS, list(t)))

    @property
    def batch(self) -> list[int]:
        """The sequences of the step in flight (begin_step's order)."""
        return list(self._batch)

    # accounting and inspection
    def report(self) -> dict:
        n = _lib.tkv_cuda_report(self._h, None, 0)
        if n < 0:
            _check(-n)
        v = (ctypes.c_double * n)()
        _lib.tkv_cuda_report(self._h, v, n)
        return parse_report(list(v))

    def report_text(self) -> str:
        n = _lib.tkv_cuda_report_text(self._h, None, 0)
        if n < 0:
            _check(-n)
        buf = ctypes.create_string_buffer(n + 1)
        _lib.tkv_cuda_report_text(self._h, buf, n + 1)
        return buf.value.decode()

    def pin(self, seq: int, first_page: int, pages: int, pinned: bool = True) -> None:
        _check(_lib.tkv_cuda_pin(self._h, seq, first_page, pages, int(pinned)))

    def page_tiers(self, seq: int, layer: int) -> list[int]:
        n = _lib.tkv_cuda_page_tiers(self._h, seq, layer, None, 0)
        if n < 0:
            _check(-n)
        t = (ctypes.c_int64 * max(1, n))()
        _lib.tkv_cuda_page_tiers(self._h, seq, layer, t, n)
        return list(t[:n])

    def check_invariants(self) -> None:
        _check(_lib.tkv_cuda_check_invariants(self._h))

    def device_error(self) -> None:
        """Raises if the last step's kernels found a bad page slot or chunk (synchronizes)."""
        _check(_lib.tkv_cuda_device_error(self._h))

    def transfers(self) -> dict:
        t = (ctypes.c_uint64 * 3)()
        _check(_lib.tkv_cuda_transfers(self._h, t))
        return dict(h2d_metadata_bytes=t[0], d2h_metadata_bytes=t[1], page_bytes=t[2])

    def host_times(self) -> dict:
        """Host seconds spent since creation, by part: steps (end_step calls), begin_step (of
        which make_room: demotions under memory pressure, index: index arrays and decode plan),
        end_step (of which mass_wait: waiting for the previous step's page masses, mass_fold:
        feeding them to the policy, plan, retier: publishing and enqueueing conversions)."""
        t = (ctypes.c_uint64 * 9)()
        _check(_lib.tkv_cuda_host_times(self._h, t))
        names = ("begin_step", "make_room", "index", "end_step", "mass_wait", "mass_fold", "plan", "retier")
        return dict(steps=t[0], **{n: t[i + 1] * 1e-9 for i, n in enumerate(names)})

    def __repr__(self) -> str:
        return describe("tierkv.CudaCache", self, f", device={str(self.device)!r}")


# ---- the custom ops: what runs inside a forward pass ----------------------------------------


def _cache_of(state: torch.Tensor) -> CudaCache:
    c = _caches.get(int(state[0]))
    if c is None:
        raise ValueError(f"tierkv.cuda: no live CudaCache with handle {int(state[0])}")
    if not c._stepping:
        raise ValueError("tierkv.cuda: call begin_step first")
    return c


def _check_tensor(x: torch.Tensor, name: str, c: CudaCache, shape: tuple) -> None:
    if x.device != c.device:
        raise ValueError(f"tierkv.cuda: {name} is on {x.device}, the cache on {c.device}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"tierkv.cuda: {name} is {x.dtype}; float32 and bfloat16 are supported")
    if tuple(x.shape) != shape:
        raise ValueError(f"tierkv.cuda: {name} has shape {tuple(x.shape)}, {shape} expected")
    if not x.is_contiguous():
        raise ValueError(f"tierkv.cuda: {name} must be contiguous")


def _as_query(q: torch.Tensor) -> torch.Tensor:
    return q.float() if q.dtype == torch.float16 else q


@torch.library.custom_op("tierkv::cuda_append", mutates_args=("state",))
def cuda_append(state: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    c = _cache_of(state)
    shape = (c._step_tokens, c.kv_heads, c.head_dim)
    _check_tensor(k, "k", c, shape)
    _check_tensor(v, "v", c, shape)
    if k.dtype != v.dtype:
        raise ValueError(f"tierkv.cuda: k is {k.dtype} and v {v.dtype}")
    _check(_lib.tkv_cuda_append(c._h, layer, k.data_ptr(), v.data_ptr(), _DTYPES[k.dtype], _stream(c.device)))
    state[1] += 1


@cuda_append.register_fake
def _(state, layer, k, v):
    return None


@torch.library.custom_op("tierkv::cuda_decode", mutates_args=())
def cuda_decode(
    state: torch.Tensor, layer: int, q: torch.Tensor, soft_cap: float = 0.0, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    c = _cache_of(state)
    qq = _as_query(q)
    _check_tensor(qq, "q", c, (len(c._batch), c.q_heads, c.head_dim))
    out = torch.empty_like(qq)
    lse = torch.empty(qq.shape[:2], dtype=torch.float32, device=q.device)
    t = _DTYPES[qq.dtype]
    rc = _lib.tkv_cuda_decode_ex(
        c._h, layer, qq.data_ptr(), t, out.data_ptr(), t, lse.data_ptr(), soft_cap, window, _stream(c.device)
    )
    _check(rc)
    return out.to(q.dtype), lse


@cuda_decode.register_fake
def _(state, layer, q, soft_cap=0.0, window=0):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("tierkv::cuda_prefill", mutates_args=())
def cuda_prefill(
    state: torch.Tensor, layer: int, q: torch.Tensor, soft_cap: float, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    c = _cache_of(state)
    qq = _as_query(q)
    _check_tensor(qq, "q", c, (c._step_tokens, c.q_heads, c.head_dim))
    out = torch.empty_like(qq)
    lse = torch.empty(qq.shape[:2], dtype=torch.float32, device=q.device)
    t = _DTYPES[qq.dtype]
    rc = _lib.tkv_cuda_prefill(
        c._h, layer, qq.data_ptr(), t, out.data_ptr(), t, lse.data_ptr(), soft_cap, window, _stream(c.device)
    )
    _check(rc)
    return out.to(q.dtype), lse


@cuda_prefill.register_fake
def _(state, layer, q, soft_cap, window):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
