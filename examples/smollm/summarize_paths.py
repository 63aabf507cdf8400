#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# One quality on every path (issue 57): the same model, tokens and cache options scored through
# several paths (bench/gpu/ppl_suite.py: the C++ engine, the transformers TieredCache on the host
# and on the GPU), one --path NAME=WORK each, every WORK in summarize_ppl.py's layout with its own
# dense run. Per path and arm: the relative perplexity exp(mean(nll_arm - nll_dense)) - 1 pooled
# over the texts every path holds (texts weighted equally, codec seeds averaged), with
# summarize_ppl.py's paired block-bootstrap interval; then, per arm, every two paths' difference
# in percentage points with its paired interval (the same blocks of the same tokens resampled for
# both), the share of pages whose final tier differs (runs that wrote layer_tiers), and the
# largest difference among --metric-paths. Writes the record (--out); the last
# line printed is {"name": "paths", "metrics": {...}}.
#
#   python3 examples/smollm/summarize_paths.py --path engine=W/engine --path host=W/host \
#       --path gpu=W/gpu --metric-paths engine=engine,host=transformers_host,gpu=transformers_gpu \
#       --out RECORD.json
import argparse
import datetime
import itertools
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from summarize_ppl import arm_blocks, load, pooled_bootstrap  # noqa: E402  (one reading of the run files)


def pooled(runs, texts, arm, block, boot, rng):
    """(relative ppl, 95% interval, seeds, bits, per-text relative, per-text [seeds][blocks]
    block means of nll_arm - nll_dense) of arm over texts."""
    per_text, blocks, bits, seeds = {}, [], [], set()
    for text in texts:
        m, per_seed = arm_blocks(runs, text, arm, block, "summarize_paths")
        blocks.append(m)
        per_text[text] = float(np.exp(m.mean()) - 1)
        bits += [b for _, _, b in per_seed]
        seeds.update(seed for seed, _, _ in per_seed)
    acc = pooled_bootstrap(blocks, boot, rng)
    rel = float(np.exp(np.mean([m.mean() for m in blocks])) - 1)
    ci = [float(np.exp(np.percentile(acc, q)) - 1) for q in (2.5, 97.5)]
    return rel, ci, sorted(seeds), float(np.mean(bits)), per_text, blocks


def gap_interval(bx, by, boot, rng):
    """95% interval of the gap (percentage points) between two paths' pooled relative changes:
    the same blocks of the same tokens resampled for both (paired), texts weighted equally."""
    ax, ay = np.zeros(boot), np.zeros(boot)
    for mx, my in zip(bx, by):
        idx = rng.integers(0, mx.shape[1], size=(boot, mx.shape[1]))
        ax += mx[:, idx].mean(axis=(0, 2))
        ay += my[:, idx].mean(axis=(0, 2))
    g = 100 * (np.exp(ax / len(bx)) - np.exp(ay / len(by)))
    return [float(np.percentile(g, 2.5)), float(np.percentile(g, 97.5))]


