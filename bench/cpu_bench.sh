#!/usr/bin/env bash
# CPU figures for BENCHMARKS.md: bench steps of the tiny and 125m presets, then the demo end to end.
# Run on an otherwise idle machine: OUT=dir bash bench/cpu_bench.sh
set -euo pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
PHALANX=${PHALANX:-.venv/bin/phalanx}
B="$PHALANX bench --json --device cpu --warmup 2 --steps 5"
{
  $B tiny --seq-len 256 --micro-batch 16
  $B tiny --seq-len 256 --micro-batch 16 --compile
  $B tiny --seq-len 256 --micro-batch 16 --dtype bfloat16
  $B 125m --seq-len 256 --micro-batch 4
} 2>/dev/null | tee "$OUT/cpu_bench.jsonl"
demo=$(mktemp -d)
start=$(date +%s)
(cd "$demo" && "$OLDPWD/$PHALANX" train --json 2>/dev/null) | tee "$OUT/cpu_demo.json"
echo "demo wall time including start-up and data preparation: $(( $(date +%s) - start )) s" | tee -a "$OUT/cpu_demo.json"
(cd "$demo" && "$OLDPWD/$PHALANX" generate runs/demo "ROMEO:" --max-new-tokens 120 --seed 0) | tee "$OUT/cpu_generate.txt"
rm -rf "$demo"
