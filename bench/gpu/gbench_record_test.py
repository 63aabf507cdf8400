#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tests of gbench_record.py on small Google Benchmark files written as Google Benchmark 1.7
writes them (aggregates only: mean, median, stddev, cv and the programs' min). No GPU needed.
Usage: python3 bench/gpu/gbench_record_test.py"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gbench_record as g  # noqa: E402


def agg(base, stat, reps, time_us, **counters):
    run_name = f"{base}/iterations:1/repeats:{reps}/manual_time"
    e = {"name": f"{run_name}_{stat}", "family_index": 0, "per_family_instance_index": 0, "run_name": run_name,
         "run_type": "aggregate", "repetitions": reps, "threads": 1, "aggregate_name": stat,
         "aggregate_unit": "percentage" if stat == "cv" else "time", "iterations": reps, "real_time": time_us,
         "cpu_time": 1.0, "time_unit": "us"}
    e.update(counters)
    return e


def doc(program, benchmarks, **context):
    ctx = {"date": "2026-12-03T00:00:00+00:00", "host_name": "h200", "executable": program, "num_cpus": 16,
           "mhz_per_cpu": 2000, "caches": [], "load_avg": [0.1], "library_build_type": "release",
           "tierkv_program": program, "commit": "abc1234", "gpu": "NVIDIA H200", "sms": "132",
           "l2_bytes": "62914560"}
    ctx.update(context)
    return {"context": ctx, "benchmarks": benchmarks}


class DecodeTest(unittest.TestCase):
    def test_rows_and_retier_append(self):
        base = "decode/shape:24x4x256/mix:tiered/path:{}/context:32768/batch:8"
        c = dict(bytes=4.0e8, chunks=12.0)
        bm = []
        for path, t in (("stream", 120.0), ("graph", 100.0)):
            bm += [agg(base.format(path), "mean", 25, t + 5, **c), agg(base.format(path), "median", 25, t, **c),
                   agg(base.format(path), "min", 25, t - 3, **c)]
        r = "retier/shape:24x4x256/recent:fp8_e4m3/stale_key:tq3_key/dir:{}"
        bm += [agg(r.format("demote"), "median", 9, 1000.0, pages=8128.0, fp8_bytes=1.0e9),
               agg(r.format("promote"), "median", 9, 800.0, pages=8128.0, fp8_bytes=1.0e9)]
        a = "append/shape:24x4x256/recent:fp8_e4m3/stale_key:tq3_key/path:{}/batch:64"
        bm += [agg(a.format("stream"), "median", 51, 4.5, tokens=64.0), agg(a.format("graph"), "median", 51, 4.2)]
        rec = g.convert(doc("gpubench_decode", bm, copy_gbps="4000.0", launch_floor_us="3.60"))
        self.assertEqual(rec["copy_gbps"], 4000.0)
        self.assertEqual(rec["launch_floor_us"], 3.6)
        (row,) = rec["rows"]
        self.assertEqual((row["q_heads"], row["kv_heads"], row["head_dim"], row["context"], row["batch"], row["mix"]),
                         (24, 4, 256, 32768, 8, "tiered"))
        self.assertEqual((row["time_us"], row["graph_us"], row["chunks_per_seq"]), (120.0, 100.0, 12))
        self.assertEqual(row["gbps"], 4000.0)  # bytes / min(stream, graph)
        self.assertEqual(row["frac_of_copy_roofline"], 1.0)
        self.assertEqual(row["cuda_core_time_us"], 0.0)  # not run: 0, as without --compare before
        (ra,) = rec["retier_append"]
        self.assertEqual((ra["recent_format"], ra["stale_key_format"], ra["pages"]), ("fp8_e4m3", "tq3_key", 8128))
        self.assertEqual((ra["fp8_to_tq3_us"], ra["fp8_to_tq3_gbps_fp8_input"]), (1000.0, 1000.0))
        self.assertEqual((ra["tq3_to_fp8_us"], ra["tq3_to_fp8_gbps_fp8_output"]), (800.0, 1250.0))
        self.assertEqual((ra["append_b64_us"], ra["append_b64_graph_us"]), (4.5, 4.2))


class OtherProgramsTest(unittest.TestCase):
    def test_prefill(self):
        b = agg("prefill/shape:24x4x256/page_tokens:16/mix:fp8/prefix:32768/chunk:512", "median", 30, 2000.0,
                flop=3.0e11)
        (row,) = g.convert(doc("gpubench_prefill", [b]))["rows"]
        self.assertEqual((row["mix"], row["page_tokens"], row["prefix"], row["chunk"], row["us"], row["tflops"]),
                         ("fp8", 16, 32768, 512, 2000.0, 150.0))
        self.assertIn("chunk   512:", g.table_prefill({"rows": [row]})[0])  # prefill_peer_run.sh greps this

    def test_codec(self):
        bm = [agg("codec/op:d2d_copy", "median", 15, 500.0, bytes=2.0e9),
              agg("codec/codec:tq3_key/head_dim:128/op:encode/vectors:2097152", "median", 15, 1000.0, bytes=1.0e9)]
        m = g.convert(doc("gpubench_codec", bm))["metrics"]
        self.assertEqual(list(m)[:3], ["d2d_copy_ms", "d2d_copy_gbps", "d2d_copy_vs_copy"])
        self.assertEqual((m["tq3_key_d128_encode_ms"], m["tq3_key_d128_encode_gbps"]), (1.0, 1000.0))
        self.assertEqual(m["tq3_key_d128_encode_vs_copy"], 0.25)

    def test_unpack_takes_the_fastest(self):
        gr = 8.0 * 256 * 4096 * 4
        bm = []
        for v, t in (("baseline", 300.0), ("tq3_table", 1600.0)):
            base = f"unpack/variant:{v}/iters:4096"
            bm += [agg(base, "median", 5, t + 50, groups_per_sm=gr), agg(base, "min", 5, t, groups_per_sm=gr)]
        rows = g.convert(doc("gpubench_unpack", bm))["rows"]
        self.assertEqual([r["ms"] for r in rows], [0.3, 1.6])
        self.assertAlmostEqual(rows[1]["net_ns"], 1.3e6 / gr, places=5)

    def test_retier_overlap_and_a_failed_check(self):
        b = "retier_overlap/shape:24x4x256/batch:8/layers:1"
        bm = [agg(f"{b}/mode:decode", "median", 25, 290.0, main_us=287.0, live_pages=4096.0, retier_pages=0.0)]
        for mode, wall, main in (("retier", 42.0, 41.0), ("serial", 330.0, 323.0), ("overlap", 314.0, 312.0),
                                 ("overlap_eq", 315.0, 313.0)):
            c = dict(main_us=main, live_pages=4096.0, retier_pages=40.0)
            if mode.startswith("overlap"):
                c.update(outputs_bit_equal=1.0, retiered_bytes_equal=1.0)
            bm.append(agg(f"{b}/pct:1/mode:{mode}", "median", 25, wall, **c))
            if mode == "overlap_eq":
                c["retiered_bytes_equal"] = 0.0  # one repetition failed: the min shows it
            bm.append(agg(f"{b}/pct:1/mode:{mode}", "min", 25, wall - 1, **c))
        (row,) = g.convert(doc("gpubench_retier_overlap", bm))["rows"]
        self.assertEqual((row["decode_us"], row["retier_alone_us"], row["serial_us"]), (287.0, 41.0, 323.0))
        self.assertEqual((row["overlap_main_us"], row["overlap_wall_us"]), (312.0, 314.0))
        self.assertEqual((row["equal_priority_main_us"], row["equal_priority_wall_us"]), (313.0, 315.0))
        self.assertEqual((row["outputs_bit_equal"], row["retiered_bytes_equal"]), (True, False))

    def test_e2e_step_single_run(self):
        run_name = "e2e_step/geometry:32x8x128/page_tokens:16/batch:64/context:4096/steps:30/mass_layers:1" \
                   "/iterations:10/manual_time"
        e = {"name": run_name, "run_name": run_name, "run_type": "iteration", "repetitions": 1, "repetition_index": 0,
             "threads": 1, "iterations": 10, "real_time": 50000.0, "cpu_time": 1.0, "time_unit": "us",
             "host_us_per_step": 50000.0, "measured_steps": 10.0, "layers": 32.0, "conversions": 2048.0}
        rec = g.convert(doc("gpubench_e2e_step", [e]))
        self.assertEqual((rec["bench"], rec["batch"], rec["context"], rec["measured_steps"], rec["conversions"]),
                         ("e2e_step", 64, 4096, 10, 2048))
        self.assertEqual(rec["host_us_per_step"], 50000.0)


if __name__ == "__main__":
    unittest.main()
