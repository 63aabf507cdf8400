# SPDX-License-Identifier: Apache-2.0
"""tierkv.CudaCache (the cache wholly on the GPU) against the host path of the same ops on the same
inputs, in CUDA graphs and under torch.compile, and through TieredCache in a transformers model.
Skipped without a CUDA device or without libtierkv_cuda.so (TIERKV_PYTHON_CUDA=1 builds it)."""

import re
import warnings

import pytest
import torch

import tierkv
from tierkv import cuda as tkv_cuda

from conftest import COLD_KNOBS, COLD_SETS, TIER_SETS, make_cache, page_bits, set_kwargs

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not tkv_cuda.library_path().is_file():
    pytest.skip(f"{tkv_cuda.library_path()} not built (TIERKV_PYTHON_CUDA=1)", allow_module_level=True)

GEO = (64, 4, 2, 16)  # (head_dim, kv_heads, group_size, page_size): in both prebuilt sets
D, KVH, G, P = GEO
QH = KVH * G
SETS = TIER_SETS
POLICY = dict(keep_first_layers=0, keep_last_layers=0, min_dwell_steps=0, recent_pages=2)


def gpu_cache(tier_set="int8r+tq4k/tq3v", num_layers=2, geo=GEO, **kw):
    d, kvh, g, p = geo
    opts = dict(max_tokens=4096, max_sequences=16, max_batch=16, max_pages=512, max_step_tokens=2048,
                mass_layers_per_step=0, **POLICY)  # fmt: skip
    opts.update(kw)
    return tierkv.CudaCache(head_dim=d, kv_heads=kvh, group_size=g, page_size=p, num_layers=num_layers,
                            **set_kwargs(tier_set), **opts)  # fmt: skip


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def twins(tier_set, lengths, num_layers=2, seed=0, geo=GEO, policy_options=None, **host_kw):
    """A GPU cache and a host cache holding the same tokens (f32 K/V) in the same sequences."""
    d, kvh = geo[0], geo[1]
    g = gpu_cache(tier_set, num_layers, geo=geo, policy_options=policy_options)
    h = make_cache(geo, tier_set, num_layers=num_layers, policy_options=policy_options, **POLICY, **host_kw)
    sg = [g.create_sequence() for _ in lengths]
    sh = [h.create_sequence() for _ in lengths]
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    g.begin_step(sg, lengths)
    h.reserve(sh, lengths)
    for layer in range(num_layers):
        k = torch.randn(n, kvh, d, generator=gen)
        v = torch.randn(n, kvh, d, generator=gen)
        g.append(layer, k.cuda(), v.cuda())
        h.write(layer, sh, k, v)
    h.commit(sh)
    g.end_step(1, wait=True)  # step 1 on both: the same policy decisions
    h.retier(1)
    return g, h, sg, sh


def test_prefill_at_head_dim_256_equals_the_host_path():
    """(24, 4, 256), int8_rotated + TQ4 / TQ3: built for sm_90a (the package's H100 / H200 cubin),
    this prefill runs on wgmma with a producer warpgroup (docs/gpu-prefill.md); the host path is the
    reference. Skipped unless both libraries were built with that combination (scripts/gpu-check's
    python mode builds it)."""
    combo = dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", head_dim=256, kv_heads=4,
                 group_size=6, page_size=16)  # fmt: skip
    if combo not in tkv_cuda.built() or combo not in tierkv.built():
        pytest.skip("the (256, 4, 6, 16) int8r+tq4k/tq3v combination is not built")
    # two sequences of 700 and 129 tokens, retiered: many Stale TQ4 / TQ3 pages
    g, h, sg, sh = twins("int8r+tq4k/tq3v", [700, 129], num_layers=1, seed=3, geo=(256, 4, 6, 16))
    assert g.page_tiers(sg[0], 0) == h.page_tiers(sh[0], 0)
    assert 1 in g.page_tiers(sg[0], 0)  # the prefill reads both tiers
    gen = torch.Generator().manual_seed(4)
    chunk = [200, 65]
    g.begin_step(sg, chunk)
    h.reserve(sh, chunk)
    k, v = torch.randn(sum(chunk), 4, 256, generator=gen), torch.randn(sum(chunk), 4, 256, generator=gen)
    q = torch.randn(sum(chunk), 24, 256, generator=gen)
    g.append(0, k.cuda(), v.cuda())
    h.write(0, sh, k, v)
    out_g, lse_g = g.prefill(0, q.cuda(), return_lse=True)
    out_h, lse_h = h.prefill(0, sh, q, torch.tensor([0, chunk[0], sum(chunk)], dtype=torch.int32))
    assert rel(out_g.cpu(), out_h) < 4e-3
    assert (lse_g.cpu() - lse_h).abs().max() < 1e-2
    h.commit(sh)
    g.end_step(2, wait=True)


