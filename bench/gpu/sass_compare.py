#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-function SASS comparison of two CUDA object files or executables (a refactor's proof
that the machine code did not move). Runs `cuobjdump -sass` on both (cuobjdump and nvdisasm on
PATH: the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm wheels), splits
the listings by function, drops addresses, column padding, blank lines, source-path identifiers and
path-derived anonymous-namespace hashes, and reports every function whose instructions differ or that exists on one side only.

  bench/gpu/sass_compare.py BASE.o NEW.o [BASE2.o NEW2.o ...] [--json OUT]
Exit status 1 when any function differs."""
import argparse
import json
import re
import subprocess
import sys


def functions(path):
    text = subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True, text=True).stdout
    out, name, body = {}, None, []
    for line in text.splitlines():
        if "Function :" in line:
            if name:
                out[name] = body
            name = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__X_", line.split("Function :")[1].strip())
            body = []
        elif name is not None and line.strip() and not line.strip().startswith("identifier ="):
            # (identifier = the source path: differs between two checkouts of the same code)
            # addresses out, whitespace runs as one space (the listing pads columns by their width)
            body.append(" ".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split()))
    if name:
        out[name] = body
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", nargs="+", help="BASE NEW [BASE NEW ...]")
    ap.add_argument("--json", help="write the counts and differing functions here")
    a = ap.parse_args()
    if len(a.pairs) % 2:
        ap.error("files come in pairs: BASE NEW")
    report = {"pairs": [], "functions": 0, "identical": 0, "differ": [], "only_one_side": []}
    for base, new in zip(a.pairs[0::2], a.pairs[1::2]):
        fb, fn = functions(base), functions(new)
        same = 0
        for k in sorted(set(fb) | set(fn)):
            if k not in fb or k not in fn:
                report["only_one_side"].append(k)
            elif fb[k] == fn[k]:
                same += 1
            else:
                report["differ"].append(k)
        report["pairs"].append({"base": base, "new": new, "functions": len(set(fb) | set(fn)), "identical": same})
        report["functions"] += len(set(fb) | set(fn))
        report["identical"] += same
        print(f"{new}: {same} of {len(set(fb) | set(fn))} functions identical")
    for k in report["differ"]:
        print("differs:", k)
    for k in report["only_one_side"]:
        print("one side only:", k)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["differ"] or report["only_one_side"] else 0


if __name__ == "__main__":
    sys.exit(main())
