# SPDX-License-Identifier: Apache-2.0
"""The tierkv ops against a float64 reference, edge shapes, refusals, fakes and torch.compile."""

import pytest
import torch
from conftest import GEOMETRIES, TIER_SETS, make_cache, reference, rel_l2

import tierkv

ops = torch.ops.tierkv

# Mean relative L2 error of attention outputs against float64 attention over the ORIGINAL
# vectors: the codec bands of tests/unit/attention/codec_attention_test.cpp (FP8 pages
# < 0.06, TQ3 < 0.32, int8_rotated a third of FP8's or less).
BAND = {"int8r only": 0.02, "fp8+tq3": 0.32, "int8r+tq4k/tq3v": 0.32}
# Against float64 attention over the DECODED vectors (read_layer): float32 rounding only.
EXACT = 5e-5


def fill(c, lens, rng, retier_steps=3):
    """Sequences of the given lengths with random K/V in every layer; retiered so older
    pages move to the Stale tier. -> (seq ids, [(K, V)] originals [layers, n, kvh, d])."""
    seqs, kv = [], []
    for n in lens:
        s = c.create_sequence()
        K = torch.randn(c.num_layers, n, c.kv_heads, c.head_dim, generator=rng)
        V = torch.randn(c.num_layers, n, c.kv_heads, c.head_dim, generator=rng)
        c.append(s, K, V)
        seqs.append(s)
        kv.append((K, V))
    for step in range(retier_steps):
        c.retier(step)
    return seqs, kv


@pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: "d{}kv{}g{}p{}".format(*g))
@pytest.mark.parametrize("tier_set", list(TIER_SETS))
def test_decode_matches_float64(geo, tier_set, rng):
    c = make_cache(geo, tier_set)
    # one token, a partial last page, pages in both tiers (past the recent window at any page size)
    lens = [1, 37, max(300, 10 * geo[3] + 11)]
    seqs, kv = fill(c, lens, rng)
    if c.num_tiers == 2:
        assert 1 in c.page_tiers(seqs[2], 1), "retier moved no page to the Stale tier"
    q = torch.randn(len(lens), c.q_heads, c.head_dim, generator=rng)
    for layer in range(c.num_layers):
        out, lse = c.decode(layer, seqs, q)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (len(lens), c.q_heads)
        errs = []
        for b, (s, n) in enumerate(zip(seqs, lens)):
            Kd, Vd = c.read_layer(s, layer)
            ref, ref_lse = reference(q[b], Kd, Vd, n, c.group_size)
            for h in range(c.q_heads):
                assert rel_l2(out[b, h], ref[h]) < EXACT
            assert float((lse[b].double() - ref_lse).abs().max()) < 1e-4
            K, V = kv[b]
            orig, _ = reference(q[b], K[layer], V[layer], n, c.group_size)
            errs += [rel_l2(out[b, h], orig[h]) for h in range(c.q_heads)]
        mean = sum(errs) / len(errs)
        assert 1e-4 < mean < BAND[tier_set], f"mean rel. error {mean:.4f} vs the original vectors"


def test_int8_rotated_beats_fp8(rng):
    """Same data in 8-bit pages: int8_rotated's error is under a third of FP8 E4M3's."""
    errs = {}
    for ts in ("fp8+tq3", "int8r only"):
        c = make_cache((128, 4, 4, 16), ts, recent_pages=1000)  # every page stays Recent
        g = torch.Generator().manual_seed(5)
        seqs, kv = fill(c, [200, 200], g)
        q = torch.randn(2, c.q_heads, c.head_dim, generator=g)
        out, _ = c.decode(0, seqs, q)
        e = [
            rel_l2(out[b, h], reference(q[b], kv[b][0][0], kv[b][1][0], 200, c.group_size)[0][h])
            for b in range(2)
            for h in range(c.q_heads)
        ]
        errs[ts] = sum(e) / len(e)
    assert errs["int8r only"] * 3 < errs["fp8+tq3"] < 0.06


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype, rng):
    c = make_cache()
    s = c.create_sequence()
    K = torch.randn(2, 50, 4, 64, generator=rng)
    V = torch.randn(2, 50, 4, 64, generator=rng)
    c.append(s, K.to(dtype), V.to(dtype))
    q = torch.randn(1, 8, 64, generator=rng)
    out, lse = c.decode(1, [s], q.to(dtype))
    assert out.dtype == dtype and lse.dtype == torch.float32
    Kd, Vd = c.read_layer(s, 1)
    ref, _ = reference(q.to(dtype).float()[0], Kd, Vd, 50, 2)
    assert rel_l2(out[0].float(), ref) < 1e-2  # the output's own rounding to 8 mantissa bits


def prefill_check(c, seqs, chunks, q, out, lse, layer):
    """out/lse of a prefill against causal float64 attention on the decoded vectors."""
    row = 0
    for s, n in zip(seqs, chunks):
        total = c.length(s) + c.reserved(s)
        Kd, Vd = c.read_layer(s, layer)
        for j in range(n):
            pos = total - n + j
            ref, ref_lse = reference(q[row], Kd, Vd, pos + 1, c.group_size)
            for h in range(c.q_heads):
                assert rel_l2(out[row, h], ref[h]) < EXACT
            assert float((lse[row].double() - ref_lse).abs().max()) < 1e-4
            row += 1


