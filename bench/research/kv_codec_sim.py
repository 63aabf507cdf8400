#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Float64 simulation of candidate KV-cache codecs on real SmolLM2-135M keys, values and queries.

Reads dumps written by `smollm dump` (examples/smollm/kv_dump.hpp; bench/research/README.md),
codes every (layer, KV head)'s keys and values with each candidate codec, and measures what
attention sees: key logit error and attention-probability error against the real queries of
later tokens (causal, softmax over every earlier token, scale 1/sqrt(64)), value relative MSE,
and the attention-output relative error ||o - o_ref|| / ||o_ref|| per (layer, query head,
query) with keys and values coded (and with only one of them coded). Bits per stored scalar are
counted exactly: payload + per-vector metadata + per-page metadata + per-sequence metadata (the
channel means), for 16-token pages of one (layer, KV head) unless a design says otherwise.

Setting ("cold", the default): the sink page (tokens 0-15) and each query's newest 4 pages
(its own and the 3 before, 16-token pages) stay exact, as tierkv's recency_anchor policy keeps
them 8-bit; every other key/value the query sees is read from the candidate's codes.
`--setting all` codes every token.

Calibrated designs (KLT, channel variances, trained codebooks) take their statistics from the
OTHER text's dump (cross-text), so nothing is fitted to the vectors it is measured on. The
attention mass used by mass-aware designs comes from a disjoint set of "calibration" queries
of the same text (positions offset from the evaluation queries), standing in for the queries a
tier controller has already seen.

Usage (one process, numpy only):
  python3 bench/research/kv_codec_sim.py --dumps build/research/dump/licence,build/research/dump/source \
      --out build/research/sim.json [--candidates REGEX] [--layers 0-29] [--queries 512]
"""

import argparse
import json
import math
import os
import re
import sys
import time

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # one thread: BLAS threads on a busy machine cost 5x

import numpy as np  # noqa: E402

D = 64
PAGE = 16
SCALE = 1.0 / math.sqrt(D)
RECENT_PAGES = 4
SINK_TOKENS = 16
CENTER_TOKENS = 512  # the library estimates the channel means from the first chunk (512 tokens)

# ----------------------------------------------------------------------------- data


def load_dump(prefix):
    with open(prefix + ".json") as f:
        h = json.load(f)
    base = os.path.dirname(prefix)
    arr = {}
    for key in ("k", "v", "q"):
        shape = tuple(h[key]["shape"])
        arr[key] = np.memmap(os.path.join(base, h[key]["file"]), dtype="<f4", mode="r", shape=shape)
    return h, arr


# ----------------------------------------------------------------------------- number formats


def bf16(x):
    """Round float64 to bf16 (round to nearest even via float32), returned as float64."""
    f = np.asarray(x, dtype=np.float32)
    b = f.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def round_mantissa(x, mbits):
    """Round positive x to mbits explicit mantissa bits (a float format with enough exponent)."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m 2^e, m in [0.5, 1)
    s = 2.0 ** (mbits + 1)
    return np.ldexp(np.round(m * s) / s, e)


# ----------------------------------------------------------------------------- grids


def lloyd_max_gaussian(levels, iters=300):
    """Lloyd-Max levels for N(0, 1) (numerical, fine grid)."""
    x = np.linspace(-8, 8, 64001)
    w = np.exp(-0.5 * x * x)
    w /= w.sum()
    c = np.linspace(-2, 2, levels) if levels > 1 else np.zeros(1)
    for _ in range(iters):
        t = 0.5 * (c[1:] + c[:-1])
        idx = np.searchsorted(t, x)
        num = np.bincount(idx, weights=w * x, minlength=levels)
        den = np.bincount(idx, weights=w, minlength=levels)
        c = num / np.maximum(den, 1e-300)
    return c


LM = {b: lloyd_max_gaussian(2**b) for b in range(1, 7)}
LM[0] = np.zeros(1)
TQ3_LEVELS = np.array([-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519])
TQ2_LEVELS = np.array([-1.5104, -0.4528, 0.4528, 1.5104])
TQ4_LEVELS = (np.arange(16) - 7.5) * 0.3352
UNIFORM = {b: (np.arange(2**b) - (2**b - 1) / 2) * s for b, s in [(5, 0.1881), (6, 0.1041), (7, 0.0569), (8, 0.0308)]}


def grid_for(bits, kind="tq"):
    """Unit-variance scalar grid at `bits` bits: TQ's grids for 2-4 bits, Lloyd-Max / uniform above."""
    if bits == 0:
        return np.zeros(1)
    if kind == "tq":
        if bits == 2:
            return TQ2_LEVELS
        if bits == 3:
            return TQ3_LEVELS
        if bits == 4:
            return TQ4_LEVELS
    if bits in LM and kind in ("tq", "lm"):
        return LM[bits]
    return UNIFORM[bits] if bits in UNIFORM else LM[bits]


def quantize(z, levels):
    """Nearest level of every element of z; returns (values, indices)."""
    t = 0.5 * (levels[1:] + levels[:-1])
    idx = np.searchsorted(t, z)
    return levels[idx], idx


# ----------------------------------------------------------------------------- rotation


