#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""SmolLM2-135M's needle suite on the GPU, every arm on the same items, with paired statistics.

The items are examples/smollm's RULER-style tasks (single, multi-key, multi-value, multi-query
needles, variable tracking, common-word extraction, questions about the haystack: tasks.hpp,
generated from a seed), written as token ids by the C++ engine, so the GPU run scores exactly the
prompts the CPU records scored:

    smollm tasks --items 50 --lengths 1024,2048,4096,8192 --no-ppl --arms "" --dump-items ITEMS.jsonl

run: SmolLM2 from the examples' GGUF (dequantized to float32 by transformers) on the GPU, each item
prefilled in the item's chunks and decoded greedily to a stop token or max_new, once per arm: dense
(transformers' own cache, SDPA) and tierkv arms through tierkv.transformers.TieredCache on the GPU
(tierkv.CudaCache: GPU prefill over mixed pages, decode, retier on the GPU). One JSON line per
(item, arm) is appended to --out; a run that stops (--time-limit) is resumed by running it again.
--device cpu runs the model and the tierkv arms' host cache (tierkv.Cache) on the CPU instead:
the same library code as the CPU engine's arms, under transformers' model and step order.

    python3 bench/gpu/needle_suite.py run --items ITEMS.jsonl --gguf MODEL.gguf --out RESULTS.jsonl
    python3 bench/gpu/needle_suite.py summarize RESULTS.jsonl [...] [--arms dense,rec,seed] --out quality.json
    python3 bench/gpu/needle_suite.py import-smollm TASKS.json [...] --arms dense,tiered_k4=rec --out RESULTS.jsonl

import-smollm: the CPU engine's records (`smollm tasks --out`, every arm on the same items) as
result lines, so that items scored on the CPU and on the GPU are summarized together (each item's
arms come from one engine; the lines name their device).

summarize: per (task, length), per length and over all items, each arm's accuracy (mean of the
fraction of answers found), the paired bootstrap 95% interval of (arm - dense) over the same items,
and the items dense answers wholly that the arm loses. The last line printed is the record's
{"name", "metrics"}.

