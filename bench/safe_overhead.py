"""Cost of keeping a run alive, and how fast faults are caught and survived.

1. The per-step cost of monitoring, measured directly: heartbeats, the straggler bookkeeping and the
   numerics guard, timed in a loop, against a training step of the demo model.
2. The same end to end: median step time of `phalanx train` with monitoring on and off, alternated.
3. Detection and recovery: a 2-rank drill with a killed rank and one with a hung rank; times from the
   fault to its detection, to the restart, and to the first step after it.

Usage: .venv/bin/python bench/safe_overhead.py [--runs DIR] [--repeats N]   (prints JSON and a table)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phalanx.safe.heartbeat import ENV_FILE, Heartbeat, HeartbeatBoard
from phalanx.safe.numerics import NumericsGuard

STEP = [
    "train.seq_len=128",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.max_steps=80",
    "train.eval_interval=1000",
    "checkpoint.interval=1000",
    "train.warmup_steps=5",
]
OFF = ["safe.heartbeats=false", "safe.straggler_window=0", "safe.numerics=none"]
DRILL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.max_seq_len=64",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=60",
    "train.eval_interval=1000",
    "checkpoint.interval=10",
    "safe.hang_floor_s=2",
]


def phalanx(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", *args, "--json"], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def monitoring_cost_per_step(micro_batches: int = 1, n: int = 20000) -> float:
    """Seconds of monitoring work per training step, timed in a tight loop."""
    with tempfile.TemporaryDirectory() as tmp:
        board = HeartbeatBoard(Path(tmp) / "hb", 1)
        os.environ[ENV_FILE] = str(Path(tmp) / "hb")
        heartbeat = Heartbeat(0)
        guard, compute = NumericsGuard(6.0, 100), []
        t0 = time.perf_counter()
        for step in range(n):
            heartbeat.beat("data", step)
            for _ in range(micro_batches):
                heartbeat.beat("forward")
                heartbeat.beat("backward")
            heartbeat.beat("collective")
            heartbeat.beat("optimizer")
            heartbeat.step_done(step, 0.1)
            compute.append(0.01)
            if guard.check(3.0, 1.0) is None:
                guard.accept(3.0)
        seconds = (time.perf_counter() - t0) / n
        del os.environ[ENV_FILE]
        board.close()
    return seconds


def overhead_ab(runs: Path, repeats: int) -> dict:
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(repeats):
        for mode in ("on", "off"):
            name = f"overhead-{mode}-{i}"
            summary = phalanx(
                f"run.dir={runs}", f"run.name={name}", "checkpoint.resume=never", *STEP, *(OFF if mode == "off" else [])
            )
            steps = [
                m["step_seconds"]
                for m in read_jsonl(Path(summary["run_dir"]) / "metrics.jsonl")
                if "loss" in m and m["step"] > 5
            ]
            medians[mode].append(statistics.median(steps))
    on, off = statistics.median(medians["on"]), statistics.median(medians["off"])
    return {
        "median_step_on_s": on,
        "median_step_off_s": off,
        "difference_pct": 100 * (on - off) / off,
        "per_run_medians": medians,
    }


def drill(runs: Path, name: str, fault: dict) -> dict:
    summary = phalanx(
        f"run.dir={runs}",
        f"run.name={name}",
        "checkpoint.resume=never",
        *DRILL,
        "--nproc",
        "2",
        f"safe.inject={json.dumps([fault])}",
    )
    run_dir = Path(summary["run_dir"])
    events = read_jsonl(run_dir / "events.jsonl")
    injected = next(e["time"] for e in events if e["kind"] == "fault_injected")
    detected = next(e for e in events if e["kind"] in ("worker_failed", "hang_detected"))
    restart = next(e["time"] for e in events if e["kind"] == "restart")
    resumed = [e["time"] for e in events if e["kind"] == "training_started"][-1]
    first_step = min(m["time"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m and m["time"] > resumed)
    return {
        "fault_to_detection_s": detected["time"] - injected,
        "detection_to_restart_s": restart - detected["time"],
        "fault_to_first_step_after_restart_s": first_step - injected,
        "restarts": summary["restarts"],
        "ettr": summary["ettr"],
        "goodput": summary["goodput"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-safe"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = args.runs.resolve()
    cost = monitoring_cost_per_step()
    ab = overhead_ab(runs, args.repeats)
    result = {
        "monitoring_cost_per_step_us": cost * 1e6,
        "monitoring_cost_pct_of_step": 100 * cost / ab["median_step_off_s"],
        "ab": ab,
        "crash": drill(runs, "drill-kill", {"fault": "kill", "rank": 1, "step": 20}),
        "hang": drill(runs, "drill-hang", {"fault": "hang", "rank": 1, "step": 25}),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
