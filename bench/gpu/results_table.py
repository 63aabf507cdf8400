#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown tables for docs/gpu.md from a bench/results/decode/decode-h200-*.json record (or
straight from gpubench_decode's Google Benchmark JSON, through gbench_record.load: no SDPA columns).
Usage: results_table.py RESULTS.json"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gbench_record  # noqa: E402


def main():
    r = gbench_record.load(sys.argv[1])
    cp = r["copy_gbps"]
    print(f"{r['gpu']}, {r['sms']} SMs, date {r.get('date', '-')}, commit {r['commit']}, "
          f"device-to-device copy {cp:.0f} GB/s (read + write), PyTorch {r.get('torch')}\n")
    peer = "flashinfer_rows" in r
    print("| q/kv/d | context | B | mix | tierkv µs (stream / graph) | bytes read (MB) | GB/s | of copy | SDPA BF16 µs | speedup |"
          + (" FlashInfer BF16 / FP8 µs | vs FlashInfer FP8 |" if peer else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if peer else ""))

    def num(v, fmt):
        return format(v, fmt) if v else "-"

    for x in r["rows"]:
        line = (f"| {x['q_heads']}/{x['kv_heads']}/{x['head_dim']} | {x['context'] // 1024}K | {x['batch']} | {x['mix']} | "
                f"{x['time_us']:.1f} / {x['graph_us']:.1f} | {x['bytes_read'] / 1e6:.1f} | {x['gbps']:.0f} | "
                f"{x['gbps'] / cp:.2f} | {num(x.get('sdpa_bf16_us'), '.1f')} | {num(x.get('speedup_vs_sdpa'), '.2f')} |")
        if peer:
            line += (f" {num(x.get('flashinfer_bf16_us'), '.1f')} / {num(x.get('flashinfer_fp8_us'), '.1f')} |"
                     f" {num(x.get('speedup_vs_flashinfer_fp8'), '.2f')} |")
        print(line)
    print("\n| q/kv/d | pages | FP8→TQ3 µs | GB/s of FP8 input | TQ3→FP8 µs | GB/s of FP8 output | append B=64 µs (stream / graph) |")
    print("|---|---|---|---|---|---|---|")
    for x in r.get("retier_append", []):
        print(f"| {x['q_heads']}/{x['kv_heads']}/{x['head_dim']} | {x['pages']} | {x['fp8_to_tq3_us']:.0f} | "
              f"{x['fp8_to_tq3_gbps_fp8_input']:.0f} | {x['tq3_to_fp8_us']:.0f} | {x['tq3_to_fp8_gbps_fp8_output']:.0f} | "
              f"{x['append_b64_us']:.2f} / {x['append_b64_graph_us']:.2f} |")


if __name__ == "__main__":
    main()
