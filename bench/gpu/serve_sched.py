# SPDX-License-Identifier: Apache-2.0
"""The serving benchmark's engine loop without a model (issue 54): continuous batching with
chunked prefill, admission by the arm's own KV capacity, prefix reuse of shared documents,
preemption under memory pressure, and the latency metrics engines are judged by.

Each step the scheduler spends a token budget: first one token for every running sequence that
is decoding, then prefill chunks, to running sequences still prefilling and then to new
requests in arrival order (FCFS), as vLLM's and SGLang's schedulers do. KV memory is a pool of
pages of `page_tokens`; a sequence holds the pages of its tokens, and a cached shared document's
full pages are held once for every sequence that starts with it (the prefix index's reuse: a hit
skips those tokens' prefill). When a decoding sequence needs a page and none is free, unused
cached documents go first (least recently used), then the most recently admitted sequence is
preempted: its pages are freed and it is queued again at the front, to prefill its prompt and
the tokens it already generated (recompute, vLLM's default); its emitted tokens stay emitted, so
no token is lost. A request whose prompt cannot fit the whole pool is refused (counted).

`run(requests, step_time, ...)` drives the loop; `step_time(batch)` runs (or models) one step of
the batch [(rid, new_tokens, context_tokens)] and returns its seconds. The GPU arms of
serve_bench.py pass a function that runs the model through their cache; the tests pass a cost
model. Time advances by each step's seconds; idle gaps jump to the next arrival.
"""
from __future__ import annotations

import collections
import dataclasses
import math

from serve_workload import Request


@dataclasses.dataclass
class SchedulerConfig:
    kv_pages: int  # the arm's KV budget in pages
    page_tokens: int = 16
    step_tokens: int = 8192  # tokens a step may process (decode tokens and prefill chunks)
    max_batch: int = 256  # sequences running at once
    prefix_reuse: bool = True

    def __post_init__(self):
        if self.kv_pages < 1 or self.page_tokens < 1 or self.step_tokens < 1 or self.max_batch < 1:
            raise ValueError(f"SchedulerConfig: kv_pages, page_tokens, step_tokens and max_batch must be >= 1, got {self}")


@dataclasses.dataclass
class RequestResult:
    rid: int
    arrival_s: float
    first_token_s: float = math.nan
    finish_s: float = math.nan
    emitted: int = 0
    wanted: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    refused: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan for a one-token output)."""
        return (self.finish_s - self.first_token_s) / (self.emitted - 1) if self.emitted > 1 else math.nan


@dataclasses.dataclass
class _Seq:
    req: Request
    res: RequestResult
    target: int  # tokens to prefill before decoding (the prompt, plus emitted tokens after a preemption)
    done: int = 0  # tokens in the KV cache
    pages: int = 0  # private pages held
    doc_pages: int = 0  # pages of a cached shared document it reads (held by the cache)


class _Pool:
    """Pages, and the shared documents' cached pages (refcounted, evicted LRU when unused)."""

    def __init__(self, pages: int):
        self.free = pages
        self.docs: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # doc -> [pages, refs]

    def take(self, n: int) -> bool:
        while self.free < n:
            idle = next((d for d, (_, refs) in self.docs.items() if refs == 0), None)
            if idle is None:
                return False
            self.free += self.docs.pop(idle)[0]
        self.free -= n
        return True

    def cached(self, doc: int) -> int:
        if doc not in self.docs:
            return 0
        self.docs.move_to_end(doc)
        return self.docs[doc][0]


