# SPDX-License-Identifier: Apache-2.0
"""Fake (meta) implementations of the tierkv ops, so torch.compile / torch.export trace them.

They only shape outputs: attention returns q's shape and dtype plus a float32 LSE; ops that
change the cache return nothing (their `Tensor(a!) state` argument carries the ordering).
Ops whose result is data the graph cannot know (create_sequence, fork, length, report, ...)
are host control calls and get no fake: call them outside compiled regions.
"""

import torch

_lib = "tierkv::"


def _check_q(q, rows, what):
    torch._check(q.dim() == 3, lambda: f"tierkv.{what}: q must be 3-D, got {tuple(q.shape)}")
    torch._check(q.shape[0] == rows, lambda: f"tierkv.{what}: q has {q.shape[0]} rows, {rows} expected")


@torch.library.register_fake(_lib + "decode")
def _decode(state, layer, seqs, q, window=0):
    _check_q(q, seqs.shape[0], "decode")
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake(_lib + "prefill")
def _prefill(state, layer, seqs, q, q_indptr, window=0):
    torch._check(q.dim() == 3, lambda: f"tierkv.prefill: q must be 3-D, got {tuple(q.shape)}")
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake(_lib + "reserve")
def _reserve(state, seqs, counts):
    return None


@torch.library.register_fake(_lib + "write")
def _write(state, layer, seqs, k, v):
    return None


@torch.library.register_fake(_lib + "commit")
def _commit(state, seqs):
    return None


@torch.library.register_fake(_lib + "cancel")
def _cancel(state, seqs):
    return None


@torch.library.register_fake(_lib + "append")
def _append(state, seq, k, v):
    return None


@torch.library.register_fake(_lib + "retier")
def _retier(state, step):
    return state.new_empty((8,), dtype=torch.int64)


@torch.library.register_fake(_lib + "read_layer")
def _read_layer(state, seq, layer, first, n):
    raise NotImplementedError("tierkv.read_layer is a host inspection call; call it outside torch.compile")


@torch.library.register_fake(_lib + "export_pages")
def _export_pages(state, seq, first=0, count=-1, head_begin=0, head_count=-1):
    raise NotImplementedError("tierkv.export_pages is a host transfer call; call it outside torch.compile")
