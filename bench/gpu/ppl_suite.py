#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Long-context perplexity over several texts on the GPU, every arm on the same tokens.

The GPU twin of `scripts/measure ppl-texts` (the C++ SmolLM2 engine, 2-core machines, 8K tokens):
any model transformers loads from a GGUF (SmolLM2, Gemma 3), texts of 32K tokens and more.

texts: writes the four texts (licence, docs, source, debian) into a folder, each a superset of
  scripts/measure ppl-texts' text of the same name (the same files first, then more of their kind,
  so that each holds --min-bytes), cut at --min-bytes. Run it where the files are (this repo's
  docs and headers, /usr/share/common-licenses, dpkg-query), then carry the folder.

run: teacher-forced chunked perplexity: each forward call is one chunk of --chunk tokens through
  the cache (dense: transformers' own cache, SDPA; tierkv arms: tierkv.transformers.TieredCache on
  the GPU, tierkv.CudaCache: GPU prefill over mixed pages, retier on the GPU); positions after the
  first chunk are scored. Arms are needle_suite.py's (rec, rec_nocenter, seed, int8r), the tierkv
  arms once per --seeds codec seed. One file per (text, arm, seed) in --work, in the format of
  examples/smollm's `ppl --nll-out` (per-token NLL), so examples/smollm/summarize_ppl.py summarizes
  both; a rerun skips the files already there (--time-limit stops between runs).

    python3 bench/gpu/ppl_suite.py texts --out TEXTS_DIR [--min-bytes 200000]
    python3 bench/gpu/ppl_suite.py run --gguf MODEL.gguf --texts TEXTS_DIR --work WORK --tokens 32768
    python3 examples/smollm/summarize_ppl.py --work WORK [--first N] --model NAME --out RECORD.json

Because attention is causal, the first N scored tokens of a 32K run are exactly those of an
N-token run (summarize_ppl.py --first).