@pytest.mark.parametrize("tier_set", list(SETS))
def test_decode_and_prefill_equal_the_host_path(tier_set):
    g, h, sg, sh = twins(tier_set, [1, 40, 133])
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    summed = g.retier_totals()  # plus every end_step's stats below: the façade's totals
    for step in range(2, 26):
        g.begin_step(sg, [1, 1, 1])
        h.reserve(sh, [1, 1, 1])
        for layer in range(2):
            k, v = torch.randn(3, KVH, D, generator=gen), torch.randn(3, KVH, D, generator=gen)
            q = torch.randn(3, QH, D, generator=gen)
            g.append(layer, k.cuda(), v.cuda())
            h.write(layer, sh, k, v)
            out_g, lse_g = g.decode(layer, q.cuda(), return_lse=True)
            out_h, lse_h = h.decode(layer, sh, q)
            worst = max(worst, rel(out_g.cpu(), out_h))
            assert rel(out_g.cpu(), out_h) < 2e-3
            assert (lse_g.cpu() - lse_h).abs().max() < 1e-3
        h.commit(sh)
        g.device_error()
        for k, n in g.end_step(step, wait=True).items():
            summed[k] += n
        h.retier(step)
        for a, b in zip(sg, sh):  # the same tiers: the GPU's page masses equal the host's to rounding
            assert g.page_tiers(a, 0) == h.page_tiers(b, 0)
    # a chunk of 24 new tokens per sequence: causal prefill over every tier's pages
    g.begin_step(sg, [24, 24, 24])
    h.reserve(sh, [24, 24, 24])
    indptr = torch.tensor([0, 24, 48, 72], dtype=torch.int32)
    for layer in range(2):
        k, v = torch.randn(72, KVH, D, generator=gen), torch.randn(72, KVH, D, generator=gen)
        q = torch.randn(72, QH, D, generator=gen)
        g.append(layer, k.cuda(), v.cuda())
        h.write(layer, sh, k, v)
        assert rel(g.prefill(layer, q.cuda()).cpu(), h.prefill(layer, sh, q, indptr)[0]) < 4e-3
    h.commit(sh)
    for k, n in g.end_step(26, wait=True).items():
        summed[k] += n
    # no memory pressure here: the totals are end_step's, summed (make_room and drain add to them)
    assert g.retier_totals() == summed
    if tier_set != "int8r only":  # pages left the Recent tier on both
        assert 1 in g.page_tiers(sg[2], 0) and 1 in h.page_tiers(sh[2], 0)
    g.check_invariants()
    assert g.transfers()["page_bytes"] == 0
    r = g.report()
    assert r["reconciles"] and r["live_tokens"] == (1 + 40 + 133) + 24 * 3 + 24 * 3


@pytest.mark.parametrize("tier_set", ["int8r+tq4k/tq3v", "fp8+tq3"])
def test_decode_with_soft_cap_and_window_equals_the_host_path(tier_set):
    """Soft-capped logits and sliding windows in the GPU decode (Gemma 2 style layers) against the
    host cache's decode with the same cap (a host cache option) and window, in one step (the same
    pages on both: no retier between the calls)."""
    cap = 5.0
    g, h, sg, sh = twins(tier_set, [1, 40, 133], soft_cap=cap)
    gen = torch.Generator().manual_seed(3)
    g.begin_step(sg, [1, 1, 1])
    h.reserve(sh, [1, 1, 1])
    for layer in range(2):
        k, v = torch.randn(3, KVH, D, generator=gen), torch.randn(3, KVH, D, generator=gen)
        g.append(layer, k.cuda(), v.cuda())
        h.write(layer, sh, k, v)
        q = torch.randn(3, QH, D, generator=gen) * 2.0  # logits into the cap's bend
        for window in (1, 17, 37, 100, 1000):
            out_g, lse_g = g.decode(layer, q.cuda(), soft_cap=cap, window=window, return_lse=True)
            out_h, lse_h = h.decode(layer, sh, q, window=window)
            assert rel(out_g.cpu(), out_h) < 3e-3, window
            assert (lse_g.cpu() - lse_h).abs().max() < 1e-3, window
        # the window alone (no cap) equals the GPU's one-token prefill with it
        out_d = g.decode(layer, q.cuda(), window=37)
        assert rel(out_d, g.prefill(layer, q.cuda(), window=37)) < 3e-3
    h.commit(sh)
    g.device_error()
    g.end_step(2, wait=True)