def tier_agreement(runs, x, y, texts, arm):
    """Share of (text, seed, layer, page) whose final tier differs between paths x and y, over the
    runs where both wrote layer_tiers (the engine's --nll-out and ppl_suite.py's files), or None."""
    differ = total = 0
    for text in texts:
        for seed, rx in runs[x][text][arm].items():
            ry = runs[y][text][arm].get(seed)
            if ry is None or not rx.get("layer_tiers") or not ry.get("layer_tiers"):
                continue
            for tx, ty in zip(rx["layer_tiers"], ry["layer_tiers"]):
                n = min(len(tx), len(ty))
                total += n
                differ += sum(tx[i] != ty[i] for i in range(n)) + abs(len(tx) - len(ty))
    return None if total == 0 else dict(pages=total, differ=differ, share=differ / total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", action="append", required=True, help="NAME=WORK (repeat)")
    ap.add_argument("--metric-paths", default="", help="NAME=METRIC[+METRIC],... the issue's metric names of "
                    "paths (e.g. engine=engine,host=transformers_host+transformers_default,gpu=transformers_gpu); "
                    "the largest gap is over these paths")
    ap.add_argument("--arms", default="rec,seed")
    ap.add_argument("--out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--command", default="")
    ap.add_argument("--notes", default="")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--boot", type=int, default=4000)
    a = ap.parse_args()
    paths = dict(p.split("=", 1) for p in a.path)
    runs = {name: load(work) for name, work in paths.items()}
    arms = a.arms.split(",")
    texts = sorted(set.intersection(*[
        {t for t in r if "dense" in r[t] and all(arm in r[t] for arm in arms)} for r in runs.values()]))
    if not texts:
        sys.exit("summarize_paths: no text has dense and every arm on every path")
    rng = np.random.default_rng(20261206)
    table, metrics = {}, {}
    alias = dict(x.split("=", 1) for x in a.metric_paths.split(",") if x)
    for arm in arms:
        blocks = {}
        for name in paths:
            rel, ci, seeds, bits, per_text, blocks[name] = pooled(runs[name], texts, arm, a.block, a.boot, rng)
            first = next(iter(runs[name][texts[0]][arm].values()))
            table.setdefault(arm, {})[name] = dict(rel_ppl=rel, ci95=ci, seeds=seeds, bits_per_scalar=bits,
                                                   per_text=per_text, device=first.get("device", ""))
            for metric in alias.get(name, "").split("+") if name in alias else []:
                metrics[f"ppl_rel_{metric}_{arm}"] = rel
                metrics[f"bits_{metric}_{arm}"] = bits
        names = [n for n in paths if n in alias] or list(paths)
        pairs = list(itertools.combinations(list(paths), 2))
        gaps = {f"{x}-{y}": 100 * (table[arm][x]["rel_ppl"] - table[arm][y]["rel_ppl"]) for x, y in pairs}
        gap_ci = {f"{x}-{y}": gap_interval(blocks[x], blocks[y], a.boot, rng) for x, y in pairs}
        worst = max((f"{x}-{y}" for x, y in itertools.combinations(names, 2)), key=lambda k: abs(gaps[k]))
        metrics[f"max_path_gap_pct_{arm}" if arm != "rec" else "max_path_gap_pct"] = abs(gaps[worst])
        table[arm]["gaps_pct"] = gaps
        table[arm]["gaps_pct_ci95"] = gap_ci
        # where the paths' tiering parted: the pages that ended in another tier
        table[arm]["tiers_differ"] = {f"{x}-{y}": tier_agreement(runs, x, y, texts, arm) for x, y in pairs}
    metrics["texts"] = len(texts)
    metrics["seeds"] = min(len(table[arm][n]["seeds"]) for arm in arms for n in paths)
    print("%-7s %-16s %9s %21s %6s" % ("arm", "path", "rel ppl", "95% interval", "bits"))
    for arm in arms:
        for name in paths:
            r = table[arm][name]
            print("%-7s %-16s %+8.3f%% [%+7.3f%%, %+7.3f%%] %6.3f" % (
                arm, name, 100 * r["rel_ppl"], 100 * r["ci95"][0], 100 * r["ci95"][1], r["bits_per_scalar"]))
        for k, g in table[arm]["gaps_pct"].items():
            lo, hi = table[arm]["gaps_pct_ci95"][k]
            t = table[arm]["tiers_differ"][k]
            tiers = "" if t is None else "; final tiers differ on %d of %d pages" % (t["differ"], t["pages"])
            print("%-7s gap %-28s %+.3f points [%+.3f, %+.3f]%s" % (arm, k, g, lo, hi, tiers))
    rec = {"name": "paths", "date": datetime.date.today().isoformat(), "commit": a.commit, "command": a.command,
           "notes": a.notes, "texts": texts, "paths": paths,
           "method": "chunked perplexity (512-token chunks, the first unscored) over the same token ids on "
                     "every path; relative perplexity exp(mean(nll_arm - nll_dense)) - 1 against the path's own "
                     "dense run, pooled over the texts (equal weight) and codec seeds; paired block bootstrap "
                     f"({a.block}-token blocks, {a.boot} resamples); gaps in percentage points",
           "arms": table, "metrics": metrics}
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        json.dump(rec, open(a.out, "w"), indent=1)
        print("wrote " + a.out)
    print(json.dumps({"name": "paths", "metrics": metrics}))


if __name__ == "__main__":
    main()