Paths (issue 57: one quality on every path): `run` writes each text's token ids beside its copy
({work}/texts/NAME.ids); `run --device cpu` scores the same arms through the host TieredCache
(tierkv.Cache); `engine` scores them through the C++ SmolLM2 engine (examples/smollm `smollm ppl
--ppl-ids`: the same ids, the same arms: rec, rec_nocenter, seed, dense); --mass-layers sets the
GPU cache's mass_layers_per_step (0, TieredCache's default: every layer's page mass feeds the
policy, as the engine and the host path do; 1: CudaCache's) and --sync-retier 1 / 0 finishes each
step's retier in that step (TieredCache's default) or overlaps it (CudaCache's). One --work folder per path, then examples/smollm/summarize_paths.py compares them.

    python3 bench/gpu/ppl_suite.py run --device cpu --gguf G --texts T --work W/host --tokens 8192
    python3 bench/gpu/ppl_suite.py engine --smollm build/release/examples/smollm/smollm \
        --gguf G --ids W/host/texts --work W/engine --tokens 8192 --jobs 2
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from needle_suite import finish, load_arm_file, load_model, load_tokenizer, make_cache, parse_arms  # noqa: E402  (the arms and their caches: one definition for both suites)

DENSE_SEED = "20261129"  # summarize_ppl.py reads the dense run under this seed name

# scripts/measure ppl-texts' files first (the C++ record's texts are these texts' beginnings)
LICENCES = ["GPL-3", "GPL-2", "LGPL-2.1", "LGPL-3", "Apache-2.0", "MPL-2.0", "Artistic", "GFDL-1.3", "CC0-1.0", "BSD"]
LICENCES_MORE = ["GFDL-1.2", "GPL-1", "LGPL-2", "MPL-1.1"]
DOCS_FIRST = ["architecture", "concepts", "tiering", "paging", "attention", "codecs"]
SOURCE_FIRST = ["cache.hpp", "tiering/tier_controller.hpp", "paging/paged_storage.hpp", "codec/turboquant.hpp"]


def log(*a):
    print(*a, flush=True)


def ordered(first, rest):
    return first + sorted(p for p in rest if p not in first)


def texts(a):
    os.makedirs(a.out, exist_ok=True)
    lic = "/usr/share/common-licenses"
    docs = ordered([f"docs/{n}.md" for n in DOCS_FIRST], [os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md")])
    srcs = [os.path.relpath(p, f"{ROOT}/include/tierkv") for p in glob.glob(f"{ROOT}/include/tierkv/**/*.hpp", recursive=True)]
    source = [f"include/tierkv/{p}" for p in ordered(SOURCE_FIRST, srcs)]
    parts = {
        "licence": [f"{lic}/{n}" for n in LICENCES + LICENCES_MORE if os.path.exists(f"{lic}/{n}")],
        "docs": [f"{ROOT}/{p}" for p in docs],
        "source": [f"{ROOT}/{p}" for p in source],
    }
    for name, files in parts.items():
        data = b"".join(open(f, "rb").read() for f in files)
        if len(data) < a.min_bytes:
            sys.exit(f"ppl_suite: the {name} text holds {len(data)} bytes, under --min-bytes {a.min_bytes}")
        open(f"{a.out}/{name}.txt", "wb").write(data[: a.min_bytes])
    deb = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\n${Description}\n\n"], capture_output=True, check=True,
                         env=dict(os.environ, LC_ALL="C")).stdout  # fmt: skip
    if len(deb) < a.min_bytes:
        sys.exit(f"ppl_suite: dpkg-query gave {len(deb)} bytes, under --min-bytes {a.min_bytes}")
    open(f"{a.out}/debian.txt", "wb").write(deb[: a.min_bytes])
    for n in ("licence", "docs", "source", "debian"):
        log(f"{a.out}/{n}.txt: {os.path.getsize(f'{a.out}/{n}.txt')} bytes")


def nll_of(model, ids, chunk, cache):
    """Per-token NLL of ids[p + 1] given ids[:p + 1] for p >= chunk - 1, chunk by chunk (float64
    log-softmax over the model's float32 logits)."""
    import torch

    dev, out = model.device, []
    ids = ids.to(dev)
    for start in range(0, ids.numel() - 1, chunk):
        x = ids[start : start + chunk].view(1, -1)
        pos = torch.arange(start, start + x.shape[1], device=dev).view(1, -1)
        logits = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True).logits[0]
        lo = max(start, chunk - 1) - start  # first scored row of this chunk
        hi = min(x.shape[1], ids.numel() - 1 - start)
        if lo < hi:
            rows = logits[lo:hi].double()
            target = ids[start + lo + 1 : start + hi + 1]
            out.append(torch.logsumexp(rows, -1) - rows.gather(1, target.view(-1, 1)).squeeze(1))
    return torch.cat(out).cpu()


def pending_runs(work, names, arms, seeds):
    """(text, arm, seed, path) of every run not yet in work, seed by seed over every (text, arm)
    so that a run cut short covers the texts alike; dense once, under DENSE_SEED."""
    runs = []
    for i, seed in enumerate(seeds.split(",")):
        for text in names:
            for arm in arms:
                if arm == "dense" and i:
                    continue
                s = DENSE_SEED if arm == "dense" else seed
                path = f"{work}/{text}-{arm}-{s}.json"
                if not os.path.exists(path):
                    runs.append((text, arm, s, path))
    return runs


def write_run(path, r):
    """A run's file, whole or not at all (a rerun skips the files present)."""
    with open(path + ".tmp", "w") as f:
        json.dump(r, f)
    os.replace(path + ".tmp", path)


# The engine's arm (and knobs) for each of needle_suite's arms (tierkv_backend.hpp: rec = tiered_k4
# centred, seed = FP8 + TQ3 uncentred).
# *_nomass: no page becomes an Anchor by attention mass (tiers by age only, the same on every
# path: the control that separates the mass signal's share of a path gap; arms/no-mass.json).
ENGINE_ARMS = {"dense": ["--arm", "dense"], "rec": ["--arm", "rec"], "seed": ["--arm", "seed"],
               "rec_nocenter": ["--arm", "tiered_k4", "--center", "0"],
               "rec_nomass": ["--arm", "rec+um=0"], "seed_nomass": ["--arm", "seed+um=0"]}


def engine(a):
    """Every (text, arm, seed) through the C++ engine over the token ids a `run` wrote, a.jobs at a
    time (one thread each); files as run's."""
    import concurrent.futures

    for f in a.arm_file or []:
        load_arm_file(f)
    arms = parse_arms(a.arms, "ppl_suite engine")
    bad = [x for x in arms if x not in ENGINE_ARMS]
    if bad:
        sys.exit(f"ppl_suite engine: no engine arm for {bad} ({', '.join(ENGINE_ARMS)})")
    os.makedirs(f"{a.work}/texts", exist_ok=True)
    names = a.text_names.split(",")
    for text in names:
        if not os.path.exists(f"{a.ids}/{text}.ids"):
            sys.exit(f"ppl_suite engine: {a.ids}/{text}.ids is missing (ppl_suite.py run writes it)")
    runs = pending_runs(a.work, names, arms, a.seeds)
    log(f"ppl_suite engine: {len(runs)} runs to do in {a.work}")

    def one(r):
        text, arm, seed, path = r
        cmd = [a.smollm, "ppl", "--model", a.gguf, "--threads", "1", "--tokens", str(a.tokens), "--chunk", str(a.chunk),
               "--codec-seed", seed, "--ppl-ids", f"{a.ids}/{text}.ids", "--nll-out", path + ".tmp", *ENGINE_ARMS[arm]]  # fmt: skip
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()[-500:]}")
        r = json.load(open(path + ".tmp"))
        r.update(arm=arm, model=os.path.basename(a.gguf), chunk=a.chunk, device="CPU (examples/smollm engine)",
                 commit=os.environ.get("TIERKV_COMMIT", "unknown"))  # fmt: skip
        write_run(path, r)
        log(f"{text:8s} {arm:12s} seed {seed:9s} ppl {r['ppl']:9.4f} {r['bits_per_scalar']:5.2f} bits "
            f"{time.perf_counter() - t0:6.1f} s")

    for text in names:  # the texts' bytes, for summarize_ppl.py's sha256
        src = f"{a.ids}/{text}.txt"
        if os.path.exists(src):
            open(f"{a.work}/texts/{text}.txt", "wb").write(open(src, "rb").read())
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(one, runs))


