# SPDX-License-Identifier: Apache-2.0
"""TieredCache in model.generate: tiny random-weight Llama and Qwen3 models on the CPU."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import tierkv  # noqa: E402
from conftest import page_bits  # noqa: E402
from tierkv.transformers import TieredCache  # noqa: E402

PROMPT_LEN, NEW = 40, 24


def tiny(kind, attn):
    common = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=512,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common))
    else:
        m = Qwen3ForCausalLM(Qwen3Config(**common))
    return m.eval()


def greedy(model, ids, cache):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1)


def tiered(model, **kw):
    # 8-bit only, every layer's pages int8_rotated: the closest tierkv cache to dense
    kw.setdefault("recent", "int8_rotated")
    kw.setdefault("cache_type_k", "int8_rotated")
    kw.setdefault("cache_type_v", "int8_rotated")
    return TieredCache(model.config, max_tokens=512, threads=2, **kw)


def teacher_forced_logits(model, ids, tokens):
    """Dense logits predicting each of `tokens` after `ids` (one forward pass over both)."""
    with torch.no_grad():
        full = torch.cat([ids, tokens], 1)
        return model(full, attention_mask=torch.ones_like(full)).logits[:, ids.shape[1] - 1 : -1]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["tierkv", "sdpa"])
def test_generate_matches_dynamic_cache(kind, attn):
    """Greedy decoding through an 8-bit-only TieredCache on a batch of two prompts, checked
    against the dense model teacher-forced on the same tokens: logits agree to 8-bit-cache
    precision, and every token is the dense argmax or within a tie of it (a random-weight model
    has near-flat logits: a 5e-4 margin flips under any 8-bit cache, so exact equality of free
    generations would test the seed, not the cache)."""
    ref_model = tiny(kind, "sdpa")
    model = tiny(kind, attn)
    ids = torch.randint(1, 256, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    # centred (TieredCache's default) and not: both within the 8-bit bound
    for center in (True, False):
        cache = tiered(model, center=center)
        tokens, logits = greedy(model, ids, cache)
        ref = teacher_forced_logits(ref_model, ids, tokens)
        rel = float((logits - ref).norm() / ref.norm())
        assert 0 < rel < 1e-2, (center, rel)  # lossy (int8 codes), yet close
        gap = ref.max(-1).values - ref.gather(-1, tokens[..., None])[..., 0]  # 0 where argmax
        assert float(gap.max()) < 1e-2, (center, gap)
    # token for token against dense, uncentred only: one near-tie flipping under other rounding
    # changes the rest of a row (centred, llama's second row flips at token 6 of 24)
    ref_tokens, _ = greedy(ref_model, ids, DynamicCache(config=ref_model.config))
    assert float((tokens == ref_tokens).float().mean()) >= 0.9
    assert cache.get_seq_length() == PROMPT_LEN + NEW - 1  # the last token is never fed back
    assert cache.tierkv.report()["live_tokens"] == 2 * (PROMPT_LEN + NEW - 1)


def test_generate_through_tiered_pages():
    """int8_rotated + TQ4/TQ3 Stale pages: generation runs over mixed pages (some pages move to
    the Stale tier) and stays close to dense; the measured agreement is asserted as a floor."""
    ref_model = tiny("qwen3", "sdpa")
    model = tiny("qwen3", "tierkv")
    ids = torch.randint(1, 256, (1, 96), generator=torch.Generator().manual_seed(8))
    ref_tokens, ref_logits = greedy(ref_model, ids, DynamicCache(config=ref_model.config))
    cache = TieredCache(
        model.config,
        max_tokens=512,
        threads=2,
        recent_pages=2,
        keep_first_layers=0,
        keep_last_layers=0,
        min_dwell_steps=0,
    )
    tokens, logits = greedy(model, ids, cache)
    stale = cache.tierkv.report()["tiers"][1]["live_pages"]
    assert stale > 0
    rel = float((logits - ref_logits).norm() / ref_logits.norm())
    assert rel < 0.2, rel
    agree = float((tokens == ref_tokens).float().mean())
    assert agree >= 0.5, agree


def windowed(kind, attn):
    """A tiny model whose layers 0 and 2 attend a 24-token sliding window (Qwen3 with
    layer_types; Gemma 2, which also soft-caps its attention logits at 50 and scales them by
    query_pre_attn_scalar; Gemma 3, which normalises queries and keys (QK-norm) and ropes its
    sliding and full layers at different bases, as Gemma 3 270M does)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=512, sliding_window=24,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"], attn_implementation=attn)  # fmt: skip
    torch.manual_seed(0)
    if kind == "gemma2":
        return Gemma2ForCausalLM(Gemma2Config(query_pre_attn_scalar=48, **common)).eval()
    if kind == "gemma3":
        return Gemma3ForCausalLM(Gemma3TextConfig(query_pre_attn_scalar=48, **common)).eval()
    return Qwen3ForCausalLM(Qwen3Config(use_sliding_window=True, max_window_layers=0, **common)).eval()


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "gemma3"])
def test_sliding_windows_and_soft_cap(kind):
    """Sliding-window layers (and Gemma 2's soft-capped, query_pre_attn_scalar-scaled logits)
    through an 8-bit-only TieredCache on a 40-token prompt (longer than the window), checked as
    test_generate_matches_dynamic_cache checks full attention. Attending every position instead
    of the window moves these logits by far more than the bound."""
    ref_model = windowed(kind, "eager")
    model = windowed(kind, "tierkv")
    ids = torch.randint(1, 256, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(9))
    cache = tiered(model)
    # centring by default, except under a soft-cap (which centring refuses)
    assert cache.tierkv.center == (kind != "gemma2")
    if kind == "gemma2":
        assert cache.soft_cap == 50.0 and abs(cache.scale - 48**-0.5) < 1e-9
    if kind == "gemma3":  # no attention soft-cap; the scale is query_pre_attn_scalar's
        assert cache.soft_cap == 0.0 and abs(cache.scale - 48**-0.5) < 1e-9
    tokens, logits = greedy(model, ids, cache)
    ref = teacher_forced_logits(ref_model, ids, tokens)
    rel = float((logits - ref).norm() / ref.norm())
    # Gemma 3's tiny model: its QK-normed keys meet the int8 pages' error at 1.2e-2 (the same
    # with eager attention over the decoded pages, below)
    assert 0 < rel < (2e-2 if kind == "gemma3" else 1e-2), rel
    gap = ref.max(-1).values - ref.gather(-1, tokens[..., None])[..., 0]
    assert float(gap.max()) < 1e-2, gap
    # the same tokens through eager attention over the same cache's decoded pages: the window,
    # scale and soft-cap of tierkv's attention against transformers' own, the page error aside
    eager = windowed(kind, "eager")
    _, twin = greedy(eager, ids, tiered(eager))
    assert float((logits - twin).norm() / twin.norm()) < 1e-3


