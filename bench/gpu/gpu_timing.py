# SPDX-License-Identifier: Apache-2.0
"""The GPU timing every Python control and peer in bench/gpu uses, so they compare with
bench/cuda/decode.cu: warm-up calls, then the median of CUDA-event-timed calls, each enqueued
behind a ~100 us sleep kernel that hides the host's launch latency (GPU time is measured)."""
import statistics

import torch


def median_us(fn, sets, warm=3, reps=25):
    """Median time in µs of fn(i % sets) over `reps` calls after `warm` untimed ones."""
    for i in range(warm):
        fn(i % sets)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200000)
        a.record()
        fn(i % sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)
