# SPDX-License-Identifier: Apache-2.0
"""FlashInfer-style plan/run wrappers over a tierkv.Cache.

FlashInfer's wrappers plan over an engine's page table (indptr, indices, last_page_len); a
tierkv cache owns its page tables, so plan() takes the batch's sequence ids (and, for
prefill, qo_indptr), checks them against the cache once, and run() attends one layer.
"""

from __future__ import annotations

import torch

from .cache import Cache, seq_tensor


class BatchDecodeWrapper:
    """plan(seqs) once per step, then run(q, layer) for every layer: one query per sequence."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self._seqs: torch.Tensor | None = None

    def plan(self, seqs) -> None:
        seqs = seq_tensor(seqs)
        if seqs.dim() != 1 or seqs.numel() < 1:
            raise ValueError(f"BatchDecodeWrapper.plan: seqs must be a non-empty 1-D list, got shape {tuple(seqs.shape)}")
        for s in seqs.tolist():
            if self.cache.length(s) + self.cache.reserved(s) < 1:
                raise ValueError(f"BatchDecodeWrapper.plan: sequence {s} holds no tokens to attend to")
        self._seqs = seqs

    def run(self, q: torch.Tensor, layer: int, *, return_lse: bool = False):
        """q [batch, q_heads, head_dim] -> out (like q), and lse [batch, q_heads] if asked."""
        if self._seqs is None:
            raise RuntimeError("BatchDecodeWrapper.run: call plan() first")
        out, lse = self.cache.decode(layer, self._seqs, q)
        return (out, lse) if return_lse else out


class BatchPrefillWrapper:
    """plan(seqs, qo_indptr) once per step, then run(q, layer): sequence b's queries are its
    last qo_indptr[b+1] - qo_indptr[b] tokens (written before run), attending causally."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self._seqs: torch.Tensor | None = None
        self._indptr: torch.Tensor | None = None

    def plan(self, seqs, qo_indptr) -> None:
        seqs = seq_tensor(seqs)
        ip = qo_indptr if isinstance(qo_indptr, torch.Tensor) else torch.tensor(list(qo_indptr))
        ip = ip.to(torch.int32)
        if ip.dim() != 1 or ip.numel() != seqs.numel() + 1:
            raise ValueError(
                f"BatchPrefillWrapper.plan: qo_indptr needs batch + 1 = {seqs.numel() + 1} entries, got shape {tuple(ip.shape)}"
            )
        lens = (ip[1:] - ip[:-1]).tolist()
        for b, (s, n) in enumerate(zip(seqs.tolist(), lens)):
            have = self.cache.length(s) + self.cache.reserved(s)
            if n < 0 or n > have:
                raise ValueError(
                    f"BatchPrefillWrapper.plan: chunk of batch entry {b} (sequence {s}) is {n} tokens; "
                    f"it must lie in [0, {have}] (the sequence's written tokens)"
                )
        self._seqs, self._indptr = seqs, ip

    def run(self, q: torch.Tensor, layer: int, *, return_lse: bool = False):
        """q [qo_indptr[-1], q_heads, head_dim] -> out (like q), and lse if asked."""
        if self._seqs is None:
            raise RuntimeError("BatchPrefillWrapper.run: call plan() first")
        out, lse = self.cache.prefill(layer, self._seqs, q, self._indptr)
        return (out, lse) if return_lse else out
