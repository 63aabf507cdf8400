#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tests of the serving benchmark's workload and engine loop (serve_workload.py, serve_sched.py),
no GPU: the loop driven by a cost model. Run: python3 bench/gpu/serve_sched_test.py"""
import math
import os
import statistics
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_sched import SchedulerConfig, max_rate, meets, percentile, run, summarize  # noqa: E402
from serve_workload import Request, WorkloadSpec, generate  # noqa: E402


class Recorder:
    """A cost model (fixed + per-token seconds) that keeps every batch it was given."""

    def __init__(self, fixed=0.004, per_token=2e-6):
        self.fixed, self.per_token, self.batches = fixed, per_token, []

    def __call__(self, batch):
        self.batches.append(list(batch))
        return self.fixed + self.per_token * sum(n for _, n, _ in batch)


def small_spec(**kw):
    base = dict(rate=2.0, requests=60, prompt_min=64, prompt_max=2048, output_min=4, output_max=40,
                shared_share=0.5, shared_docs=2, doc_min=256, doc_max=512, seed=7)  # fmt: skip
    base.update(kw)
    return WorkloadSpec(**base)


class WorkloadTest(unittest.TestCase):
    def test_deterministic_and_in_range(self):
        spec = WorkloadSpec(rate=5.0, requests=4000, seed=11)
        a, b = generate(spec), generate(spec)
        self.assertEqual(a, b)
        self.assertNotEqual(a, generate(WorkloadSpec(rate=5.0, requests=4000, seed=12)))
        gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:])]
        self.assertTrue(all(g >= 0 for g in gaps))
        self.assertAlmostEqual(statistics.mean(gaps), 1 / 5.0, delta=0.02)  # Poisson at rate 5
        own = [r.prompt_len for r in a if r.doc < 0]
        self.assertTrue(all(spec.prompt_min <= p <= spec.prompt_max for p in own))
        # log-uniform: the median is near the geometric mean of the range
        geo = math.sqrt(spec.prompt_min * spec.prompt_max)
        self.assertAlmostEqual(statistics.median(own) / geo, 1.0, delta=0.1)
        self.assertTrue(all(spec.output_min <= r.output_len <= spec.output_max for r in a))
        shared = [r for r in a if r.doc >= 0]
        self.assertAlmostEqual(len(shared) / len(a), 0.3, delta=0.03)
        self.assertTrue(all(r.prompt_len > r.doc_len >= spec.doc_min for r in shared))
        lens = {}
        for r in shared:  # a document has one length
            self.assertEqual(lens.setdefault(r.doc, r.doc_len), r.doc_len)

    def test_bad_specs_name_the_value(self):
        for kw, word in [(dict(rate=0), "rate"), (dict(rate=float("nan")), "rate"), (dict(requests=-1), "requests"),
                         (dict(prompt_min=10, prompt_max=5), "prompt"), (dict(output_min=0), "output"),
                         (dict(shared_share=1.5), "shared_share")]:  # fmt: skip
            with self.assertRaisesRegex(ValueError, word):
                WorkloadSpec(**{"rate": 1.0, "requests": 1, **kw})


class SchedulerTest(unittest.TestCase):
    def check_served(self, reqs, results, summary):
        self.assertEqual(summary["tokens_lost"], 0)
        for r in reqs:
            res = results[r.rid]
            if res.refused:
                continue
            self.assertEqual(res.emitted, r.output_len, r)
            self.assertGreaterEqual(res.first_token_s, r.arrival_s)
            self.assertGreaterEqual(res.finish_s, res.first_token_s)

    def check_pool(self, stats, cfg):  # every page back: free, or a cached document no one reads
        self.assertEqual(stats["pages_free_end"] + stats["doc_pages_end"], cfg.kv_pages)
        self.assertEqual(stats["doc_refs_end"], 0)

    def check_batches(self, rec, cfg):
        for batch in rec.batches:
            self.assertLessEqual(sum(n for _, n, _ in batch), cfg.step_tokens)
            rids = [rid for rid, _, _ in batch]
            self.assertEqual(len(rids), len(set(rids)))  # a sequence once per step
            self.assertLessEqual(len(rids), cfg.max_batch)
            self.assertTrue(all(n >= 1 and ctx >= n for _, n, ctx in batch))

    def test_every_request_served_within_the_step_budget(self):
        reqs = generate(small_spec())
        cfg = SchedulerConfig(kv_pages=4096, page_tokens=16, step_tokens=512, max_batch=8)
        rec = Recorder()
        results, stats = run(reqs, rec, cfg)
        summary = summarize(results, stats)
        self.assertEqual(summary["served"], len(reqs))
        self.check_served(reqs, results, summary)
        self.check_batches(rec, cfg)
        self.check_pool(stats, cfg)
        self.assertEqual(stats["decode_tokens"] + len(reqs), sum(r.output_len for r in reqs))
        # chunked prefill: some step mixes decode tokens and a prefill chunk
        self.assertTrue(any({n == 1 for _, n, _ in b} == {True, False} for b in rec.batches))

    def test_memory_pressure_preempts_and_loses_nothing(self):
        reqs = generate(small_spec(rate=50.0, shared_share=0.0))
        cfg = SchedulerConfig(kv_pages=200, page_tokens=16, step_tokens=256, max_batch=32)
        rec = Recorder()
        results, stats = run(reqs, rec, cfg)
        summary = summarize(results, stats)
        self.assertGreater(summary["preemptions"], 0)
        self.assertEqual(summary["refused"], sum(1 for r in reqs if math.ceil((r.prompt_len + r.output_len) / 16) > 200))
        self.check_served(reqs, results, summary)
        self.check_batches(rec, cfg)
        self.check_pool(stats, cfg)
        # no step ever holds more context than the pool: every batch's sequences fit it
        for batch in rec.batches:
            self.assertLessEqual(sum(math.ceil(ctx / 16) for _, _, ctx in batch), 200)

    def test_prefix_reuse_skips_the_documents_prefill(self):
        reqs = generate(small_spec(shared_share=1.0, shared_docs=1, rate=0.5))
        cfg = dict(kv_pages=4096, page_tokens=16, step_tokens=512, max_batch=8)
        on = run(reqs, Recorder(), SchedulerConfig(**cfg))
        off = run(reqs, Recorder(), SchedulerConfig(prefix_reuse=False, **cfg))
        self.assertGreater(on[1]["prefix_hit_tokens"], 0)
        self.assertEqual(off[1]["prefix_hit_tokens"], 0)
        self.assertEqual(on[1]["prefill_tokens"] + on[1]["prefix_hit_tokens"], off[1]["prefill_tokens"])
        s_on, s_off = summarize(*on), summarize(*off)
        self.check_served(reqs, on[0], s_on)
        self.check_served(reqs, off[0], s_off)
        self.check_pool(on[1], SchedulerConfig(**cfg))
        self.check_pool(off[1], SchedulerConfig(**cfg))
        self.assertLess(s_on["ttft_p50_s"], s_off["ttft_p50_s"])

    def test_a_request_larger_than_the_pool_is_refused_by_name(self):
        reqs = [Request(0, 0.0, 100, 10), Request(1, 0.1, 5000, 10), Request(2, 0.2, 50, 5)]
        results, stats = run(reqs, Recorder(), SchedulerConfig(kv_pages=64, page_tokens=16, step_tokens=128))
        self.assertIn("pages", results[1].refused)
        summary = summarize(results, stats)
        self.assertEqual((summary["served"], summary["refused"]), (2, 1))
        self.assertFalse(meets(summary))  # a refusal fails the targets
        self.check_served(reqs, results, summary)

    def test_latency_of_a_hand_trace(self):
        # prompt 32 in chunks of 16 at 1 s a step: first token at 2 s, then one a second
        results, stats = run([Request(0, 0.0, 32, 3)], lambda b: 1.0,
                             SchedulerConfig(kv_pages=16, page_tokens=16, step_tokens=16))  # fmt: skip
        r = results[0]
        self.assertEqual((r.first_token_s, r.finish_s, r.emitted), (2.0, 4.0, 3))
        self.assertEqual((r.ttft_s, r.tpot_s), (2.0, 1.0))
        self.assertEqual(stats["steps"], 4)
        # an idle gap: the loop jumps to the next arrival
        results, _ = run([Request(0, 0.0, 16, 1), Request(1, 100.0, 16, 1)], lambda b: 1.0,
                         SchedulerConfig(kv_pages=16, page_tokens=16, step_tokens=16))  # fmt: skip
        self.assertEqual(results[1].first_token_s, 101.0)

    def test_bad_step_times_and_configs_are_refused(self):
        with self.assertRaisesRegex(ValueError, "step_time"):
            run([Request(0, 0.0, 16, 2)], lambda b: float("nan"), SchedulerConfig(kv_pages=8))
        with self.assertRaisesRegex(ValueError, "kv_pages"):
            SchedulerConfig(kv_pages=0)


class MetricsTest(unittest.TestCase):
    def test_percentile(self):
        xs = [5.0, 1.0, 3.0, 2.0, 4.0, float("nan")]
        self.assertEqual(percentile(xs, 50), 3.0)
        self.assertAlmostEqual(percentile(xs, 99), 4.96)
        self.assertTrue(math.isnan(percentile([], 50)))

    def test_max_rate_stops_at_the_first_failure(self):
        ok = {1: True, 2: True, 4: False, 8: True}
        summ = lambda r: dict(refused=0, ttft_p99_s=1.0 if ok[r] else 20.0, tpot_p99_ms=10.0)  # noqa: E731
        self.assertEqual(max_rate([1, 2, 4, 8], summ), 2)
        self.assertEqual(max_rate([4, 8], summ), 0.0)


if __name__ == "__main__":
    unittest.main(verbosity=1)
