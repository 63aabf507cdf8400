#!/usr/bin/env bash
# One device call: the prefill tests (and the façade's 1000-step run, which calls prefill), bench/cuda/prefill.cu, then FlashInfer's BF16 paged prefill
# (bench/gpu/flashinfer_prefill.py, wheels in .whl/: bench/gpu/FLASHINFER.md) and tierkv's
# 512 / 2048 chunks again in the same run. Writes under $OUT.
set -uo pipefail
cmake --preset cuda > /dev/null 2>&1
cmake --build build/cuda --target gpubench_prefill test_cuda_prefill test_cuda_tiered_cache -j16 2>&1 |
  grep -E "error" | head
./build/cuda/tests/test_cuda_prefill > "$OUT/prefill_test.txt" 2>&1; tail -2 "$OUT/prefill_test.txt"
./build/cuda/tests/test_cuda_tiered_cache > "$OUT/tiered_cache_test.txt" 2>&1
grep -E "^e2e:|passed|failed" "$OUT/tiered_cache_test.txt"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# Google Benchmark's JSON to prefill.gbench.json; gbench_record.py writes the old record and
# prints the old "prefill <mix> ... chunk C: T us  F TFLOP/s" lines
./build/cuda/bench/gpubench_prefill --d128 --out "$OUT/prefill.gbench.json" --commit "$commit" > "$OUT/prefill_bench.txt" 2>&1
python3 bench/gpu/gbench_record.py "$OUT/prefill.gbench.json" -o "$OUT/prefill.json" >> "$OUT/prefill_bench.txt"
grep -E "chunk +(512|2048|8):" "$OUT/prefill_bench.txt" | grep p16
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
  # both of gpubench_prefill's shapes: (24, 4, 256) and --d128's (32, 8, 128)
  for shape in "24 4 256:" "32 8 128:_d128"; do
    PYTHONPATH=/tmp/site:bench/gpu PYTHONUNBUFFERED=1 timeout "${FI_TIMEOUT:-420}" \
      python3 bench/gpu/flashinfer_prefill.py --shape ${shape%%:*} \
      --out "$OUT/flashinfer_prefill${shape#*:}.json" 2>&1 | grep -v Warning | tail -8
  done
  ./build/cuda/bench/gpubench_prefill --mix fp8 --out "$OUT/prefill_after_fi.gbench.json" --commit "$commit" > /dev/null
  python3 bench/gpu/gbench_record.py "$OUT/prefill_after_fi.gbench.json" -o "$OUT/prefill_after_fi.json" | grep -E "chunk +(512|2048):"
fi