def run(requests: list[Request], step_time, cfg: SchedulerConfig, max_steps: int = 10_000_000):
    """Serves `requests` (arrival order) to completion; returns (results by rid, stats)."""
    P = cfg.page_tokens
    pool = _Pool(cfg.kv_pages)
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
    waiting: collections.deque[_Seq] = collections.deque()
    running: list[_Seq] = []
    results = {r.rid: RequestResult(r.rid, r.arrival_s, wanted=r.output_len) for r in requests}
    stats = dict(steps=0, preemptions=0, prefix_hit_tokens=0, prefill_tokens=0, decode_tokens=0, busy_s=0.0,
                 resident_max=0, refused=0)  # fmt: skip
    now = 0.0

    def release(s: _Seq):
        pool.free += s.pages
        s.pages = 0
        if s.doc_pages:
            pool.docs[s.req.doc][1] -= 1
            s.doc_pages = 0

    def need(s: _Seq, tokens: int) -> int:  # new pages to hold `tokens` more
        return math.ceil((s.done + tokens) / P) - s.doc_pages - s.pages

    def start(s: _Seq):  # admission: a prefix hit first (the first chunk's pages follow)
        if cfg.prefix_reuse and s.req.doc >= 0 and s.done == 0:
            pages = pool.cached(s.req.doc)
            if pages:
                pool.docs[s.req.doc][1] += 1
                s.doc_pages = pages
                s.done = pages * P
                s.res.prefix_hit_tokens += s.done
                stats["prefix_hit_tokens"] += s.done

    steps = 0
    while pending or waiting or running:
        if steps >= max_steps:
            raise RuntimeError(f"serve_sched.run: {max_steps} steps without finishing")
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            if math.ceil((r.prompt_len + r.output_len) / P) > cfg.kv_pages:
                results[r.rid].refused = f"needs {math.ceil((r.prompt_len + r.output_len) / P)} pages, the pool has {cfg.kv_pages}"
                stats["refused"] += 1
                continue
            waiting.append(_Seq(r, results[r.rid], target=r.prompt_len))
        if not waiting and not running:
            now = pending[0].arrival_s  # idle: jump to the next arrival
            continue
        budget, batch = cfg.step_tokens, []

        def preempt_newest():
            nonlocal budget
            victim = running.pop()
            for i, (t, n) in enumerate(batch):
                if t is victim:  # scheduled earlier in this step: not any more
                    budget += n
                    del batch[i]
                    break
            release(victim)
            victim.target = victim.req.prompt_len + victim.res.emitted
            victim.done = 0
            victim.res.preemptions += 1
            stats["preemptions"] += 1
            waiting.appendleft(victim)
            return victim

        # 1. decode: one token per decoding sequence; a page short preempts the newest admitted
        for s in list(running):
            if s not in running or s.done < s.target or budget == 0:
                continue
            while need(s, 1) > 0 and not pool.take(need(s, 1)):
                if preempt_newest() is s:
                    break
            if s not in running:
                continue
            s.pages = max(s.pages, math.ceil((s.done + 1) / P) - s.doc_pages)
            batch.append((s, 1))
            budget -= 1

        # 2. prefill chunks: running sequences first, then admissions in order
        def chunk(s: _Seq) -> bool:
            nonlocal budget
            n = min(s.target - s.done, budget)
            while n > 0 and not pool.take(max(need(s, n), 0)):
                n = (n // 2) // P * P  # a smaller chunk, in whole pages, if the pool is short
            if n <= 0:
                return False
            s.pages = max(s.pages, math.ceil((s.done + n) / P) - s.doc_pages)
            batch.append((s, n))
            budget -= n
            return True

        for s in running:
            if budget == 0:
                break
            if s.done < s.target:
                chunk(s)
        while waiting and budget > 0 and len(running) < cfg.max_batch:
            s = waiting[0]
            start(s)
            if chunk(s):
                waiting.popleft()
                running.append(s)
                continue
            if s.doc_pages:  # not admitted after all: give the document's reference back
                pool.docs[s.req.doc][1] -= 1
                s.res.prefix_hit_tokens -= s.done
                stats["prefix_hit_tokens"] -= s.done
                s.doc_pages, s.done = 0, 0
            break
        if not batch:
            if running:  # prefills holding the pool and nothing decoding: make room
                preempt_newest()
                continue
            if not pending:
                raise RuntimeError("serve_sched.run: a waiting request cannot start in an empty pool")
            now = max(now, pending[0].arrival_s)  # nothing fits yet: wait for an arrival
            continue
        seconds = float(step_time([(s.req.rid, n, s.done + n) for s, n in batch]))
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"serve_sched.run: step_time returned {seconds}")
        now += seconds
        stats["busy_s"] += seconds
        steps += 1
        stats["resident_max"] = max(stats["resident_max"], len(running))
        for s, n in batch:
            if s.done >= s.target:
                stats["decode_tokens"] += n
            else:
                stats["prefill_tokens"] += n
            s.done += n
            if s.done < s.target:
                continue
            # a finished prefill (a first one, or a recompute after a preemption) and each
            # decode step emit the next token
            if s.res.emitted == 0:
                s.res.first_token_s = now
            s.res.emitted += 1
            if cfg.prefix_reuse and s.req.doc >= 0 and not s.doc_pages and s.req.doc not in pool.docs:
                # the document's full pages move from the sequence to the cache (shared from now on)
                doc_pages = s.req.doc_len // P
                if 0 < doc_pages <= s.pages:
                    s.pages -= doc_pages
                    s.doc_pages = doc_pages
                    pool.docs[s.req.doc] = [doc_pages, 1]
            if s.res.emitted >= s.req.output_len:
                s.res.finish_s = now
                running.remove(s)
                release(s)
    stats["steps"] = steps
    stats["end_s"] = now
    # what the pool holds at the end: free pages, cached documents' pages and their references
    stats["pages_free_end"] = pool.free
    stats["doc_pages_end"] = sum(pages for pages, _ in pool.docs.values())
    stats["doc_refs_end"] = sum(refs for _, refs in pool.docs.values())
    return results, stats


