#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The GPU benchmarks' Google Benchmark JSON -> the records in their old shape (one place).

bench/cuda/*.cu (gpubench_*) are Google Benchmark programs: `--out FILE` (= --benchmark_out=FILE
--benchmark_out_format=json) writes Google Benchmark's JSON, whose context names the program
("tierkv_program") and whose benchmark names carry the fields ("decode/shape:24x4x256/mix:tiered/
path:graph/context:32768/batch:8"). This turns such a file into the JSON the hand-rolled programs
wrote, which merge_results.py, results_table.py, ab_compare.py, scripts/gpu-check and
bench/results/ hold, and prints the old programs' text tables:

  gpubench_decode          {gpu, sms, l2_bytes, commit, copy_gbps, launch_floor_us, rows, retier_append}
  gpubench_prefill         {bench, commit, device, rows}
  gpubench_codec           {name, device, metrics}
  gpubench_unpack          {name, device, rows}
  gpubench_retier_overlap  {gpu, sms, l2_bytes, commit, step, rows}
  gpubench_e2e_step        the one-line {"bench": "e2e_step", ...} object

Times are the medians of each benchmark's repetitions (gpubench_unpack: the fastest, as its old
loop took the best of 5; the retier-overlap checks: the minimum, so one failed repetition shows).

Usage: gbench_record.py IN.json [-o OUT.json] [--quiet]
As a module: load(path) returns the old shape of either kind of file (an old record as it is).
"""
import argparse
import json
import sys
from collections import OrderedDict

# Keys Google Benchmark adds to a run's name; not fields of ours.
_GB_KEYS = {"iterations", "repeats", "repetitions", "threads", "min_time", "min_warmup_time"}
_TO_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def is_gbench(doc):
    return isinstance(doc, dict) and "benchmarks" in doc and "context" in doc


def parse_name(run_name):
    """'family/k:v/k:v/.../iterations:1/repeats:25/manual_time' -> (family, {k: v}), ints as int."""
    parts = run_name.split("/")
    fields = OrderedDict()
    for p in parts[1:]:
        if ":" not in p:
            continue  # manual_time, real_time, process_time
        k, v = p.split(":", 1)
        if k in _GB_KEYS:
            continue
        try:
            fields[k] = int(v)
        except ValueError:
            fields[k] = v
    return parts[0], fields


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class Run:
    """One benchmark's result: time (µs) and counters of one statistic of its repetitions."""

    def __init__(self, family, fields, time_us, counters, order):
        self.family, self.fields, self.time_us, self.counters, self.order = family, fields, time_us, counters, order

    def __getitem__(self, k):
        return self.fields[k]

    def get(self, k, default=None):
        return self.fields.get(k, default)


_NOT_COUNTERS = {"name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
                 "repetition_index", "threads", "aggregate_name", "aggregate_unit", "iterations", "real_time",
                 "cpu_time", "time_unit", "label", "error_occurred", "error_message"}


def runs(doc, stat="median"):
    """The benchmarks of a Google Benchmark JSON, one Run each, in the order they ran: the `stat`
    aggregate where the file has aggregates (stat 'median', 'mean', 'min', ...), else computed
    from the repetitions (median / min / mean), or the single run as it is."""
    by_name = OrderedDict()
    for b in doc.get("benchmarks", []):
        if b.get("error_occurred"):
            print(f"gbench_record: {b['name']}: {b.get('error_message')}", file=sys.stderr)
            continue
        by_name.setdefault(b["run_name"], []).append(b)
    out = []
    for order, (run_name, entries) in enumerate(by_name.items()):
        family, fields = parse_name(run_name)
        agg = [e for e in entries if e.get("run_type") == "aggregate" and e.get("aggregate_name") == stat]
        its = [e for e in entries if e.get("run_type", "iteration") == "iteration"]

        def us(e):
            return e["real_time"] * _TO_US[e.get("time_unit", "ns")]

        def counters(e):
            return {k: v for k, v in e.items() if k not in _NOT_COUNTERS}

        if agg:
            e = agg[0]
            out.append(Run(family, fields, us(e), counters(e), order))
        elif its:
            pick = {"median": _median, "min": min, "mean": lambda xs: sum(xs) / len(xs)}.get(stat, _median)
            keys = set(counters(its[0]))
            c = {k: pick([counters(e)[k] for e in its if k in counters(e)]) for k in keys}
            out.append(Run(family, fields, pick([us(e) for e in its]), c, order))
    return out


def _shape(s):
    qh, kvh, d = (int(x) for x in s.split("x"))
    return qh, kvh, d


def _device(ctx):
    return ctx.get("gpu", "unknown")


def _int(ctx, k, default=0):
    try:
        return int(ctx.get(k, default))
    except (TypeError, ValueError):
        return default


def _float(ctx, k):
    try:
        return float(ctx[k])
    except (KeyError, TypeError, ValueError):
        return None


def convert_decode(doc):
    ctx = doc["context"]
    copy_gbps = _float(ctx, "copy_gbps")
    rows = OrderedDict()
    ra = OrderedDict()
    field = {"stream": "time_us", "graph": "graph_us", "cuda_core_stream": "cuda_core_time_us",
             "cuda_core_graph": "cuda_core_graph_us", "waves3_stream": "tensor_core_waves3_time_us"}
    for r in runs(doc):
        if r.family == "decode":
            qh, kvh, d = _shape(r["shape"])
            key = (qh, kvh, d, r["context"], r["batch"], r["mix"])
            row = rows.setdefault(key, OrderedDict(
                q_heads=qh, kv_heads=kvh, head_dim=d, context=r["context"], batch=r["batch"], mix=r["mix"],
                time_us=0.0, graph_us=0.0, bytes_read=0.0, gbps=0.0, frac_of_copy_roofline=0.0, chunks_per_seq=0,
                path="tensor_core", cuda_core_time_us=0.0, cuda_core_graph_us=0.0, tensor_core_waves3_time_us=0.0))
            row[field[r["path"]]] = round(r.time_us, 2)
            row["bytes_read"] = round(r.counters.get("bytes", 0.0))
            row["chunks_per_seq"] = int(round(r.counters.get("chunks", 0)))
        elif r.family in ("retier", "append"):
            qh, kvh, d = _shape(r["shape"])
            key = (r["shape"], r["recent"], r["stale_key"])
            e = ra.setdefault(key, OrderedDict(
                recent_format=r["recent"], stale_key_format=r["stale_key"], q_heads=qh, kv_heads=kvh, head_dim=d,
                pages=0, fp8_to_tq3_us=0.0, fp8_to_tq3_gbps_fp8_input=0.0, tq3_to_fp8_us=0.0,
                tq3_to_fp8_gbps_fp8_output=0.0, append_b64_us=0.0, append_b64_graph_us=0.0))
            if r.family == "retier":
                e["pages"] = int(round(r.counters.get("pages", 0)))
                gbps = round(r.counters.get("fp8_bytes", 0.0) / r.time_us * 1e-3, 1) if r.time_us else 0.0
                if r["dir"] == "demote":
                    e["fp8_to_tq3_us"], e["fp8_to_tq3_gbps_fp8_input"] = round(r.time_us, 2), gbps
                else:
                    e["tq3_to_fp8_us"], e["tq3_to_fp8_gbps_fp8_output"] = round(r.time_us, 2), gbps
            else:
                e["append_b64_graph_us" if r["path"] == "graph" else "append_b64_us"] = round(r.time_us, 2)
    for row in rows.values():
        times = [t for t in (row["time_us"], row["graph_us"]) if t > 0]
        if times:
            row["gbps"] = round(row["bytes_read"] / min(times) * 1e-3, 1)
        if copy_gbps:
            row["frac_of_copy_roofline"] = round(row["gbps"] / copy_gbps, 3)
    return OrderedDict(gpu=_device(ctx), sms=_int(ctx, "sms"), l2_bytes=_int(ctx, "l2_bytes"),
                       commit=ctx.get("commit", "unknown"), copy_gbps=copy_gbps,
                       launch_floor_us=_float(ctx, "launch_floor_us"), rows=list(rows.values()),
                       retier_append=list(ra.values()))


def convert_prefill(doc):
    ctx = doc["context"]
    rows = []
    for r in runs(doc):
        if r.family != "prefill":
            continue
        qh, kvh, d = _shape(r["shape"])
        flop = r.counters.get("flop", 0.0)
        rows.append(OrderedDict(mix=r["mix"], q_heads=qh, kv_heads=kvh, head_dim=d, page_tokens=r["page_tokens"],
                                prefix=r["prefix"], chunk=r["chunk"], us=round(r.time_us, 2),
                                tflops=round(flop / (r.time_us * 1e-6) / 1e12, 2) if r.time_us else 0.0))
    return OrderedDict(bench="gpubench_prefill", commit=ctx.get("commit", "unknown"), device=_device(ctx), rows=rows)


def convert_codec(doc):
    ctx = doc["context"]
    got = []
    for r in runs(doc):
        if r.family != "codec":
            continue
        label = "d2d_copy" if r.get("op") == "d2d_copy" else f"{r['codec']}_d{r['head_dim']}_{r['op']}"
        gbps = r.counters.get("bytes", 0.0) / r.time_us * 1e-3 if r.time_us else 0.0
        got.append((label, r.time_us * 1e-3, gbps))
    copy = next((g for lab, _, g in got if lab == "d2d_copy"), None)
    metrics = OrderedDict()
    for label, ms, gbps in got:
        metrics[f"{label}_ms"] = round(ms, 6)
        metrics[f"{label}_gbps"] = round(gbps, 3)
        metrics[f"{label}_vs_copy"] = round(gbps / copy, 4) if copy else None
    return OrderedDict(name="gpubench_codec", device=_device(ctx), commit=ctx.get("commit", "unknown"),
                       metrics=metrics)


def convert_unpack(doc):
    ctx = doc["context"]
    got = [r for r in runs(doc, stat="min") if r.family == "unpack"]
    base = next((r for r in got if r["variant"] == "baseline"), None)
    rows = []
    for r in got:
        groups = r.counters.get("groups_per_sm", 0.0)
        ms = r.time_us * 1e-3
        ns = ms * 1e6 / groups if groups else 0.0
        net = (ms - base.time_us * 1e-3) * 1e6 / groups if (groups and base) else None
        rows.append(OrderedDict(variant=r["variant"], ms=round(ms, 4), ns_per_4codes_per_sm=round(ns, 5),
                                net_ns=round(net, 5) if net is not None else None))
    return OrderedDict(name="unpack", device=_device(ctx), commit=ctx.get("commit", "unknown"), rows=rows)


def convert_retier_overlap(doc):
    ctx = doc["context"]
    med = runs(doc)
    mins = {r.order: r for r in runs(doc, stat="min")}
    decode = {}
    rows = OrderedDict()
    for r in med:
        if r.family != "retier_overlap":
            continue
        qh, kvh, d = _shape(r["shape"])
        case = (r["shape"], r["batch"], r["layers"])
        if r["mode"] == "decode":
            decode[case] = r.counters.get("main_us", r.time_us)
            continue
        row = rows.setdefault(case + (r["pct"],), OrderedDict(
            q_heads=qh, kv_heads=kvh, head_dim=d, context=32768, batch=r["batch"], layers=r["layers"],
            retier_pct=r["pct"], live_pages=int(round(r.counters.get("live_pages", 0))),
            retier_pages=int(round(r.counters.get("retier_pages", 0))), decode_us=None, retier_alone_us=None,
            serial_us=None, overlap_main_us=None, overlap_wall_us=None, equal_priority_main_us=None,
            equal_priority_wall_us=None, outputs_bit_equal=None, retiered_bytes_equal=None))
        main = round(r.counters.get("main_us", r.time_us), 2)
        m = r["mode"]
        if m == "retier":
            row["retier_alone_us"] = main
        elif m == "serial":
            row["serial_us"] = main
        elif m in ("overlap", "overlap_eq"):
            pre = "overlap" if m == "overlap" else "equal_priority"
            row[f"{pre}_main_us"], row[f"{pre}_wall_us"] = main, round(r.time_us, 2)
            lo = mins.get(r.order, r).counters
            for k in ("outputs_bit_equal", "retiered_bytes_equal"):
                if k in lo:
                    ok = lo[k] >= 1
                    row[k] = ok if row[k] is None else (row[k] and ok)
    for key, row in rows.items():
        t = decode.get(key[:3])
        row["decode_us"] = round(t, 2) if t is not None else None
    return OrderedDict(gpu=_device(ctx), sms=_int(ctx, "sms"), l2_bytes=_int(ctx, "l2_bytes"),
                       commit=ctx.get("commit", "unknown"),
                       step=ctx.get("step", "L layer decodes in sequence, tiered mix, context 32768"),
                       rows=list(rows.values()))


def convert_e2e_step(doc):
    ctx = doc["context"]
    r = next((r for r in runs(doc) if r.family == "e2e_step"), None)
    if r is None:
        return OrderedDict(bench="e2e_step", error="no e2e_step run in the file")
    c = r.counters

    def one(k):
        return round(c.get(k, 0.0), 1)

    return OrderedDict(
        bench="e2e_step", geometry="(32,8,128) page 16", tiers="int8_rotated + tq4k/tq3v", batch=r["batch"],
        layers=int(c.get("layers", 32)), context=r["context"], mass_layers_per_step=r["mass_layers"],
        measured_steps=int(c.get("measured_steps", 0)), host_us_begin_step=one("host_us_begin_step"),
        host_us_launch_32_layers=one("host_us_launch_32_layers"), host_us_end_step=one("host_us_end_step"),
        host_us_per_step=one("host_us_per_step"), gpu_forward_us=one("gpu_forward_us"),
        h2d_metadata_bytes_per_step=int(round(c.get("h2d_metadata_bytes_per_step", 0))),
        d2h_metadata_bytes_per_step=int(round(c.get("d2h_metadata_bytes_per_step", 0))),
        page_bytes_per_step=int(round(c.get("page_bytes_per_step", 0))), conversions=int(c.get("conversions", 0)),
        conversions_per_measured_step=one("conversions_per_measured_step"),
        tier0_pages_used=int(c.get("tier0_pages_used", 0)), tier1_pages_used=int(c.get("tier1_pages_used", 0)),
        commit=ctx.get("commit", "unknown"))


CONVERTERS = {
    "gpubench_decode": convert_decode,
    "gpubench_prefill": convert_prefill,
    "gpubench_codec": convert_codec,
    "gpubench_unpack": convert_unpack,
    "gpubench_retier_overlap": convert_retier_overlap,
    "gpubench_e2e_step": convert_e2e_step,
}


def program_of(doc):
    prog = doc["context"].get("tierkv_program")
    if prog in CONVERTERS:
        return prog
    fams = {b.get("run_name", b.get("name", "")).split("/")[0] for b in doc.get("benchmarks", [])}
    for fam, p in (("decode", "gpubench_decode"), ("prefill", "gpubench_prefill"), ("codec", "gpubench_codec"),
                   ("unpack", "gpubench_unpack"), ("retier_overlap", "gpubench_retier_overlap"),
                   ("e2e_step", "gpubench_e2e_step")):
        if fam in fams:
            return p
    raise ValueError("not a tierkv GPU benchmark file (no tierkv_program in its context)")


def convert(doc):
    return CONVERTERS[program_of(doc)](doc)


def load(path):
    """The record in its old shape, from a Google Benchmark JSON or an old record."""
    with open(path) as f:
        doc = json.load(f)
    return convert(doc) if is_gbench(doc) else doc


# ---- the old programs' text tables ----------------------------------------------------------


def _n(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def table_decode(rec):
    lines = [f"device {rec['gpu']}, {rec['sms']} SMs, L2 {rec['l2_bytes'] >> 20} MB, copy {_n(rec['copy_gbps'], '.0f')} "
             f"GB/s (read + write), empty split + merge pair {_n(rec['launch_floor_us'], '.1f')} us, commit {rec['commit']}",
             " qh kv   d context   B mix            time_us   graph_us        bytes     GB/s  frac chunks  "
             "cc_time_us cc_graph_us  waves3_us"]
    for r in rec["rows"]:
        lines.append(f"{r['q_heads']:3d} {r['kv_heads']:2d} {r['head_dim']:3d} {r['context']:7d} {r['batch']:3d} "
                     f"{r['mix']:<13} {r['time_us']:10.1f} {r['graph_us']:10.1f} {r['bytes_read']:12.0f} "
                     f"{r['gbps']:8.1f} {r['frac_of_copy_roofline']:5.2f} {r['chunks_per_seq']:6d} "
                     f"{r['cuda_core_time_us']:11.1f} {r['cuda_core_graph_us']:11.1f} "
                     f"{r['tensor_core_waves3_time_us']:10.1f}")
    for x in rec["retier_append"]:
        lines.append(f"retier {x['recent_format']} -> {x['stale_key_format']} keys {x['q_heads']}/{x['kv_heads']}/"
                     f"{x['head_dim']}: {x['pages']} pages, down {x['fp8_to_tq3_us']:.1f} us "
                     f"({x['fp8_to_tq3_gbps_fp8_input']:.0f} GB/s 8-bit in), up {x['tq3_to_fp8_us']:.1f} us "
                     f"({x['tq3_to_fp8_gbps_fp8_output']:.0f} GB/s 8-bit out); append B=64 "
                     f"{x['append_b64_us']:.2f} us (graph {x['append_b64_graph_us']:.2f} us)")
    return lines


def table_prefill(rec):
    return [f"prefill {r['mix']:<13} {r['q_heads']:3d}/{r['kv_heads']}/{r['head_dim']:3d} p{r['page_tokens']:<2d} "
            f"prefix {r['prefix']:6d} chunk {r['chunk']:5d}: {r['us']:9.1f} us  {r['tflops']:6.1f} TFLOP/s"
            for r in rec["rows"]]


def table_codec(rec):
    m = rec["metrics"]
    labels = [k[:-3] for k in m if k.endswith("_ms")]
    lines = [f"device {rec['device']}; bytes = float input + payload + meta",
             f"{'kernel':<22} {'ms':>10} {'GB/s':>10} {'vs copy':>10}"]
    for lab in labels:
        lines.append(f"{lab:<22} {m[lab + '_ms']:10.4f} {m[lab + '_gbps']:10.1f} {_n(m[lab + '_vs_copy'], '10.3f')}")
    return lines


def table_unpack(rec):
    lines = [f"device {rec['device']}", f"{'variant':<10} {'ms':>10} {'ns/4 codes/SM':>16} {'minus baseline':>22}"]
    for r in rec["rows"]:
        lines.append(f"{r['variant']:<10} {r['ms']:10.3f} {r['ns_per_4codes_per_sm']:16.4f} {_n(r['net_ns'], '22.4f')}")
    return lines


def table_retier_overlap(rec):
    lines = [f"device {rec['gpu']}, {rec['sms']} SMs; {rec['step']}",
             " qh kv   d   B  L  pct   live      N decode_us retier_us serial_us  ovl_main  ovl_wall slowdn hidden"
             "   eq_main   eq_wall  out= pages="]
    for r in rec["rows"]:
        d, rt, se = r["decode_us"], r["retier_alone_us"], r["serial_us"]
        om, ow = r["overlap_main_us"], r["overlap_wall_us"]
        slow = om / d if (om and d) else None
        hidden = (se - ow) / rt if (se and ow and rt) else None
        yes = {True: "yes", False: "NO", None: "-"}
        lines.append(f"{r['q_heads']:3d} {r['kv_heads']:2d} {r['head_dim']:3d} {r['batch']:3d} {r['layers']:2d} "
                     f"{r['retier_pct']:3d}% {r['live_pages']:6d} {r['retier_pages']:6d} {_n(d, '9.1f')} {_n(rt, '9.1f')} "
                     f"{_n(se, '9.1f')} {_n(om, '9.1f')} {_n(ow, '9.1f')} {_n(slow, '6.3f')} {_n(hidden, '6.2f')} "
                     f"{_n(r['equal_priority_main_us'], '9.1f')} {_n(r['equal_priority_wall_us'], '9.1f')}  "
                     f"{yes[r['outputs_bit_equal']]} {yes[r['retiered_bytes_equal']]}")
    lines.append("slowdn = ovl_main / decode_us; hidden = (serial_us - ovl_wall) / retier_us (1 = retier fully "
                 "hidden); eq_* = side stream at the main stream's priority")
    return lines


def table_e2e_step(rec):
    return [json.dumps(rec)]


TABLES = {
    "gpubench_decode": table_decode,
    "gpubench_prefill": table_prefill,
    "gpubench_codec": table_codec,
    "gpubench_unpack": table_unpack,
    "gpubench_retier_overlap": table_retier_overlap,
    "gpubench_e2e_step": table_e2e_step,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", help="Google Benchmark JSON of a gpubench_* program")
    ap.add_argument("-o", "--out", help="write the record in its old shape here")
    ap.add_argument("--quiet", action="store_true", help="no table")
    args = ap.parse_args()
    with open(args.input) as f:
        doc = json.load(f)
    if not is_gbench(doc):
        sys.exit(f"gbench_record: {args.input} is not Google Benchmark JSON")
    prog = program_of(doc)
    rec = CONVERTERS[prog](doc)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
    if not args.quiet:
        print("\n".join(TABLES[prog](rec)))
    if prog == "gpubench_retier_overlap" and any(
            r["outputs_bit_equal"] is False or r["retiered_bytes_equal"] is False for r in rec["rows"]):
        print("gbench_record: a retier-overlap check failed", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