def test_bf16_io_and_f16_queries():
    g, h, sg, sh = twins("int8r+tq4k/tq3v", [70, 9])
    gen = torch.Generator().manual_seed(2)
    g.begin_step(sg, [1, 1])
    h.reserve(sh, [1, 1])
    for layer in range(2):
        k = torch.randn(2, KVH, D, generator=gen).bfloat16()
        v = torch.randn(2, KVH, D, generator=gen).bfloat16()
        g.append(layer, k.cuda(), v.cuda())  # bf16 keys: encoded from their exact f32 values
        h.write(layer, sh, k.float(), v.float())
        q = torch.randn(2, QH, D, generator=gen)
        ref = h.decode(layer, sh, q)[0]
        out16 = g.decode(layer, q.bfloat16().cuda())
        assert out16.dtype == torch.bfloat16 and rel(out16.cpu(), ref) < 1e-2
        outh = g.decode(layer, q.half().cuda())  # f16 queries run as f32
        assert outh.dtype == torch.float16 and rel(outh.cpu(), ref) < 2e-3
    h.commit(sh)
    g.end_step(2, wait=True)


def test_cuda_graph_replays_equal_eager_steps():
    eager, _, se, _ = twins("int8r+tq4k/tq3v", [50, 17, 90], seed=3)
    graphed, _, sgr, _ = twins("int8r+tq4k/tq3v", [50, 17, 90], seed=3)
    gen = torch.Generator().manual_seed(4)
    k = torch.zeros(2, 3, KVH, D, device="cuda")
    v = torch.zeros_like(k)
    q = torch.zeros(2, 3, QH, D, device="cuda")
    outs = [None, None]

    def forward():
        for layer in range(2):
            graphed.append(layer, k[layer], v[layer])
            outs[layer] = graphed.decode(layer, q[layer])

    graph = None
    for step in range(2, 31):
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
        q.copy_(torch.randn(q.shape, generator=gen))
        eager.begin_step(se, [1, 1, 1])
        ref = []
        for layer in range(2):
            eager.append(layer, k[layer].clone(), v[layer].clone())
            ref.append(eager.decode(layer, q[layer].clone()))
        graphed.begin_step(sgr, [1, 1, 1])
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()  # recorded, not run
        graph.replay()
        for layer in range(2):
            assert rel(outs[layer], ref[layer]) < 1e-5
        eager.end_step(step, wait=True)
        graphed.end_step(step, wait=True)
        for s1, s2 in zip(se, sgr):
            assert eager.page_tiers(s1, 1) == graphed.page_tiers(s2, 1)
    assert 1 in graphed.page_tiers(sgr[2], 0)  # the replayed steps' masses drove conversions too


