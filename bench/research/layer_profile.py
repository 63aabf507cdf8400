#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-layer budgets from an offline profile (issue 52; CompressKV's per-layer allocation).

Measures, on a calibration text the evaluation does not use, how much each layer's error costs:
the SmolLM2 engine's perplexity with every layer's old pages in the Stale tier (the base arm),
with all of them Cold, and with one layer's Cold (the policy knob cold_layers, the engine's arm
knob clm), each on the same tokens. A layer's sensitivity is its one-layer-Cold perplexity over
the base's, minus 1. Then, for each bits-per-scalar budget, the Cold layers are the least
sensitive ones, as many as the budget needs (bits interpolated between the all-Stale and the
all-Cold runs: every layer holds the same pages), and the profile file lists them with their
cold_layers mask, ready for an arm (`ARM+clm=MASK`) or policy_options={"cold_layers": MASK}.

    layer_profile.py measure --smollm build/release/examples/smollm/smollm --text CAL.txt \\
        --tokens 4096 --layers 30 --jobs 2 --work W
    layer_profile.py allocate --work W --budgets 3.0,2.9 --out PROFILE.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import time

BASE_ARM = "cold_u4_k3v2u+kf=0+kl=0+um=0+cm=0+cl=0"  # Stale TQ4k/TQ3v, Cold TQ3k/TQ2v, no mass roles


def run_one(a, tag, mask):
    path = os.path.join(a.work, f"{tag}.json")
    if os.path.exists(path):
        return json.load(open(path))
    arm = f"{a.arm}+clm={mask}"
    cmd = [a.smollm, "ppl", "--threads", "1", "--tokens", str(a.tokens), "--chunk", str(a.chunk),
           "--codec-seed", str(a.seed), "--ppl-text", a.text, "--arm", arm, "--nll-out", path + ".tmp"]  # fmt: skip
    if a.model:
        cmd += ["--model", a.model]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()[-400:]}")
    r = json.load(open(path + ".tmp"))
    r.update(arm=arm, mask=mask, tag=tag)
    del r["nll"]
    json.dump(r, open(path, "w"))
    os.remove(path + ".tmp")
    print(f"{tag:10s} ppl {r['ppl']:.4f} bits {r['bits_per_scalar']:.3f} {time.perf_counter() - t0:.0f} s", flush=True)
    return r


def measure(a):
    os.makedirs(a.work, exist_ok=True)
    jobs = [("base", 0), ("all_cold", (1 << a.layers) - 1)] + [(f"layer{l:02d}", 1 << l) for l in range(a.layers)]
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda j: run_one(a, *j), jobs))
    json.dump(dict(text=os.path.abspath(a.text), tokens=a.tokens, chunk=a.chunk, seed=a.seed, arm=a.arm,
                   layers=a.layers), open(os.path.join(a.work, "meta.json"), "w"))  # fmt: skip


def allocate(a):
    meta = json.load(open(os.path.join(a.work, "meta.json")))
    n = meta["layers"]
    load = lambda tag: json.load(open(os.path.join(a.work, f"{tag}.json")))  # noqa: E731
    base, cold = load("base"), load("all_cold")
    sens = {l: load(f"layer{l:02d}")["ppl"] / base["ppl"] - 1 for l in range(n)}
    # bits of the two ends: the calibration runs', or the evaluation context's where given (the
    # share of 8-bit Recent pages falls with the context)
    b_s = a.bits_all_stale or base["bits_per_scalar"]
    b_c = a.bits_all_cold or cold["bits_per_scalar"]
    order = sorted(range(n), key=lambda l: sens[l])  # least sensitive first: Cold first
    budgets = []
    for b in (float(x) for x in a.budgets.split(",")):
        k = n if b <= b_c else 0 if b >= b_s else math.ceil((b_s - b) / (b_s - b_c) * n - 1e-9)
        layers = sorted(order[:k])
        budgets.append(dict(bits_budget=b, cold_layers=layers, cold_layers_mask=sum(1 << l for l in layers),
                            bits_estimate=b_s - k / n * (b_s - b_c),
                            sensitivity_of_cold_layers=sum(sens[l] for l in layers)))  # fmt: skip
    out = dict(name="layer-profile", model=base.get("model", "SmolLM2-135M"), calibration=meta,
               bits_all_stale=b_s, bits_all_cold=b_c, ppl_all_stale=base["ppl"], ppl_all_cold=cold["ppl"],
               ppl_rel_all_cold=cold["ppl"] / base["ppl"] - 1,
               sensitivity_sum=sum(sens.values()), sensitivity={str(l): sens[l] for l in range(n)},
               budgets=budgets)  # fmt: skip
    json.dump(out, open(a.out, "w"), indent=1)
    for l in order:
        print(f"layer {l:2d} {100 * sens[l]:+.3f}%")
    for b in budgets:
        print(f"budget {b['bits_budget']}: {len(b['cold_layers'])} Cold layers, mask {b['cold_layers_mask']}, "
              f"~{b['bits_estimate']:.3f} bits")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--smollm", required=True)
    m.add_argument("--model", default="")
    m.add_argument("--text", required=True, help="calibration text (not one the evaluation scores)")
    m.add_argument("--tokens", type=int, default=4096)
    m.add_argument("--chunk", type=int, default=512)
    m.add_argument("--seed", type=int, default=20261129)
    m.add_argument("--layers", type=int, default=30)
    m.add_argument("--arm", default=BASE_ARM)
    m.add_argument("--jobs", type=int, default=2)
    m.add_argument("--work", required=True)
    al = sub.add_parser("allocate")
    al.add_argument("--work", required=True)
    al.add_argument("--budgets", default="3.0")
    al.add_argument("--out", required=True)
    al.add_argument("--bits-all-stale", type=float, default=0.0, help="bits with no Cold layer at the target context")
    al.add_argument("--bits-all-cold", type=float, default=0.0, help="bits with every layer Cold at the target context")
    a = ap.parse_args()
    if a.cmd == "measure":
        if a.layers > 53:
            sys.exit("layer_profile: layers 0-52 only (the mask travels as a double)")
        measure(a)
    else:
        allocate(a)


if __name__ == "__main__":
    main()
