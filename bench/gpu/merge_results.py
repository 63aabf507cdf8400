#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Merges gpubench_decode's JSON with the SDPA control's into one results record:
bench/results/decode-h200-<date>.json rows carry sdpa_bf16_us and speedup_vs_sdpa
(the control's time / tierkv's best of stream and graph-replay time).
Usage: merge_results.py TIERKV.json SDPA.json OUT.json [--date YYYY-MM-DD]"""
import datetime
import json
import sys


def main():
    tk = json.load(open(sys.argv[1]))
    try:
        sd = json.load(open(sys.argv[2]))
    except (OSError, ValueError):
        sd = {"rows": [], "error": "no SDPA control output"}
    date = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--date" else datetime.date.today().isoformat()
    ctl = {(r["q_heads"], r["kv_heads"], r["head_dim"], r["context"], r["batch"]): r for r in sd["rows"]}
    rows = []
    for r in tk["rows"]:
        c = ctl.get((r["q_heads"], r["kv_heads"], r["head_dim"], r["context"], r["batch"]))
        sdpa = c["sdpa_bf16_us"] if c else None
        best = min(r["time_us"], r["graph_us"])
        r = dict(r, best_us=best, sdpa_bf16_us=sdpa,
                 speedup_vs_sdpa=(sdpa / best) if sdpa else None)
        rows.append(r)
    out = dict(date=date, gpu=tk["gpu"], commit=tk["commit"], copy_gbps=tk["copy_gbps"], sms=tk["sms"],
               l2_bytes=tk["l2_bytes"], torch=sd.get("torch"), command="scripts/gpu-bench",
               time_us_note="time_us: stream launch (split + merge kernels), graph_us: CUDA-graph replay; "
                            "each timed call is enqueued behind a ~100 us spin kernel so host launch latency is "
                            "hidden (GPU time; the SDPA control is timed the same way, behind torch.cuda._sleep); "
                            "gbps = bytes_read / min(time_us, graph_us); cuda_core_* and tensor_core_waves3_* "
                            "are 0 unless gpubench_decode ran with --compare",
               rows=rows, retier_append=tk.get("retier_append", []), sdpa_rows=sd["rows"])
    json.dump(out, open(sys.argv[3], "w"), indent=1)
    print(f"{'qh':>3} {'kv':>2} {'d':>3} {'ctx':>7} {'B':>3} {'mix':7} {'us':>9} {'GB/s':>7} {'roof':>5} {'sdpa_us':>9} {'x':>5}")
    for r in rows:
        sp = r["speedup_vs_sdpa"]
        print(f"{r['q_heads']:3d} {r['kv_heads']:2d} {r['head_dim']:3d} {r['context']:7d} {r['batch']:3d} "
              f"{r['mix']:7} {r['best_us']:9.1f} {r['gbps']:7.0f} {r['gbps'] / tk['copy_gbps']:5.2f} "
              f"{(r['sdpa_bf16_us'] or float('nan')):9.1f} {(sp or float('nan')):5.2f}")


if __name__ == "__main__":
    main()