def test_tierkv_attention_without_tiered_cache_is_refused():
    model = tiny("llama", "tierkv")
    with pytest.raises(RuntimeError, match="TieredCache"):
        model(torch.randint(1, 256, (1, 5)), past_key_values=DynamicCache(config=model.config))


def test_geometry_not_built_is_refused():
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=3, num_key_value_heads=3, head_dim=32, num_hidden_layers=1)
    with pytest.raises(ValueError, match="no prebuilt tierkv cache"):
        TieredCache(cfg)


def test_sync_retier_is_for_the_gpu_cache():
    # the host path's step is synchronous already: asking for it there is a mistake, said so
    with pytest.raises(ValueError, match="sync_retier"):
        tiered(tiny("llama", "tierkv"), sync_retier=True)

RECOMMENDED = dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3")
EIGHT_BIT = dict(recent="int8_rotated", cache_type_k="int8_rotated", cache_type_v="int8_rotated")
# pages leave tier 0 as soon as they are out of the recent window (the tests' short runs)
EAGER_POLICY = dict(recent_pages=2, keep_first_layers=0, keep_last_layers=0, min_dwell_steps=0)


def counting_retier(cache):
    """Sums what the cache's own retier op returns, beside TieredCache's bookkeeping."""
    seen = dict.fromkeys(tierkv.RETIER_FIELDS, 0)
    retier = cache.tierkv.retier

    def wrapped(step):
        stats = retier(step)
        for k, v in stats.items():
            seen[k] += v
        return stats

    cache.tierkv.retier = wrapped
    return seen


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("tiers", ["8-bit", "recommended"])
def test_max_tokens_is_the_limit_in_every_tier_set(tiers, batch):
    """A run longer than max_tokens (the batch's tokens together) fails at the first step past
    it with an error naming max_tokens and the size needed, whatever the tier set: before, an
    8-bit-only cache failed later with "block table has 0 free entries" and a tiered one ran on,
    holding back demotions once its Stale pool was full. Up to the limit no demotion is held
    back."""
    model = tiny("llama", "tierkv")
    ids = torch.randint(1, 256, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(10))
    limit = batch * (PROMPT_LEN + 12)
    formats = EIGHT_BIT if tiers == "8-bit" else RECOMMENDED
    cache = TieredCache(model.config, max_tokens=limit, threads=2, **formats, **EAGER_POLICY)
    need = limit + batch
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError) as err:
        warnings.simplefilter("always")
        greedy(model, ids, cache)
    assert not [w for w in caught if "TieredCache" in str(w.message)]  # nothing held back
    assert str(err.value) == (
        f"TieredCache: {need} tokens needed ({limit} held + {batch} x 1 new), max_tokens={limit}; "
        f"pass max_tokens>={need} (the tokens of every sequence of the batch together)"
    )
    assert cache.get_seq_length() == PROMPT_LEN + 12  # the refused step changed nothing
    assert cache.max_tokens == limit
    assert cache.tierkv.report()["live_tokens"] == limit
    stats = cache.retier_stats()
    assert stats["deferred_full"] == 0
    if tiers == "recommended":  # pages did move to the Stale tier before the limit
        assert stats["demoted"] > 0
        assert any(1 in cache.tierkv.page_tiers(s, layer) for s in cache.seqs.tolist() for layer in range(3))
    assert cache.bits_per_scalar() == pytest.approx(page_bits(cache), rel=1e-12)


