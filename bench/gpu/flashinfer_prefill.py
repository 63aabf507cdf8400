#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's paged chunked prefill (BF16 KV and queries): the peer of bench/cuda/prefill.cu.

One sequence: a chunk of C query tokens, causal inside itself, over P cached tokens (the chunk's own
K/V appended to the pages first, so kv_len = P + C), as in bench/cuda/prefill.cu. Pages of 16 tokens
(NHD) in a shuffled order; BatchPrefillWithPagedKVCacheWrapper with the FA2 and FA3 backends (the
row reports both). plan() once per row, outside timing; the median of CUDA-event-timed calls behind
a sleep kernel (gpu_timing.median_us). The first row is checked against a float32 reference over
the last 16 queries. The JSON is rewritten after every row. Wheels and run: bench/gpu/FLASHINFER.md.
Usage: flashinfer_prefill.py --out FILE [--chunk C ...] [--prefix P ...] [--backends fa2,fa3]
"""
import argparse
import json
import math
import os

from flashinfer_env import JIT_DIR as _JIT  # noqa: E402,F401  (before torch)

import torch  # noqa: E402

from gpu_timing import median_us  # noqa: E402

PAGE = 16


def short(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def reference_err(out, q, k, v, pages, kv_len, hq, hkv, d):
    """Max |out - attention| over the last 16 queries (float32, causal)."""
    kk = k[pages].float().reshape(-1, hkv, d)[:kv_len].repeat_interleave(hq // hkv, dim=1)
    vv = v[pages].float().reshape(-1, hkv, d)[:kv_len].repeat_interleave(hq // hkv, dim=1)
    c = q.shape[0]
    rows = range(max(0, c - 16), c)
    err = 0.0
    for j in rows:
        pos = kv_len - c + j
        s = torch.einsum("hd,lhd->hl", q[j].float(), kk[: pos + 1]) / math.sqrt(d)
        ref = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), vv[: pos + 1])
        err = max(err, (out[j].float() - ref).abs().max().item())
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunk", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--prefix", type=int, nargs="*", default=[32768])
    ap.add_argument("--shape", type=int, nargs=3, default=[24, 4, 256], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--backends", default="fa2,fa3")
    args = ap.parse_args()
    out = dict(rows=[])

    def dump():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    try:
        import flashinfer
    except Exception as e:
        print(f"flashinfer unavailable: {short(e)}", flush=True)
        out["error"] = short(e)
        dump()
        return
    hq, hkv, d = args.shape
    props = torch.cuda.get_device_properties(0)
    out.update(flashinfer_version=flashinfer.__version__, torch=torch.__version__, gpu=props.name,
               page_size=PAGE, shape=[hq, hkv, d])
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    checked = set()
    for prefix in args.prefix:
        for c in args.chunk:
            kv_len = prefix + c
            n_pages = (kv_len + PAGE - 1) // PAGE
            k = torch.randn(n_pages, PAGE, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            v = torch.randn(n_pages, PAGE, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            q = torch.randn(c, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            pages = torch.randperm(n_pages, device="cuda", generator=gen).to(torch.int32)
            i32 = dict(dtype=torch.int32, device="cuda")
            qo_indptr = torch.tensor([0, c], **i32)
            kv_indptr = torch.tensor([0, n_pages], **i32)
            last = torch.tensor([kv_len - (n_pages - 1) * PAGE], **i32)
            row = dict(prefix=prefix, chunk=c, kv_len=kv_len, by_backend={})
            for backend in args.backends.split(","):
                r = row["by_backend"][backend] = dict(time_us=None, max_abs_err=None, error=None)
                try:
                    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
                    w.plan(qo_indptr, kv_indptr, pages, last, hq, hkv, d, PAGE, causal=True,
                           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                    o = w.run(q, (k, v))
                    torch.cuda.synchronize()
                    if backend not in checked:
                        r["max_abs_err"] = reference_err(o, q, k, v, pages.long(), kv_len, hq, hkv, d)
                        checked.add(backend)
                    r["time_us"] = median_us(lambda i: w.run(q, (k, v), out=o), 1, warm=3, reps=30)
                except Exception as e:
                    r["error"] = short(e)
                print(f"flashinfer prefill {backend} prefix={prefix} chunk={c}: {r}", flush=True)
            out["rows"].append(row)
            dump()
            del k, v, q
            torch.cuda.empty_cache()
    dump()


if __name__ == "__main__":
    main()