def test_torch_compile_traces_the_ops():
    g, _, sg, _ = twins("int8r only", [30, 31])
    q = torch.randn(2, QH, D, device="cuda")
    k = torch.randn(2, KVH, D, device="cuda")

    def step(q, k):
        g.append(0, k, k)
        return g.decode(0, q * 2.0) + 1.0

    g.begin_step(sg, [1, 1])
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(q, k)
    g.append(0, k, k)  # the same token written again: decode reads the same pages
    assert rel(out, g.decode(0, q * 2.0) + 1.0) < 1e-6
    torch.library.opcheck(torch.ops.tierkv.cuda_decode.default, (g.state, 0, q), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(
        torch.ops.tierkv.cuda_decode.default, (g.state, 0, q, 5.0, 37), test_utils=("test_schema", "test_faketensor")
    )
    g.end_step(wait=True)


def test_refusals_name_the_value():
    g = gpu_cache("int8r+tq4k/tq3v")
    s = g.create_sequence()
    with pytest.raises(ValueError, match="begin_step"):
        g.decode(0, torch.randn(1, QH, D, device="cuda"))
    g.begin_step([s], [2])
    with pytest.raises(ValueError, match="shape"):
        g.append(0, torch.randn(3, KVH, D, device="cuda"), torch.randn(3, KVH, D, device="cuda"))
    with pytest.raises(ValueError, match="cuda"):
        g.append(0, torch.randn(2, KVH, D), torch.randn(2, KVH, D))
    with pytest.raises(ValueError, match="float64"):
        g.append(0, torch.randn(2, KVH, D, device="cuda", dtype=torch.float64), torch.randn(2, KVH, D, device="cuda"))
    with pytest.raises(ValueError, match="layer"):
        g.append(7, torch.randn(2, KVH, D, device="cuda"), torch.randn(2, KVH, D, device="cuda"))
    g.append(0, torch.randn(2, KVH, D, device="cuda"), torch.randn(2, KVH, D, device="cuda"))
    with pytest.raises(ValueError, match="soft_cap"):
        g.decode(0, torch.randn(1, QH, D, device="cuda"), soft_cap=-1.0)
    with pytest.raises(ValueError, match="window"):
        g.decode(0, torch.randn(1, QH, D, device="cuda"), window=-3)
    with pytest.raises(ValueError, match="end_step|begin_step"):
        g.begin_step([s], [1])  # a step is open
    g.end_step()
    with pytest.raises(ValueError, match="max_pages"):
        g.begin_step([s], [512 * P])
    with pytest.raises(ValueError, match="no prebuilt"):
        tierkv.CudaCache(head_dim=D, kv_heads=3, group_size=5, num_layers=1, max_tokens=64)
    with pytest.raises(ValueError, match="unknown cache format"):
        tierkv.CudaCache(head_dim=D, kv_heads=KVH, group_size=G, num_layers=1, max_tokens=64, recent="q8_0")
    assert any(c["head_dim"] == D and c["kv_heads"] == KVH for c in tkv_cuda.built())


def test_prefix_reuse_on_the_gpu():
    g = gpu_cache(num_layers=2)
    ids = list(range(1000, 1050))  # 3 full pages + 2 tokens
    gen = torch.Generator().manual_seed(3)
    K, V = torch.randn(2, 50, KVH, D, generator=gen), torch.randn(2, 50, KVH, D, generator=gen)
    a = g.create_sequence()
    g.begin_step([a], [50])
    for layer in range(2):
        g.append(layer, K[layer].cuda(), V[layer].cuda())
    g.end_step(wait=True)
    assert g.insert_prefix(a, ids, salt=5) == 3 and g.insert_prefix(a, ids, salt=5) == 0
    b, cached = g.start_from_prefix(ids[:40] + [7, 8, 9], salt=5)
    assert (cached, g.length(b)) == (32, 32)
    g.begin_step([b], [18])  # the rest of a's prompt
    for layer in range(2):
        g.append(layer, K[layer, 32:].contiguous().cuda(), V[layer, 32:].contiguous().cuda())
    g.end_step(wait=True)
    q = torch.randn(1, KVH * G, D, generator=gen).cuda()
    g.begin_step([a, b], [0, 0])
    out = g.decode(0, torch.cat([q, q]))
    g.end_step(wait=True)
    assert rel(out[0], out[1]) < 1e-6
    r = g.report()
    assert (r["sequence_tokens"], r["live_tokens"]) == (100, 68)  # 32 tokens stored once
    c, none = g.start_from_prefix(ids, salt=6)  # another salt shares nothing
    assert none == 0 and g.length(c) == 0
    assert g.evict_prefixes(10) == 0  # still used
    for s in (a, b, c):
        g.release(s)
    assert g.evict_prefixes(10) == 3
    g.drain()
    g.check_invariants()
    with pytest.raises(ValueError, match="int32"):
        g.start_from_prefix([2**40])
    with pytest.raises(ValueError, match="negative"):
        g.evict_prefixes(-1)


def twin_models(seed):
    """A small random Qwen3 (3 layers, 8 query heads on 4 KV heads, head_dim 64) on the CPU and
    the same weights on the GPU, both with the "tierkv" attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=512, attn_implementation="tierkv")  # fmt: skip
    torch.manual_seed(seed)
    cpu = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    gpu = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval().cuda()
    gpu.load_state_dict(cpu.state_dict())
    return cpu, gpu


def test_cold_tier_on_the_gpu_equals_the_host_path():
    """A Cold tier set (issue 52: TQ3 keys / TQ2 values in tier 2) by name on the GPU: the same
    pages go Cold as on the host, step by step, and decode over the three formats equals the host's.
    Each step's queries attend their own new token, so the older pages' mass falls below the Cold
    threshold (random queries spread it evenly: no page went Cold)."""
    (name,) = COLD_SETS
    g, h, sg, sh = twins(name, [150, 61], num_layers=1, seed=5, policy_options=COLD_KNOBS)
    assert g.num_tiers == 3
    gen = torch.Generator().manual_seed(6)
    for step in range(2, 8):
        g.begin_step(sg, [1, 1])
        h.reserve(sh, [1, 1])
        k, v = torch.randn(2, KVH, D, generator=gen), torch.randn(2, KVH, D, generator=gen)
        q = 4.0 * k.repeat_interleave(G, dim=1)
        g.append(0, k.cuda(), v.cuda())
        h.write(0, sh, k, v)
        out_g, lse_g = g.decode(0, q.cuda(), return_lse=True)
        out_h, lse_h = h.decode(0, sh, q)
        assert rel(out_g.cpu(), out_h) < 2e-3
        assert (lse_g.cpu() - lse_h).abs().max() < 1e-3
        h.commit(sh)
        g.end_step(step, wait=True)
        h.retier(step)
        for a, b in zip(sg, sh):
            assert g.page_tiers(a, 0) == h.page_tiers(b, 0)
    assert 2 in g.page_tiers(sg[0], 0)  # pages went Cold on both
    g.check_invariants()


def test_tiered_cache_on_the_gpu_matches_the_host_cache():
    from tierkv.transformers import TieredCache

    cpu, gpu = twin_models(seed=0)
    ids0 = torch.randint(0, 256, (2, 40))
    kw = dict(max_tokens=512, page_size=16, max_sequences=4, max_batch=4, **POLICY)
    # 8-bit pages only: the two paths hold the same codes, and no tier decision can differ
    # (the GPU policy is fed a step later than the host's: end_step overlaps the next step).
    # Uncentred: each device estimates the channel means in its own summation order, so a
    # centred pair would round some codes apart (the centred GPU path: the centring test above).
    eight = dict(recent="int8_rotated", cache_type_k="int8_rotated", cache_type_v="int8_rotated", center=False)
    gc = TieredCache(gpu.config, device="cuda", max_step_tokens=128, **eight, **kw)
    hc = TieredCache(cpu.config, **eight, **kw)
    tiered = TieredCache(gpu.config, device="cuda", max_step_tokens=128, **kw)  # TQ4/TQ3 Stale pages
    ids, worst, worst_tiered = ids0, 0.0, 0.0
    with torch.no_grad():
        for _ in range(20):
            lg = gpu(input_ids=ids.cuda(), past_key_values=gc).logits[:, -1].cpu()
            lh = cpu(input_ids=ids, past_key_values=hc).logits[:, -1]
            lt = gpu(input_ids=ids.cuda(), past_key_values=tiered).logits[:, -1].cpu()
            worst, worst_tiered = max(worst, rel(lg, lh)), max(worst_tiered, rel(lt, lh))
            ids = lh.argmax(-1, keepdim=True)
    # The 40-token first step runs the GPU prefill (half-precision tensor-core products: its op
    # bound above is 4e-3 a layer) through 3 layers; the H200 measured 2.6e-3 here, and
    # torch_e2e's logits check 3.5e-3 for the same comparison at head_dim 256.
    assert worst < 1e-2
    assert worst_tiered < 0.2  # the Stale tier's error (the host tests' band, test_transformers.py)
    assert 1 in tiered.tierkv.page_tiers(int(tiered.seqs[0]), 1)  # Stale pages were read


def test_tiered_cache_defaults_on_the_gpu_give_the_host_tiers():
    """TieredCache(device="cuda")'s defaults (every layer's page mass a step, each step's retier
    finished in its step) give the host cache's tier for every page, step by step, through a
    chunked prefill (whose last rows' masses make Anchors) and decode steps; one layer's mass a
    step, or the side stream's overlap, would not (bench/results/quality/paths-2026-12-06.json)."""
    from tierkv.transformers import TieredCache

    cpu, gpu = twin_models(seed=3)
    # uncentred: each device estimates the channel means in its own summation order
    kw = dict(max_tokens=512, page_size=16, max_sequences=4, max_batch=4, center=False, **POLICY)
    gc = TieredCache(gpu.config, device="cuda", max_step_tokens=128, **kw)
    hc = TieredCache(cpu.config, **kw)
    ids = torch.randint(0, 256, (2, 192))
    stale = 0
    with torch.no_grad():
        for start in range(0, 192, 48):  # the prompt in four chunks, then decode steps
            gpu(input_ids=ids[:, start : start + 48].cuda(), past_key_values=gc)
            cpu(input_ids=ids[:, start : start + 48], past_key_values=hc)
        nxt = ids[:, -1:]
        for _ in range(12):
            gpu(input_ids=nxt.cuda(), past_key_values=gc)
            nxt = cpu(input_ids=nxt, past_key_values=hc).logits[:, -1].argmax(-1, keepdim=True)
    for b in range(2):  # both with the last step open (each ends a step at the next begin)
        for layer in range(3):
            g = gc.tierkv.page_tiers(int(gc.seqs[b]), layer)
            h = hc.tierkv.page_tiers(int(hc.seqs[b]), layer)
            assert list(g) == list(h), f"sequence {b} layer {layer}: GPU tiers {list(g)}, host {list(h)}"
            stale += sum(1 for t in h if t == 1)
    assert stale > 0  # some pages were demoted, and the same ones on both


def test_generate_through_a_gpu_tiered_cache():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tierkv.transformers import TieredCache

    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, max_position_embeddings=512, attn_implementation="tierkv")  # fmt: skip
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 30))
    kw = dict(max_tokens=256, max_sequences=4, max_batch=4)
    with torch.no_grad():
        host = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=TieredCache(model.config, **kw),
                              max_new_tokens=12, do_sample=False, pad_token_id=0)  # fmt: skip
        model.cuda()
        gpu = model.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=12, do_sample=False,
                             past_key_values=TieredCache(model.config, device="cuda", max_step_tokens=64, **kw),
                             pad_token_id=0)  # fmt: skip
    assert gpu.shape == host.shape
    assert (gpu.cpu()[:, 30:] == host[:, 30:]).float().mean() >= 0.9  # ties may flip (docs/python.md)


