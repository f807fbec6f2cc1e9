"""Time from command to first training step: a local `phalanx train --nproc 2` against the same run
submitted with `phalanx cluster slurm ... --submit` (one node agent with 2 ranks on CPU) to the Slurm
that scripts/start_slurm.sh starts on this machine.

The clock starts when the command is started and stops at the `time` of the run's first training step in
its metrics.jsonl. Runs alternate (local, Slurm, local, ...) on a warm prepared-data cache, so both pay
the same imports, data checks and rendezvous; the difference is Slurm's: sbatch, scheduling, the batch
script and srun. Usage: python bench/slurm_first_step.py [--tries 3] [--work /tmp/phalanx-slurm-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.max_seq_len=64",
    "data.vocab_size=384",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=12",
    "train.warmup_steps=2",
    "train.eval_interval=6",
    "train.eval_batches=4",
    "checkpoint.interval=4",
    "checkpoint.keep=5",
]


def first_step_time(run_dir: Path, timeout: float = 600) -> float:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line) if line.endswith("}") else {}
                if "loss" in record:
                    return record["time"]
        time.sleep(0.05)
    raise SystemExit(f"{run_dir}: no training step after {timeout} s")


def wait_done(job: str) -> None:
    while True:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
        if any(f"JobState={s}" in out for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")):
            return
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/phalanx-slurm-bench"))
    opts = parser.parse_args()
    os.environ["SLURM_CONF"] = subprocess.run(
        ["bash", str(ROOT / "scripts" / "start_slurm.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    shutil.rmtree(opts.work, ignore_errors=True)
    opts.work.mkdir(parents=True)
    sys.path.insert(0, str(ROOT))
    from phalanx.data.corpus import iter_documents, resolve_sources

    sources = [
        s for s in resolve_sources(["builtin:shakespeare"], ROOT) if s.path.stem in ("romeo-and-juliet", "macbeth")
    ]
    corpus = opts.work / "plays.txt"
    corpus.write_text("\n\n".join(iter_documents(sources)))
    args = [*TINY, f"data.sources=[{corpus}]", f"run.dir={opts.work / 'runs'}"]
    phalanx = [sys.executable, "-m", "phalanx"]
    subprocess.run([*phalanx, "data", "prepare", *args, "run.name=warm", "--json"], check=True, capture_output=True)
    results: dict[str, list[float]] = {"local": [], "slurm": []}
    for i in range(opts.tries):
        name = f"local-{i}"
        t0 = time.time()
        subprocess.run(
            [*phalanx, "train", *args, f"run.name={name}", "--nproc", "2", "--json"], check=True, capture_output=True
        )
        results["local"].append(first_step_time(opts.work / "runs" / name) - t0)
        name = f"slurm-{i}"
        t0 = time.time()
        proc = subprocess.run(
            [
                *phalanx,
                "cluster",
                "slurm",
                *args,
                f"run.name={name}",
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--cpu",
                "--out",
                str(opts.work / f"{name}.sbatch"),
                "--submit",
                "--json",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        results["slurm"].append(first_step_time(opts.work / "runs" / name) - t0)
        wait_done(json.loads(proc.stdout)["job_id"])
        print(f"try {i + 1}: local {results['local'][-1]:.2f} s, slurm {results['slurm'][-1]:.2f} s", flush=True)
    for kind, values in results.items():
        print(f"{kind}: median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
