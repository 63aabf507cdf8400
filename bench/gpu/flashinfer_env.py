# SPDX-License-Identifier: Apache-2.0
"""Environment FlashInfer reads when it is imported, shared by the peer benchmarks (import this
before torch / flashinfer). Its JIT cache defaults to ~/.cache/flashinfer, and the home may be
read-only; compile for sm_90a only; let ninja use every core. A value already set wins."""
import os

JIT_DIR = os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/tierkv-flashinfer")
os.environ.setdefault("TVM_FFI_CACHE_DIR", JIT_DIR + "/tvm-ffi")
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 16))
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