def test_tiered_cache_capacity_and_accounting_on_the_gpu():
    """The GPU TieredCache shares the host's capacity check, warning and accounting
    (transformers.py): a run past max_tokens fails at the first step past it with the same
    message; a Stale pool too small for the run warns once; retier_stats() is the growth of
    retier_totals() and bits_per_scalar() the report's, the bits counted page by page once the
    conversions in flight are drained."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tierkv.transformers import TieredCache

    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, max_position_embeddings=512, attn_implementation="tierkv")  # fmt: skip
    torch.manual_seed(2)
    model = Qwen3ForCausalLM(cfg).eval().cuda()
    kw = dict(max_step_tokens=128, max_sequences=4, max_batch=4, **POLICY)

    def generate(cache, n):
        ids = torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(n)).cuda()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                           do_sample=False, pad_token_id=0)  # fmt: skip

    limited = TieredCache(model.config, device="cuda", max_tokens=52, **kw)
    msg = "TieredCache: 53 tokens needed (52 held + 1 x 1 new), max_tokens=52; pass max_tokens>=53"
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        generate(limited, 40)
    assert limited.get_seq_length() == 52

    def run(stale_pages):
        cache = TieredCache(model.config, device="cuda", pages_per_tier=[64 * 3, stale_pages], **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate(cache, 96)
            cache.end_step()
            cache.tierkv.drain()
        assert cache.retier_stats() == cache.tierkv.retier_totals()  # a fresh cache: from zero
        assert cache.bits_per_scalar() == pytest.approx(page_bits(cache), rel=1e-12)
        return cache, [str(w.message) for w in caught if "TieredCache" in str(w.message)]

    full, warned = run(2 * 3)
    assert full.retier_stats()["deferred_full"] > 0
    assert len(warned) == 1 and "pages_per_tier=[192, 6]" in warned[0], warned
    roomy, quiet = run(64 * 3)
    assert quiet == [] and roomy.retier_stats()["deferred_full"] == 0
    assert full.bits_per_scalar() > roomy.bits_per_scalar() + 0.5


def test_centering_removes_channel_offsets():
    """Keys with a per-channel offset 5x their spread and values with one 2x: center=True stores
    them minus the layer's channel means (estimated from the first append) and adds the means back
    exactly, so a Stale TQ3 tier's error is the spread's, not the offset's (docs/gpu-cache.md)."""
    from conftest import reference

    gen = torch.Generator().manual_seed(7)
    n = 200
    off_k = 5.0 * torch.randn(KVH, D, generator=gen)
    off_v = 2.0 * torch.randn(KVH, D, generator=gen)
    K = torch.randn(n + 1, KVH, D, generator=gen) + off_k
    V = torch.randn(n + 1, KVH, D, generator=gen) + off_v
    q = torch.randn(1, QH, D, generator=gen)
    ref_out, ref_lse = reference(q[0], K, V, n + 1, G)
    errors = {}
    for center in (False, True):
        g = gpu_cache("fp8+tq3", num_layers=1, center=center)
        s = g.create_sequence()
        g.begin_step([s], [n])
        g.append(0, K[:n].cuda(), V[:n].cuda())
        g.end_step(1, wait=True)  # the policy demotes all but the last pages to TQ3
        assert 1 in g.page_tiers(s, 0)
        g.begin_step([s], [1])
        g.append(0, K[n:].cuda(), V[n:].cuda())
        out, lse = g.decode(0, q.cuda(), return_lse=True)
        if center:
            with pytest.raises(ValueError, match="soft"):
                g.decode(0, q.cuda(), soft_cap=30.0)
        g.end_step(2, wait=True)
        g.device_error()
        errors[center] = rel(out[0].cpu(), ref_out)
        if center:  # uncentred, the offsets' TQ3 error moves the lse by ~2 (measured on the H200)
            assert (lse[0].cpu().double() - ref_lse).abs().max() < 0.25
    assert errors[True] < 0.05, errors
    assert errors[True] < 0.5 * errors[False], errors