Another model (Gemma 3): --retokenize builds each prompt from the item's text instead ("user", the
chat message, and "answer_prefix", which the engine writes beside the ids): the model's own chat
template (--template auto: the tokenizer's; gemma: Gemma's turn markers; plain: the text as is)
around "user", then the prefix, encoded by the model's tokenizer with its default leading special
tokens (Gemma's <bos>); the stop tokens become the model's end-of-sequence and end-of-turn ids. The
haystack was sized by SmolLM2's tokenizer, so "target" stays the nominal length and each result
records its own prompt_tokens.
"""

import argparse
import json
import os
import random
import sys
import time

# Arms: TieredCache keywords (formats, centring, policy knobs). "rec" is the recommended cache of
# docs/model.md (int8_rotated Recent/Anchor pages, TQ4 Stale keys, TQ3 Stale values) with the
# library's centring; "seed" the seed paper's FP8 + TQ3 pages, uncentred. --arm-file adds more.
ARMS = {
    "rec": dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", center=True),
    "rec_nocenter": dict(recent="int8_rotated", cache_type_k="tq4", cache_type_v="tq3", center=False),
    "seed": dict(recent="fp8", cache_type_k="tq3", cache_type_v="tq3", center=False),
    "int8r": dict(recent="int8_rotated", cache_type_k="int8_rotated", cache_type_v="int8_rotated", center=False),
}


def load_arm_file(path):
    """Adds the arms of a JSON file {name: TieredCache keywords} (e.g. bench/gpu/arms/cold-sweep.json:
    Cold tier sets and policy knobs) to ARMS; a name already taken is refused."""
    import json

    with open(path) as f:
        arms = json.load(f)
    for name, kw in arms.items():
        if name in ARMS or name == "dense" or name.endswith(SDPA_SUFFIX) or not isinstance(kw, dict):
            sys.exit(f"{path}: arm {name!r}: a new name (not dense, {', '.join(ARMS)}, or *{SDPA_SUFFIX}) with a dict of TieredCache keywords")
        ARMS[name] = kw


# end-of-turn tokens by name (Gemma, SmolLM2/ChatML, Llama 3): the ones the vocabulary holds stop decoding
STOP_NAMES = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")
TEMPLATES = {
    "gemma": "<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n",
    "plain": "{user}\n",
}


def retokenize(item, tok, template="auto"):
    """The item's prompt in tok's ids: the chat template around item["user"], then
    item["answer_prefix"]; tok's default leading special tokens (e.g. <bos>) once at the start."""
    if "user" not in item or "answer_prefix" not in item:
        raise ValueError("needle_suite: --retokenize needs items with \"user\" and \"answer_prefix\" (smollm tasks --dump-items writes them)")
    if template == "auto":
        if not getattr(tok, "chat_template", None):
            raise ValueError("needle_suite: the tokenizer has no chat template; pass --template gemma or plain")
        text = tok.apply_chat_template([{"role": "user", "content": item["user"]}], add_generation_prompt=True, tokenize=False)
    else:
        text = TEMPLATES[template].format(user=item["user"])
    lead = list(tok("", add_special_tokens=True)["input_ids"])  # e.g. [<bos>]; [] for SmolLM2
    ids = list(tok(text + item["answer_prefix"], add_special_tokens=False)["input_ids"])
    if lead and ids[: len(lead)] != lead:  # a template that writes <bos> itself keeps one
        ids = lead + ids
    return ids


def stop_ids(tok):
    """The model's end-of-sequence id and the end-of-turn ids its vocabulary holds."""
    vocab = tok.get_vocab()
    ids = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    return ids | {int(vocab[n]) for n in STOP_NAMES if n in vocab}


def log(*a):
    print(*a, flush=True)


def item_key(r):
    return (r["task"], int(r["target"]), int(r["index"]))


def score(answers, text):
    """The fraction of the answers that appear in the output, ignoring ASCII case (tasks.hpp's
    niah_score)."""
    low = text.translate(_ASCII_LOWER)
    return sum(1 for a in answers if a.translate(_ASCII_LOWER) in low) / len(answers)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


# ---- run (needs torch, transformers and a CUDA device, or --device cpu) --------------------


def generate(model, prompt, chunk, max_new, stop, cache, done=None):
    """Chunked prefill, then greedy decoding to a stop token, max_new tokens or done(tokens) (every
    answer already in the output: the score cannot change after); returns (tokens without the
    stop, prefill s, decode s)."""
    import torch

    dev = model.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ids = torch.tensor(prompt, dtype=torch.long, device=dev)
    sync()
    t0 = time.perf_counter()
    for start in range(0, ids.numel(), chunk):
        x = ids[start : start + chunk].view(1, -1)
        pos = torch.arange(start, start + x.shape[1], device=dev).view(1, -1)
        logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits[0, -1]
    sync()
    t1 = time.perf_counter()
    out, p = [], ids.numel()
    tok = int(logits.argmax())
    while tok not in stop and len(out) < max_new:
        out.append(tok)
        if done is not None and done(out):
            break
        x = torch.tensor([[tok]], device=dev)
        logits = model(input_ids=x, position_ids=torch.tensor([[p]], device=dev), past_key_values=cache, use_cache=True).logits[0, -1]
        p += 1
        tok = int(logits.argmax())
    sync()
    return out, t1 - t0, time.perf_counter() - t1


# An arm name ending in SDPA_SUFFIX keeps the model's own attention (SDPA) over the pages the
# cache decodes back to dense K/V: no tierkv attention runs, so no page mass reaches the policy.
SDPA_SUFFIX = "_sdpa"


def parse_arms(spec, prog):
    """The arms of a comma-separated list; exits naming an unknown one."""
    arms = spec.split(",")
    for arm in arms:
        base = arm[: -len(SDPA_SUFFIX)] if arm.endswith(SDPA_SUFFIX) else arm
        if arm != "dense" and base not in ARMS:
            sys.exit(f"{prog}: unknown arm {arm!r} (dense, {', '.join(ARMS)}, each also as NAME{SDPA_SUFFIX})")
    return arms


def load_tokenizer(gguf, tokenizer=None):
    """The GGUF's tokenizer, or one saved by save_pretrained() (tokenizer: its folder;
    transformers 5.17 builds Gemma 3's from the GGUF wrongly: 2.4x the tokens of 5.25's)."""
    from transformers import AutoTokenizer

    d, name = os.path.split(os.path.abspath(gguf))
    return AutoTokenizer.from_pretrained(tokenizer) if tokenizer else AutoTokenizer.from_pretrained(d, gguf_file=name)


def load_model(gguf, device="cuda"):
    """The GGUF's model on `device` (the GPU by default), dequantized to float32 by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(os.path.abspath(gguf))
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).to(device).eval()


def make_cache(model, arm, max_tokens, step_tokens, codec_seed, device="cuda", **cache_kw):
    """One sequence's cache for arm: transformers' own (SDPA) for dense, else a TieredCache on
    `device` (tierkv.CudaCache on the GPU, tierkv.Cache on the CPU; cache_kw passes through);
    sets the model's attention to match."""
    from transformers import DynamicCache

    import tierkv  # noqa: F401  (registers the "tierkv" attention)
    from tierkv.transformers import TieredCache

    if arm == "dense":
        model.config._attn_implementation = "sdpa"
        return DynamicCache(config=model.config)
    sdpa = arm.endswith(SDPA_SUFFIX)
    kw = ARMS[arm[: -len(SDPA_SUFFIX)] if sdpa else arm]
    model.config._attn_implementation = "sdpa" if sdpa else "tierkv"
    gpu = dict(max_step_tokens=step_tokens) if str(device).startswith("cuda") else {}  # the GPU's step workspace
    return TieredCache(model.config, device=device, max_tokens=max_tokens, max_sequences=1, max_batch=1,
                       codec_seed=codec_seed, **kw, **gpu, **cache_kw)  # fmt: skip


def finish(cache, layers):
    """A TieredCache's (bits per scalar, tiers its pages ended in) once its last step is closed
    and every planned conversion finished and published: end_step publishes a batch only once
    the side stream is done with it, so without the drain they would depend on timing."""
    cache.end_step()
    if cache.on_gpu:  # the host cache's steps are synchronous
        cache.tierkv.drain()
    seq = int(cache.seqs[0])
    tiers = sorted({t for layer in range(layers) for t in cache.tierkv.page_tiers(seq, layer)})
    return cache.tierkv.report()["bits_per_scalar"], tiers


def run(a):
    import torch

    start = time.perf_counter()
    arms = parse_arms(a.arms, "needle_suite")
    items = [json.loads(line) for line in open(a.items)]
    items = [d for d in items if d.get("kind") == "niah"]
    if a.lengths:
        keep = {int(x) for x in a.lengths.split(",")}
        items = [d for d in items if int(d["target"]) in keep]
    if a.tasks:
        items = [d for d in items if d["task"] in a.tasks.split(",")]
    # item by item index first: a run cut short covers every (task, length) alike
    items.sort(key=lambda d: (int(d["index"]), int(d["target"]), d["task"]))
    done = set()
    if os.path.exists(a.out):
        for line in open(a.out):
            r = json.loads(line)
            done.add((r["arm"], *item_key(r)))
    todo = [(d, arm) for d in items for arm in arms if (arm, *item_key(d)) not in done]
    log(f"needle_suite: {len(items)} items x {len(arms)} arms, {len(done)} done, {len(todo)} to run")
    if not todo:
        return
    name = os.path.basename(a.gguf)
    tok = load_tokenizer(a.gguf, a.tokenizer)
    if a.retokenize:
        stops = stop_ids(tok)
        for it in items:
            it["prompt"], it["stop"] = retokenize(it, tok, a.template), sorted(stops)
        lens = [len(it["prompt"]) for it in items]
        log(f"needle_suite: re-tokenized ({a.template}): prompts of {min(lens)}-{max(lens)} tokens, stop {sorted(stops)}")
    model = load_model(a.gguf, a.device)
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else a.device_name
    commit = os.environ.get("TIERKV_COMMIT", "unknown")
    ran = 0
    with open(a.out, "a") as out, torch.inference_mode():
        for it, arm in todo:
            if time.perf_counter() - start > a.time_limit:
                log(f"needle_suite: time limit ({a.time_limit:.0f} s) reached after {ran} runs; run again to resume")
                break
            prompt, chunk, max_new = it["prompt"], int(it["chunk"]), int(it["max_new"])
            stop = set(int(s) for s in it["stop"])
            cache = make_cache(model, arm, len(prompt) + max_new + 16, chunk, a.codec_seed, a.device)
            found = lambda t, ans=it["answers"]: score(ans, tok.decode(t, skip_special_tokens=True)) == 1.0  # noqa: E731
            toks, pre_s, dec_s = generate(model, prompt, chunk, max_new, stop, cache, found)
            bits, tiers = (16.0, [0]) if arm == "dense" else finish(cache, model.config.num_hidden_layers)
            text = tok.decode(toks, skip_special_tokens=True)
            sc = score(it["answers"], text)
            r = dict(arm=arm, task=it["task"], target=int(it["target"]), index=int(it["index"]),
                     prompt_tokens=len(prompt), answers=it["answers"], score=sc, output=text, tokens=toks,
                     bits_per_scalar=bits, tiers=tiers, prefill_s=pre_s, decode_s=dec_s, device=device,
                     commit=commit, date=time.strftime("%Y-%m-%d"), model=name)  # fmt: skip
            out.write(json.dumps(r) + "\n")
            out.flush()
            del cache
            ran += 1
            if ran % 25 == 0 or a.verbose:
                shown = text.replace("\n", " ")[:50]
                log(f"{ran:5d}/{len(todo)} {arm:12s} {it['task']:10s} {it['target']:5d} {it['index']:3d} "
                    f"{sc:.2f} {bits:5.2f} bits  {pre_s:.2f}+{dec_s:.2f} s  {shown}")  # fmt: skip
    log(f"needle_suite: {ran} runs in {time.perf_counter() - start:.0f} s")


# ---- summarize (pure Python: runs anywhere) --------------------------------------------------


def load_results(paths):
    """{arm: {item key: result}} over every file; a later line for the same (arm, item) wins."""
    by_arm = {}
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            by_arm.setdefault(r["arm"], {})[item_key(r)] = r
    return by_arm


def paired(dense, arm, keys, boot, rng):
    """Mean of (arm - dense) over keys, its paired bootstrap 95% interval (items resampled with
    replacement), the items dense answers wholly that the arm does not, and the reverse."""
    diffs = [arm[k]["score"] - dense[k]["score"] for k in keys]
    n = len(diffs)
    mean = sum(diffs) / n
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(boot))
    lo, hi = means[int(0.025 * (boot - 1))], means[int(0.975 * (boot - 1))]
    lost = sum(1 for k in keys if dense[k]["score"] == 1.0 and arm[k]["score"] < 1.0)
    gained = sum(1 for k in keys if dense[k]["score"] < 1.0 and arm[k]["score"] == 1.0)
    return dict(delta=mean, ci_low=lo, ci_high=hi, lost=lost, gained=gained)