def percentile(xs, q):
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: dict[int, RequestResult], stats: dict) -> dict:
    """Request throughput, output tokens/s, TTFT / TPOT p50 and p99, tokens lost (wanted but not
    emitted by a served request), refusals."""
    served = [r for r in results.values() if not r.refused]
    span = max((r.finish_s for r in served), default=0.0) - min((r.arrival_s for r in served), default=0.0)
    out_tokens = sum(r.emitted for r in served)
    return dict(
        requests=len(results), served=len(served), refused=len(results) - len(served),
        request_throughput=len(served) / span if span > 0 else math.nan,
        output_tokens_per_s=out_tokens / span if span > 0 else math.nan,
        ttft_p50_s=percentile([r.ttft_s for r in served], 50), ttft_p99_s=percentile([r.ttft_s for r in served], 99),
        tpot_p50_ms=1e3 * percentile([r.tpot_s for r in served], 50),
        tpot_p99_ms=1e3 * percentile([r.tpot_s for r in served], 99),
        tokens_lost=sum(r.wanted - r.emitted for r in served),
        preemptions=stats["preemptions"], prefix_hit_rate=stats["prefix_hit_tokens"] / max(1, stats["prefix_hit_tokens"] + stats["prefill_tokens"]),
        resident_max=stats["resident_max"], steps=stats["steps"],
    )  # fmt: skip


def meets(summary: dict, ttft_p99_s: float = 10.0, tpot_p99_ms: float = 100.0) -> bool:
    """The latency targets of issue 54 (TTFT p99 <= 10 s, TPOT p99 <= 100 ms), nothing refused."""
    return (summary["refused"] == 0 and summary["ttft_p99_s"] <= ttft_p99_s
            and summary["tpot_p99_ms"] <= tpot_p99_ms)  # fmt: skip


def max_rate(rates, summary_at, **targets) -> float:
    """The highest rate of the sweep `rates` (ascending) whose summary meets the targets, every
    lower rate meeting them too (a rate past the first failure does not count); 0 if none."""
    best = 0.0
    for rate in rates:
        if not meets(summary_at(rate), **targets):
            break
        best = rate
    return best