# ---- page transfer: CudaCache.export_pages / import_pages, tierkv.Cache's bytes ---------------


def stepped_twins(tier_set, lengths=(40, 133), steps=3):
    """twins(), then `steps` steps of one new token per sequence on both (no decode: the policy
    demotes by recency alone, so both make the same decisions): pages in both tiers, open pages
    the GPU appended to after its conversions."""
    g, h, sg, sh = twins(tier_set, list(lengths))
    gen = torch.Generator().manual_seed(5)
    n = len(lengths)
    for step in range(2, 2 + steps):
        g.begin_step(sg, [1] * n)
        h.reserve(sh, [1] * n)
        for layer in range(2):
            k, v = torch.randn(n, KVH, D, generator=gen), torch.randn(n, KVH, D, generator=gen)
            g.append(layer, k.cuda(), v.cuda())
            h.write(layer, sh, k, v)
        h.commit(sh)
        g.end_step(step, wait=True)
        h.retier(step)
    for a, b in zip(sg, sh):
        assert g.page_tiers(a, 0) == h.page_tiers(b, 0)
    if tier_set != "int8r only":
        assert 1 in g.page_tiers(sg[1], 0)
    return g, h, sg, sh


@pytest.mark.parametrize("tier_set", list(SETS))
def test_gpu_export_equals_the_host_export(tier_set):
    """The same appended tokens on the GPU and on the host (encoders and conversions bit-exact):
    the same buffer byte for byte, whole runs, sub-runs, the open page alone and head slices."""
    g, h, sg, sh = stepped_twins(tier_set)
    moved = g.transfers()["page_bytes"]
    for a, b in zip(sg, sh):
        whole = g.export_pages(a)
        assert whole[:8] == b"TKVPAGES" and whole == h.export_pages(b)
        assert g.export_pages(a, first=1, count=2) == h.export_pages(b, first=1, count=2)
        last = (g.length(a) - 1) // P
        assert g.export_pages(a, first=last) == h.export_pages(b, first=last)
        assert g.export_pages(a, heads=(1, 2)) == h.export_pages(b, heads=(1, 2))
    assert g.transfers()["page_bytes"] > moved  # export is the only page-bytes path
    g.check_invariants()