def summarize_results(by_arm, boot=2000, seed=25):
    """Tables per (task, length), per length and overall: accuracy per arm and each tierkv arm
    against dense, over the items every arm has scored."""
    if "dense" not in by_arm:
        raise ValueError("needle_suite: no dense results to compare with")
    arms = ["dense"] + sorted(a for a in by_arm if a != "dense")
    keys = sorted(set.intersection(*(set(by_arm[a]) for a in arms)))
    if not keys:
        raise ValueError("needle_suite: no item is scored by every arm")
    rng = random.Random(seed)
    groups = {}
    for k in keys:
        task, target, _ = k
        for g in ((task, target), ("all", target), ("all", 0)):
            groups.setdefault(g, []).append(k)
    rows = []
    for (task, target), ks in sorted(groups.items(), key=lambda x: (x[0][1] == 0, x[0][1], x[0][0])):
        row = dict(task=task, length=target or "all", items=len(ks))
        for a in arms:
            row[f"acc_{a}"] = sum(by_arm[a][k]["score"] for k in ks) / len(ks)
            row[f"bits_{a}"] = sum(by_arm[a][k].get("bits_per_scalar", 16.0) for k in ks) / len(ks)
        for a in arms[1:]:
            for name, v in paired(by_arm["dense"], by_arm[a], ks, boot, rng).items():
                row[f"{name}_{a}"] = v
        rows.append(row)
    return arms, keys, rows


