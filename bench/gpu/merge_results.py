#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Merges gpubench_decode's JSON with the SDPA control's (and FlashInfer's, when it ran) into
one results record: bench/results/decode/decode-h200-<date>.json rows carry sdpa_bf16_us and
speedup_vs_sdpa (the control's time / tierkv's best of stream and graph-replay time), and
flashinfer_bf16_us / flashinfer_fp8_us (FlashInfer's paged decode, best of its tensor-core and
CUDA-core backends) with speedup_vs_flashinfer_fp8. TIERKV.json is gpubench_decode's Google
Benchmark JSON or its old-shape record (gbench_record.py converts the first).
Usage: merge_results.py TIERKV.json SDPA.json OUT.json [--date YYYY-MM-DD] [--flashinfer FI.json]"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gbench_record  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tierkv")
    ap.add_argument("sdpa")
    ap.add_argument("out")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--flashinfer")
    args = ap.parse_args()
    tk = gbench_record.load(args.tierkv)
    try:
        sd = json.load(open(args.sdpa))
    except (OSError, ValueError):
        sd = {"rows": [], "error": "no SDPA control output"}
    fi = {"rows": []}
    if args.flashinfer:
        try:
            fi = json.load(open(args.flashinfer))
        except (OSError, ValueError):
            fi = {"rows": [], "error": "no FlashInfer output"}
    date = args.date
    ctl = {(r["q_heads"], r["kv_heads"], r["head_dim"], r["context"], r["batch"]): r for r in sd["rows"]}
    peer = {}
    for r in fi.get("rows") or []:
        if r.get("time_us"):
            peer[(r["q_heads"], r["kv_heads"], r["head_dim"], r["context"], r["batch"], r["kv_dtype"])] = r["time_us"]
    rows = []
    for r in tk["rows"]:
        key = (r["q_heads"], r["kv_heads"], r["head_dim"], r["context"], r["batch"])
        c = ctl.get(key)
        sdpa = c["sdpa_bf16_us"] if c else None
        best = min(t for t in (r["time_us"], r["graph_us"]) if t > 0)  # one may be filtered out (0)
        fb, f8 = peer.get(key + ("bf16",)), peer.get(key + ("fp8",))
        r = dict(r, best_us=best, sdpa_bf16_us=sdpa,
                 speedup_vs_sdpa=(sdpa / best) if sdpa else None)
        if peer:
            r.update(flashinfer_bf16_us=fb, flashinfer_fp8_us=f8,
                     speedup_vs_flashinfer_fp8=(f8 / best) if f8 else None)
        rows.append(r)
    out = dict(date=date, gpu=tk["gpu"], commit=tk["commit"], copy_gbps=tk["copy_gbps"], sms=tk["sms"],
               l2_bytes=tk["l2_bytes"], launch_floor_us=tk.get("launch_floor_us"), torch=sd.get("torch"),
               command="scripts/gpu-check bench",
               time_us_note="time_us: stream launch (split + merge kernels), graph_us: CUDA-graph replay; "
                            "each timed call is enqueued behind a ~100 us spin kernel so host launch latency is "
                            "hidden (GPU time; the SDPA control is timed the same way, behind torch.cuda._sleep); "
                            "gbps = bytes_read / min(time_us, graph_us); cuda_core_* and tensor_core_waves3_* "
                            "are 0 unless gpubench_decode ran with --compare",
               rows=rows, retier_append=tk.get("retier_append", []), sdpa_rows=sd["rows"])
    if peer:
        out.update(flashinfer_version=fi.get("flashinfer_version"),
                   flashinfer_note="FlashInfer BatchDecodeWithPagedKVCacheWrapper, page size 64, bf16 queries, "
                                   "best of use_tensor_cores True / False; measured by bench/gpu/flashinfer_peer.py "
                                   "in the same device session",
                   flashinfer_rows=fi["rows"])
    json.dump(out, open(args.out, "w"), indent=1)
    print(f"{'qh':>3} {'kv':>2} {'d':>3} {'ctx':>7} {'B':>3} {'mix':7} {'us':>9} {'GB/s':>7} {'roof':>5} {'sdpa_us':>9} {'x':>5}")
    for r in rows:
        sp = r["speedup_vs_sdpa"]
        print(f"{r['q_heads']:3d} {r['kv_heads']:2d} {r['head_dim']:3d} {r['context']:7d} {r['batch']:3d} "
              f"{r['mix']:7} {r['best_us']:9.1f} {r['gbps']:7.0f} {r['gbps'] / tk['copy_gbps']:5.2f} "
              f"{(r['sdpa_bf16_us'] or float('nan')):9.1f} {(sp or float('nan')):5.2f}")


if __name__ == "__main__":
    main()
