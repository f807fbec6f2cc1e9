"""The fault soak: one run through the real launcher with many injected faults, before and after the
fast-recovery work, and what each fault cost.

Two gloo ranks, the tiny preset at 8 x 128 tokens (the model of BENCHMARKS.md's monitoring figures),
300 steps, a checkpoint every 25, with the fault schedule of issue 13's soak: 5 kills, 3 hangs, 3 NaN
losses, a failed save, a corrupt checkpoint and 2 slow ranks. "before" starts every rank as a fresh
interpreter and resumes from disk only (safe.warm_restarts=false checkpoint.memory_interval=0);
"after" is warm restarts with an in-memory snapshot every step, "default" the defaults (warm restarts,
snapshots at the interval `auto` picks). Each run's losses are checked against a clean run's, bit for bit.

Per fault, from the run's events: fault to detection (a crash's last heartbeat, a hang's whole stall),
detection to the first step after recovery, and steps redone.

Usage: .venv/bin/python bench/soak.py [--runs DIR] [--steps N] [--modes clean,before,after]  (JSON, table)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = [
    "model.preset=tiny",
    "train.seq_len=128",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.warmup_steps=5",
    "train.eval_interval=1000",
    "checkpoint.keep=3",
    "safe.max_restarts=20",
    "safe.crash_loop_restarts=5",
    "safe.hang_timeout_s=2",
]
MODES = {
    "clean": ["checkpoint.memory_interval=0"],
    "before": ["safe.warm_restarts=false", "checkpoint.memory_interval=0"],
    "after": ["safe.warm_restarts=true", "checkpoint.memory_interval=1"],
    "default": [],  # warm restarts and checkpoint.memory_interval=auto
}


def schedule(steps: int) -> list[dict]:
    """Issue 13's soak faults, spread over the run (steps as fractions of it, so --steps scales them)."""
    at = lambda fraction: max(2, round(steps * fraction))  # noqa: E731
    return [
        {"fault": "slow", "rank": 1, "step": at(0.05), "ms": 20},
        {"fault": "kill", "rank": 1, "step": at(0.10)},
        {"fault": "nan", "rank": 0, "step": at(0.15)},
        {"fault": "hang", "rank": 0, "step": at(0.21)},
        {"fault": "kill", "rank": 0, "step": at(0.28)},
        {"fault": "fail_save", "rank": 0, "step": at(1 / 3)},
        {"fault": "nan", "rank": 1, "step": at(0.37)},
        {"fault": "hang", "rank": 1, "step": at(0.44), "phase": "collective"},
        {"fault": "kill", "rank": 1, "step": at(0.52)},
        {"fault": "slow", "rank": 0, "step": at(0.55), "ms": 20},
        {"fault": "corrupt_checkpoint", "rank": 0, "step": at(0.59)},
        {"fault": "kill", "rank": 0, "step": at(0.61)},
        {"fault": "nan", "rank": 0, "step": at(0.7)},
        {"fault": "hang", "rank": 1, "step": at(0.8)},
        {"fault": "kill", "rank": 1, "step": at(0.9)},
    ]


def train(runs: Path, name: str, steps: int, extra: list[str]) -> dict:
    args = [
        *MODEL,
        f"train.max_steps={steps}",
        "checkpoint.interval=25",
        f"run.dir={runs}",
        f"run.name={name}",
        *extra,
        "--nproc",
        "2",
        "--json",
    ]
    proc = subprocess.run([sys.executable, "-m", "phalanx", "train", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m}


def per_fault(run_dir: Path) -> list[dict]:
    """Each fault's detection, recovery and redone steps, from the events and the metrics."""
    events = read_jsonl(run_dir / "events.jsonl")
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    rows = []
    for i, e in enumerate(events):
        if e["kind"] in ("worker_failed", "hang_detected"):
            kind = "kill" if e["kind"] == "worker_failed" else "hang"
            later = events[i + 1 :]
        elif e["kind"] == "anomaly":
            kind, later = "nan", events[i + 1 :]
        else:
            continue
        back = next((x for x in later if x["kind"] in ("training_started", "rollback")), None)
        if back is None:
            continue
        resumed = back["step"] if back["kind"] == "training_started" else back["to_step"]
        reached = max((m["step"] for m in steps if m["time"] <= e["time"]), default=0)
        first_after = next((m["time"] for m in steps if m["time"] > back["time"]), back["time"])
        rows.append(
            {
                "fault": kind,
                "step": reached,
                "detection_s": round(e.get("stalled_for") or 0.0, 3),
                "to_first_step_s": round(first_after - e["time"], 3),
                "redone_steps": reached - resumed,
                "resumed_from": back.get("source", "disk") if back["kind"] == "training_started" else "rollback",
            }
        )
    loaded = [x for x in events if x["kind"] == "checkpoint_loaded"]
    for row, load in zip([r for r in rows if r["fault"] != "nan"], loaded):
        row["resumed_from"] = load.get("source", "disk")
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {}
    for kind in sorted({r["fault"] for r in rows}):
        mine = [r for r in rows if r["fault"] == kind]
        out[kind] = {
            "count": len(mine),
            "detection_s": round(statistics.median(r["detection_s"] for r in mine), 3),
            "to_first_step_s": round(statistics.median(r["to_first_step_s"] for r in mine), 3),
            "redone_steps": round(statistics.mean(r["redone_steps"] for r in mine), 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", default="clean,before,after")
    opts = parser.parse_args()
    runs = opts.runs or Path(tempfile.mkdtemp(prefix="phalanx-soak-"))
    faults = json.dumps(schedule(opts.steps)).replace('"', "")
    results, clean = {}, None
    for mode in opts.modes.split(","):
        inject = [] if mode == "clean" else [f"safe.inject={faults}"]
        summary = train(runs, f"soak-{mode}", opts.steps, MODES[mode] + inject)
        run_dir = Path(summary["run_dir"])
        result = {
            "ettr": round(summary["ettr"], 3),
            "wall_s": round(summary["wall_seconds"], 1),
            "restarts": summary["restarts"],
            "faults": summary["faults"],
            "goodput": summary["goodput"],
        }
        if mode == "clean":
            clean = losses(run_dir)
        else:
            rows = per_fault(run_dir)
            result.update(per_fault=rows, by_kind=summarise(rows))
            if clean is not None:
                result["losses_identical_to_clean"] = losses(run_dir) == clean
        results[mode] = result
        print(json.dumps({mode: result}), flush=True)
    print("\n| mode | ETTR | restarts | losses = clean |")
    print("|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['ettr']} | {r['restarts']} | {r.get('losses_identical_to_clean', '-')} |")
    print("\n| mode | fault | count | fault to detection | to the first step after | steps redone |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        for kind, k in r.get("by_kind", {}).items():
            print(
                f"| {mode} | {kind} | {k['count']} | {k['detection_s']} s | {k['to_first_step_s']} s | "
                f"{k['redone_steps']} |"
            )


if __name__ == "__main__":
    main()