@pytest.mark.parametrize("geo", [GEOMETRIES[1], GEOMETRIES[2]], ids=["d64g2p16", "d128g6p64"])
def test_prefill_over_reserved_chunk(geo, rng):
    """A layer-by-layer step: reserve, write a layer, prefill that layer before commit (the
    chunk is read from its reserved pages), commit; the same prefill after commit is equal."""
    c = make_cache(geo, "fp8+tq3")
    seqs, _ = fill(c, [100, 37, 16, 5], rng)
    chunks = [29, 37, 0, 1]  # across pages, a page-aligned start, an empty chunk, one token
    total = sum(chunks)
    c.reserve(seqs, chunks)
    k = torch.randn(c.num_layers, total, c.kv_heads, c.head_dim, generator=rng)
    v = torch.randn(c.num_layers, total, c.kv_heads, c.head_dim, generator=rng)
    indptr = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0)), dtype=torch.int32)
    q = torch.randn(total, c.q_heads, c.head_dim, generator=rng)
    before = []
    for layer in range(c.num_layers):
        c.write(layer, seqs, k[layer], v[layer])
        out, lse = c.prefill(layer, seqs, q, indptr)
        prefill_check(c, seqs, chunks, q, out, lse, layer)
        before.append(out)
    c.commit(seqs)
    assert [c.length(s) for s in seqs] == [129, 74, 16, 6]
    for layer in range(c.num_layers):
        out, _ = c.prefill(layer, seqs, q, indptr)
        assert torch.equal(out, before[layer])


def test_decode_sees_reserved_token_and_prefill_of_one_equals_decode(rng):
    c = make_cache((128, 4, 4, 16))
    seqs, _ = fill(c, [63, 64, 65], rng)
    c.reserve(seqs, [1, 1, 1])
    k = torch.randn(3, 4, 128, generator=rng)
    for layer in range(2):
        c.write(layer, seqs, k, k)
    q = torch.randn(3, 16, 128, generator=rng)
    out, lse = c.decode(0, seqs, q)
    pout, plse = c.prefill(0, seqs, q, [0, 1, 2, 3])
    assert torch.equal(out, pout) and torch.equal(lse, plse)
    for b, s in enumerate(seqs):  # the reserved token is attended to
        Kd, Vd = c.read_layer(s, 0)
        ref, _ = reference(q[b], Kd, Vd, Kd.shape[0], 4)
        assert Kd.shape[0] == [64, 65, 66][b]
        assert rel_l2(out[b], ref) < EXACT


def test_fork_release_and_sharing(rng):
    c = make_cache()
    (s,), _ = fill(c, [40], rng)
    f = c.fork(s)
    q = torch.randn(2, 8, 64, generator=rng)
    out, _ = c.decode(0, [s, f], q[[0, 0]])
    assert torch.equal(out[0], out[1])
    c.append(f, torch.randn(2, 3, 4, 64, generator=rng), torch.randn(2, 3, 4, 64, generator=rng))
    assert (c.length(s), c.length(f)) == (40, 43)
    out2, _ = c.decode(0, [s], q[:1])
    assert torch.equal(out2[0], out[0])  # the parent did not see the fork's tokens
    shared = c.report()["live_tokens"]
    assert shared == 40 + 3 + 8  # 2 sealed pages shared; the open tail page (8 tokens) copied
    c.release(f)
    with pytest.raises(ValueError, match="seq#"):
        c.decode(0, [f], q[:1])
    assert c.report()["live_tokens"] == 40


