#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A GGUF model in transformers (float32: the engine of needle_suite.py and ppl_suite.py) against
llama.cpp (llama-cpp-python) on the same GGUF and the same token ids: the golden test of the
Gemma 3 270M path (K-quant dequantization, sliding-window layers, its norms and scales), with
transformers' own cache and with tierkv's caches. Runs on the CPU (or --device cuda).

  reference --gguf MODEL.gguf --out GOLDEN.json [--text FILE] [--tokens 1200]
      llama.cpp with an f32 KV cache and flash attention off: the prompt's ids (<bos> + the text,
      cut to --tokens), the log-probabilities of its top 20 tokens at positions before, at and
      after the 512-token sliding window, and its 32 greedy tokens. The same measured for
      llama.cpp against itself (f16 KV cache, flash attention on) gives the noise floor.
  check --gguf MODEL.gguf --golden GOLDEN.json [--arms dense,int8r,rec,seed] [--out RESULT.json]
      transformers on the golden ids, prefilled in chunks of 512 with each arm's cache (dense:
      transformers' DynamicCache and SDPA; the others tierkv.transformers.TieredCache): per
      position the largest |log p - log p_llama.cpp| over llama.cpp's top 20 and whether the top
      token agrees; then llama.cpp's 32 greedy tokens teacher-forced, counting the steps whose
      argmax is llama.cpp's next token. The last line printed is the JSON summary.
"""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from needle_suite import load_model, make_cache, parse_arms  # noqa: E402

TOP = 20
GREEDY = 32
CHUNK = 512


def positions_of(n):
    """Positions whose next-token distribution is compared: the start, both sides of the
    512-token sliding window, and the end."""
    return sorted({p for p in (0, 5, 100, 510, 511, 512, 513, 700, 1000, n // 2, n - 1) if 0 <= p < n})


def log_softmax(row):
    import numpy as np

    row = np.asarray(row, dtype=np.float64)
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum()))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


# ---- llama.cpp -----------------------------------------------------------------------------


def llama(gguf, kv, flash, threads):
    import llama_cpp

    types = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}
    return llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=threads,
                           n_threads_batch=threads, logits_all=False, flash_attn=flash, type_k=types[kv],
                           type_v=types[kv], verbose=False, seed=0)  # fmt: skip


def llama_rows(llm, ids, positions):
    """{position: log-probabilities of the next token} after evaluating ids[: position + 1],
    the prompt split at each position (only the last row of an eval is kept)."""
    import numpy as np

    llm.reset()
    rows, start = {}, 0
    for p in positions:
        llm.eval(ids[start : p + 1])
        start = p + 1
        rows[p] = log_softmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm._n_vocab,)).copy())
    return rows


def llama_greedy(llm, ids):
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out = []
    for i in range(GREEDY):
        out.append(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm._n_vocab,)))))
        if i + 1 < GREEDY:
            llm.eval([out[-1]])
    return out


def compare(rows, golden):
    """Per golden position: the largest |log p - golden log p| over golden's top ids, and whether
    the argmax is golden's top id."""
    out = []
    for g in golden:
        row = rows[g["position"]]
        diff = max(abs(float(row[t]) - lp) for t, lp in zip(g["ids"], g["logprobs"]))
        out.append(dict(position=g["position"], max_abs_logprob_diff=diff, top1_agrees=int(row.argmax()) == g["ids"][0]))
    return out


def cmd_reference(a):
    import llama_cpp

    text = open(a.text, encoding="utf-8", errors="replace").read()
    llm = llama(a.gguf, "f32", False, a.threads)
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)[: a.tokens]
    positions = positions_of(len(ids))
    t0 = time.time()
    rows = llama_rows(llm, ids, positions)
    golden = []
    for p in positions:
        top = [int(t) for t in rows[p].argsort()[::-1][:TOP]]
        golden.append(dict(position=p, ids=top, logprobs=[float(rows[p][t]) for t in top]))
    greedy = llama_greedy(llm, ids)
    del llm
    floor = llama(a.gguf, "f16", True, a.threads)
    self_cmp = compare(llama_rows(floor, ids, positions), golden)
    self_greedy = llama_greedy(floor, ids)
    rec = dict(name="golden_llamacpp", date=time.strftime("%Y-%m-%d"), model=os.path.basename(a.gguf),
               model_sha256=sha256(a.gguf), llama_cpp_python=llama_cpp.__version__,
               reference="llama.cpp, KV cache f32, flash attention off, n_batch %d, %d threads" % (CHUNK, a.threads),
               text=os.path.basename(a.text), prompt_ids=ids, golden=golden, greedy=greedy,
               noise_floor=dict(reference="llama.cpp, KV cache f16, flash attention on", positions=self_cmp,
                                max_abs_logprob_diff=max(x["max_abs_logprob_diff"] for x in self_cmp),
                                top1_agree=sum(x["top1_agrees"] for x in self_cmp),
                                greedy_equal=sum(1 for x, y in zip(greedy, self_greedy) if x == y)),
               seconds=time.time() - t0)  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(rec, f)
        f.write("\n")
    print(f"golden_llamacpp: {len(ids)} tokens, {len(positions)} positions, greedy {greedy[:8]}...; noise floor "
          f"{rec['noise_floor']['max_abs_logprob_diff']:.3f} -> {a.out}", flush=True)  # fmt: skip