@pytest.mark.parametrize("tier_set", ["int8r+tq4k/tq3v", "fp8+tq3"])
def test_page_transfer_between_the_gpu_and_the_host(tier_set):
    g, h, sg, sh = stepped_twins(tier_set)
    # host -> GPU: a fresh GPU cache re-exports the same bytes
    buf_h = h.export_pages(sh[1])
    g2 = gpu_cache(tier_set)
    s2 = g2.import_pages(buf_h)
    assert g2.length(s2) == h.length(sh[1]) == 136
    assert g2.page_tiers(s2, 1) == h.page_tiers(sh[1], 1)
    assert g2.export_pages(s2) == buf_h
    g2.check_invariants()
    # GPU -> host, and GPU -> the same GPU cache
    buf_g = g.export_pages(sg[1])
    h2 = make_cache(GEO, tier_set, **POLICY)
    s3 = h2.import_pages(buf_g)
    assert h2.export_pages(s3) == buf_g
    s4 = g.import_pages(buf_g)
    assert g.export_pages(s4) == buf_g
    # decode after one more token: the GPU import as the host source (kernel rounding), the host
    # import equal to the host source bit for bit
    gen = torch.Generator().manual_seed(7)
    g2.begin_step([s2], [1])
    h.reserve([sh[1]], [1])
    h2.reserve([s3], [1])
    for layer in range(2):
        k, v = torch.randn(1, KVH, D, generator=gen), torch.randn(1, KVH, D, generator=gen)
        q = torch.randn(1, QH, D, generator=gen)
        g2.append(layer, k.cuda(), v.cuda())
        h.write(layer, [sh[1]], k, v)
        h2.write(layer, [s3], k, v)
        out_h, lse_h = h.decode(layer, [sh[1]], q)
        out_g, lse_g = g2.decode(layer, q.cuda(), return_lse=True)
        assert rel(out_g.cpu(), out_h) < 2e-3 and (lse_g.cpu() - lse_h).abs().max() < 1e-3
        assert torch.equal(h2.decode(layer, [s3], q)[0], out_h)
    h.commit([sh[1]])
    h2.commit([s3])
    g2.device_error()
    g2.end_step(wait=True)
    g2.check_invariants()


