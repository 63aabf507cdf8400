# SPDX-License-Identifier: Apache-2.0
"""Builds tierkv._C with torch.utils.cpp_extension (docs/python.md says why).

Environment:
  TIERKV_PYTHON_SET=default|full|extra-only
                                   KV-head counts of the prebuilt set (csrc/formats.hpp);
                                   extra-only builds only TIERKV_PYTHON_EXTRA
  TIERKV_PYTHON_EXTRA=set:head_dim:kv_heads:group_size:page_size[,...]
                                   extra geometries, set = fp8_tq3 | int8r_tq4 | int8r_only
  MAX_JOBS=N                       parallel compile jobs (ninja; default: all cores)
"""

import os
import re
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = Path(__file__).resolve().parent
include = Path(os.environ.get("TIERKV_INCLUDE", here.parent / "include"))
if not (include / "tierkv" / "cache.hpp").is_file():
    raise RuntimeError(
        f"tierkv headers not found under {include}: build from a tierkv checkout "
        "(pip install ./python) or set TIERKV_INCLUDE to the repository's include/"
    )

full = os.environ.get("TIERKV_PYTHON_SET", "default")
if full not in ("default", "full", "extra-only"):
    raise RuntimeError(f"TIERKV_PYTHON_SET={full!r}: expected 'default', 'full' or 'extra-only'")

# extra.inc: one registration per TIERKV_PYTHON_EXTRA entry (empty when none), written into
# the build tree so the source tree stays clean.
gen = here / "build" / "gen"
gen.mkdir(parents=True, exist_ok=True)
lines = []
for item in filter(None, os.environ.get("TIERKV_PYTHON_EXTRA", "").split(",")):
    m = re.fullmatch(r"(fp8_tq3|int8r_tq4|int8r_only):(\d+):(\d+):(\d+):(\d+)", item.strip())
    if not m:
        raise RuntimeError(
            f"TIERKV_PYTHON_EXTRA entry {item!r}: expected set:head_dim:kv_heads:group_size:page_size "
            "with set one of fp8_tq3, int8r_tq4, int8r_only"
        )
    s, d, kv, g, p = m.groups()
    lines.append(f"tierkv_py::register_one<tierkv_py::{s}, {d}, {kv}, {g}, {p}>();\n")
extra = gen / "extra.inc"
if not extra.exists() or extra.read_text() != "".join(lines):
    extra.write_text("".join(lines))

# Paths relative to setup.py: setuptools refuses absolute source paths.
sources = ["csrc/ops.cpp", "csrc/registry.cpp", "csrc/extra.cpp"]
if full != "extra-only":
    sources += sorted(str(p.relative_to(here)) for p in (here / "csrc" / "inst").glob("*.cpp"))

setup(
    ext_modules=[
        CppExtension(
            "tierkv._C",
            sources,
            include_dirs=[str(include), str(here / "csrc"), str(gen)],
            define_macros=[("TIERKV_PY_FULL", "1" if full == "full" else "0")],
            # -g0: debug info triples the objects and the link; -O2 like the C++ release preset.
            extra_compile_args=["-std=c++20", "-O2", "-g0", "-fvisibility=hidden"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
