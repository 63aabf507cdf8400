#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CTest smollm_quick: the whole pipeline on short items, every arm (FP8 and int8_rotated recent tiers, TQ3 and TQ4 Stale keys); checks that the dense
# arm answers the needle items, that every arm produced finite results, and that the
# compressed arms stay near dense. Usage: run_quick.sh path/to/smollm
set -euo pipefail
bin=$1
out=$(mktemp --suffix=.json)
trap 'rm -f "$out"' EXIT
"$bin" tasks --quick --out "$out"
python3 - "$out" <<'PY'
import json, math, sys
r = json.load(open(sys.argv[1]))
arms = r["arms"]
fail = []
for a in ("dense", "fp8", "tq3", "tiered", "int8r", "tiered_int8r", "tiered_k4"):
    if a not in arms: fail.append("arm %s missing" % a); continue
    if not math.isfinite(arms[a]["ppl"]): fail.append("%s: ppl not finite" % a)
d = arms.get("dense", {})
if d and d["niah"]["1k"]["acc"] != 1.0: fail.append("dense arm missed a quick needle item")
if "fp8" in arms and abs(arms["fp8"]["ppl"] / d["ppl"] - 1) > 0.02: fail.append("fp8 ppl more than 2% from dense")
# int8_rotated measured +0.01% over 7.6K tokens (docs/model.md): 0.5% leaves room for short text
if "int8r" in arms and abs(arms["int8r"]["ppl"] / d["ppl"] - 1) > 0.005: fail.append("int8r ppl more than 0.5% from dense")
# Bits over the quick 512-token text, where the 8-bit recent window is a larger share than at
# the bar's 4K / 8K (checked by the full run): TQ4 Stale keys add 0.5 bits per Stale scalar.
bits_limit = {"tiered": 4.6, "tiered_int8r": 4.6, "tiered_k4": 5.1}
for n in ("tiered", "tiered_int8r", "tiered_k4"):
    if n not in arms: continue
    t = arms[n]
    if abs(t["ppl"] / d["ppl"] - 1) > 0.10: fail.append("%s ppl more than 10%% from dense" % n)
    if not t["ppl_bits_per_scalar"] < bits_limit[n]: fail.append("%s above %.1f bits per scalar" % (n, bits_limit[n]))
for a, v in arms.items():
    print("%-12s ppl %.4f  niah_1k %.2f  bits %.3f  agree64 %.3f" % (a, v["ppl"], v["niah"]["1k"]["acc"],
          v["ppl_bits_per_scalar"], v["agree64"]))
if fail:
    print("FAILED: " + "; ".join(fail)); sys.exit(1)
print("quick pipeline: ok")
PY