def test_page_transfer_refusals_on_the_gpu():
    g, h, sg, sh = twins("int8r+tq4k/tq3v", [40, 133])
    buf = h.export_pages(sh[1])
    before, moved = g.report(), g.transfers()["page_bytes"]
    flipped = bytearray(buf)
    flipped[len(buf) // 2] ^= 0x40
    damaged = {
        rf"buffer of {len(buf) - 100} bytes is truncated": buf[:-100],
        r"checksum 0x[0-9a-f]+ of the content != 0x[0-9a-f]+ stored": flipped,
        r"bad magic": b"X" + buf[1:],
    }
    for msg, bad in damaged.items():
        with pytest.raises(ValueError, match=r"tierkv\.cuda\.import_pages: corrupt_data: page transfer: " + msg):
            g.import_pages(bad)
    fp8 = make_cache(GEO, "fp8+tq3", **POLICY)
    s = fp8.create_sequence()
    fp8.append(s, torch.randn(2, 20, KVH, D), torch.randn(2, 20, KVH, D))
    with pytest.raises(ValueError, match=r"tier 0 formats .* nothing imported"):
        g.import_pages(fp8.export_pages(s))
    assert g.report() == before and g.transfers()["page_bytes"] == moved
    g.check_invariants()
    g.begin_step(sg, [0, 0])  # inside a step: refused
    with pytest.raises(ValueError, match="not between begin_step and end_step"):
        g.import_pages(buf)
    with pytest.raises(ValueError, match="not between begin_step and end_step"):
        g.export_pages(sg[0])
    g.end_step(wait=True)
    with pytest.raises(ValueError, match="codec seed 0x0 != this storage's 0x7"):
        gpu_cache(codec_seed=7).import_pages(buf)
    with pytest.raises(RuntimeError, match=r"tier 1 pool has 4 free pages, the import needs \d+"):
        gpu_cache(pages_per_tier=[64, 4]).import_pages(buf)
    with pytest.raises(ValueError, match=r"first logical page = 10 is out of range \[0, 10\)"):
        g.export_pages(sg[1], first=10)
    with pytest.raises(ValueError, match="center = true"):
        gpu_cache(center=True).import_pages(buf)


def test_host_tier_offload_and_restore():
    """offload parks a sequence in pinned host memory and releases it; restore brings the same
    pages back byte for byte, decoding as before; refusals change nothing (docs/gpu-cache.md,
    "Host tier")."""
    g = gpu_cache(host_pool_bytes=4 << 20)
    s = g.create_sequence()
    gen = torch.Generator().manual_seed(11)
    g.begin_step([s], [150])
    for layer in range(2):
        g.append(layer, torch.randn(150, KVH, D, generator=gen).cuda(), torch.randn(150, KVH, D, generator=gen).cuda())
    g.end_step(1, wait=True)
    before = g.export_pages(s)
    q = torch.randn(1, QH, D, generator=gen).cuda()

    def decode_all(seq, step):
        g.begin_step([seq], [0])
        outs = [g.decode(layer, q, return_lse=True) for layer in range(2)]
        g.end_step(step, wait=True)
        return outs

    ref = decode_all(s, 2)
    tiers = [g.page_tiers(s, layer) for layer in range(2)]
    parked = g.offload(s)
    st = g.host_stats()
    assert st["parked"] == 1 and st["offloads"] == 1 and st["used_bytes"] > 0 and st["capacity_bytes"] == 4 << 20
    with pytest.raises(ValueError, match="stale"):
        g.length(s)  # released on the GPU
    r = g.restore(parked)
    assert g.restore_pending(r) in (True, False)  # the copy may still run on its own stream
    assert g.length(r) == 150 and g.export_pages(r) == before
    assert not g.restore_pending(r)  # export_pages waited for it
    assert [g.page_tiers(r, layer) for layer in range(2)] == tiers
    for (o, lse), (o0, lse0) in zip(decode_all(r, 3), ref):
        assert torch.equal(o, o0) and torch.equal(lse, lse0)
    st = g.host_stats()
    assert st["parked"] == 0 and st["restores"] == 1 and st["bytes_restored"] == st["bytes_offloaded"] > 0
    with pytest.raises(ValueError, match="not parked"):
        g.restore(parked)
    with pytest.raises(ValueError, match="not parked"):
        g.drop_parked(parked)
    # refusals: no host tier, too little host memory; the sequence stays where it was
    none = gpu_cache()
    s0 = none.create_sequence()
    with pytest.raises(RuntimeError, match="host_pool_bytes = 0"):
        none.offload(s0)
    small = gpu_cache(host_pool_bytes=8192)
    s1 = small.create_sequence()
    small.begin_step([s1], [150])
    for layer in range(2):
        small.append(layer, torch.randn(150, KVH, D).cuda(), torch.randn(150, KVH, D).cuda())
    small.end_step(1, wait=True)
    kept = small.export_pages(s1)
    with pytest.raises(RuntimeError, match="bytes of the host pool.*nothing moved"):
        small.offload(s1)
    assert small.export_pages(s1) == kept and small.host_stats()["used_bytes"] == 0
    with pytest.raises(ValueError, match="host_pool_bytes = -1"):
        gpu_cache(host_pool_bytes=-1)
    g.check_invariants()
