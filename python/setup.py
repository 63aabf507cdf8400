# SPDX-License-Identifier: Apache-2.0
"""Builds tierkv._C with torch.utils.cpp_extension (docs/python.md says why).

Environment:
  TIERKV_PYTHON_SET=default|full|extra-only
                                   KV-head counts of the prebuilt set (csrc/formats.hpp);
                                   extra-only builds only TIERKV_PYTHON_EXTRA
  TIERKV_PYTHON_EXTRA=set:head_dim:kv_heads:group_size:page_size[,...]
                                   extra combinations; set = recent+k+v[+cold_k+cold_v], names of the
                                   format registry (include/tierkv/formats.hpp: fp8, int8_rotated,
                                   tq3, tq4, bf16, ...), e.g. int8_rotated+tq4+tq3, or one of the
                                   aliases fp8_tq3, int8r_tq4, int8r_only
  MAX_JOBS=N                       parallel compile jobs (ninja; default: all cores)
  TIERKV_PYTHON_OPT=0|1|2|3        -O level of the host units (default 2)
  TIERKV_PYTHON_CUDA=1             also build libtierkv_cuda.so (tierkv.CudaCache: the cache on the
                                   GPU) with CMake and nvcc into the package
  TIERKV_PYTHON_CUDA_SET=entry;... its prebuilt set (csrc/cuda/CMakeLists.txt has the default)
  TIERKV_USER_FORMATS_HEADER=path  formats registered outside tierkv (tierkv/formats.hpp): the
  TIERKV_USER_FORMATS=Type,...     header declaring them and their descriptor types; every unit
                                   (and the CUDA library) is compiled with them, and their names
                                   work in sets like tierkv's own
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import setuptools
from setuptools import setup

# pip builds a wheel: setuptools before 70.1 needs the `wheel` package for that, and without build
# isolation nothing installs it (pip's own error is "invalid command 'bdist_wheel'").
if "bdist_wheel" in sys.argv and importlib.util.find_spec("wheel") is None:
    version = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (70, 1):
        raise SystemExit(
            f"tierkv: building a wheel with setuptools {setuptools.__version__} needs the 'wheel' "
            "package, which this environment lacks: pip install wheel ninja, then rerun "
            "pip install --no-build-isolation ./python (docs/python.md)"
        )
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = Path(__file__).resolve().parent
include = Path(os.environ.get("TIERKV_INCLUDE", here.parent / "include"))
if not (include / "tierkv" / "cache.hpp").is_file():
    raise RuntimeError(
        f"tierkv headers not found under {include}: build from a tierkv checkout "
        "(pip install ./python) or set TIERKV_INCLUDE to the repository's include/"
    )

# -O level of the host units (CI's scripts/test-python builds at 0: about 40% less compile time
# than -O1 on 2 cores; the same code and tests, run slower).
opt = os.environ.get("TIERKV_PYTHON_OPT", "2")
if opt not in ("0", "1", "2", "3"):
    raise RuntimeError(f"TIERKV_PYTHON_OPT={opt!r}: expected 0, 1, 2 or 3 (the -O level)")

full = os.environ.get("TIERKV_PYTHON_SET", "default")
if full not in ("default", "full", "extra-only"):
    raise RuntimeError(f"TIERKV_PYTHON_SET={full!r}: expected 'default', 'full' or 'extra-only'")

# Tier sets by their three registry names (recent+cache_type_k+cache_type_v), or five with a Cold
# tier (+cold_type_k+cold_type_v); the aliases are the names of the first releases.
SET_ALIASES = {
    "fp8_tq3": "fp8+tq3+tq3",
    "int8r_tq4": "int8_rotated+tq4+tq3",
    "int8r_only": "int8_rotated+int8_rotated+int8_rotated",
}
# The default prebuilt set: every (set, head_dim, page size) below over formats.hpp's group sizes
# and KV-head counts, one translation unit each.
PREBUILT = [
    (s, d, p)
    for s in ("fp8+tq3+tq3", "int8_rotated+tq4+tq3", "int8_rotated+int8_rotated+int8_rotated")
    for d in (64, 128, 256)
    for p in (16, 64)
] + [("int8_rotated+tq4+tq3+tq3+tq2", 64, 16)]  # a Cold tier set (issue 52), for its tests


def tier_set(name, where):
    """The three or five format names of a set entry (an alias, recent+k+v or
    recent+k+v+cold_k+cold_v)."""
    names = SET_ALIASES.get(name, name).split("+")
    if len(names) not in (3, 5) or not all(re.fullmatch(r"[a-z][a-z0-9_]*", n) for n in names):
        raise RuntimeError(
            f"{where}: tier set {name!r}: expected recent+k+v or recent+k+v+cold_k+cold_v, format names "
            f"of include/tierkv/formats.hpp (e.g. int8_rotated+tq4+tq3), or one of {', '.join(SET_ALIASES)}"
        )
    return names


def set_macro(names):
    return "TIERKV_PY_SET(" + ", ".join(f'"{n}"' for n in names) + ")"


# Generated translation units (compiled in parallel), written into the build tree so the source
# tree stays clean: the default set's, then one per TIERKV_PYTHON_EXTRA entry.
gen = here / "build" / "gen"
gen.mkdir(parents=True, exist_ok=True)


def unit(name, body):
    path = gen / name
    text = '// Generated by setup.py.\n#include "instantiate.hpp"\n' + body + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return str(path.relative_to(here))


units = []
if full != "extra-only":
    for s, d, p in PREBUILT:
        units.append(unit(f"set_{s.replace('+', '_')}_d{d}_p{p}.cpp",
                          f"TIERKV_PY_INSTANTIATE({set_macro(tier_set(s, 'PREBUILT'))}, {d}, {p})"))
for item in filter(None, os.environ.get("TIERKV_PYTHON_EXTRA", "").split(",")):
    m = re.fullmatch(r"([a-z0-9_+]+):(\d+):(\d+):(\d+):(\d+)", item.strip())
    if not m:
        raise RuntimeError(
            f"TIERKV_PYTHON_EXTRA entry {item!r}: expected set:head_dim:kv_heads:group_size:page_size "
            "with set recent+k+v[+cold_k+cold_v] (e.g. int8_rotated+tq4+tq3) or one of " + ", ".join(SET_ALIASES)
        )
    s, d, kv, g, p = m.groups()
    names = tier_set(s, "TIERKV_PYTHON_EXTRA")
    units.append(unit(f"extra_{'_'.join(names)}_d{d}_kv{kv}_g{g}_p{p}.cpp",
                      f"TIERKV_PY_INSTANTIATE_ONE({set_macro(names)}, {d}, {kv}, {g}, {p})"))

# User formats: one forced include that defines tierkv/formats.hpp's two macros for every unit
# (a file rather than -D flags: the header's quotes would not survive the build's shell).
user_header = os.environ.get("TIERKV_USER_FORMATS_HEADER", "")
user_types = os.environ.get("TIERKV_USER_FORMATS", "")
if bool(user_header) != bool(user_types):
    raise RuntimeError("TIERKV_USER_FORMATS_HEADER and TIERKV_USER_FORMATS go together: set both or neither")
user_config = None
if user_header:
    header = Path(user_header)
    if not header.is_absolute() or not header.is_file():  # pip builds in a directory of its own
        raise RuntimeError(f"TIERKV_USER_FORMATS_HEADER={user_header!r}: expected an absolute path to a file")
    user_config = gen / "user_formats_config.hpp"
    text = (f'#define TIERKV_USER_FORMATS_HEADER "{header}"\n'
            f"#define TIERKV_USER_FORMATS {user_types}\n")
    if not user_config.exists() or user_config.read_text() != text:
        user_config.write_text(text)
forced = ["-include", str(user_config)] if user_config else []

# Paths relative to setup.py: setuptools refuses absolute source paths.
sources = ["csrc/ops.cpp", "csrc/registry.cpp"] + units


class BuildExtAndCuda(BuildExtension):
    """The torch extension, then (TIERKV_PYTHON_CUDA=1) libtierkv_cuda.so next to it."""

    def run(self):
        super().run()
        if os.environ.get("TIERKV_PYTHON_CUDA", "0") != "1":
            return
        if shutil.which("cmake") is None or shutil.which(os.environ.get("CUDACXX", "nvcc")) is None:
            raise RuntimeError("TIERKV_PYTHON_CUDA=1 needs cmake and nvcc on PATH (or CUDACXX)")
        build = here / "build" / "cuda-lib"
        out = Path(self.build_lib).resolve() / "tierkv"
        args = ["cmake", "-S", str(here / "csrc" / "cuda"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                f"-DTIERKV_PYTHON_CUDA_OUTPUT_DIR={out}"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        if user_config:
            args.append(f"-DTIERKV_PYTHON_USER_FORMATS_CONFIG={user_config}")
        if "TIERKV_PYTHON_CUDA_SET" in os.environ:
            args.append(f"-DTIERKV_PYTHON_CUDA_SET={os.environ['TIERKV_PYTHON_CUDA_SET']}")
        subprocess.check_call(args)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build), "--parallel", jobs])
        if self.inplace:
            shutil.copy2(out / "libtierkv_cuda.so", here / "tierkv" / "libtierkv_cuda.so")

setup(
    ext_modules=[
        CppExtension(
            "tierkv._C",
            sources,
            include_dirs=[str(include), str(here / "csrc"), str(gen)],
            define_macros=[("TIERKV_PY_FULL", "1" if full == "full" else "0")],
            # -g0: debug info triples the objects and the link; -O2 (the default) like the C++
            # release preset.
            extra_compile_args=["-std=c++20", f"-O{opt}", "-g0", "-fvisibility=hidden"] + forced,
        )
    ],
    cmdclass={"build_ext": BuildExtAndCuda},
)
