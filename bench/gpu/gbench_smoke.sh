#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One device call that checks the GPU benchmarks on Google Benchmark end to end (~5 min on an
# H200 with 16 cores): builds the six gpubench_* targets, runs each in a short configuration
# writing Google Benchmark's JSON, turns each file into its old-shape record with
# bench/gpu/gbench_record.py (printing the old programs' tables), feeds the decode record through
# merge_results.py, results_table.py and ab_compare.py, and, when OLD_DECODE_SRC names a
# pre-port bench/cuda/decode.cu (e.g. `git show 986fdb9:bench/cuda/decode.cu > build/gb-old/decode.cu`,
# carried to the device), builds it and compares the hand-rolled timing (rotated page sets, no
# L2 flush) with the Google Benchmark one (L2 flush) in the same session.
# Writes $OUT/gbench.tgz (the Google Benchmark JSON, the old-shape records, the logs); prints the
# tables (pipe it through `tee $OUT/smoke.txt` to keep them).
# Usage: OUT=DIR [OLD_DECODE_SRC=FILE] bash bench/gpu/gbench_smoke.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/build/gpu-out}
W=$OUT/gbench
mkdir -p "$W"
trap 'tar -C "$OUT" -czf "$OUT/gbench.tgz" gbench && rm -rf "$W"' EXIT
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rc=0
B=build/cuda/bench
old=${OLD_DECODE_SRC:-build/gb-old/decode.cu}
start=$SECONDS
cmake --preset cuda > "$W/configure.log" 2>&1 || { tail -20 "$W/configure.log"; exit 1; }
if [ -f "$old" ]; then
  # the pre-port program against the current headers and bench_support.cuh (which keeps its helpers)
  nvcc -O3 -DNDEBUG -std=c++20 --expt-relaxed-constexpr -lineinfo \
    --generate-code=arch=compute_90,code=[sm_90] -Iinclude -Ibench/cuda -Ibench/measure \
    "$old" -o "$W/gpubench_decode_old" -lbenchmark -lpthread > "$W/old-build.log" 2>&1 &
  old_build=$!
fi
cmake --build build/cuda -j "$(nproc)" --target gpubench_decode gpubench_prefill gpubench_codec \
  gpubench_unpack gpubench_retier_overlap gpubench_e2e_step > "$W/build.log" 2>&1 ||
  { grep -E -A8 "error|FAILED" "$W/build.log" | head -40; exit 1; }
echo "build: $((SECONDS - start)) s"

# name, then the program's arguments (short configurations)
runs=(
  "gpubench_decode --quick --int8r --k4"
  "gpubench_prefill --quick"
  "gpubench_codec"
  "gpubench_unpack"
  "gpubench_retier_overlap"
  "gpubench_e2e_step 64 4096 30 1"
)
for r in "${runs[@]}"; do
  read -r -a a <<< "$r"
  n=${a[0]}
  start=$SECONDS
  timeout 400 "$B/$n" "${a[@]:1}" --out "$W/$n.gbench.json" --commit "$commit" > "$W/$n.log" 2>&1
  status=$?
  ((status == 0)) || { rc=1; echo "$n: exit $status"; tail -20 "$W/$n.log"; }
  echo "== $n ($((SECONDS - start)) s): $(grep -c '_median' "$W/$n.log") medians on the console"
  python3 bench/gpu/gbench_record.py "$W/$n.gbench.json" -o "$W/$n.json" || { rc=1; echo "$n: gbench_record.py failed"; }
done

echo "== merge_results.py (no SDPA control here) and results_table.py"
python3 bench/gpu/merge_results.py "$W/gpubench_decode.gbench.json" /nonexistent "$W/decode-merged.json" > /dev/null || rc=1
python3 bench/gpu/results_table.py "$W/decode-merged.json" > "$W/decode-table.txt" || rc=1
head -12 "$W/decode-table.txt"
echo "== ab_compare.py: the last decode record (A, 81554fa) vs this run (B)"
python3 bench/gpu/ab_compare.py --a bench/results/decode/decode-h200-2026-11-30-run16.json \
  --b "$W/gpubench_decode.gbench.json" | tail -4 || rc=1

if [ -n "${old_build:-}" ]; then
  if wait "$old_build"; then
    echo "== same session: pre-port hand-rolled decode (A, rotated sets) vs Google Benchmark (B, L2 flush), best of 2 each"
    for i in 1 2; do
      "$W/gpubench_decode_old" --quick --no-retier --out "$W/old$i.json" --commit old > "$W/old$i.log" 2>&1 || rc=1
      "$B/gpubench_decode" --quick --no-retier --out "$W/new$i.gbench.json" --commit "$commit" > "$W/new$i.log" 2>&1 || rc=1
    done
    python3 bench/gpu/ab_compare.py --a "$W"/old*.json --b "$W"/new*.gbench.json || rc=1
  else
    echo "old decode build failed:"; tail -20 "$W/old-build.log"
  fi
fi
echo "smoke: exit $rc"
exit $rc