def run(a):
    import torch

    start = time.perf_counter()
    for path in a.arm_file or []:
        load_arm_file(path)
    arms = parse_arms(a.arms, "ppl_suite")
    os.makedirs(a.work, exist_ok=True)
    names = a.text_names.split(",")
    runs = pending_runs(a.work, names, arms, a.seeds)  # a --time-limit cut covers the texts alike
    log(f"ppl_suite: {len(runs)} runs to do in {a.work}")
    if not runs:
        return
    name = os.path.basename(a.gguf)
    tok = None if a.ids else load_tokenizer(a.gguf, a.tokenizer)
    model = load_model(a.gguf, a.device)
    gpu = a.device == "cuda"
    extra = dict(mass_layers_per_step=a.mass_layers) if gpu and a.mass_layers is not None else {}
    if gpu and a.sync_retier is not None:
        extra["sync_retier"] = bool(a.sync_retier)
    os.makedirs(f"{a.work}/texts", exist_ok=True)
    ids = {}
    for text in names:
        raw = open(f"{a.ids or a.texts}/{text}.txt", "rb").read()
        open(f"{a.work}/texts/{text}.txt", "wb").write(raw)  # summarize_ppl.py names each text's sha256
        if a.ids:  # another run's tokens (a device whose transformers tokenizes the GGUF differently)
            t = [int(x) for x in open(f"{a.ids}/{text}.ids").read().split()]
        else:
            t = tok(raw.decode("utf-8", errors="replace"))["input_ids"]
        if len(t) < a.tokens:
            sys.exit(f"ppl_suite: {text} holds {len(t)} tokens, under --tokens {a.tokens}")
        ids[text] = torch.tensor(t[: a.tokens], dtype=torch.long)
        with open(f"{a.work}/texts/{text}.ids", "w") as f:  # the same tokens for the engine (ppl_suite.py engine)
            f.write(" ".join(map(str, t[: a.tokens])) + "\n")
        log(f"ppl_suite: {text}: {len(t)} tokens, the first {a.tokens} scored after the first chunk")
    layers = model.config.get_text_config().num_hidden_layers
    with torch.inference_mode():
        for i, (text, arm, seed, path) in enumerate(runs):
            if time.perf_counter() - start > a.time_limit:
                log(f"ppl_suite: time limit ({a.time_limit:.0f} s) reached after {i} runs; run again to resume")
                break
            t0 = time.perf_counter()
            cache = make_cache(model, arm, a.tokens + 64, a.chunk, int(seed), a.device, **extra)
            nll = nll_of(model, ids[text], a.chunk, cache)
            bits, tiers = (16.0, []) if arm == "dense" else finish(cache, layers)
            # each layer's pages' tiers as digits, as the engine's --nll-out writes them
            layer_tiers = [] if arm == "dense" else [
                "".join(str(t) for t in cache.tierkv.page_tiers(int(cache.seqs[0]), layer)) for layer in range(layers)]
            retier = {} if arm == "dense" else cache.retier_stats()  # held-back demotions show here
            secs = time.perf_counter() - t0
            ppl = float(torch.exp(nll.mean()))
            r = dict(arm=arm, tokens=int(ids[text].numel()), scored=int(nll.numel()), ppl=ppl, bits_per_scalar=bits,
                     seconds=secs, tiers=tiers, layer_tiers=layer_tiers, retier=retier, model=name, chunk=a.chunk, device=torch.cuda.get_device_name(0) if gpu else a.device_name,
                     mass_layers_per_step=a.mass_layers if gpu else 0, sync_retier=a.sync_retier if gpu else None,
                     commit=os.environ.get("TIERKV_COMMIT", "unknown"), nll=[round(float(x), 6) for x in nll])  # fmt: skip
            write_run(path, r)
            del cache
            log(f"{i + 1:3d}/{len(runs)} {text:8s} {arm:12s} seed {seed:9s} ppl {ppl:9.4f} {bits:5.2f} bits {secs:6.1f} s")
    log(f"ppl_suite: {time.perf_counter() - start:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("texts", help="write the texts")
    t.add_argument("--out", required=True)
    t.add_argument("--min-bytes", type=int, default=200000)
    r = sub.add_parser("run", help="score every (text, arm, seed)")
    r.add_argument("--gguf", required=True)
    r.add_argument("--texts", help="folder of NAME.txt (ppl_suite.py texts)")
    r.add_argument("--ids", help="instead of --texts: another run's WORK/texts (NAME.ids, NAME.txt)")
    r.add_argument("--text-names", default="licence,docs,source,debian")
    r.add_argument("--work", required=True)
    r.add_argument("--tokens", type=int, default=32768)
    r.add_argument("--chunk", type=int, default=512)
    r.add_argument("--arms", default="dense,rec,seed")
    r.add_argument("--arm-file", action="append", help="JSON {arm: TieredCache keywords} adding arms (bench/gpu/arms/)")
    r.add_argument("--seeds", default="20261129,11,23", help="codec seeds of the tierkv arms")
    r.add_argument("--time-limit", type=float, default=float("inf"))
    r.add_argument("--tokenizer", help="a folder from tokenizer.save_pretrained() instead of the GGUF's tokenizer")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the host TieredCache (tierkv.Cache)")
    r.add_argument("--device-name", default="CPU (python/ tierkv.Cache, transformers)", help="the files' device with --device cpu")
    r.add_argument("--mass-layers", type=int, help="the GPU cache's mass_layers_per_step (default: TieredCache's, 0: every layer)")
    r.add_argument("--sync-retier", type=int, choices=[0, 1], help="TieredCache(sync_retier=...) on the GPU: 1 finishes each "
                   "step's retier in its end_step (TieredCache's default), 0 overlaps it with the next step (CudaCache's)")
    e = sub.add_parser("engine", help="score every (text, arm, seed) through the C++ engine over run's token ids")
    e.add_argument("--smollm", required=True, help="examples/smollm's binary (build/release/examples/smollm/smollm)")
    e.add_argument("--gguf", required=True)
    e.add_argument("--ids", required=True, help="a run's WORK/texts (NAME.ids, NAME.txt)")
    e.add_argument("--text-names", default="licence,docs,source,debian")
    e.add_argument("--work", required=True)
    e.add_argument("--tokens", type=int, default=32768)
    e.add_argument("--chunk", type=int, default=512)
    e.add_argument("--arms", default="dense,rec,seed")
    e.add_argument("--seeds", default="20261129,11,23")
    e.add_argument("--arm-file", action="append", help="as run's (names the engine maps too: ENGINE_ARMS)")
    e.add_argument("--jobs", type=int, default=os.cpu_count())
    a = ap.parse_args()
    if a.cmd == "run" and not (a.texts or a.ids):
        ap.error("run needs --texts or --ids")
    {"texts": texts, "run": run, "engine": engine}[a.cmd](a)


if __name__ == "__main__":
    main()