# ---- transformers (+ tierkv) ---------------------------------------------------------------


def model_rows(model, ids, positions, cache, device):
    """Chunked prefill of ids with cache; {position: log-probabilities} at the positions, then
    the logits of the last position (to continue from)."""
    import torch

    want = set(positions)
    rows, last = {}, None
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        keep = [i for i in range(len(chunk)) if start + i in want]
        keep_last = len(chunk) - 1 not in keep
        idx = torch.tensor(keep + ([len(chunk) - 1] if keep_last else []), device=device)
        x = torch.tensor([chunk], device=device)
        pos = torch.arange(start, start + len(chunk), device=device).view(1, -1)
        logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=idx).logits[0]
        for j, i in enumerate(keep):
            rows[start + i] = log_softmax(logits[j].double().cpu().numpy())
        last = logits[-1]
    return rows, last


def teacher_forced(model, cache, last, greedy, start, device):
    """llama.cpp's greedy tokens fed one at a time: the steps whose argmax is its next token."""
    import torch

    agree, p = 0, start
    logits = last
    for i, tok in enumerate(greedy):
        agree += int(logits.argmax()) == tok
        if i + 1 == len(greedy):
            break
        x = torch.tensor([[tok]], device=device)
        logits = model(input_ids=x, position_ids=torch.tensor([[p]], device=device), past_key_values=cache, use_cache=True).logits[0, -1]
        p += 1
    return agree


def cmd_check(a):
    import torch

    g = json.load(open(a.golden))
    if g["model_sha256"] != sha256(a.gguf):
        sys.exit(f"golden_llamacpp: {a.gguf} is not the model the golden file was made from ({g['model']})")
    arms = parse_arms(a.arms, "golden_llamacpp")
    ids, positions = g["prompt_ids"], [x["position"] for x in g["golden"]]
    torch.set_num_threads(a.threads)
    model = load_model(a.gguf, a.device)
    result = dict(name="golden_llamacpp_check", date=time.strftime("%Y-%m-%d"), golden=os.path.basename(a.golden),
                  device=a.device, torch=torch.__version__, noise_floor=g["noise_floor"]["max_abs_logprob_diff"],
                  tokens=len(ids), arms={})  # fmt: skip
    with torch.inference_mode():
        for arm in arms:
            t0 = time.time()
            cache = make_cache(model, arm, len(ids) + GREEDY + 16, CHUNK, a.codec_seed, a.device)
            rows, last = model_rows(model, ids, positions, cache, a.device)
            per = compare(rows, g["golden"])
            forced = teacher_forced(model, cache, last, g["greedy"], len(ids), a.device)
            r = dict(max_abs_logprob_diff=max(x["max_abs_logprob_diff"] for x in per),
                     top1_agree=sum(x["top1_agrees"] for x in per), positions=per, greedy_teacher_forced=forced,
                     seconds=time.time() - t0)  # fmt: skip
            result["arms"][arm] = r
            print(f"{arm:8s} max |dlogp| {r['max_abs_logprob_diff']:.3f} (floor {result['noise_floor']:.3f}), top-1 "
                  f"{r['top1_agree']}/{len(per)}, greedy {forced}/{len(g['greedy'])} ({r['seconds']:.0f} s)", flush=True)  # fmt: skip
            del cache
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(json.dumps({k: {m: v[m] for m in ("max_abs_logprob_diff", "top1_agree", "greedy_teacher_forced")}
                      for k, v in result["arms"].items()}))  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    r.add_argument("--tokens", type=int, default=1200)
    r.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--golden", required=True)
    c.add_argument("--arms", default="dense,int8r,rec,seed")
    c.add_argument("--device", default="cpu")
    c.add_argument("--codec-seed", type=int, default=0)
    c.add_argument("--out")
    for x in (r, c):
        x.add_argument("--gguf", required=True)
        x.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    {"reference": cmd_reference, "check": cmd_check}[a.cmd](a)


if __name__ == "__main__":
    main()