def test_pools_too_small_name_pages_per_tier():
    """A cache sized by pages_per_tier (3 pages per layer: 48 tokens) that runs out of pages
    says so, naming them, not only the library's "block table has 0 free entries"."""
    model = tiny("llama", "tierkv")
    ids = torch.randint(1, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(11))
    cache = TieredCache(model.config, pages_per_tier=[9], threads=2, **EIGHT_BIT)
    with pytest.raises(RuntimeError, match=r"^TieredCache: no room for 1 x 1 new tokens \(48 held\): the pools "
                       r"hold pages_per_tier=\[9\] pages .*capacity_exhausted"):  # fmt: skip
        greedy(model, ids, cache)
    assert cache.get_seq_length() == 48
    assert cache.max_tokens is None  # no default max_tokens beside the caller's pages


def run_with_stale_pool(stale_pages):
    """The recommended cache over a 96-token prompt and 24 greedy tokens, its Stale pool
    stale_pages pages (one layer each): the cache, TieredCache's warnings, and the sums of what
    the retier op returned."""
    model = tiny("qwen3", "tierkv")
    ids = torch.randint(1, 256, (1, 96), generator=torch.Generator().manual_seed(12))
    cache = TieredCache(model.config, pages_per_tier=[64 * 3, stale_pages], threads=2, **RECOMMENDED, **EAGER_POLICY)
    seen = counting_retier(cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        greedy(model, ids, cache)
    return cache, [w for w in caught if "TieredCache" in str(w.message)], seen


def test_held_back_demotions_warn_once():
    """A Stale pool too small for the run (2 pages per layer; the policy wants ~5 of each
    layer's 8 pages there) holds demotions back: TieredCache warns once, naming the counter and
    the pools, and the run ends at more bits per scalar than the same run with room. With room
    nothing warns. retier_stats() equals the sums of the retier op's returns, bits_per_scalar()
    the bits counted page by page."""
    full, warned, seen = run_with_stale_pool(2 * 3)
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert warned[0].category is RuntimeWarning
    msg = str(warned[0].message)
    assert "retier_stats()['deferred_full']" in msg and "pages_per_tier=[192, 6]" in msg, msg
    stats = full.retier_stats()
    assert stats == seen and stats["deferred_full"] > 0
    roomy, quiet, roomy_seen = run_with_stale_pool(64 * 3)
    assert quiet == []
    assert roomy.retier_stats() == roomy_seen and roomy_seen["deferred_full"] == 0
    for c in (full, roomy):
        assert c.bits_per_scalar() == pytest.approx(page_bits(c), rel=1e-12)
    assert roomy.retier_stats()["demoted"] > stats["demoted"]
    assert full.bits_per_scalar() > roomy.bits_per_scalar() + 0.5, (full.bits_per_scalar(), roomy.bits_per_scalar())


def test_bits_per_scalar_of_an_8_bit_cache():
    """An 8-bit-only cache stores int8 codes plus per-vector metadata: a little over 8 bits per
    scalar, and the same figure counted page by page."""
    model = tiny("llama", "sdpa")
    ids = torch.randint(1, 256, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(13))
    cache = tiered(model)
    greedy(model, ids, cache)
    bits = cache.bits_per_scalar()
    assert 8.0 < bits < 9.5, bits
    assert bits == pytest.approx(page_bits(cache), rel=1e-12)


def test_end_step_runs_the_steps_retier_on_the_host():
    """end_step() ends the step as on the GPU: the host cache's retier for that step runs then
    (once: the next step's begin does not run it again), so what a run reports after its last
    end_step (bits per scalar, tiers) is after its last retier. Before, the host's last step
    waited for a next begin that never came: SmolLM2's 8K perplexity runs reported 4.72 bits
    per scalar on the host against 4.49 on the GPU and in the C++ engine for the same tiers."""
    model = tiny("qwen3", "tierkv")
    ids = torch.randint(1, 256, (1, 96), generator=torch.Generator().manual_seed(14))
    cache = TieredCache(model.config, max_tokens=256, threads=2, **RECOMMENDED, **EAGER_POLICY)
    seen = counting_retier(cache)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)  # one prefill step: six pages a layer
    before = cache.bits_per_scalar()
    assert seen["planned"] == 0  # the step is still open
    cache.end_step()
    assert seen["demoted"] > 0 and cache.bits_per_scalar() < before - 1.0, (before, cache.bits_per_scalar())
    planned = seen["planned"]
    cache.end_step()  # ending it again runs nothing
    with torch.no_grad():
        model(input_ids=ids[:, -1:], past_key_values=cache)  # the next step's begin: no second retier
    assert seen["planned"] == planned
    assert cache.retier_stats() == seen
