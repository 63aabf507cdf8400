#!/usr/bin/env python3
"""Same-run A/B of two gpubench_decode binaries: best of each side's repetitions per row.

Usage: ab_compare.py --a A1.json [A2.json ...] --b B1.json [B2.json ...]
Prints one line per (shape, context, batch, mix) with the best (min of stream / graph)
time of A and of B and the ratio B / A, then the geometric mean of the ratios per batch.
scripts/gpu-ab runs the binaries alternately on the device and calls this. A file is
gpubench_decode's Google Benchmark JSON or a record in the old shape (a binary built before the
port to Google Benchmark, a bench/results/decode record): gbench_record.load reads both.
"""
import argparse
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gbench_record  # noqa: E402


def best_times(paths):
    best = {}
    for p in paths:
        for r in gbench_record.load(p)["rows"]:
            key = (r["q_heads"], r["kv_heads"], r["head_dim"], r["context"], r["batch"], r["mix"])
            t = min(x for x in (r.get("time_us", 0), r.get("graph_us", 0)) if x > 0)
            best[key] = min(best.get(key, math.inf), t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", nargs="+", required=True)
    ap.add_argument("--b", nargs="+", required=True)
    args = ap.parse_args()
    a, b = best_times(args.a), best_times(args.b)
    ratios = defaultdict(list)
    print(f"{'q/kv/d':>10} {'ctx':>7} {'B':>3} {'mix':>13} {'A us':>9} {'B us':>9} {'B/A':>6}")
    for key in sorted(a.keys() & b.keys()):
        qh, kvh, d, ctx, batch, mix = key
        r = b[key] / a[key]
        ratios[batch].append(r)
        print(f"{qh}/{kvh}/{d:>3} {ctx:>7} {batch:>3} {mix:>13} {a[key]:>9.1f} {b[key]:>9.1f} {r:>6.3f}")
    for batch, rs in sorted(ratios.items()):
        g = math.exp(sum(math.log(x) for x in rs) / len(rs))
        print(f"B={batch}: geometric mean B/A {g:.3f} over {len(rs)} rows (min {min(rs):.3f}, max {max(rs):.3f})")


if __name__ == "__main__":
    main()
