#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Time to first token on a prefix hit with the prefix parked in the host tier, against
recomputing the prefix by prefill (issue 55's TTFT pair; bench/results/host-tier/).

The model is torch_e2e's (16 Qwen3-style layers of (24, 4, 256), hidden 3072, random bf16 weights).

  recompute  one causal prefill of the whole prefix through the model (PyTorch SDPA, its fused
             backends, only the last position's logits): the fastest recompute this model has, so the
             ratio below is a lower bound on what an engine's chunked prefill would lose.
  hit        the same-length prefix in a tierkv.CudaCache (written through begin_step + append of
             every layer, the default policy retiered to its steady state), offloaded to the host
             tier, then restore() (host -> GPU copies, the page table rebuilt) followed by one
             decode step of the model (a CUDA graph replay, begin_step / end_step included).

TTFT(hit) = restore wall time (host call to the copies' end) + one step's wall time; both parts are
reported. The sequence's K/V are random: the cost of restore and of a step does not depend on values.

Usage: ttft_prefix.py --out FILE [--context 131072] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

import torch_e2e as e2e
import tierkv
from tierkv.transformers import TieredCache


def causal_attention(module, q, k, v, mask, scaling=None, **kw):
    # The whole prefix at once: causal, no mask tensor (a 128K x 128K mask would not fit); K/V
    # repeated to the query heads, and only fused backends (the math one would not fit either).
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, scale=scaling, is_causal=True)
    return o.transpose(1, 2), None


AttentionInterface.register("ttft_causal", causal_attention)


def wall_ms(fn):
    """fn's wall time until the device is idle (a restore's copy runs on the host tier's own
    stream, so the device, not one stream, is synchronized)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - t0)


def recompute(model, L, reps):
    e2e.set_attention(model, "ttft_causal")
    ids = torch.randint(0, model.config.vocab_size, (1, L), device="cuda")

    def run(n):
        with torch.no_grad():
            out = model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1)

    run(4096)  # warm-up: cuBLAS handles, SDPA backend choice
    walls = [wall_ms(lambda: run(L))[1] for _ in range(reps)]
    torch.cuda.empty_cache()
    return walls


def hit(model, L, reps, steps):
    arm = e2e.TierkvArm(L, budget=0, fill_step_tokens=4096, batch=1, host_pool_bytes=0)
    arm.host_pool_bytes = int(arm.per_seq * 1.25) + (64 << 20)
    arm.fill()
    c, seq = arm.c, arm.seqs[0]
    info = arm.report()
    restores, offloads = [], []
    for i in range(reps):
        parked, off_ms = wall_ms(lambda: c.offload(seq))
        offloads.append(off_ms)
        seq, restore_ms = wall_ms(lambda: c.restore(parked))
        restores.append(restore_ms)
    host = c.host_stats()
    e2e.set_attention(model, "tierkv")
    tc = TieredCache.from_cache(model.config, c, [seq], softmax_scale=e2e.D**-0.5)
    r = e2e.StepRunner(model, tc, 1, L - 1)
    r.capture(before=lambda: tc.begin_step(1), after=tc.end_step)
    step_s = r.time_steps(steps, before=lambda: tc.begin_step(1), after=tc.end_step)
    out = dict(restore_wall_ms=restores, offload_wall_ms=offloads, step_ms=1e3 * step_s, step_host_ms=r.host_ms,
               host_stats=host, bits_per_scalar=info["bits_per_scalar"], live_pages=info["live_pages"],
               host_pool_bytes=arm.host_pool_bytes)  # fmt: skip
    r = tc = None
    c.close()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    L = args.context
    model = e2e.make_model(e2e.model_config(), torch.bfloat16)
    out = dict(name="ttft-prefix", date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
               commit=os.environ.get("TIERKV_COMMIT", "unknown"), torch=torch.__version__, context=L,
               model=dict(layers=e2e.LAYERS, q_heads=e2e.HQ, kv_heads=e2e.HKV, head_dim=e2e.D, hidden=3072,
                          weights="random", dtype="bfloat16"))  # fmt: skip
    out["hit"] = hit(model, L, args.reps, args.steps)
    e2e.log(f"hit: {out['hit']}")
    out["recompute_wall_ms"] = recompute(model, L, args.reps)
    e2e.log(f"recompute: {out['recompute_wall_ms']}")
    restore_ms = statistics.median(out["hit"]["restore_wall_ms"])
    ttft_hit = restore_ms + out["hit"]["step_ms"]
    ttft_re = statistics.median(out["recompute_wall_ms"])
    out["metrics"] = dict(ttft_prefix_hit_host_ms=ttft_hit, ttft_recompute_ms=ttft_re,
                          ttft_gain_vs_recompute=ttft_re / ttft_hit, restore_wall_ms=restore_ms,
                          first_step_ms=out["hit"]["step_ms"], bits_per_scalar=out["hit"]["bits_per_scalar"],
                          device=out["device"])  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    e2e.log(json.dumps(out["metrics"]))


if __name__ == "__main__":
    main()