def test_prefix_reuse(rng):
    c = make_cache()  # 16-token pages
    ids = list(range(1000, 1050))  # a 50-token prompt: 3 full pages + 2 tokens
    a = c.create_sequence()
    K, V = torch.randn(2, 50, 4, 64, generator=rng), torch.randn(2, 50, 4, 64, generator=rng)
    c.append(a, K, V)
    assert c.insert_prefix(a, ids, salt=5) == 3  # full pages only
    assert c.insert_prefix(a, torch.tensor(ids), salt=5) == 0  # cached already
    assert c.prefix_entries() == 3
    # The same prompt with another tail: the 3 cached pages, not the partial fourth.
    b, cached = c.start_from_prefix(ids[:40] + [7, 8, 9], salt=5)
    assert cached == 32 and c.length(b) == 32  # whole pages of the first 40 ids match
    la, _ = c.read_layer(a, 1, 0, 32)
    lb, _ = c.read_layer(b, 1, 0, 32)
    assert torch.equal(la, lb)  # the same pages, by reference
    q = torch.randn(1, 8, 64, generator=rng)
    c.append(b, K[:, 32:].contiguous(), V[:, 32:].contiguous())  # the rest of a's prompt
    out, _ = c.decode(0, [a, b], q[[0, 0]])
    assert rel_l2(out[0], out[1]) < 1e-6  # same keys and values, shared or written
    r = c.report()
    assert (r["sequence_tokens"], r["live_tokens"]) == (100, 68)  # 32 tokens stored once
    # Another salt, or other ids, share nothing.
    d, none = c.start_from_prefix(ids, salt=6)
    assert none == 0 and c.length(d) == 0
    c.release(d)
    # Entries that sequences still use are not evicted; once released, they are.
    assert c.evict_prefixes(10) == 0
    c.release(a)
    c.release(b)
    assert c.evict_prefixes(10) == 3 and c.prefix_entries() == 0
    assert c.report()["live_tokens"] == 0
    # Bad input is refused by name.
    with pytest.raises(ValueError, match="1-D"):
        c.start_from_prefix(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        c.start_from_prefix(torch.zeros(3))
    with pytest.raises(ValueError, match="int32"):
        c.start_from_prefix([2**40])
    with pytest.raises(ValueError, match="seq#"):
        c.insert_prefix(a, ids)  # released
    with pytest.raises(ValueError, match="negative"):
        c.evict_prefixes(-1)


def test_report_reconciles_and_counts_bits(rng):
    c = make_cache((128, 4, 4, 16), "int8r+tq4k/tq3v")
    fill(c, [400], rng)
    r = c.report()
    assert r["reconciles"] and r["live_tokens"] == 400
    t0, t1 = r["tiers"]
    assert t0["live_pages"] > 0 and t1["live_pages"] > 0
    assert 8.0 < t0["bits_per_scalar"] < 8.6  # int8 codes + a bf16 scale per vector
    assert 3.0 < t1["bits_per_scalar"] < 4.0  # TQ4 keys + TQ3 values + norms
    assert r["bits_per_scalar"] < t0["bits_per_scalar"]
    assert "reconciled" in c.report_text()


def test_retier_stats_and_pin(rng):
    c = make_cache((64, 4, 2, 16), "fp8+tq3", recent_pages=2, sink_pages=0)
    s = c.create_sequence()
    c.pin(s, 0, 0)  # a no-op range is accepted
    c.append(s, torch.randn(2, 160, 4, 64, generator=rng), torch.randn(2, 160, 4, 64, generator=rng))
    c.pin(s, 0, 2)
    st = c.retier(1)
    assert set(st) == set(tierkv.RETIER_FIELDS) and st["demoted"] == 2 * (10 - 2 - 2)
    tiers = c.page_tiers(s, 0)
    assert tiers[:2] == [0, 0] and tiers[-2:] == [0, 0] and set(tiers[2:-2]) == {1}


def test_policy_by_name_and_its_knobs(rng):
    """policy= / policy_options= reach the registered policy (include/tierkv/policies.hpp): a
    knob set in policy_options does what its keyword does, knobs that had no keyword (the Cold
    role's) take effect, and bad names or values raise naming them."""
    listed = tierkv.policies()
    assert listed["recency_anchor"]["recent_pages"] == 4.0 and "cold_enter_mass" in listed["recency_anchor"]

    def tiers_after(**kw):
        c = make_cache((64, 4, 2, 16), "fp8+tq3", **kw)
        s = c.create_sequence()
        g = torch.Generator().manual_seed(3)
        c.append(s, torch.randn(2, 160, 4, 64, generator=g), torch.randn(2, 160, 4, 64, generator=g))
        c.retier(1)
        return c.page_tiers(s, 0)

    by_keyword = tiers_after(recent_pages=2, sink_pages=0)
    assert by_keyword == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]  # no sink page, two Recent ones
    assert tiers_after(policy="recency_anchor", policy_options=dict(recent_pages=2, sink_pages=0)) == by_keyword
    assert tiers_after(policy_options=dict(recent_pages=2), sink_pages=0) == by_keyword
    # a knob without a keyword: three sink pages stay 8-bit
    assert tiers_after(recent_pages=2, policy_options=dict(sink_pages=3)) == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match=r'unknown tier policy "lru"; known policies: recency_anchor'):
        make_cache((64, 4, 2, 16), "fp8+tq3", policy="lru")
    with pytest.raises(ValueError, match=r'no knob "recent_page".*recent_pages=4'):
        make_cache((64, 4, 2, 16), "fp8+tq3", policy_options=dict(recent_page=2))
    with pytest.raises(ValueError, match=r"recent_pages = 2.5 must be an integer"):
        make_cache((64, 4, 2, 16), "fp8+tq3", policy_options=dict(recent_pages=2.5))
    with pytest.raises(ValueError, match=r"hysteresis"):
        make_cache((64, 4, 2, 16), "fp8+tq3", policy_options=dict(enter_mass=1.0, leave_mass=2.0))
    with pytest.raises(ValueError, match=r"recent_pages given both"):
        make_cache((64, 4, 2, 16), "fp8+tq3", recent_pages=2, policy_options=dict(recent_pages=3))


def test_cold_tier_set(rng):
    """A five-name tier set (recent + Stale k/v + Cold k/v, issue 52) from Python: pages of little
    attention mass go to the Cold tier (tier 2) by the policy's cold knobs, the high-mass page
    stays 8-bit, and decode over the three formats equals float64 attention over the decoded
    vectors."""
    cold = dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", cold_type_k="tq3", cold_type_v="tq2")
    assert any({k: r[k] for k in cold if k in r} == cold for r in tierkv.built())
    c = tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, page_size=16, num_layers=1, max_tokens=1024,
                     max_sequences=4, threads=2, **cold, recent_pages=1, sink_pages=0, keep_first_layers=0,
                     keep_last_layers=0, min_dwell_steps=0,
                     policy_options=dict(ema_alpha=1.0, cold_enter_mass=0.5, cold_leave_mass=1.0))  # fmt: skip
    assert c.num_tiers == 3 and "cold_type_v='tq2'" in repr(c)
    s = c.create_sequence()
    K = torch.randn(1, 160, 4, 64, generator=rng)
    V = torch.randn(1, 160, 4, 64, generator=rng)
    c.append(s, K, V)
    q = 4.0 * K[0, 40].repeat_interleave(2, dim=0).unsqueeze(0)  # every head attends token 40 (page 2)
    for step in range(3):
        c.decode(0, [s], q)
        c.retier(step)
    tiers = c.page_tiers(s, 0)
    assert tiers[2] == 0 and tiers[-1] == 0, tiers  # the attended page (Anchor) and the Recent page
    assert 2 in tiers, tiers  # low-mass pages went Cold
    out, lse = c.decode(0, [s], q)
    Kd, Vd = c.read_layer(s, 0)
    ref, ref_lse = reference(q[0], Kd, Vd, 160, 2)
    for h in range(c.q_heads):
        assert rel_l2(out[0, h], ref[h]) < EXACT
    with pytest.raises(ValueError, match="both cold_type_k and cold_type_v"):
        tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, num_layers=1, max_tokens=64, cold_type_k="tq3")
    # Per-layer budgets (the cold_layers mask): layer 1's old pages Cold without any mass, layer 0's Stale.
    c = tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, page_size=16, num_layers=2, max_tokens=1024,
                     max_sequences=4, threads=2, **cold, recent_pages=1, sink_pages=0, keep_first_layers=0,
                     keep_last_layers=0, min_dwell_steps=0, policy_options=dict(cold_layers=2))  # fmt: skip
    s = c.create_sequence()
    c.append(s, torch.randn(2, 160, 4, 64, generator=rng), torch.randn(2, 160, 4, 64, generator=rng))
    c.retier(1)
    assert c.page_tiers(s, 0) == [1] * 9 + [0] and c.page_tiers(s, 1) == [2] * 9 + [0]
    with pytest.raises(ValueError, match="cold_layers"):
        tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, num_layers=1, max_tokens=64, **cold,
                     policy_options=dict(cold_layers=2.0**53 + 2))  # fmt: skip


