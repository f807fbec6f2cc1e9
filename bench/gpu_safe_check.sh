#!/usr/bin/env bash
# The node agent on a GPU: a killed rank and a hung rank, recovered, on the demo model in bf16.
# Writes results under ${OUT:-bench-out}/. Usage: OUT=dir bash bench/gpu_safe_check.sh
set -uo pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
T="python3 -m phalanx train run.dir=/tmp/runs train.max_steps=60 train.eval_interval=30 checkpoint.interval=10 --json"
$T run.name=clean 2>"$OUT/clean.err" | tail -1 | tee "$OUT/clean.json"
$T run.name=kill 'safe.inject=[{fault: kill, rank: 0, step: 25}]' 2>"$OUT/kill.err" | tail -1 | tee "$OUT/kill.json"
$T run.name=hang safe.hang_floor_s=3 'safe.inject=[{fault: hang, rank: 0, step: 35}]' 2>"$OUT/hang.err" | tail -1 | tee "$OUT/hang.json"
$T run.name=nan 'safe.inject=[{fault: nan, rank: 0, step: 33}]' 2>"$OUT/nan.err" | tail -1 | tee "$OUT/nan.json"
for r in kill hang nan; do cp /tmp/runs/$r/events.jsonl "$OUT/$r-events.jsonl"; done
python3 - "$OUT" <<'PY'
import json, sys
def losses(run):
    return {m["step"]: m["loss"] for m in map(json.loads, open(f"/tmp/runs/{run}/metrics.jsonl")) if "loss" in m}
clean = losses("clean")
for run in ("kill", "hang", "nan"):
    other = losses(run)
    diff = max(abs(other[s] - clean[s]) for s in clean)
    print(run, "steps", len(other), "bit-identical" if other == clean else f"max |diff| {diff:.3g}")
PY
tail -n 2 "$OUT"/*.err
