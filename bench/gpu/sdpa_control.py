#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Dense BF16 decode through PyTorch SDPA: the control an engine has without tierkv.

Same shapes, contexts and batches as bench/cuda/decode.cu; for each the best of the flash,
efficient and cuDNN backends (median of CUDA-event timings after warm-up). Cache-cold like
the tierkv bench: K/V sets are rotated so each timed call reads at least 4x the L2 of fresh
data; each timed call is enqueued behind a ~100 us sleep kernel (GPU time, no launch latency). Writes JSON to --out. Usage: sdpa_control.py --out FILE [--quick] [--ctx L ...] [--batch B ...]
[--head-dim D ...]
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_timing import median_us

SHAPES = [(24, 4, 256), (32, 8, 128), (9, 3, 64)]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ctx", type=int, nargs="*", help="only these contexts")
    ap.add_argument("--batch", type=int, nargs="*", help="only these batches")
    ap.add_argument("--head-dim", type=int, nargs="*", help="only the shapes of these head dims")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 << 20)
    contexts = [32768] if args.quick else [8192, 32768, 131072]
    batches = [1, 8] if args.quick else [1, 8, 32]
    contexts, batches = args.ctx or contexts, args.batch or batches
    shapes = [s for s in SHAPES if not args.head_dim or s[2] in args.head_dim]
    rows = []
    for hq, hkv, d in shapes:
        for L in contexts:
            for B in batches:
                kv_bytes = 2 * B * hkv * L * d * 2
                if kv_bytes > 40e9:
                    continue
                sets = max(1, min(16, math.ceil(4 * l2 / kv_bytes)))
                q = torch.randn(B, hq, 1, d, dtype=torch.bfloat16, device="cuda")
                ks = [torch.randn(B, hkv, L, d, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
                vs = [torch.randn(B, hkv, L, d, dtype=torch.bfloat16, device="cuda") for _ in range(sets)]
                res = {}
                for name, be in BACKENDS:
                    try:
                        with sdpa_kernel([be]):
                            res[name] = median_us(
                                lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True), sets)
                    except Exception as e:  # a backend that does not support the shape
                        res[name] = None
                        res[name + "_error"] = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                ok = [v for k, v in res.items() if not k.endswith("_error") and v is not None]
                best = min(ok) if ok else None
                row = dict(q_heads=hq, kv_heads=hkv, head_dim=d, context=L, batch=B, kv_bytes=kv_bytes,
                           sdpa_bf16_us=best, **{f"{k}_us" if not k.endswith("_error") else k: v
                                                  for k, v in res.items()})
                rows.append(row)
                print(f"sdpa hq={hq} hkv={hkv} d={d} L={L} B={B} best={best}", flush=True)
                del q, ks, vs
                torch.cuda.empty_cache()
    out = dict(device=props.name, torch=torch.__version__, l2_bytes=l2, rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
