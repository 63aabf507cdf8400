#!/usr/bin/env python3
"""SmolLM2-135M through tierkv's ops on the GPU and on the CPU: the same weights (the GGUF that
examples/smollm reads, dequantized by transformers to float32), the same text, the same cache
settings; teacher-forced chunked perplexity with a tierkv.transformers.TieredCache on the GPU
(tierkv.CudaCache: GPU prefill over mixed pages, retier on the GPU) and on the host
(tierkv.Cache), and transformers' own dense cache as the reference.

    python3 bench/gpu/smollm_ppl.py --gguf PATH --out FILE.json [--tokens 2048] [--chunk 128]

Each forward call is one cache step (a chunk of `chunk` tokens); positions after the first
chunk are scored, as examples/smollm's `ppl` does. Arms: "int8r" (8-bit pages only: the two
paths hold the same codes, so their difference is the ops') and "recommended" (int8_rotated
Recent/Anchor pages, TQ4 Stale keys, TQ3 Stale values: the policy moves pages too; the GPU's
policy is fed a step later than the host's, so their tiers may differ at a step).
"""

import argparse
import json
import math
import os
import time

import torch

from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import tierkv  # noqa: F401  (the installed package: scripts/gpu-check builds it)
from tierkv.transformers import TieredCache

ARMS = {
    "int8r": dict(recent="int8_rotated", cache_type_k="int8_rotated", cache_type_v="int8_rotated"),
    "recommended": dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3"),
}


def log(*a):
    print(*a, flush=True)


def perplexity(model, ids, chunk, cache):
    """exp(mean NLL) of ids[p + 1] given ids[:p + 1] for p >= chunk - 1, chunk by chunk."""
    nll, scored, dev = 0.0, 0, model.device
    with torch.no_grad():
        for start in range(0, ids.numel(), chunk):
            x = ids[start : start + chunk].view(1, -1).to(dev)
            pos = torch.arange(start, start + x.shape[1], device=dev).view(1, -1)
            logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits[0].double()
            lp = torch.log_softmax(logits, -1).cpu()
            for j in range(x.shape[1]):
                p = start + j
                if p + 1 >= ids.numel() or p + 1 < chunk:
                    continue
                nll -= lp[j, ids[p + 1]].item()
                scored += 1
    return math.exp(nll / scored), scored


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=32, help="tokens a step (64 steps over 2048 tokens: the policy moves pages)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--devices", default="cuda,cpu")
    args = ap.parse_args()
    d, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    with open(args.text, encoding="utf-8") as f:
        ids = torch.tensor(tok(f.read())["input_ids"][: args.tokens], dtype=torch.long)
    out = dict(name="smollm-gpu-ppl", date=time.strftime("%Y-%m-%d"), commit=os.environ.get("TIERKV_COMMIT", "unknown"),
               model=name, text=args.text, tokens=int(ids.numel()), chunk=args.chunk, page_size=args.page_size,
               device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", rows=[])  # fmt: skip
    devices = args.devices.split(",")
    for dev in devices:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).to(dev).eval()
        ppl, n = perplexity(model, ids, args.chunk, DynamicCache(config=model.config))
        out["rows"].append(dict(arm="dense", device=dev, ppl=ppl, scored=n))
        log(f"dense  {dev:4s}: ppl {ppl:.5f} over {n} tokens ({time.perf_counter() - t0:.1f} s)")
        model.config._attn_implementation = "tierkv"
        for arm, names in ARMS.items():
            t0 = time.perf_counter()
            kw = dict(max_tokens=args.tokens + 64, page_size=args.page_size, max_sequences=1, max_batch=1, **names)
            if dev == "cuda":
                kw.update(device="cuda", max_step_tokens=args.chunk)
            cache = TieredCache(model.config, **kw)
            ppl, n = perplexity(model, ids, args.chunk, cache)
            seq = int(cache.seqs[0])
            tiers = sorted({t for layer in range(model.config.num_hidden_layers) for t in cache.tierkv.page_tiers(seq, layer)})
            bits = cache.tierkv.report()["bits_per_scalar"]
            out["rows"].append(dict(arm=arm, device=dev, ppl=ppl, scored=n, tiers_seen=tiers, bits_per_scalar=bits))
            log(f"{arm:12s} {dev:4s}: ppl {ppl:.5f} over {n} tokens, tiers {tiers}, {bits:.2f} bits ({time.perf_counter() - t0:.1f} s)")
        del model
    rows = {(r["arm"], r["device"]): r["ppl"] for r in out["rows"]}
    m = {}
    for arm in ["dense", *ARMS]:
        if (arm, "cuda") in rows and (arm, "cpu") in rows:
            m[f"ppl_rel_diff_gpu_vs_cpu_{arm}"] = rows[(arm, "cuda")] / rows[(arm, "cpu")] - 1
        for dev in devices:
            if arm != "dense" and (arm, dev) in rows and ("dense", dev) in rows:
                m[f"ppl_rel_vs_dense_{arm}_{dev}"] = rows[(arm, dev)] / rows[("dense", dev)] - 1
    out["metrics"] = m
    log(json.dumps(m))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
