#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Issue 52's GPU comparison in one device call: decode over the Cold / sub-3-bit mixes and the
# recommended tiers (gpubench_decode --cold) at (24,4,256) 128K B=32 and 32K B=1, against BF16
# SDPA (sdpa_control.py) and FlashInfer's FP8 paged decode (flashinfer_peer.py, tensor-core
# backend; its wheels carried in .whl/, bench/gpu/FLASHINFER.md), merged into one record by
# merge_results.py; then retier into and out of Cold (--cold-only --retier-only). FlashInfer's JIT
# build overlaps the C++ build. Writes under $OUT (default build/gpu-out).
# Usage (on the device, repository root): bash bench/gpu/cold_peers.sh   [carry: .whl]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/build/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/tierkv-fi-site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  > "$OUT/pip.txt" 2>&1 || echo "cold_peers: FlashInfer wheels did not install (see pip.txt)"
(cd bench/gpu && PYTHONPATH=$SITE python3 flashinfer_peer.py --out /tmp/fi_jit.json --head-dim 256 --kv-dtype fp8 \
  --backends tc --jit-only > "$OUT/fi_jit.txt" 2>&1) &
jit=$!
cmake --preset cuda > "$OUT/configure.txt" 2>&1 && cmake --build --preset cuda --target gpubench_decode -j "$(nproc)" \
  > "$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
echo "build done at $SECONDS s"
wait $jit
echo "FlashInfer JIT done at $SECONDS s: $(tail -1 "$OUT/fi_jit.txt")"
build/cuda/bench/gpubench_decode --cold --ctx 131072 --ctx 32768 --batch 32 --batch 1 --dim 256 --no-retier \
  --out "$OUT/tierkv.json" > "$OUT/tierkv.txt" 2>&1
echo "decode rc $? at $SECONDS s"
(cd bench/gpu && python3 sdpa_control.py --ctx 131072 32768 --batch 32 1 --head-dim 256 --out "$OUT/sdpa.json" \
  > "$OUT/sdpa.txt" 2>&1; echo "sdpa rc $?")
(cd bench/gpu && PYTHONPATH=$SITE python3 flashinfer_peer.py --ctx 131072 32768 --batch 32 1 --head-dim 256 \
  --kv-dtype fp8 --backends tc --out "$OUT/fi.json" > "$OUT/fi.txt" 2>&1; echo "flashinfer rc $?")
python3 bench/gpu/merge_results.py "$OUT/tierkv.json" "$OUT/sdpa.json" "$OUT/cold-peers.json" --flashinfer "$OUT/fi.json" \
  > "$OUT/merge.txt" 2>&1
echo "merge rc $? at $SECONDS s"
build/cuda/bench/gpubench_decode --cold-only --retier-only --dim 256 --out "$OUT/retier.json" > "$OUT/retier.txt" 2>&1
echo "retier rc $? at $SECONDS s"
