#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""FlashInfer paged decode (BF16 and FP8-E4M3 KV, bf16 queries): the peer a serving engine would use.

Same shapes, contexts and batches as bench/cuda/decode.cu and sdpa_control.py. The KV cache is paged
(page size 64, NHD, pages in a shuffled order) and read by BatchDecodeWithPagedKVCacheWrapper with
tensor cores (the FA2 prefill kernel, meant for GQA groups >= 4) and with CUDA cores (the decode
kernel); the row reports the faster. plan() runs once per row, outside timing. Cache-cold as in
sdpa_control.py: KV sets are rotated so each timed call reads >= 4x the L2 of fresh data, and each
timed call is enqueued behind a ~100 us sleep kernel. The first row of each (shape, KV dtype) is
checked against a float32 reference. FlashInfer JIT-compiles its kernels with nvcc at first use: all
modules are built up front, in parallel (prewarm). The JSON is rewritten after every row, so a run
stopped by its time limit still leaves what it measured. Usage: flashinfer_peer.py --out FILE [--quick]
[--ctx N ...] [--batch N ...] [--head-dim D ...] [--kv-dtype bf16|fp8 ...] [--backends tc,cc] [--jit-only]
"""
import argparse
import concurrent.futures
import json
import math
import os
import time

from flashinfer_env import JIT_DIR as _JIT  # noqa: E402,F401  (before torch)

import torch  # noqa: E402

from gpu_timing import median_us  # noqa: E402

SHAPES = [(24, 4, 256), (32, 8, 128), (9, 3, 64)]
PAGE = 64
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
BACKENDS = {"tc": ("tensor_cores", True), "cc": ("cuda_cores", False)}


def reference_err(out, q, k, v, indptr, indices, hq, hkv, d):
    """Max |out - softmax(q k^T / sqrt(d)) v| over the batch, in float32 on the dequantized cache."""
    def gather(x, pages):  # fp8 gathered as bytes: indexing kernels need not support float8 types
        return x.view(torch.uint8)[pages].view(x.dtype) if x.element_size() == 1 else x[pages]

    err = 0.0
    for b in range(q.shape[0]):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        kb = gather(k, pages).float().reshape(-1, hkv, d).repeat_interleave(hq // hkv, dim=1)  # [L, hq, d]
        vb = gather(v, pages).float().reshape(-1, hkv, d).repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), kb) / math.sqrt(d), dim=-1)
        ref = torch.einsum("hl,lhd->hd", p, vb)
        err = max(err, (out[b].float() - ref).abs().max().item())
    return err


def short(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def bench_row(wrappers, backends, jit_err, gen, checked, hq, hkv, d, L, B, kv_dtype, sets, device="cuda"):
    """One (shape, context, batch, KV dtype): {backend: time_us, max_abs_err, error, first_call_s}.
    Its tensors are freed when it returns."""
    n_pages = B * L // PAGE
    # Random normal data (never all zero); E4M3 holds randn well inside its range, so scale 1.
    ks = [torch.randn(n_pages, PAGE, hkv, d, device=device, generator=gen,
                      dtype=torch.bfloat16).to(kv_dtype) for _ in range(sets)]
    vs = [torch.randn(n_pages, PAGE, hkv, d, device=device, generator=gen,
                      dtype=torch.bfloat16).to(kv_dtype) for _ in range(sets)]
    q = torch.randn(B, hq, d, device=device, generator=gen, dtype=torch.bfloat16)
    o = torch.empty_like(q)
    indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * (L // PAGE)
    # A shuffled page table, as an allocator leaves it after churn (pages of 64 tokens stay contiguous).
    indices = torch.randperm(n_pages, device=device, generator=gen).to(torch.int32)
    last = torch.full((B,), PAGE, dtype=torch.int32, device=device)
    scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype.itemsize == 1 else {}
    res = {}
    for name, _ in backends:
        w = wrappers[name]
        r = res[name] = dict(time_us=None, max_abs_err=None, error=jit_err.get((d, kv_dtype, name)))
        if r["error"]:  # its module did not build: trying again would only spend minutes recompiling
            continue
        try:
            t0 = time.time()  # ~0 once prewarm() has built the module
            w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
            w.run(q, (ks[0], vs[0]), out=o, **scales)
            torch.cuda.synchronize()
            r["first_call_s"] = round(time.time() - t0, 2)
            if name not in checked:
                r["max_abs_err"] = reference_err(o, q, ks[0], vs[0], indptr.tolist(), indices, hq, hkv, d)
                checked.add(name)
            r["time_us"] = median_us(lambda i: w.run(q, (ks[i], vs[i]), out=o, **scales), sets)
        except Exception as e:  # e.g. a dtype/head_dim this version does not build
            r["error"] = short(e)
    return res


def prewarm(flashinfer, combos):
    """Build every JIT module the run needs, all at once, before any timing. FlashInfer compiles a
    module (tensor cores: 10 nvcc units of ~50-80 s; CUDA cores: 3 of ~30-40 s) at its first plan(),
    one module at a time, which leaves most of 16 cores idle: 12 modules in turn would take ~10 min.
    Threads suffice, as ninja/nvcc processes do the work. Returns ({(d, dtype, backend): error}, log)."""
    def one(hq, hkv, d, kv_dtype, name, tc):
        t0 = time.time()
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(16 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=tc)
        i32 = dict(dtype=torch.int32, device="cuda")
        w.plan(torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([PAGE], **i32),
               hq, hkv, d, PAGE, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
        kv = torch.randn(1, PAGE, hkv, d, device="cuda").to(kv_dtype)
        w.run(torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16), (kv, kv))
        torch.cuda.synchronize()
        return time.time() - t0

    t0, errors, log = time.time(), {}, []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(combos))) as ex:
        futs = {ex.submit(one, *c): c for c in combos}
        for f in concurrent.futures.as_completed(futs):
            hq, hkv, d, kv_dtype, name, _ = futs[f]
            err = None if f.exception() is None else "jit/first call: " + short(f.exception())
            if err:
                errors[(d, kv_dtype, name)] = err
            log.append(dict(head_dim=d, kv_dtype=str(kv_dtype), backend=name, error=err,
                            ready_s=round(time.time() - t0, 1)))
            print(f"jit d={d} kv={kv_dtype} {name}: {err or 'ready'} at {time.time() - t0:.1f}s", flush=True)
    return errors, log


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int, nargs="*")
    ap.add_argument("--batch", type=int, nargs="*")
    ap.add_argument("--head-dim", type=int, nargs="*")
    ap.add_argument("--kv-dtype", nargs="*", choices=list(KV_DTYPES))
    ap.add_argument("--backends", default="tc,cc", help="tc (tensor cores), cc (CUDA cores) or both")
    ap.add_argument("--jit-only", action="store_true", help="build the modules and stop (a later run reuses them)")
    args = ap.parse_args()

    def dump(out):
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    try:
        import flashinfer
    except Exception as e:  # not installed, or a dependency missing: a null result, not a failure
        print(f"flashinfer unavailable: {short(e)}", flush=True)
        dump({"flashinfer": None, "error": short(e)})
        return
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    contexts = args.ctx or ([32768] if args.quick else [8192, 32768, 131072])
    batches = args.batch or ([1, 8] if args.quick else [1, 8, 32])
    kv_names = args.kv_dtype or list(KV_DTYPES)
    backends = [BACKENDS[b] for b in args.backends.split(",")]
    out = dict(flashinfer_version=flashinfer.__version__, torch=torch.__version__, gpu=props.name,
               l2_bytes=l2, page_size=PAGE, jit_dir=_JIT, rows=[])
    shapes = [s for s in SHAPES if not args.head_dim or s[2] in args.head_dim]
    jit_err, out["jit"] = prewarm(flashinfer, [(hq, hkv, d, KV_DTYPES[k], name, tc) for hq, hkv, d in shapes
                                               for k in kv_names for name, tc in backends])
    dump(out)
    if args.jit_only:
        return
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # must be zero at first use
    wrappers = {name: flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
                for name, tc in backends}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv, d in shapes:
        for kv_name in kv_names:
            kv_dtype = KV_DTYPES[kv_name]
            checked = set()  # backends already compared with the reference for this (shape, dtype)
            for L in contexts:
                for B in batches:
                    kv_bytes = 2 * B * hkv * L * d * kv_dtype.itemsize
                    if kv_bytes > 40e9:
                        continue
                    sets = max(1, min(16, math.ceil(4 * l2 / kv_bytes)))
                    res = bench_row(wrappers, backends, jit_err, gen, checked, hq, hkv, d, L, B, kv_dtype, sets)
                    ok = {n: r for n, r in res.items() if r["time_us"] is not None}
                    win = min(ok, key=lambda n: ok[n]["time_us"]) if ok else None
                    row = dict(q_heads=hq, kv_heads=hkv, head_dim=d, context=L, batch=B, kv_dtype=kv_name,
                               kv_bytes=kv_bytes, time_us=ok[win]["time_us"] if win else None,
                               backend=win, max_abs_err=ok[win]["max_abs_err"] if win else None,
                               error=None if win else "; ".join(f"{n}: {r['error']}" for n, r in res.items()),
                               by_backend=res)
                    out["rows"].append(row)
                    dump(out)
                    desc = " ".join(f"{n}={r['time_us'] and round(r['time_us'], 1)}"
                                    + (f"(first {r['first_call_s']}s)" if "first_call_s" in r else "")
                                    + (f"(err {r['max_abs_err']:.2e})" if r["max_abs_err"] is not None else "")
                                    + (f"(ERROR {r['error']})" if r["error"] else "") for n, r in res.items())
                    print(f"flashinfer hq={hq} hkv={hkv} d={d} L={L} B={B} kv={kv_name} {desc}", flush=True)
                    torch.cuda.empty_cache()  # the row's tensors died with bench_row()
    dump(out)


if __name__ == "__main__":
    main()