def from_smollm(path, names, device, commit, model="SmolLM2-135M-Instruct.Q4_1.gguf"):
    """A `smollm tasks --out` record (examples/smollm, the CPU engine) as result lines: one per
    (item, arm), each arm named by names ({engine arm: name}; arms not in it are left out)."""
    rec = json.load(open(path))
    lines = []
    for arm, res in rec["arms"].items():
        if arm not in names:
            continue
        for it in res.get("items", []):
            lines.append(dict(arm=names[arm], task=it["task"], target=int(it["target"]), index=int(it["index"]),
                              prompt_tokens=it["prompt_tokens"], score=float(it["score"]), output=it["output"],
                              tokens=it["tokens"], bits_per_scalar=it["bits_per_scalar"],
                              prefill_s=it["prefill_s"], decode_s=it["decode_s"], device=device, commit=commit,
                              date=time.strftime("%Y-%m-%d"), model=model))  # fmt: skip
    return lines


def import_smollm(a):
    names = dict(x.split("=", 1) if "=" in x else (x, x) for x in a.arms.split(","))
    with open(a.out, "a") as out:
        for path in a.records:
            for line in from_smollm(path, names, a.device, a.commit):
                out.write(json.dumps(line) + "\n")


def summarize(a):
    by_arm = load_results(a.results)
    if a.arms:  # the arms every item must have (the others are left out)
        keep = a.arms.split(",")
        by_arm = {k: v for k, v in by_arm.items() if k in keep}
    arms, keys, rows = summarize_results(by_arm, a.boot, a.seed)
    log(f"{len(keys)} items scored by every arm ({', '.join(arms)}); [lo, hi]: paired bootstrap 95% of arm - dense")
    head = f"{'task':10s} {'len':>5s} {'n':>4s} " + " ".join(f"{x:>22s}" for x in arms)
    log(head)
    for r in rows:
        cells = [f"{r['acc_dense']:22.3f}"]
        for x in arms[1:]:
            cells.append(f"{r[f'acc_{x}']:.3f} [{r[f'ci_low_{x}']:+.3f},{r[f'ci_high_{x}']:+.3f}] -{r[f'lost_{x}']}".rjust(22))
        log(f"{r['task']:10s} {str(r['length']):>5s} {r['items']:4d} " + " ".join(cells))
    overall = rows[-1]
    metrics = {"items_scored": len(keys)}
    for x in arms[1:]:
        metrics[f"items_lost_{x}"] = overall[f"lost_{x}"]
        metrics[f"items_gained_{x}"] = overall[f"gained_{x}"]
        metrics[f"acc_delta_{x}"] = overall[f"delta_{x}"]
        metrics[f"acc_delta_{x}_ci_low"] = overall[f"ci_low_{x}"]
        metrics[f"acc_delta_{x}_ci_high"] = overall[f"ci_high_{x}"]
        metrics[f"needle_bits_per_scalar_{x}"] = overall[f"bits_{x}"]
    metrics["acc_dense"] = overall["acc_dense"]
    if a.ppl_record:  # perplexity over several texts (scripts/measure ppl-texts)
        ppl = json.load(open(a.ppl_record))["metrics"]
        for k in ("ppl_rel_rec_pooled", "ppl_rel_rec_ci_high", "bits_per_scalar_rec",
                  "ppl_rel_seed_pooled", "ppl_rel_seed_ci_high", "bits_per_scalar_seed"):  # fmt: skip
            metrics[k] = ppl.get(k)
    first = next(iter(by_arm["dense"].values()))
    seen = lambda field, default="": sorted({r.get(field, default) for arm in by_arm.values() for r in arm.values()})  # noqa: E731
    rec = dict(name="quality", date=time.strftime("%Y-%m-%d"), commit=a.commit or first.get("commit", "unknown"),
               device="; ".join(seen("device")), model="; ".join(seen("model", "SmolLM2-135M-Instruct.Q4_1.gguf")),
               command=a.command, results=a.results, ppl_record=a.ppl_record, arms={x: ARMS.get(x, "transformers DynamicCache, SDPA") for x in arms},
               bootstrap=dict(resamples=a.boot, seed=a.seed, level=0.95), rows=rows, metrics=metrics)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
    print(json.dumps({"name": "quality", "metrics": metrics}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--items", required=True)
    r.add_argument("--gguf", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--arms", default="dense,rec,seed")
    r.add_argument("--arm-file", action="append", help="JSON {arm: TieredCache keywords} adding arms (bench/gpu/arms/)")
    r.add_argument("--lengths", default="", help="comma-separated targets to run (default: all)")
    r.add_argument("--tasks", default="", help="comma-separated tasks to run (default: all)")
    r.add_argument("--codec-seed", type=int, default=0)
    r.add_argument("--retokenize", action="store_true", help="prompts from the items' text, the model's tokenizer and stops")
    r.add_argument("--template", default="auto", choices=["auto", *TEMPLATES], help="chat template with --retokenize")
    r.add_argument("--time-limit", type=float, default=1e9, help="seconds; stop between items after this")
    r.add_argument("--verbose", action="store_true")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the model and tierkv's host Cache (tierkv.Cache) on the CPU")
    r.add_argument("--device-name", default="CPU (python/ tierkv.Cache, transformers)", help="the records' device with --device cpu")
    r.add_argument("--tokenizer", help="a folder from tokenizer.save_pretrained() instead of the GGUF's tokenizer")
    s = sub.add_parser("summarize")
    s.add_argument("results", nargs="+")
    s.add_argument("--out", default="")
    s.add_argument("--ppl-record", default="")
    s.add_argument("--commit", default="")
    s.add_argument("--command", default="")
    s.add_argument("--boot", type=int, default=2000)
    s.add_argument("--seed", type=int, default=25)
    s.add_argument("--arms", default="", help="comma-separated arms to compare (default: every arm in the files)")
    s.add_argument("--arm-file", action="append", help="as run's: the record names these arms' keywords")
    i = sub.add_parser("import-smollm", help="examples/smollm `tasks --out` records as result lines")
    i.add_argument("records", nargs="+")
    i.add_argument("--out", required=True, help="result lines are appended here")
    i.add_argument("--arms", default="dense,rec,seed", help="engine arms to take, each ARM or ARM=NAME")
    i.add_argument("--device", default="CPU (examples/smollm)")
    i.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    for path in getattr(a, "arm_file", None) or []:
        load_arm_file(path)
    {"run": run, "summarize": summarize, "import-smollm": import_smollm}[a.cmd](a)


if __name__ == "__main__":
    main()