def hadamard(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


H64 = hadamard(D)


def rotation_signs(seed, layer, head):
    """The seeded +-1 diagonal D of a (layer, KV head)'s rotation R = H D (y = x @ R.T)."""
    rng = np.random.default_rng([seed, layer, head])
    return rng.integers(0, 2, D) * 2.0 - 1.0


# ----------------------------------------------------------------------------- codecs
# A codec is a function f(X, ctx) -> (Xhat, bits, noise) for one (layer, KV head): X is T x 64
# (float64, tokens in order), bits the exact total stored for those T vectors (payload +
# metadata), noise the decoder's model of its error, for the logit correction (below): a list
# of terms (C, w), C a 64 x 64 matrix and w a per-token weight, meaning E[e_j e_j^T] ~ sum C w_j,
# computed from decoded quantities only (or None: no model). ctx: role ('key'/'value'), rot (R), seed, layer, head, cal (the other text's
# statistics), mass (per-token relative attention mass, calibration queries), page_mass_layer.

ALPHA_BITS = {"bf16": 16, "e4m3": 8, "log6": 6}


def quant_alpha(alpha, mode, page):
    """Stored alpha and its bits per vector and per page."""
    if mode == "bf16":
        return bf16(alpha), 16, 0
    if mode == "e4m3":  # 3 mantissa bits, exponent relative to a per-page bf16 base (exact range)
        return round_mantissa(alpha, 3), 8, 16
    if mode == "log6":  # 64 log-uniform steps between the page's min and max alpha (2 x bf16 per page)
        a = np.maximum(alpha, 1e-30)
        T = a.shape[0]
        out = np.empty_like(a)
        for p0 in range(0, T, page):
            seg = np.log2(a[p0 : p0 + page])
            lo, hi = bf16(2.0 ** seg.min()), bf16(2.0 ** seg.max())
            lo, hi = np.log2(lo), np.log2(hi)
            if hi <= lo:
                out[p0 : p0 + page] = 2.0**lo
                continue
            step = (hi - lo) / 63
            out[p0 : p0 + page] = 2.0 ** (lo + np.round((seg - lo) / step) * step)
        return out, 6, 32
    raise ValueError(mode)


def scalar_transform_code(W, sigma, bits, role, grid_kind="tq", meta="bf16", page=PAGE, scale_mode="norm", info=None):
    """Generic per-vector-scaled scalar coding of coefficients W (T x n), coefficient i on a
    2^bits[i]-level unit-variance grid in units of sigma[i] * s (s = the vector's rms normalized
    coefficient), then one stored scale alpha per vector: keys the inner-product-unbiased
    |W|^2 / <W, c>, values the least-squares <W, c> / |c|^2 (TQ's two alphas). Returns Ŵ and
    the metadata bits (per vector, per page); payload bits are sum(bits) per vector."""
    T, n = W.shape
    Wn = W / sigma[None, :]
    if scale_mode == "norm":
        s = np.sqrt(np.mean(Wn * Wn, axis=1))
    else:  # fixed: no per-vector scale (sigma carries the calibrated scale)
        s = np.ones(T)
    s_safe = np.where(s > 0, s, 1.0)
    z = Wn / s_safe[:, None]
    C = np.zeros_like(W)
    for b in np.unique(bits):
        cols = np.nonzero(bits == b)[0]
        if b == 0:
            continue
        C[:, cols] = quantize(z[:, cols], grid_for(int(b), grid_kind))[0] * sigma[cols][None, :]
    if meta == "none":
        return C * s_safe[:, None] * (s > 0)[:, None], 0, 0
    zc = np.sum(W * C, axis=1)
    if role == "key":
        ww = np.sum(W * W, axis=1)
        alpha = np.where(zc > 0, ww / np.where(zc > 0, zc, 1.0), 0.0)
    else:
        cc = np.sum(C * C, axis=1)
        alpha = np.where(cc > 0, zc / np.where(cc > 0, cc, 1.0), 0.0)
    alpha = np.maximum(alpha, 0.0)
    a_q, vb, pb = quant_alpha(alpha, meta, page)
    if info is not None:
        info["alpha"] = a_q
    return C * a_q[:, None], vb, pb


def pages_of(T, page):
    return -(-T // page)


def token_signs(ctx, T, nrot):
    """The D of each token's rotation H D: one seeded pattern (nrot = 1, tierkv), nrot patterns
    by position mod nrot, or one per token (nrot = 0); nrot = -R: R patterns by 16-token page
    index mod R (a page keeps one rotation). T x 64 of +-1."""
    if nrot == 1:
        return np.broadcast_to(ctx["signs"], (T, D))
    rng = np.random.default_rng([ctx["seed"], ctx["layer"], ctx["head"], 1000 + abs(nrot)])
    if nrot == 0:
        return rng.integers(0, 2, (T, D)) * 2.0 - 1.0
    pats = rng.integers(0, 2, (abs(nrot), D)) * 2.0 - 1.0
    if nrot < 0:
        return pats[(np.arange(T) // PAGE) % -nrot]
    return pats[np.arange(T) % nrot]


_KAPPA = {}


def tq_kappa(bits, grid_kind, role, per_alpha=False):
    """E|x - x_hat|^2 / E|x_hat|^2 of TQ on Gaussian vectors: the decoder's estimate of a token's
    error energy is kappa |x_hat|^2 (|x_hat|^2 = alpha^2 sum c_i^2, known at decode after a sum
    of squared levels). per_alpha: E|x - x_hat|^2 / E[alpha^2] instead, so that the estimate is
    kappa' alpha^2 (no per-token sum: one multiply-add on the score)."""
    k = (bits, grid_kind, role, per_alpha)
    if k not in _KAPPA:
        G = np.random.default_rng(5).standard_normal((20000, D))
        Y = G @ H64.T
        info = {}
        Yh = scalar_transform_code(Y, np.ones(D), np.full(D, bits), role, grid_kind, "bf16", PAGE, info=info)[0]
        den = (info["alpha"] ** 2).sum() if per_alpha else (Yh**2).sum()
        _KAPPA[k] = float(((Yh - Y) ** 2).sum() / den)
    return _KAPPA[k]


def iso(eps):
    """An isotropic error model: E[e e^T] = eps_j / d I."""
    return [(np.eye(D) / D, eps)]


def tq(bits, meta="bf16", grid_kind="tq", page=PAGE, nrot=1, noise_model="norm"):
    """TurboQuant: rotate (H D, D = token_signs), bits per rotated coordinate in units of
    |x|/sqrt(d), one alpha per vector. noise_model: the decoder's per-token error energy,
    kappa |x_hat|^2 ('norm') or kappa' alpha^2 ('alpha')."""

    def f(X, ctx):
        T = X.shape[0]
        Sg = token_signs(ctx, T, nrot)
        Y = (X * Sg) @ H64.T
        info = {}
        Yh, vb, pb = scalar_transform_code(Y, np.ones(D), np.full(D, bits), ctx["role"], grid_kind, meta, page, info=info)
        if noise_model == "alpha":
            noise = iso(tq_kappa(bits, grid_kind, ctx["role"], per_alpha=True) * info["alpha"] ** 2)
        else:
            noise = iso(tq_kappa(bits, grid_kind, ctx["role"]) * (Yh**2).sum(1))
        return (Yh @ H64) * Sg, T * (bits * D + vb) + pages_of(T, page) * pb, noise

    return f


def as_role(inner, role):
    """Code with the other role's alpha (e.g. values with the inner-product-unbiased alpha)."""

    def f(X, ctx):
        return inner(X, dict(ctx, role=role))

    return f


def tq_residual2(b1, b2, meta="bf16"):
    """Two-stage TQ: TQ-b1 of x, then TQ-b2 (another rotation seed) of the residual."""

    def f(X, ctx):
        X1, bits1, _ = tq(b1, meta)(X, ctx)
        c2 = dict(ctx, signs=-ctx["signs"][::-1].copy())  # another fixed pattern
        X2, bits2, n2 = tq(b2, meta)(X - X1, c2)
        return X1 + X2, bits1 + bits2, n2

    return f


def int8_rotated():
    """tierkv's int8_rotated: int8 codes of the rotated vector, scale amax/127 as bf16 (rounded up)."""

    def f(X, ctx):
        R = ctx["rot"]
        Y = X @ R.T
        amax = np.max(np.abs(Y), axis=1)
        sc = bf16(amax / 127.0 * (1 + 2**-8))  # ~ rounded up
        sc = np.where(sc > 0, sc, 1.0)
        Yh = np.clip(np.round(Y / sc[:, None]), -127, 127) * sc[:, None]
        return Yh @ R, X.shape[0] * (8 * D + 16), iso(D * sc**2 / 12)

    return f


def int8_vec(Y):
    """int8 of a rotated vector with a bf16 scale (528 bits): the anchors' format."""
    amax = np.max(np.abs(Y), axis=-1, keepdims=True)
    sc = bf16(amax / 127.0 * (1 + 2**-8))
    sc = np.where(sc > 0, sc, 1.0)
    return np.clip(np.round(Y / sc), -127, 127) * sc


def centered(inner):
    """Subtract the per-(layer, head) channel mean of the first 512 tokens (float32 per
    sequence: 64 x 32 bits per layer-head-role, counted), code, add it back."""

    def f(X, ctx):
        mu = X[:CENTER_TOKENS].mean(axis=0).astype(np.float32).astype(np.float64)
        Xh, bits, noise = inner(X - mu[None, :], ctx)
        return Xh + mu[None, :], bits + D * 32, noise

    return f


def anchor_residual(bits, page, anchor="mean", meta="bf16", n_anchors=1, refine=0, refine_bits=4, nrot=1):
    """Per page: anchor vector(s) int8 in the rotated domain + bf16 scale (528 bits each); every
    token coded as its anchor + TQ-bits(residual). n_anchors > 1: k-means anchors, log2(A)-bit
    index per token. refine = m: the m tokens of each page with the largest (relative attention
    mass x residual error) get a TQ-refine_bits residual instead (m token indices per page)."""

    def f(X, ctx):
        R = ctx["rot"]
        T = X.shape[0]
        npg = pages_of(T, page)
        A_hat = np.zeros_like(X)
        for p in range(npg):
            seg = X[p * page : (p + 1) * page]
            if n_anchors == 1:
                a = seg.mean(axis=0) if anchor == "mean" else seg[0]
                A_hat[p * page : (p + 1) * page] = (int8_vec(a @ R.T) @ R)[None, :]
            else:
                cq = int8_vec(kmeans_small(seg, n_anchors) @ R.T) @ R
                d2 = ((seg[:, None, :] - cq[None, :, :]) ** 2).sum(-1)
                A_hat[p * page : (p + 1) * page] = cq[np.argmin(d2, axis=1)]
        idx_bits = T * int(math.ceil(math.log2(n_anchors))) if n_anchors > 1 else 0
        Rs = X - A_hat
        Rh, rbits, noise = tq(bits, meta, page=page, nrot=nrot)(Rs, ctx)
        total = rbits + npg * n_anchors * (8 * D + 16) + idx_bits
        if refine:
            Rh4, _, n4 = tq(refine_bits, meta, page=page, nrot=nrot)(Rs, ctx)
            w = noise[0][1].copy()
            err = np.linalg.norm(Rs - Rh, axis=1) * ctx["mass"]
            for p in range(npg):
                lo = p * page
                e = err[lo : lo + page]
                top = lo + np.argsort(-e)[: min(refine, e.shape[0])]
                Rh[top] = Rh4[top]
                w[top] = n4[0][1][top]
            noise = iso(w)
            total += npg * refine * ((refine_bits - bits) * D + int(math.log2(page)))  # payload + token index
        return A_hat + Rh, total, noise

    return f


def kmeans_small(P, k, iters=8):
    """k-means of a page's vectors (init: k tokens spread over the page)."""
    n = P.shape[0]
    c = P[np.linspace(0, n - 1, k).astype(int)].copy()
    for _ in range(iters):
        d2 = ((P[:, None, :] - c[None, :, :]) ** 2).sum(-1)
        a = np.argmin(d2, axis=1)
        for j in range(k):
            m = a == j
            if m.any():
                c[j] = P[m].mean(axis=0)
    return c


def refine_tokens(base_bits, hi_bits, m, page=PAGE, meta="bf16", nrot=1):
    """Plain TQ-base_bits, but per page the m tokens with the largest (mass x coding error)
    are coded at TQ-hi_bits instead (page layout fixed: m slots + a 4-bit index each)."""

    def f(X, ctx):
        lo_h, lo_b, lo_n = tq(base_bits, meta, nrot=nrot)(X, ctx)
        hi_h, _, hi_n = tq(hi_bits, meta, nrot=nrot)(X, ctx)
        w = lo_n[0][1].copy()
        T = X.shape[0]
        err = np.linalg.norm(X - lo_h, axis=1) * ctx["mass"]
        out = lo_h.copy()
        npg = pages_of(T, page)
        for p in range(npg):
            lo = p * page
            e = err[lo : lo + page]
            top = lo + np.argsort(-e)[: min(m, e.shape[0])]
            out[top] = hi_h[top]
            w[top] = hi_n[0][1][top]
        return out, lo_b + npg * m * ((hi_bits - base_bits) * D + 4), iso(w)

    return f


def topk_channels(k, rest_bits=2, per="vector", page=PAGE):
    """No rotation (MosaicKV-flavoured). per='vector': each vector's k largest-magnitude
    channels int8 (+ a 6-bit index each); per='page': the page's k highest-energy channels
    (6-bit index each per page) int8 for every token. Scales: bf16 for the int8 part, bf16 for
    the rest, which is Lloyd-Max rest_bits in units of its rms."""

    def f(X, ctx):
        T = X.shape[0]
        mask = np.zeros_like(X, dtype=bool)
        if per == "vector":
            top = np.argsort(-np.abs(X), axis=1)[:, :k]
            np.put_along_axis(mask, top, True, axis=1)
            idx_bits = T * k * 6
        else:
            for p in range(pages_of(T, page)):
                seg = X[p * page : (p + 1) * page]
                top = np.argsort(-(seg * seg).sum(0))[:k]
                mask[p * page : (p + 1) * page, top] = True
            idx_bits = pages_of(T, page) * k * 6
        out = np.zeros_like(X)
        big = np.where(mask, X, 0.0)
        amax = np.abs(big).max(axis=1)
        sc = np.where(amax > 0, bf16(amax / 127 * (1 + 2**-8)), 1.0)
        out += np.where(mask, np.clip(np.round(big / sc[:, None]), -127, 127) * sc[:, None], 0.0)
        rest = np.where(mask, 0.0, X)
        nr = D - k
        rms = np.sqrt((rest * rest).sum(1) / nr)
        rs = np.where(rms > 0, rms, 1.0)
        qv = quantize(rest / rs[:, None], LM[rest_bits])[0]
        zc = (rest * qv).sum(1)
        cc = (np.where(mask, 0.0, qv) ** 2).sum(1)
        if ctx["role"] == "key":
            alpha = np.where(zc > 0, (rest * rest).sum(1) / np.where(zc > 0, zc, 1), 0)
        else:
            alpha = np.where(cc > 0, zc / np.where(cc > 0, cc, 1), 0)
        out += np.where(mask, 0.0, qv * bf16(alpha)[:, None])
        bits = T * (8 * k + rest_bits * nr + 16 + 16) + idx_bits
        return out, bits, None

    return f


_GRID_MSE = {}


def grid_mse(kind, max_bits=8):
    """Gaussian MSE of the unit-variance grids at 0..max_bits bits."""
    if kind not in _GRID_MSE:
        z = np.random.default_rng(0).standard_normal(400000)
        _GRID_MSE[kind] = [1.0] + [float(np.mean((quantize(z, grid_for(b, kind))[0] - z) ** 2)) for b in range(1, max_bits + 1)]
    return _GRID_MSE[kind]


def greedy_allocation(var, avg_bits, max_bits=8, kind="lm"):
    """Integer bits per coefficient minimizing sum var_i * mse(b_i) at sum b_i = avg_bits * n
    (marginal-return greedy; mse(b) from the Gaussian grids)."""
    mse = grid_mse(kind, max_bits)
    n = var.shape[0]
    b = np.zeros(n, dtype=int)
    budget = int(round(avg_bits * n))
    for _ in range(budget):
        gain = np.array([var[i] * (mse[b[i]] - mse[b[i] + 1]) if b[i] < max_bits else -1 for i in range(n)])
        b[int(np.argmax(gain))] += 1
    return b


_ALLOC_CACHE = {}


def transform_coder(basis, avg_bits, meta="bf16", scale_mode="norm", grid_kind="lm"):
    """Calibrated transform coding (KLT / channel variances): coefficients W = X @ A.T with a
    per-(layer, head) transform A from the other text; integer bits per coefficient by
    reverse water-filling on the calibrated coefficient variances; a per-vector alpha.
    basis: 'klt' (PCA of centred vectors; keys: PCA after whitening by the query second
    moment, so coefficient MSE = logit MSE), 'kltp' (plain PCA for keys too), 'chan'
    (identity: per-channel allocation, no rotation). The transforms are model constants
    (calibrated offline), not per-sequence bytes: 0 bits counted."""

    def f(X, ctx):
        cal = ctx["cal"][(ctx["layer"], ctx["head"], ctx["role"])]
        if basis == "chan":
            A = np.eye(D)
            var = cal["chan_var"]
        elif basis.startswith("kltr"):  # keys: whitened PCA of page-mean residuals
            A = cal[f"wpcar{basis[4:]}_A"]
            var = cal[f"wpcar{basis[4:]}_vals"]
        elif basis == "kltp" or ctx["role"] == "value":
            A = cal["pca_vecs"].T
            var = cal["pca_vals"]
        else:
            A = cal["wpca_A"]
            var = cal["wpca_vals"]
        key = (ctx["layer"], ctx["head"], ctx["role"], basis, avg_bits, grid_kind)
        if key not in _ALLOC_CACHE:
            _ALLOC_CACHE[key] = greedy_allocation(var, avg_bits, kind=grid_kind)
        bits = _ALLOC_CACHE[key]
        sigma = np.sqrt(np.maximum(var, 1e-30))
        W = X @ A.T
        Wh, vb, pb = scalar_transform_code(W, sigma, bits, ctx["role"], grid_kind, meta, PAGE, scale_mode)
        T = X.shape[0]
        Ainv = np.linalg.inv(A)
        Xh = Wh @ Ainv.T
        m = np.array(grid_mse(grid_kind))[bits]
        C = Ainv @ np.diag(var * m) @ Ainv.T
        if scale_mode == "fixed":
            w = np.ones(T)
        else:  # the per-vector scale: errors scale with the decoded rms normalized coefficient
            w = np.mean((Wh / sigma[None, :]) ** 2, axis=1) / max(float(np.mean(1.0 - m)), 1e-3)
        return Xh, T * (int(bits.sum()) + vb) + pages_of(T, PAGE) * pb, [(C, w)]

    return f


def anchor_klt(page, avg_bits, meta="none", scale_mode="fixed"):
    """Keys: per page the mean as an int8 anchor (rotated domain + bf16 scale, 528 bits), every
    token's residual coded by the query-whitened KLT of page-mean residuals (calibrated on the
    other text)."""

    def f(X, ctx):
        R = ctx["rot"]
        T = X.shape[0]
        npg = pages_of(T, page)
        A_hat = np.repeat(int8_vec(X.reshape(npg, page, D).mean(1) @ R.T) @ R, page, axis=0)
        Rh, rbits, noise = transform_coder(f"kltr{page}", avg_bits, meta=meta, scale_mode=scale_mode)(X - A_hat, ctx)
        return A_hat + Rh, rbits + npg * (8 * D + 16), noise

    return f


def vq_rotated(dim, bits_per_scalar, meta="bf16"):
    """Rotate (as TQ), then vector-quantize consecutive dim-D sub-vectors of z = y sqrt(d)/|x|
    with a 2^(dim*bits) codebook trained by k-means on N(0, I) samples (a universal codebook,
    like TQ's grids); one alpha per vector (TQ's two alphas)."""
    def f(X, ctx):
        cb = trained_codebook(dim, 2 ** (dim * bits_per_scalar))
        R = ctx["rot"]
        Y = X @ R.T
        T = X.shape[0]
        n = np.linalg.norm(Y, axis=1)
        ns = np.where(n > 0, n, 1.0)
        Z = (Y * math.sqrt(D) / ns[:, None]).reshape(T * D // dim, dim)
        C = np.empty_like(Z)
        cc = (cb * cb).sum(1)
        for i in range(0, Z.shape[0], 8192):
            blk = Z[i : i + 8192]
            d2 = cc[None, :] - 2 * blk @ cb.T
            C[i : i + 8192] = cb[np.argmin(d2, axis=1)]
        C = C.reshape(T, D)
        zc = (Y * C).sum(1)
        if ctx["role"] == "key":
            alpha = np.where(zc > 0, (Y * Y).sum(1) / np.where(zc > 0, zc, 1), 0)
        else:
            c2 = (C * C).sum(1)
            alpha = np.where(c2 > 0, zc / np.where(c2 > 0, c2, 1), 0)
        a_q, vb, pb = quant_alpha(alpha, meta, PAGE)
        return (C * a_q[:, None]) @ R, T * (bits_per_scalar * D + vb) + pages_of(T, PAGE) * pb, None

    return f


_CB = {}


def trained_codebook(dim, size, n=200000, iters=40):
    if (dim, size) in _CB:
        return _CB[(dim, size)]
    rng = np.random.default_rng(1234)
    Z = rng.standard_normal((n, dim))
    c = Z[rng.choice(n, size, replace=False)].copy()
    for _ in range(iters):
        a = np.empty(n, dtype=int)
        cc = (c * c).sum(1)
        for i in range(0, n, 20000):
            a[i : i + 20000] = np.argmin(cc[None, :] - 2 * Z[i : i + 20000] @ c.T, axis=1)
        s = np.zeros_like(c)
        np.add.at(s, a, Z)
        cnt = np.bincount(a, minlength=size)
        live = cnt > 0
        c[live] = s[live] / cnt[live, None]
    _CB[(dim, size)] = c
    return c


def mixed_pages(frac8, frac_mid, mid_bits, low_bits, rank="mass", low=None, nrot=1):
    """Page tiers by the attention mass the (layer's) pages receive (the tiering policy): the
    top frac8 of pages int8_rotated, the next frac_mid TQ-mid_bits, the rest TQ-low_bits (or
    the codec `low`). Pages are 16 tokens of one layer (all KV heads share a page's tier).
    rank='random' ranks pages at random (the control: what the mass information buys)."""

    def f(X, ctx):
        T = X.shape[0]
        npg = pages_of(T, PAGE)
        pm = ctx["page_mass_layer"][:npg]
        if rank == "head":  # per-(layer, KV head) pages: rank by this head's own mass
            pm = np.array([ctx["mass"][p * PAGE : (p + 1) * PAGE].mean() for p in range(npg)])
        if rank == "random":
            order = np.random.default_rng([ctx["layer"], 99]).permutation(npg)
        else:
            order = np.argsort(-pm, kind="stable")
        n8 = int(round(frac8 * npg))
        nm = int(round(frac_mid * npg))
        tier = np.full(npg, 2)
        tier[order[:n8]] = 0
        tier[order[n8 : n8 + nm]] = 1
        outs = [int8_rotated()(X, ctx), tq(mid_bits, nrot=nrot)(X, ctx) if nm else None, (low or tq(low_bits, nrot=nrot))(X, ctx)]
        per_tok = np.repeat(tier, PAGE)[:T]
        out = np.empty_like(X)
        bits = 0.0
        noise = []
        for t in range(3):
            m = per_tok == t
            if not m.any():
                continue
            out[m] = outs[t][0][m]
            bits += outs[t][1] * m.sum() / T  # every codec here is a fixed cost per token
            if outs[t][2] is None:
                noise = None
            elif noise is not None:
                noise += [(C, w * m) for C, w in outs[t][2]]
        return out, bits, noise

    return f


# ----------------------------------------------------------------------------- candidates


def candidate_list():
    """(name, key codec, value codec, group, uses_mass). Keys and values of a row share a
    design unless the name says k../v..; uses_mass: the codec reads the attention mass."""
    C = []

    def add(name, k, v, group, mass=False, lc=False):
        C.append((name, k, v, group, mass, lc))

    def both(name, make, group, mass=False, center=True):
        w = centered if center else (lambda f: f)
        add(name, w(make()), w(make()), group, mass)

    # a. plain TQ (no centring), b. centred TQ, K/V bit splits
    for b in (2, 3, 4):
        both(f"tq{b}", lambda b=b: tq(b), "a", center=False)
    for b in (2, 3, 4):
        both(f"c-tq{b}", lambda b=b: tq(b), "b")
    both("c-int8r", int8_rotated, "b")
    for kb, vb in ((4, 3), (3, 2), (4, 2), (2, 3), (3, 4), (2, 4)):
        add(f"c-k{kb}v{vb}", centered(tq(kb)), centered(tq(vb)), "b")
    # f. centred keys, values not centred (centring values can make their errors coherent)
    for b in (2, 3, 4):
        add(f"ck-tq{b}", centered(tq(b)), tq(b), "f-center")
    add("ck-tq2-rot8", centered(tq(2, nrot=8)), tq(2, nrot=8), "f-center")
    add("ck-tq3-rot8", centered(tq(3, nrot=8)), tq(3, nrot=8), "f-center")
    # f. values with the inner-product-unbiased alpha instead of least squares
    for b in (2, 3, 4):
        add(f"c-tq{b}-vunb", centered(tq(b)), centered(as_role(tq(b), "key")), "f-valpha")
    # f. decorrelate the codes of similar tokens: nrot rotations by position mod nrot (0: per token)
    for b in (2, 3):
        for nr in (2, 4, 8, 0):
            both(f"c-tq{b}-rot{nr if nr else 'T'}", lambda b=b, nr=nr: tq(b, nrot=nr), "f-rot")
    for b in (2, 3):
        both(f"c-tq{b}-prot8", lambda b=b: tq(b, nrot=-8), "f-rot")
    add("c-tq2-rot8-vunb", centered(tq(2, nrot=8)), centered(as_role(tq(2, nrot=8), "key")), "f-rot")
    add("c-tq3-rot8-vunb", centered(tq(3, nrot=8)), centered(as_role(tq(3, nrot=8), "key")), "f-rot")
    add("c-tq4-rot8-vunb", centered(tq(4, nrot=8)), centered(as_role(tq(4, nrot=8), "key")), "f-rot")
    # f. cheaper alpha (metadata) on centred TQ
    for b in (2, 3):
        for m in ("e4m3", "log6"):
            both(f"c-tq{b}-a{m}", lambda b=b, m=m: tq(b, meta=m), "f-alpha")
    # f. Lloyd-Max 16 levels for TQ4 (vs uniform); residual TQ2 + TQ2 (4 bits + 2 alphas) vs TQ4
    both("c-tq4lm", lambda: tq(4, grid_kind="lm"), "f-grid")
    both("c-tq2+tq2", lambda: tq_residual2(2, 2), "f-residual")
    # c. page anchors + residual (AnchorKV-flavoured)
    for page in (16, 64):
        for anc in ("mean", "first"):
            both(f"c-anc{anc}-p{page}-r2", lambda page=page, anc=anc: anchor_residual(2, page, anc), "c")
        both(f"c-ancmean-p{page}-r3", lambda page=page: anchor_residual(3, page), "c")
    for A in (2, 4):
        both(f"c-km{A}-p64-r2", lambda A=A: anchor_residual(2, 64, n_anchors=A), "c")
    both("c-ancmean-p64-r2-ref8x4", lambda: anchor_residual(2, 64, refine=8), "c", mass=True)
    both("c-ancmean-p64-r2-rot8", lambda: anchor_residual(2, 64, nrot=8), "c")
    for m in (1, 2, 4):
        both(f"c-tq2-ref{m}x4", lambda m=m: refine_tokens(2, 4, m), "c-refine", mass=True)
    both("c-tq2-ref2x8", lambda: refine_tokens(2, 8, 2), "c-refine", mass=True)
    # d. channel importance, no rotation (MosaicKV-flavoured)
    for k in (2, 4):
        both(f"c-top{k}v-r2", lambda k=k: topk_channels(k, 2, "vector"), "d")
    for k in (4, 8):
        both(f"c-top{k}p-r2", lambda k=k: topk_channels(k, 2, "page"), "d")
    for b in (2.0, 3.0, 4.0):
        both(f"c-chan-b{b}", lambda b=b: transform_coder("chan", b), "d")
    # f. calibrated transform coding (KLT + reverse water-filling), the other text's statistics
    for b in (1.5, 2.0, 2.5, 3.0, 4.0):
        both(f"c-klt-b{b}", lambda b=b: transform_coder("klt", b), "f-klt")
    for b in (2.0, 3.0):
        both(f"c-kltp-b{b}", lambda b=b: transform_coder("kltp", b), "f-klt")
        both(f"c-klt-b{b}-fixed", lambda b=b: transform_coder("klt", b, meta="none", scale_mode="fixed"), "f-klt")
        add(f"c-kltk-b{b}-tqv", centered(transform_coder("klt", b)), centered(tq(int(b))), "f-klt")
    # f. vector quantization of rotated sub-vectors (universal codebooks trained on N(0, I))
    both("c-vq2d-2b", lambda: vq_rotated(2, 2), "f-vq")
    both("c-vq4d-2b", lambda: vq_rotated(4, 2), "f-vq")
    # e. mixed precision by attention mass (the tiering idea)
    for f8 in (0.0, 0.05, 0.1, 0.2):
        for fm, mb in ((0.0, 4), (0.1, 4), (0.25, 4), (0.5, 4), (0.25, 3), (0.5, 3)):
            if f8 == 0 and fm == 0:
                continue
            both(f"c-mix8:{f8:g}-tq{mb}:{fm:g}-tq2", lambda f8=f8, fm=fm, mb=mb: mixed_pages(f8, fm, mb, 2), "e", mass=True)
    both("c-mix8:0.1-tq4:0.25-tq2-random", lambda: mixed_pages(0.1, 0.25, 4, 2, rank="random"), "e-control", mass=True)
    both("c-mix8:0.05-tq4:0.1-tq2-random", lambda: mixed_pages(0.05, 0.1, 4, 2, rank="random"), "e-control", mass=True)
    for f8 in (0.05, 0.1):
        both(f"c-mix8:{f8:g}-tq3", lambda f8=f8: mixed_pages(f8, 0.0, 4, 3, low=tq(3)), "e", mass=True)
    both("c-mix8:0.1-tq4:0.25-tq2-head", lambda: mixed_pages(0.1, 0.25, 4, 2, rank="head"), "e", mass=True)
    both("c-mix8:0.05-tq4:0.1-tq2-head", lambda: mixed_pages(0.05, 0.1, 4, 2, rank="head"), "e", mass=True)
    # e x f: mass tiers over decorrelated codes
    for f8, fm in ((0.05, 0.1), (0.1, 0.25), (0.05, 0.0), (0.1, 0.0)):
        both(f"c-mix8:{f8:g}-tq4:{fm:g}-tq2-rot8", lambda f8=f8, fm=fm: mixed_pages(f8, fm, 4, 2, nrot=8), "e+f", mass=True)
    return C


def final_list():
    """The second round, after the screen (4 layers, 128 queries; bench/research/codec-sim-*.md):
    the baselines, the screen's winners and their combinations, with and without the
    noise-aware logit correction ('lc')."""
    C = []

    def add(name, k, v, group, mass=False, lc=False):
        C.append((name, k, v, group, mass, lc))

    c = centered

    def klt(b, meta="none"):
        return transform_coder("klt", b, meta=meta, scale_mode="fixed" if meta == "none" else "norm")

    def v2p():  # values: not centred, 8 rotations by page index, 6-bit log alpha
        return tq(2, nrot=-8, meta="log6")

    def v3p():
        return tq(3, nrot=-8, meta="log6")

    # the library's designs (a, b) and the K/V splits
    for b in (2, 3, 4):
        add(f"tq{b}", tq(b), tq(b), "a")
        add(f"c-tq{b}", c(tq(b)), c(tq(b)), "b")
    add("c-int8r", c(int8_rotated()), c(int8_rotated()), "b")
    add("c-k3v2", c(tq(3)), c(tq(2)), "b")
    add("c-k4v2", c(tq(4)), c(tq(2)), "b")
    add("c-k4v3", c(tq(4)), c(tq(3)), "b")
    # f. the noise-aware logit correction on the library's designs (no stored bits)
    for b in (2, 3, 4):
        add(f"c-tq{b}-lc", c(tq(b)), c(tq(b)), "f-lc", lc=True)
    add("tq2-lc", tq(2), tq(2), "f-lc", lc=True)
    add("c-k4v3-lc", c(tq(4)), c(tq(3)), "f-lc", lc=True)
    add("c-tq4lm-lc", c(tq(4, grid_kind="lm")), c(tq(4, grid_kind="lm")), "f-lc", lc=True)
    # f. values: not centred / rotation patterns / 6-bit alpha (keys c-tqB-lc)
    for b in (2, 3):
        add(f"c-k{b}lc-uv{b}", c(tq(b)), tq(b), "f-rot", lc=True)
        add(f"c-k{b}lc-cv{b}prot8", c(tq(b)), c(tq(b, nrot=-8)), "f-rot", lc=True)
        add(f"c-k{b}lc-v{b}prot8", c(tq(b)), tq(b, nrot=-8), "f-rot", lc=True)
    add("c-k2lc-v2rot8", c(tq(2)), tq(2, nrot=8), "f-rot", lc=True)
    # keys with rotation patterns too (+ lc), 6-bit alpha on both
    for b in (2, 3):
        add(f"c-k{b}a6lc-v{b}p", c(tq(b, meta="log6")), tq(b, nrot=-8, meta="log6"), "f-rot", lc=True)
        add(f"c-k{b}pa6lc-v{b}p", c(tq(b, nrot=-8, meta="log6")), tq(b, nrot=-8, meta="log6"), "f-rot", lc=True)
    add("c-k2ra6lc-v2p", c(tq(2, nrot=8, meta="log6")), v2p(), "f-rot", lc=True)
    # keys not centred (+ lc)
    for b in (2, 3):
        add(f"k{b}a6lc-v{b}p", tq(b, meta="log6"), tq(b, nrot=-8, meta="log6"), "f-center", lc=True)
    add("k2pa6lc-v2p", tq(2, nrot=-8, meta="log6"), v2p(), "f-center", lc=True)
    add("c-k4pa6lc-v3p", c(tq(4, nrot=-8, meta="log6")), v3p(), "f-rot", lc=True)
    add("c-tq2-vq4d", c(vq_rotated(4, 2)), c(vq_rotated(4, 2)), "f-vq")
    # f. keys: query-whitened KLT + reverse water-filling, fixed scales (no per-vector metadata)
    add("kk2.0f-v2p", c(klt(2.0)), v2p(), "f-klt")
    for kb in (1.5, 2.0, 2.5, 3.0):
        add(f"kk{kb}f-lc-v2p", c(klt(kb)), v2p(), "f-klt", lc=True)
    add("kk2.0a-lc-v2p", c(klt(2.0, meta="log6")), v2p(), "f-klt", lc=True)
    for kb in (2.0, 3.0, 4.0):
        add(f"kk{kb}f-lc-v3p", c(klt(kb)), v3p(), "f-klt", lc=True)
    # c. page anchors (+ KLT residuals for keys)
    add("c-ancmean-p64-r2", c(anchor_residual(2, 64)), c(anchor_residual(2, 64)), "c")
    add("c-ancmean-p64-r2-lc", c(anchor_residual(2, 64)), c(anchor_residual(2, 64)), "c", lc=True)
    add("c-ancmean-p64-r2-ref8x4-lc", c(anchor_residual(2, 64, refine=8)), c(anchor_residual(2, 64, refine=8)), "c", mass=True, lc=True)
    add("c-ancmean-p64-r2-ref8x4", c(anchor_residual(2, 64, refine=8)), c(anchor_residual(2, 64, refine=8)), "c", mass=True)
    add("ancref-k2lc-v2p", c(anchor_residual(2, 64, refine=8, meta="log6")), v2p(), "c", mass=True, lc=True)
    # e. tiers by attention mass (int8_rotated / TQ4 / TQ2 pages)
    add("c-mix8:0.05-tq4:0.1-tq2", c(mixed_pages(0.05, 0.1, 4, 2)), c(mixed_pages(0.05, 0.1, 4, 2)), "e", mass=True)
    for f8, fm in ((0.05, 0.0), (0.05, 0.1), (0.1, 0.25), (0.2, 0.5)):
        add(f"c-mix8:{f8:g}-tq4:{fm:g}-tq2-lc", c(mixed_pages(f8, fm, 4, 2)), c(mixed_pages(f8, fm, 4, 2)), "e", mass=True, lc=True)
    add("c-mix8:0.05-tq4:0.1-tq2-random-lc", c(mixed_pages(0.05, 0.1, 4, 2, rank="random")), c(mixed_pages(0.05, 0.1, 4, 2, rank="random")), "e-control", mass=True, lc=True)
    add("c-mix8:0.05-tq4:0.1-tq2-head-lc", c(mixed_pages(0.05, 0.1, 4, 2, rank="head")), c(mixed_pages(0.05, 0.1, 4, 2, rank="head")), "e", mass=True, lc=True)
    add("c-mix8:0.1-tq3-lc", c(mixed_pages(0.1, 0.0, 4, 3, low=tq(3))), c(mixed_pages(0.1, 0.0, 4, 3, low=tq(3))), "e", mass=True, lc=True)
    # e x f: the tiers over the best low codecs
    for f8 in (0.03, 0.05, 0.1):
        for kb in (1.5, 2.0):
            add(f"mix8:{f8:g}-kk{kb}f-lc-v2p", c(mixed_pages(f8, 0.0, 4, 2, low=klt(kb))), mixed_pages(f8, 0.0, 4, 2, low=v2p()), "e+f", mass=True, lc=True)
    add("mix8:0.05-kk2.0f-lc-v3p", c(mixed_pages(0.05, 0.0, 4, 2, low=klt(2.0))), mixed_pages(0.05, 0.0, 4, 2, low=v3p()), "e+f", mass=True, lc=True)
    add("mix8:0.05-kk3.0f-lc-v3p", c(mixed_pages(0.05, 0.0, 4, 2, low=klt(3.0))), mixed_pages(0.05, 0.0, 4, 2, low=v3p()), "e+f", mass=True, lc=True)
    add("mix8:0.05-k2pa6lc-v2p", c(mixed_pages(0.05, 0.0, 4, 2, low=tq(2, nrot=-8, meta="log6"))), mixed_pages(0.05, 0.0, 4, 2, low=v2p()), "e+f", mass=True, lc=True)
    add("mix8:0.1-k2pa6lc-v2p", c(mixed_pages(0.1, 0.0, 4, 2, low=tq(2, nrot=-8, meta="log6"))), mixed_pages(0.1, 0.0, 4, 2, low=v2p()), "e+f", mass=True, lc=True)
    for f8 in (0.05, 0.1):
        add(f"mix8:{f8:g}-k2a6lc-v2p", mixed_pages(f8, 0.0, 4, 2, low=tq(2, meta="log6")), mixed_pages(f8, 0.0, 4, 2, low=v2p()), "e+f", mass=True, lc=True)
    add("mix8:0.05-k3a6lc-v3p", mixed_pages(0.05, 0.0, 4, 2, low=tq(3, meta="log6")), mixed_pages(0.05, 0.0, 4, 2, low=v3p()), "e+f", mass=True, lc=True)
    add("mix8:0.05-k3pa6lc-v3p", c(mixed_pages(0.05, 0.0, 4, 2, low=tq(3, nrot=-8, meta="log6"))), mixed_pages(0.05, 0.0, 4, 2, low=v3p()), "e+f", mass=True, lc=True)
    return C


def followup_list():
    """Third round: the logit correction's zero-cost form (kappa' alpha^2, no per-token sum of
    squared levels) against the exact-norm form, on the library's designs and the recommended
    low tier; run it in the cold setting and in --setting all (every token coded: a uniform
    inflation of the coded mass is then harmless)."""
    C = []

    def add(name, k, v, group, mass=False, lc=False):
        C.append((name, k, v, group, mass, lc))

    c = centered
    for b in (2, 3, 4):
        add(f"c-tq{b}", c(tq(b)), c(tq(b)), "b")
        add(f"c-tq{b}-lc", c(tq(b)), c(tq(b)), "f-lc", lc=True)
        add(f"c-tq{b}-lca", c(tq(b, noise_model="alpha")), c(tq(b)), "f-lc", lc=True)
    add("c-k2pa6lc-v2p", c(tq(2, nrot=-8, meta="log6")), tq(2, nrot=-8, meta="log6"), "f-rot", lc=True)
    add("c-k2pa6lca-v2p", c(tq(2, nrot=-8, meta="log6", noise_model="alpha")), tq(2, nrot=-8, meta="log6"), "f-rot", lc=True)
    add("c-k4v3", c(tq(4)), c(tq(3)), "b")
    add("c-k4v3-lca", c(tq(4, noise_model="alpha")), c(tq(3)), "f-lc", lc=True)
    return C


# ----------------------------------------------------------------------------- calibration


def calibrate(arr, layers, kv_heads, q_heads):
    """Per (layer, KV head, role) statistics of a text: channel variances of centred vectors,
    PCA, and for keys the PCA after whitening by the queries' second moment."""
    out = {}
    group = q_heads // kv_heads
    for l in layers:
        K = np.asarray(arr["k"][l], dtype=np.float64)
        V = np.asarray(arr["v"][l], dtype=np.float64)
        Q = np.asarray(arr["q"][l], dtype=np.float64)
        for g in range(kv_heads):
            for role, X in (("key", K[:, g]), ("value", V[:, g])):
                Xc = X - X[:CENTER_TOKENS].mean(0)
                cov = Xc.T @ Xc / Xc.shape[0]
                vals, vecs = np.linalg.eigh(cov)
                o = np.argsort(-vals)
                e = {"chan_var": np.diag(cov).copy(), "pca_vals": vals[o], "pca_vecs": vecs[:, o]}
                if role == "key":
                    Qg = Q[:, g * group : (g + 1) * group].reshape(-1, D)
                    Cq = Qg.T @ Qg / Qg.shape[0]
                    Cq += 1e-4 * np.trace(Cq) / D * np.eye(D)
                    qv, qU = np.linalg.eigh(Cq)
                    M = qU @ np.diag(np.sqrt(qv)) @ qU.T  # Cq^(1/2): |M e|^2 = E (q.e)^2
                    cw = M @ cov @ M.T
                    wv, wU = np.linalg.eigh(cw)
                    o = np.argsort(-wv)
                    e["wpca_A"] = wU[:, o].T @ M
                    e["wpca_vals"] = wv[o]
                    for page in (16, 64):  # residuals from the page mean (anchor + KLT designs)
                        Xr = X - np.repeat(X.reshape(-1, page, D).mean(1), page, axis=0)
                        cr = M @ (Xr.T @ Xr / Xr.shape[0]) @ M.T
                        rv, rU = np.linalg.eigh(cr)
                        o = np.argsort(-rv)
                        e[f"wpcar{page}_A"] = rU[:, o].T @ M
                        e[f"wpcar{page}_vals"] = rv[o]
                out[(l, g, role)] = e
    return out


# ----------------------------------------------------------------------------- evaluation


def softmax_rows(S):
    m = S.max(axis=-1, keepdims=True)
    E = np.exp(S - m)
    return E / E.sum(axis=-1, keepdims=True)


def parse_layers(s, n):
    if not s:
        return list(range(n))
    out = []
    for part in s.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def run(args):
    dumps = args.dumps.split(",")
    data = [load_dump(p) for p in dumps]
    h0 = data[0][0]
    L, KVH, QH = h0["layers"], h0["kv_heads"], h0["q_heads"]
    assert h0["head_dim"] == D
    group = QH // KVH
    layers = parse_layers(args.layers, L)
    sets = {"screen": candidate_list, "final": final_list, "followup": followup_list}
    cands = [c for c in sets[args.set]() if re.search(args.candidates, c[0])]
    print(f"{len(cands)} candidates, layers {layers[0]}..{layers[-1]}, texts {dumps}", flush=True)
    cals = []  # each text's statistics calibrate the other text's transform coders
    if any(c[3] in ("d", "f-klt", "c+f", "e+f") for c in cands):
        for h, arr in data:
            t0 = time.time()
            cals.append(calibrate(arr, layers, KVH, QH))
            print(f"calibrated {h['text']} in {time.time() - t0:.1f} s", flush=True)
    results = {c[0]: {"group": c[3], "texts": {}} for c in cands}
    for ti, (h, arr) in enumerate(data):
        T = min(h["tokens"], args.tokens)
        other = cals[(ti + 1) % len(cals)] if cals else None
        qpos = np.arange(args.first_query, T, args.query_stride)[: args.queries]
        cpos = np.arange(3, T, args.query_stride)  # calibration queries: disjoint positions
        nb = args.mass_blocks
        blocks = np.array_split(np.arange(len(qpos)), nb)
        bounds = [(int(bl[0]), int(bl[-1]) + 1) for bl in blocks]
        tok = np.arange(T)
        causal = tok[None, :] <= qpos[:, None]
        if args.setting == "cold":
            protect = (tok[None, :] < SINK_TOKENS) | (tok[None, :] >= PAGE * (qpos[:, None] // PAGE - (RECENT_PAGES - 1)))
        else:
            protect = np.zeros_like(causal)
        cold = causal & ~protect
        prot = (causal & protect).astype(np.float64)
        ccausal = tok[None, :] <= cpos[:, None]
        coded_rows = tok >= SINK_TOKENS if args.setting == "cold" else tok >= 0
        acc = {c[0]: {} for c in cands}
        t_text = time.time()
        for l in layers:
            t_layer = time.time()
            K = np.asarray(arr["k"][l, :T], dtype=np.float64)
            V = np.asarray(arr["v"][l, :T], dtype=np.float64)
            Q = np.asarray(arr["q"][l, :T], dtype=np.float64)
            # Relative attention mass (p x visible tokens) each token received from the calibration
            # queries a block's evaluation queries come after (what a tier controller has seen).
            W = np.zeros((KVH, len(cpos), T))
            for g in range(KVH):
                for hq in range(g * group, (g + 1) * group):
                    S = np.where(ccausal, Q[cpos, hq] @ K[:, g].T * SCALE, -np.inf)
                    W[g] += softmax_rows(S) * (cpos[:, None] + 1.0) / group
            block_mass = []
            for bl in blocks:
                seen = cpos < qpos[bl[0]]
                cnt = np.maximum(ccausal[seen].sum(0), 1)
                m = W[:, seen].sum(1) / cnt[None, :]
                npg = -(-T // PAGE)
                pml = np.array([m[:, p * PAGE : (p + 1) * PAGE].mean() for p in range(npg)])
                block_mass.append((m, pml))
            del W
            for g in range(KVH):
                Kg, Vg = K[:, g], V[:, g]
                Qg = Q[qpos, g * group : (g + 1) * group].transpose(1, 0, 2)  # group x nq x d
                S_ref = np.where(causal[None], Qg @ Kg.T * SCALE, -np.inf)
                P_ref = softmax_rows(S_ref)
                O_ref = P_ref @ Vg
                On = np.linalg.norm(O_ref, axis=-1)
                sg = rotation_signs(args.seed, l, g)
                base = {"seed": args.seed, "layer": l, "head": g, "signs": sg, "rot": H64 * sg[None, :], "cal": other}
                Kc = Kg - Kg[:CENTER_TOKENS].mean(0)
                Vc = Vg - Vg[:CENTER_TOKENS].mean(0)
                kref = float((Kc[coded_rows] ** 2).sum())
                vref = float((Vc[coded_rows] ** 2).sum())
                for name, kc, vc, _grp, uses_mass, lc in cands:
                    a = acc[name].setdefault(l, {"kbits": 0.0, "vbits": 0.0, "scalars": 0, "dl2": 0.0, "dln": 0, "dl_abs_max": 0.0, "pl1": [], "ok": [], "ov": [], "okv": [], "kerr": 0.0, "kref": 0.0, "verr": 0.0, "vref": 0.0, "bias": [], "sd": [], "cmass": []})
                    enc = None
                    for bi, (q0, q1) in enumerate(bounds):
                        if enc is None or uses_mass:
                            ctx = dict(base, mass=block_mass[bi][0][g], page_mass_layer=block_mass[bi][1]) if uses_mass else dict(base, mass=None, page_mass_layer=None)
                            Kh, kbits, knoise = kc(Kg, dict(ctx, role="key"))
                            Vh, vbits, _ = vc(Vg, dict(ctx, role="value"))
                            if lc and knoise is None:
                                raise ValueError(f"{name}: logit correction without a noise model")
                            dK, dV = Kg - Kh, Vg - Vh
                            enc = True
                        w = (q1 - q0) / len(qpos)
                        km = int(qpos[q1 - 1]) + 1  # keys any query of the block sees
                        cb, pb = cold[q0:q1, :km], prot[q0:q1, :km]
                        Sr, Pr, Or, Onb = S_ref[:, q0:q1, :km], P_ref[:, q0:q1, :km], O_ref[:, q0:q1], On[:, q0:q1]
                        Qb = Qg[:, q0:q1]
                        Dl = (Qb @ dK[:km].T) * (-SCALE)  # logit error on coded keys
                        if lc:  # noise-aware logit correction: - Var(q.e_j) / 2 (scaled logits)
                            for Cn, wn in knoise:
                                qcq = np.einsum("hqd,de,hqe->hq", Qb, Cn, Qb) * SCALE * SCALE
                                Dl -= 0.5 * qcq[:, :, None] * wn[None, None, :km]
                        Dl *= cb[None]
                        P = softmax_rows(Sr + Dl)
                        wr = Pr * cb[None]  # reference mass on coded keys: per-query bias / spread of their logit error
                        wsum = np.maximum(wr.sum(-1), 1e-30)
                        bias = (wr * Dl).sum(-1) / wsum
                        a["bias"].append(np.abs(bias).ravel())
                        a["sd"].append(np.sqrt(np.maximum((wr * Dl * Dl).sum(-1) / wsum - bias**2, 0)).ravel())
                        a["cmass"].append(((P * cb[None]).sum(-1) - wr.sum(-1)).ravel())
                        O_k = P @ Vg[:km]
                        O_v = Or - Pr @ dV[:km] + (Pr * pb[None]) @ dV[:km]
                        O_kv = O_k - P @ dV[:km] + (P * pb[None]) @ dV[:km]
                        a["kbits"] += kbits * w
                        a["vbits"] += vbits * w
                        a["scalars"] += T * D * w
                        a["dl2"] += float(np.sum(Dl * Dl))
                        a["dln"] += int(cb.sum()) * Qg.shape[0]
                        a["dl_abs_max"] = max(a["dl_abs_max"], float(np.abs(Dl).max()))
                        a["pl1"].append(np.abs(P - Pr).sum(-1).ravel())
                        a["ok"].append((np.linalg.norm(O_k - Or, axis=-1) / Onb).ravel())
                        a["ov"].append((np.linalg.norm(O_v - Or, axis=-1) / Onb).ravel())
                        a["okv"].append((np.linalg.norm(O_kv - Or, axis=-1) / Onb).ravel())
                        a["kerr"] += w * float((dK[coded_rows] ** 2).sum())
                        a["kref"] += w * kref
                        a["verr"] += w * float((dV[coded_rows] ** 2).sum())
                        a["vref"] += w * vref
            print(f"  {h['text'].split('/')[-1]} layer {l}: {time.time() - t_layer:.1f} s", flush=True)
        for name, kc, vc, grp, _m, _lc in cands:
            rows = {}
            allkv = []
            for l in layers:
                a = acc[name][l]
                okv = np.concatenate(a["okv"])
                allkv.append(okv)
                rows[l] = {
                    "bits_key": a["kbits"] / a["scalars"],
                    "bits_value": a["vbits"] / a["scalars"],
                    "bits_per_scalar": (a["kbits"] + a["vbits"]) / (2 * a["scalars"]),
                    "key_logit_rms": math.sqrt(a["dl2"] / max(a["dln"], 1)),
                    "key_logit_absmax": a["dl_abs_max"],
                    "prob_l1_mean": float(np.concatenate(a["pl1"]).mean()),
                    "key_rel_mse_centred": a["kerr"] / a["kref"],
                    "value_rel_mse_centred": a["verr"] / a["vref"],
                    "logit_bias_abs": float(np.concatenate(a["bias"]).mean()),
                    "logit_sd_attended": float(np.concatenate(a["sd"]).mean()),
                    "coded_mass_shift": float(np.concatenate(a["cmass"]).mean()),
                    "out_rel_err_k_only": float(np.concatenate(a["ok"]).mean()),
                    "out_rel_err_v_only": float(np.concatenate(a["ov"]).mean()),
                    "out_rel_err": float(okv.mean()),
                    "out_rel_err_p50": float(np.percentile(okv, 50)),
                    "out_rel_err_p90": float(np.percentile(okv, 90)),
                    "out_rel_err_p99": float(np.percentile(okv, 99)),
                }
            results[name]["texts"][h["text"]] = {"layers": rows, "out_rel_err_all_quantiles": {str(q): float(np.percentile(np.concatenate(allkv), q)) for q in (50, 90, 99, 99.9)}}
        print(f"text {h['text']}: {time.time() - t_text:.0f} s", flush=True)
    metrics = ["bits_key", "bits_value", "bits_per_scalar", "key_logit_rms", "logit_bias_abs", "logit_sd_attended", "coded_mass_shift", "prob_l1_mean", "key_rel_mse_centred", "value_rel_mse_centred", "out_rel_err_k_only", "out_rel_err_v_only", "out_rel_err", "out_rel_err_p50", "out_rel_err_p90", "out_rel_err_p99"]
    for name, r in results.items():
        pooled, mid = {}, {}
        inner = [l for l in layers if 0 < l < L - 1]
        for m in metrics:  # pooled: the mean over layers of the per-layer figure, then over texts
            vals = [np.mean([t["layers"][l][m] for l in layers]) for t in r["texts"].values()]
            pooled[m] = float(np.mean(vals))
            pooled[m + "_by_text"] = [float(v) for v in vals]
            if inner:
                mid[m] = float(np.mean([np.mean([t["layers"][l][m] for l in inner]) for t in r["texts"].values()]))
        r["pooled"] = pooled
        r["pooled_layers_1_to_28"] = mid
        r["per_layer"] = {m: [float(np.mean([t["layers"][l][m] for t in r["texts"].values()])) for l in layers] for m in ("out_rel_err", "out_rel_err_k_only", "out_rel_err_v_only", "key_logit_rms", "value_rel_mse_centred", "bits_per_scalar")}
    meta = {"set": args.set, "layers": layers, "queries_per_head": int(len(qpos)), "first_query": args.first_query, "query_stride": args.query_stride, "calibration_query_stride": args.query_stride, "mass_blocks": nb, "tokens": args.tokens, "setting": args.setting, "seed": args.seed, "page_tokens": PAGE, "recent_pages": RECENT_PAGES, "sink_tokens": SINK_TOKENS, "center_tokens": CENTER_TOKENS}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "dumps": [{k: v for k, v in h.items() if k != "token_ids"} for h, _ in data], "results": results}, f, indent=1)
    print_table(results)


def print_table(results):
    rows = sorted(results.items(), key=lambda kv: kv[1]["pooled"]["bits_per_scalar"])
    print(f"{'candidate':42s} {'bits':>6s} {'bitsK':>6s} {'bitsV':>6s} {'logit':>7s} {'bias':>7s} {'dmass':>7s} {'pL1':>7s} {'vMSE':>7s} {'outK':>7s} {'outV':>7s} {'outKV':>7s} {'p90':>7s} {'p99':>7s}")
    for name, r in rows:
        p = r["pooled"]
        print(f"{name:42s} {p['bits_per_scalar']:6.3f} {p['bits_key']:6.3f} {p['bits_value']:6.3f} {p['key_logit_rms']:7.4f} {p.get('logit_bias_abs', float('nan')):7.4f} {p.get('coded_mass_shift', float('nan')):+7.4f} {p['prob_l1_mean']:7.4f} {p['value_rel_mse_centred']:7.4f} {p['out_rel_err_k_only']:7.4f} {p['out_rel_err_v_only']:7.4f} {p['out_rel_err']:7.4f} {p['out_rel_err_p90']:7.4f} {p['out_rel_err_p99']:7.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dumps", required=True, help="comma-separated dump prefixes (PREFIX.json ...); 2 texts: each calibrates the other")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", choices=("screen", "final", "followup"), default="final", help="candidate set: the first-round screen, the final list, the follow-up")
    ap.add_argument("--candidates", default=".", help="regex over candidate names")
    ap.add_argument("--layers", default="", help="e.g. 0-29 or 1,5,9 (default: all)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=512, help="evaluation queries per head")
    ap.add_argument("--first-query", type=int, default=512)
    ap.add_argument("--query-stride", type=int, default=7)
    ap.add_argument("--setting", choices=("cold", "all"), default="cold")
    ap.add_argument("--mass-blocks", type=int, default=8, help="mass-aware designs re-tier before each of this many query blocks")
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--table", help="print the table of an existing result file and exit")
    args = ap.parse_args()
    run(args)


if __name__ == "__main__":
    if "--table" in sys.argv:
        with open(sys.argv[sys.argv.index("--table") + 1]) as f:
            print_table(json.load(f)["results"])
    else:
        main()
