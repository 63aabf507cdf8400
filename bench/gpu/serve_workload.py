# SPDX-License-Identifier: Apache-2.0
"""The serving benchmark's workload (issue 54): requests with Poisson arrivals, log-uniform prompt
lengths, uniform output lengths and a share that starts with one of a few long shared documents.
Everything comes from one seed, so every arm of a run sees the same requests.

A request's prompt is its shared document (if any) followed by its own tokens; `prompt_len`
counts both. Token ids are not drawn here (the model's weights are random): what the engines
need is lengths, and which requests share which prefix (`doc`, `doc_len`).
"""
from __future__ import annotations

import dataclasses
import math
import random


@dataclasses.dataclass(frozen=True)
class Request:
    rid: int
    arrival_s: float
    prompt_len: int  # tokens, the shared document's included
    output_len: int  # tokens to generate (the first one comes out of the prefill)
    doc: int = -1  # the shared document it starts with, -1 for none
    doc_len: int = 0  # that document's tokens (a prefix of the prompt)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    rate: float  # requests per second (Poisson)
    requests: int  # how many arrive
    prompt_min: int = 8192
    prompt_max: int = 131072
    output_min: int = 128
    output_max: int = 1024
    shared_share: float = 0.3  # of requests that start with a shared document
    shared_docs: int = 4
    doc_min: int = 16384
    doc_max: int = 65536
    seed: int = 20261208

    def __post_init__(self):
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"WorkloadSpec: rate = {self.rate} must be a positive number")
        if self.requests < 0:
            raise ValueError(f"WorkloadSpec: requests = {self.requests} must be >= 0")
        if not (1 <= self.prompt_min <= self.prompt_max):
            raise ValueError(f"WorkloadSpec: prompt lengths [{self.prompt_min}, {self.prompt_max}] must be a range >= 1")
        if not (1 <= self.output_min <= self.output_max):
            raise ValueError(f"WorkloadSpec: output lengths [{self.output_min}, {self.output_max}] must be a range >= 1")
        if not (0.0 <= self.shared_share <= 1.0):
            raise ValueError(f"WorkloadSpec: shared_share = {self.shared_share} must lie in [0, 1]")
        if self.shared_share > 0 and not (1 <= self.shared_docs and 1 <= self.doc_min <= self.doc_max):
            raise ValueError("WorkloadSpec: shared documents need shared_docs >= 1 and 1 <= doc_min <= doc_max")


def generate(spec: WorkloadSpec) -> list[Request]:
    """The requests of `spec`, in arrival order. Prompt lengths are log-uniform over
    [prompt_min, prompt_max]; a request with a shared document has at least its document plus
    one token of its own. The documents' lengths are drawn first, from the same seed."""
    rng = random.Random(spec.seed)
    docs = [rng.randint(spec.doc_min, spec.doc_max) for _ in range(spec.shared_docs)] if spec.shared_share > 0 else []
    lo, hi = math.log(spec.prompt_min), math.log(spec.prompt_max)
    t, out = 0.0, []
    for rid in range(spec.requests):
        t += rng.expovariate(spec.rate)
        prompt = int(round(math.exp(rng.uniform(lo, hi))))
        prompt = min(max(prompt, spec.prompt_min), spec.prompt_max)
        output = rng.randint(spec.output_min, spec.output_max)
        doc, doc_len = -1, 0
        if docs and rng.random() < spec.shared_share:
            doc = rng.randrange(len(docs))
            doc_len = docs[doc]
            prompt = max(prompt, doc_len + 1)
        out.append(Request(rid, t, prompt, output, doc, doc_len))
    return out