def test_bit_budget(rng):
    """bits_per_scalar (a bit budget, docs/tiering.md): the movable pages (all but the Recent one)
    store at most the target, within one step of it; the attended page is in the best tier any
    movable page has; bad targets are refused naming the value."""
    cold = dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", cold_type_k="tq3", cold_type_v="tq2")
    page_bits = {0: 8.25, 1: (4.25 + 3.25) / 2, 2: (3.25 + 2.25) / 2}  # d = 64: the set's tiers
    for target in (3.0, 3.5):
        c = tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, page_size=16, num_layers=1, max_tokens=1024,
                         max_sequences=4, threads=2, **cold, recent_pages=1, sink_pages=0, keep_first_layers=0,
                         keep_last_layers=0, min_dwell_steps=0, bits_per_scalar=target,
                         policy_options=dict(ema_alpha=1.0))  # fmt: skip
        s = c.create_sequence()
        K = torch.randn(1, 320, 4, 64, generator=rng)
        c.append(s, K, torch.randn(1, 320, 4, 64, generator=rng))
        q = 4.0 * K[0, 40].repeat_interleave(2, dim=0).unsqueeze(0)  # every head attends page 2
        c.decode(0, [s], q)
        c.retier(1)
        tiers = c.page_tiers(s, 0)
        movable = [page_bits[t] for t in tiers[:-1]]
        bits = sum(movable) / len(movable)
        assert bits <= target + 1e-9 and bits > target - (8.25 - 3.75) / len(movable), (target, tiers)
        assert tiers[2] == min(tiers[:-1]) and tiers[-1] == 0, tiers  # the attended page: the best
    # keep_first_layers / keep_last_layers default to 0 under a budget: with them at 1 the first
    # and last layers' pages would take the budget before any other layer's (docs/tiering.md)
    kw = dict(head_dim=64, kv_heads=4, group_size=2, page_size=16, num_layers=3, max_tokens=1024, max_sequences=4,
              threads=2, **cold, recent_pages=1, sink_pages=0, min_dwell_steps=0, bits_per_scalar=3.0)
    K, V = torch.randn(3, 320, 4, 64, generator=rng), torch.randn(3, 320, 4, 64, generator=rng)
    for layers_kept, middle_all_cold in ((None, False), (1, True)):
        c = tierkv.Cache(**kw, keep_first_layers=layers_kept, keep_last_layers=layers_kept)
        s = c.create_sequence()
        c.append(s, K, V)
        c.retier(1)
        assert (c.page_tiers(s, 1)[:-1] == [2] * 19) == middle_all_cold, [c.page_tiers(s, l) for l in range(3)]
    assert tierkv.cache.policy_knobs("recency_anchor", None, {}, 3.0) == (["keep_first_layers", "keep_last_layers"], [0.0, 0.0])
    assert tierkv.cache.policy_knobs("recency_anchor", dict(keep_first_layers=2), {}, 3.0)[1] == [2.0, 0.0]
    with pytest.raises(ValueError, match=r"bits_per_scalar_target = -1"):
        tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, num_layers=1, max_tokens=64, **cold, bits_per_scalar=-1)


def test_mutating_ops_bump_the_state(rng):
    c = make_cache()
    before = int(c.state[1])
    s = c.create_sequence()
    c.reserve([s], [3])
    c.write(0, [s], torch.zeros(3, 4, 64), torch.zeros(3, 4, 64))
    assert int(c.state[1]) == before + 3
    c.decode(0, [s], torch.zeros(1, 8, 64))
    assert int(c.state[1]) == before + 3  # attention reads the cache


