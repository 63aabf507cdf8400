# SPDX-License-Identifier: Apache-2.0
"""Shared helpers: cache makers and a float64 attention reference."""

import math

import pytest
import torch

import tierkv

# Geometries the default prebuilt set holds (and the tests use).
GEOMETRIES = [  # (head_dim, kv_heads, group_size, page_size)
    (64, 1, 1, 16),
    (64, 4, 2, 16),
    (128, 1, 6, 64),
    (128, 4, 4, 16),
    (256, 1, 8, 16),
]
TIER_SETS = {  # name: (recent, cache_type_k, cache_type_v)
    "fp8+tq3": ("fp8", "tq3", "tq3"),
    "int8r+tq4k/tq3v": ("int8_rotated", "tq4", "tq3"),
    "int8r only": ("int8_rotated", "int8_rotated", "int8_rotated"),
}
# Sets with a Cold tier (cold_type_k, cold_type_v too), prebuilt at (64, 4, 2, 16) only.
COLD_SETS = {"int8r+tq4k/tq3v+cold tq3k/tq2v": ("int8_rotated", "tq4", "tq3", "tq3", "tq2")}
# Cold knobs that make pages of under half a uniform share of attention Cold at once.
COLD_KNOBS = dict(ema_alpha=1.0, cold_enter_mass=0.5, cold_leave_mass=1.0)


def set_kwargs(tier_set):
    """recent, cache_type_k, cache_type_v[, cold_type_k, cold_type_v] of a named test set."""
    names = {**TIER_SETS, **COLD_SETS}[tier_set]
    return dict(zip(("recent", "cache_type_k", "cache_type_v", "cold_type_k", "cold_type_v"), names))


def make_cache(geo=(64, 4, 2, 16), tier_set="int8r+tq4k/tq3v", num_layers=2, **kw):
    d, kv, g, p = geo
    opts = dict(
        max_tokens=4096,
        max_sequences=16,
        max_batch=16,
        max_pages=512,
        threads=2,
        keep_first_layers=0,
        keep_last_layers=0,
        min_dwell_steps=0,
    )
    opts.update(kw)
    return tierkv.Cache(
        head_dim=d,
        kv_heads=kv,
        group_size=g,
        page_size=p,
        num_layers=num_layers,
        **set_kwargs(tier_set),
        **opts,
    )


def reference(q, K, V, limit, group, scale=None):
    """float64 attention of query rows q [QH, D] over the first `limit` tokens of
    K, V [n, KVH, D]; query head h reads KV head h // group. -> (out [QH, D], lse [QH])."""
    q, K, V = q.double(), K[:limit].double(), V[:limit].double()
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    Kh = K.repeat_interleave(group, dim=1)  # [n, QH, D]
    Vh = V.repeat_interleave(group, dim=1)
    s = torch.einsum("hd,nhd->hn", q, Kh) * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    return torch.einsum("hn,nhd->hd", p, Vh), lse


def page_bits(cache):
    """Bits per K/V scalar of a TieredCache's pages, counted page by page: each (sequence,
    layer) page's tier (page_tiers) at that tier's page bytes, over every committed token."""
    c = cache.tierkv
    page_bytes = [t["page_bytes"] for t in c.report()["tiers"]]
    seqs = cache.seqs.tolist()
    stored = sum(page_bytes[t] for s in seqs for layer in range(c.num_layers) for t in c.page_tiers(s, layer))
    tokens = sum(c.length(s) for s in seqs)
    return 8.0 * stored / (tokens * c.num_layers * 2 * c.kv_heads * c.head_dim)


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
