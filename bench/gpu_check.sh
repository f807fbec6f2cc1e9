#!/usr/bin/env bash
# GPU figures for BENCHMARKS.md, run on a lent accelerator machine as one script.
# Writes every result under ${OUT:-bench-out}/. Usage: OUT=dir bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # packages the machine's image lacks, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
run() { echo "+ $*" >&2; "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
B="python3 -m phalanx bench --json --warmup 3 --steps 10"
{
  run $B tiny --seq-len 256 --micro-batch 64
  run $B 125m --seq-len 2048 --micro-batch 8
  run $B 125m --seq-len 2048 --micro-batch 8 --compile
  run $B 1b --seq-len 2048 --micro-batch 4
  run $B 1b --seq-len 2048 --micro-batch 4 --compile
  run $B 1b --seq-len 2048 --micro-batch 8 --compile --activation-checkpointing
} 2>"$OUT/bench.err" | tee "$OUT/bench.jsonl"
# The demo config on the GPU: bf16 autocast end to end, then text from it.
run python3 -m phalanx train run.dir=/tmp/runs --json 2>"$OUT/train.err" | tee "$OUT/train.json"
run python3 -m phalanx generate /tmp/runs/demo "ROMEO:" --max-new-tokens 80 --seed 0 2>&1 | tee "$OUT/generate.txt"
tail -n 3 "$OUT/bench.err" "$OUT/train.err"