def test_wrappers_equal_the_ops(rng):
    c = make_cache((64, 4, 2, 16))
    seqs, _ = fill(c, [20, 50], rng)
    q = torch.randn(2, 8, 64, generator=rng)
    w = tierkv.BatchDecodeWrapper(c)
    w.plan(seqs)
    out, lse = w.run(q, 1, return_lse=True)
    ref_out, ref_lse = c.decode(1, seqs, q)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    p = tierkv.BatchPrefillWrapper(c)
    p.plan(seqs, [0, 4, 9])
    qp = torch.randn(9, 8, 64, generator=rng)
    assert torch.equal(p.run(qp, 0), c.prefill(0, seqs, qp, [0, 4, 9])[0])
    with pytest.raises(ValueError, match="must lie in"):
        p.plan(seqs, [0, 21, 22])
    with pytest.raises(ValueError, match="batch \\+ 1"):
        p.plan(seqs, [0, 1])
    with pytest.raises(RuntimeError, match="plan"):
        tierkv.BatchDecodeWrapper(c).run(q, 0)
    empty = c.create_sequence()
    with pytest.raises(ValueError, match="no tokens"):
        w.plan([empty])


# ---- refusals ---------------------------------------------------------------------------------


def test_unknown_format_and_combination_not_built():
    with pytest.raises(ValueError, match='unknown cache format name "q8_0".*known names: fp8, int8_rotated, tq3, tq4'):
        tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, num_layers=1, max_tokens=16, recent="q8_0")
    with pytest.raises(ValueError, match="no prebuilt tierkv cache.*kv_heads=3.*Built: .*kv_heads \\{"):
        tierkv.Cache(head_dim=64, kv_heads=3, group_size=2, num_layers=1, max_tokens=16)
    # the refusal names the exact build entry (a first-hour trap: it used to suggest a set that
    # would not contain the shape)
    with pytest.raises(ValueError, match=r"To build it: TIERKV_PYTHON_EXTRA=int8_rotated\+tq4\+tq3:64:3:2:16 pip"):
        tierkv.Cache(head_dim=64, kv_heads=3, group_size=2, num_layers=1, max_tokens=16)
    with pytest.raises(ValueError, match="recent=fp8, cache_type_k=tq4"):  # names known, set not built
        tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, num_layers=1, max_tokens=16, recent="fp8")
    with pytest.raises(ValueError, match="pages_per_tier has 1 entries; this tier set has 2 tiers"):
        tierkv.Cache(head_dim=64, kv_heads=4, group_size=2, num_layers=1, pages_per_tier=[8])
    with pytest.raises(ValueError, match="max_pages = 0"):
        make_cache(max_pages=0)
    built = tierkv.built()
    assert {"recent": "int8_rotated", "cache_type_k": "tq4", "cache_type_v": "tq3", "head_dim": 256,
            "kv_heads": 4, "group_size": 6, "page_size": 16} in built


