# SPDX-License-Identifier: Apache-2.0
"""A format registered outside tierkv, by name from Python (issue 51).

Runs only against a package built with tests/unit/user_format/int8_twin.hpp registered (skipped
otherwise, as in CI's default build); the build and run are docs/formats.md's "Adding a format
outside tierkv" commands. int8_twin is int8_rotated's codes under a tag and name of their own, so
an FP8 cache whose Stale tier is int8_twin must give the outputs of one whose Stale tier is
int8_rotated bit for bit (the same FP8 -> rotated conversions).
"""

import pytest
import torch

import tierkv

GEO = dict(head_dim=64, kv_heads=1, group_size=2, num_layers=2)


def twin_built():
    return {("fp8", "int8_twin"), ("fp8", "int8_rotated")} <= {(r["recent"], r["cache_type_k"]) for r in tierkv.built()}


@pytest.mark.skipif(not twin_built(), reason="package built without the int8_twin user format")
def test_user_format_by_name_matches_its_twin_bit_for_bit():
    def run(k, v):
        c = tierkv.Cache(**GEO, recent="fp8", cache_type_k=k, cache_type_v=v, max_tokens=512,
                         keep_first_layers=0, keep_last_layers=0, min_dwell_steps=0, center=False)
        rng = torch.Generator().manual_seed(5)
        s = c.create_sequence()
        c.append(s, torch.randn(2, 100, 1, 64, generator=rng), torch.randn(2, 100, 1, 64, generator=rng))
        moved = sum(c.retier(step)["converted"] for step in range(3))
        q = torch.randn(1, 2, 64, generator=rng)
        outs = [c.decode(layer, [s], q)[0] for layer in range(2)]
        return moved, outs, c.report()

    moved, twin, report = run("int8_twin", "int8_twin")
    moved_base, base, _ = run("int8_rotated", "int8_rotated")
    assert moved > 0 and moved == moved_base  # pages went into the user format's tier, read from it
    assert report["tiers"][1]["live_pages"] > 0
    for a, b in zip(twin, base):
        assert torch.equal(a, b)


def cuda_twin_built():
    if not torch.cuda.is_available():
        return False
    try:
        rows = tierkv.cuda.built()
    except Exception:  # no libtierkv_cuda.so in this package
        return False
    return {("fp8", "int8_twin"), ("fp8", "int8_rotated")} <= {(r["recent"], r["cache_type_k"]) for r in rows}


@pytest.mark.skipif(not cuda_twin_built(), reason="no GPU, or libtierkv_cuda.so built without int8_twin")
def test_user_format_on_the_gpu_by_name_matches_its_twin_bit_for_bit():
    def run(k, v):
        c = tierkv.CudaCache(**GEO, recent="fp8", cache_type_k=k, cache_type_v=v, max_tokens=512,
                             keep_first_layers=0, keep_last_layers=0, min_dwell_steps=0, recent_pages=1,
                             sink_pages=0)
        rng = torch.Generator().manual_seed(5)
        s = c.create_sequence()
        outs, moved = [], 0
        for step, n in enumerate([100, 1, 1, 1]):
            c.begin_step([s], [n])
            for layer in range(2):
                k_, v_ = (torch.randn(n, 1, 64, generator=rng).cuda() for _ in range(2))
                c.append(layer, k_, v_)
                q = torch.randn(1, 2, 64, generator=rng).cuda()
                if step > 0:
                    outs.append(c.decode(layer, q).cpu())
            moved += c.end_step(step, wait=True)["converted"]
        return moved, outs

    moved, twin = run("int8_twin", "int8_twin")
    moved_base, base = run("int8_rotated", "int8_rotated")
    assert moved > 0 and moved == moved_base
    assert len(twin) == len(base) == 6
    for a, b in zip(twin, base):
        assert torch.equal(a, b)