def test_bad_tensors(rng):
    c = make_cache()
    seqs, _ = fill(c, [10], rng)
    q = torch.randn(1, 8, 64)
    with pytest.raises(ValueError, match="q must be float32, bfloat16 or float16, got Double"):
        c.decode(0, seqs, q.double())
    with pytest.raises(ValueError, match=r"q must have shape \[1, 8, 64\], got \[1, 8, 32\]"):
        c.decode(0, seqs, q[..., :32].contiguous())
    with pytest.raises(ValueError, match="q must be contiguous"):
        c.decode(0, seqs, torch.randn(1, 64, 8).transpose(1, 2))
    with pytest.raises(ValueError, match="seqs must be int64, got Float"):
        ops.decode(c.state, 0, torch.tensor([0.0]), q)
    with pytest.raises(ValueError, match="layer = 2 is out of range \\[0, 2\\)"):
        c.decode(2, seqs, q)
    with pytest.raises(ValueError, match="seq#"):
        c.decode(0, [7], q)
    with pytest.raises(ValueError, match="state must be the int64 CPU tensor"):
        ops.decode(torch.zeros(3, dtype=torch.int64), 0, seqs_t := torch.tensor(seqs), q)
    with pytest.raises(ValueError, match="appears twice"):
        c.reserve([seqs[0], seqs[0]], [1, 1])
    # prefill arguments
    with pytest.raises(ValueError, match="q_indptr has 3 entries, batch \\+ 1 = 2"):
        c.prefill(0, seqs, q, [0, 1, 1])
    with pytest.raises(ValueError, match="q_indptr\\[0\\] = 1 must be 0"):
        c.prefill(0, seqs_t, q, [1, 1])
    with pytest.raises(ValueError, match="chunk length of sequence 0 = 11 exceeds"):
        c.prefill(0, seqs, torch.randn(11, 8, 64), [0, 11])
    # write sizes
    c.reserve(seqs, [2])
    with pytest.raises(ValueError, match="have 2 reserved tokens, keys/values hold 3"):
        c.write(0, seqs, torch.zeros(3, 4, 64), torch.zeros(3, 4, 64))
    with pytest.raises(ValueError, match=r"v must have shape \[2, 4, 64\]"):
        c.write(0, seqs, torch.zeros(2, 4, 64), torch.zeros(2, 4, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the device check needs one")
def test_cuda_tensor_refused_by_the_host_ops(rng):
    c = make_cache()
    seqs, _ = fill(c, [10], rng)
    with pytest.raises(ValueError, match="q is on cuda"):
        c.decode(0, seqs, torch.randn(1, 8, 64, device="cuda"))


def test_non_finite_inputs_refused(rng):
    c = make_cache()
    seqs, _ = fill(c, [10], rng)
    q = torch.randn(1, 8, 64)
    q[0, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="query head 3, dim 5\\) is not finite"):
        c.decode(0, seqs, q)
    q[0, 3, 5] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        c.prefill(0, seqs, q, [0, 1])
    c.reserve(seqs, [2])
    k = torch.zeros(2, 4, 64)
    k[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="keys\\[.*token 1, kv head 2\\) is not finite; nothing written"):
        c.write(0, seqs, k, torch.zeros(2, 4, 64))
    c.write(0, seqs, torch.zeros(2, 4, 64), torch.zeros(2, 4, 64))  # the reservation is intact
    c.cancel(seqs)
    assert c.length(seqs[0]) == 10 and c.reserved(seqs[0]) == 0


def test_reserve_is_all_or_none():
    c = make_cache(pages_per_tier=[4, 4], num_layers=1, max_tokens=None)
    a, b = c.create_sequence(), c.create_sequence()
    with pytest.raises(RuntimeError, match="capacity_exhausted.*batch entry 1.*nothing reserved"):
        c.reserve([a, b], [48, 48])  # 3 pages each, 4 in tier 0
    assert c.reserved(a) == 0 and c.reserved(b) == 0
    c.reserve([a, b], [32, 32])


def test_threads_checked_before_any_worker_starts():
    """threads out of range is refused naming the limit, before the pool would start them."""
    with pytest.raises(ValueError, match=r"threads = 100000 must lie in \[0, 1024\]"):
        make_cache(threads=100000)
    with pytest.raises(ValueError, match="threads = -1"):
        make_cache(threads=-1)


def test_destroyed_cache_refused():
    c = make_cache()
    state = c.state
    c.close()
    with pytest.raises(ValueError, match="no cache with handle"):
        ops.create_sequence(state)


# ---- fakes and torch.compile -------------------------------------------------------------------


def test_opcheck_attention_and_write(rng):
    c = make_cache()
    seqs, _ = fill(c, [30, 5], rng)
    st = torch.tensor(seqs)
    q = torch.randn(2, 8, 64, generator=rng)
    torch.library.opcheck(ops.decode.default, (c.state, 0, st, q))
    torch.library.opcheck(ops.prefill.default, (c.state, 1, st, torch.randn(6, 8, 64), torch.tensor([0, 4, 6], dtype=torch.int32)))
    c.reserve(seqs, [1, 2])
    torch.library.opcheck(ops.write.default, (c.state, 0, st, torch.randn(3, 4, 64), torch.randn(3, 4, 64)))


def test_compile_decode_fullgraph(rng):
    c = make_cache()
    seqs, _ = fill(c, [30, 70], rng)
    st = torch.tensor(seqs)
    q = torch.randn(2, 8, 64, generator=rng)

    def step(q):
        out, lse = c.decode(0, st, q)
        return out * 2.0, lse

    compiled = torch.compile(step, fullgraph=True)
    out, lse = compiled(q)
    ref_out, ref_lse = step(q)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_compile_write_then_decode_keeps_order(rng):
    """write mutates `state`; the decode after it in the same graph must see the new token."""
    c = make_cache(num_layers=1)
    seqs, _ = fill(c, [17], rng)
    st = torch.tensor(seqs)

    def step(k, q):
        ops.write(c.state, 0, st, k, k)
        return ops.decode(c.state, 0, st, q)[0]

    compiled = torch.compile(step, fullgraph=True)
    k = torch.randn(1, 4, 64, generator=rng) * 4
    q = torch.randn(1, 8, 64, generator=rng)
    c.reserve(seqs, [1])
    out = compiled(k, q)
    Kd, Vd = c.read_layer(seqs[0], 0)
    assert Kd.shape[0] == 18
    ref, _ = reference(q[0], Kd, Vd, 18, 2)
    assert rel_l2(out[0], ref) < EXACT


def test_centering_removes_channel_offsets(rng):
    """Keys offset 5x their spread per channel, values 2x: center=True stores them minus the
    layer's channel means (estimated from the first write) and adds the means back exactly, in
    decode and in prefill over a reserved chunk; the Stale TQ3 tier's error is then the
    spread's, not the offset's."""
    D, KVH, G, n, m = 64, 4, 2, 300, 20
    off_k, off_v = 5.0 * torch.randn(KVH, D, generator=rng), 2.0 * torch.randn(KVH, D, generator=rng)
    K = torch.randn(2, n + m, KVH, D, generator=rng) + off_k
    V = torch.randn(2, n + m, KVH, D, generator=rng) + off_v
    q = torch.randn(1, KVH * G, D, generator=rng)
    qc = torch.randn(m, KVH * G, D, generator=rng)
    errs, perrs, rerr = {}, {}, {}
    for center in (False, True):
        c = make_cache((D, KVH, G, 16), "fp8+tq3", center=center)
        s = c.create_sequence()
        c.append(s, K[:, :n].contiguous(), V[:, :n].contiguous())
        for step in range(3):
            c.retier(step)
        assert 1 in c.page_tiers(s, 0)
        out, lse = c.decode(0, [s], q)
        ref, ref_lse = reference(q[0], K[0], V[0], n, G)
        errs[center] = rel_l2(out[0], ref)
        # read_layer gives back the vectors written (the means added back), within the pages' error
        rk, rv = c.read_layer(s, 0, 0, n)
        rerr[center] = (rel_l2(rk, K[0, :n]), rel_l2(rv, V[0, :n]))
        # a chunk of m tokens, reserved and written layer by layer, attended causally
        c.reserve([s], [m])
        for layer in range(2):
            c.write(layer, [s], K[layer, n:], V[layer, n:])
        pout, plse = c.prefill(1, [s], qc, torch.tensor([0, m], dtype=torch.int32))
        c.commit([s])
        worst = 0.0
        for j in range(m):
            r, rl = reference(qc[j], K[1], V[1], n + j + 1, G)
            perrs[center] = max(perrs.get(center, 0.0), rel_l2(pout[j], r))
            worst = max(worst, float((plse[j].double() - rl).abs().max()))
        if center:  # uncentred, the offsets' TQ3 error moves the lse by ~2 (the GPU test)
            assert float((lse[0].double() - ref_lse).abs().max()) < 0.25
            assert worst < 0.25
    assert errs[True] < 0.05 and errs[True] < 0.5 * errs[False], errs
    assert perrs[True] < 0.5 * perrs[False], perrs
    # centred pages read back with the means: no worse than uncentred ones (offsets 5x / 2x the
    # spread: read without the means, the error would be about 1)
    assert rerr[True][0] < 0.1 and rerr[True][1] < 0.2 and rerr[True][0] <= rerr[False][0], rerr
    with pytest.raises(ValueError, match="soft_cap"):
        make_cache((D, KVH, G, 16), "fp8+tq3", center=True, soft_cap=30.0)


# ---- page transfer: export_pages / import_pages (paging/page_transfer.hpp's buffer) -----------


def transfer_source(rng, lens=(75, 40), tier_set="int8r+tq4k/tq3v"):
    """A (64, 4, 2, 16) cache whose older pages were demoted (recent_pages=1): the first
    sequence holds 4 Stale pages and a partial Recent one."""
    c = make_cache((64, 4, 2, 16), tier_set, recent_pages=1, sink_pages=0)
    seqs, _ = fill(c, list(lens), rng)
    if c.num_tiers == 2:
        assert c.page_tiers(seqs[0], 0) == [1, 1, 1, 1, 0]
    return c, seqs


@pytest.mark.parametrize("tier_set", list(TIER_SETS))
def test_page_transfer_round_trip(tier_set, rng):
    """export -> import into a fresh cache: the same pages in the same tiers, so read_layer and
    decode equal the source's bit for bit and the import re-exports the same bytes."""
    src, seqs = transfer_source(rng, tier_set=tier_set)
    before = src.report()
    buf = src.export_pages(seqs[0])
    assert isinstance(buf, bytes) and buf[:8] == b"TKVPAGES"
    assert src.report() == before  # the export changes nothing
    dst = make_cache((64, 4, 2, 16), tier_set)
    s = dst.import_pages(buf)
    assert dst.length(s) == 75
    for layer in range(2):
        assert dst.page_tiers(s, layer) == src.page_tiers(seqs[0], layer)
        ka, va = src.read_layer(seqs[0], layer)
        kb, vb = dst.read_layer(s, layer)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        q = torch.randn(1, 8, 64, generator=rng)
        oa, la = src.decode(layer, [seqs[0]], q)
        ob, lb = dst.decode(layer, [s], q)
        assert torch.equal(oa, ob) and torch.equal(la, lb)
    assert dst.export_pages(s) == buf
    # Both grow by the same token: still equal (the imported open page takes appends).
    k, v = torch.randn(2, 1, 4, 64, generator=rng), torch.randn(2, 1, 4, 64, generator=rng)
    src.append(seqs[0], k, v)
    dst.append(s, k, v)
    q = torch.randn(1, 8, 64, generator=rng)
    assert torch.equal(src.decode(1, [seqs[0]], q)[0], dst.decode(1, [s], q)[0])
    assert dst.export_pages(s) == src.export_pages(seqs[0])
    r = dst.report()
    assert r["reconciles"] and r["live_tokens"] == 76


def test_page_transfer_runs_heads_and_buffer_types(rng):
    src, seqs = transfer_source(rng)
    dst = make_cache((64, 4, 2, 16))
    # a sub-run: logical pages 1..3 (full) become a new sequence's pages 0..2
    part = src.export_pages(seqs[0], first=1, count=3)
    p = dst.import_pages(bytearray(part))
    assert dst.length(p) == 48 and dst.page_tiers(p, 0) == [1, 1, 1]
    for layer in range(2):
        ka, va = src.read_layer(seqs[0], layer, 16, 48)
        kb, vb = dst.read_layer(p, layer)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # the open last page alone, and an empty run
    tail = dst.import_pages(memoryview(src.export_pages(seqs[0], first=4)))
    assert dst.length(tail) == 11
    assert torch.equal(dst.read_layer(tail, 0)[0], src.read_layer(seqs[0], 0, 64, 11)[0])
    empty = dst.import_pages(src.export_pages(seqs[0], first=5))
    assert dst.length(empty) == 0
    # a head slice: KV head 0 of 4 into a one-KV-head cache of the same group size (global head 0
    # on both: the rotations agree), from a uint8 tensor
    one = make_cache((64, 1, 2, 16))
    sliced = src.export_pages(seqs[1], heads=(0, 1))
    h = one.import_pages(torch.frombuffer(bytearray(sliced), dtype=torch.uint8))
    for layer in range(2):
        ka, va = src.read_layer(seqs[1], layer)
        kb, vb = one.read_layer(h, layer)
        assert torch.equal(ka[:, :1], kb) and torch.equal(va[:, :1], vb)
    again = one.export_pages(h)  # the same bytes but the source's KV-head count (offset 44) and the checksum
    assert again[:44] == sliced[:44] and again[48:-8] == sliced[48:-8] and again[44] == 1 and sliced[44] == 4


def test_page_transfer_refusals_change_nothing(rng):
    src, seqs = transfer_source(rng)
    buf = src.export_pages(seqs[0])
    dst = make_cache((64, 4, 2, 16))
    resident, _ = fill(dst, [30], rng, retier_steps=0)
    before = dst.report()
    kv_before = dst.read_layer(resident[0], 1)
    flipped = bytearray(buf)
    flipped[len(buf) // 2] ^= 0x40
    damaged = {
        rf"buffer of {len(buf) - 100} bytes is truncated: total_bytes needs {len(buf)}": buf[:-100],
        r"buffer of 0 bytes is truncated: the header needs 88": b"",
        r"checksum 0x[0-9a-f]+ of the content != 0x[0-9a-f]+ stored": flipped,
        r"bad magic": b"X" + buf[1:],
        rf"header says {len(buf)} bytes, buffer has {len(buf) + 1}": buf + b"\0",
    }
    for msg, bad in damaged.items():
        with pytest.raises(ValueError, match=r"tierkv\.import_pages: corrupt_data: page transfer: " + msg):
            dst.import_pages(bad)
    assert dst.report() == before
    assert all(torch.equal(a, b) for a, b in zip(dst.read_layer(resident[0], 1), kv_before))
    # foreign buffers: each value named against this cache's
    foreign = {
        "buffer kv_heads = 4, this storage has 1": make_cache((64, 1, 2, 16)),
        "buffer num_layers = 2, this storage has 3": make_cache((64, 4, 2, 16), num_layers=3),
        r"tier 0 formats \(key \d+, value \d+\) != this storage's": make_cache((64, 4, 2, 16), "fp8+tq3"),
        "buffer num_tiers = 2, this storage has 1": make_cache((64, 4, 2, 16), "int8r only"),
        r"codec seed 0x0 != this storage's 0x7": make_cache((64, 4, 2, 16), codec_seed=7),
    }
    for msg, other in foreign.items():
        fresh = other.report()
        with pytest.raises(ValueError, match=msg + ".*nothing imported"):
            other.import_pages(buf)
        assert other.report() == fresh
    # too little room: the Stale pool short (4 of its pages per layer), no sequence slot
    small = make_cache((64, 4, 2, 16), pages_per_tier=[16, 6])
    with pytest.raises(RuntimeError, match="tier 1 pool has 6 free pages, the import needs 8"):
        small.import_pages(buf)
    full = make_cache((64, 4, 2, 16), max_sequences=1)
    full.create_sequence()
    with pytest.raises(RuntimeError, match="all 1 sequence slots are in use; nothing imported"):
        full.import_pages(buf)
    # export arguments, each named with its limit
    with pytest.raises(ValueError, match=r"first logical page = 6 is out of range \[0, 6\)"):
        src.export_pages(seqs[0], first=6)
    with pytest.raises(ValueError, match="export page count = 5 exceeds the limit 4"):
        src.export_pages(seqs[0], first=1, count=5)
    with pytest.raises(ValueError, match=r"head slice \[3, 5\) is not a non-empty part of the 4 KV heads"):
        src.export_pages(seqs[0], heads=(3, 2))
    with pytest.raises(ValueError, match="count = -1 is negative"):
        src.export_pages(seqs[0], count=-1)
    with pytest.raises(ValueError, match=r"heads must be None or \(begin, count\)"):
        src.export_pages(seqs[0], heads=2)
    src.reserve([seqs[1]], [3])
    with pytest.raises(ValueError, match="has 3 reserved tokens not committed"):
        src.export_pages(seqs[1])
    src.cancel([seqs[1]])
    src.release(seqs[1])
    with pytest.raises(ValueError, match="seq#"):
        src.export_pages(seqs[1])
    with pytest.raises(TypeError, match="bytes-like"):
        dst.import_pages("TKVPAGES")
    with pytest.raises(ValueError, match="uint8 CPU tensor"):
        dst.import_pages(torch.zeros(8))
    # a centred cache's pages carry means the binding cannot move: refused both ways
    centred = make_cache((64, 4, 2, 16), center=True)
    with pytest.raises(ValueError, match="center = true"):
        centred.import_pages(buf)
    c = centred.create_sequence()
    centred.append(c, torch.randn(2, 5, 4, 64, generator=rng), torch.randn(2, 5, 4, 64, generator=rng))
    with pytest.raises(ValueError, match="center = true.*nothing exported"):
        centred.export_pages(c)


def test_prefill_feeds_page_mass_to_the_policy(rng):
    # A run made only of prefill chunks (a perplexity pass) whose queries all look at page 2: the
    # page masses of each chunk reach the policy (its last row, as tiered_cache::prefill), so
    # page 2 becomes an Anchor and stays 8-bit while the other old pages go Stale (issue 57:
    # without them this path never made an Anchor by attention).
    c = make_cache((64, 4, 2, 16), "int8r+tq4k/tq3v", num_layers=1, recent_pages=1, sink_pages=0)
    u = torch.nn.functional.normalize(torch.randn(64, generator=rng), dim=0)
    s = c.create_sequence()
    K = torch.randn(1, 128, 4, 64, generator=rng)
    K[0, 32:48] += 8 * u  # page 2 (tokens 32..47), every KV head
    c.append(s, K, torch.randn(1, 128, 4, 64, generator=rng))
    indptr = torch.tensor([0, 16], dtype=torch.int32)
    for step in range(1, 5):
        c.reserve([s], [16])
        c.write(0, [s], torch.randn(16, 4, 64, generator=rng), torch.randn(16, 4, 64, generator=rng))
        c.prefill(0, [s], (8 * u).expand(16, 8, 64).contiguous(), indptr)
        c.commit([s])
        c.retier(step)
    tiers = c.page_tiers(s, 0)
    assert tiers[2] == 0, tiers  # attended: kept in tier 0
    assert tiers[4] == 1 and tiers[5] == 1, tiers  # old and unattended: Stale
