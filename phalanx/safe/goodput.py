"""Goodput: where the wall time of a `phalanx train` went, from its event log and step metrics.

Buckets, in seconds:
  productive       steps whose result the run kept
  redone           steps run again after a restart or rollback (their first runs were lost)
  skipped          steps whose update the numerics guard threw away
  eval             validation
  checkpoint_save  saves, failed ones included
  checkpoint_load  resumes and rollbacks
  startup          from the command to the first step, less loading and step-0 evaluation
  detection        from a fault to its detection (a hang's whole stall; a crash's last heartbeat)
  restart          from a detection until steps run again (stopping ranks, rendezvous, start-up), less
                   checkpoint loading
  other            the rest (logging, progress, the unfinished step at a fault)
ETTR (effective training time ratio) = productive / wall.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from phalanx.run.records import read_events
from phalanx.run.throughput import run_throughput

FAILURES = ("worker_failed", "hang_detected")  # one event per incident, from the node agent
# Weights read before training: a checkpoint of the run, or the pretrained checkpoint it starts from.
LOADS = ("checkpoint_loaded", "pretrained_loaded")
FAULT_KINDS = {
    "worker_failed": "crash",
    "hang_detected": "hang",
    "save_failed": "save_failed",
    "checkpoint_corrupt": "corrupt_checkpoint",
}


def account(events: list[dict], metrics: list[dict], wall_start: float, wall_end: float) -> dict[str, Any]:
    """The `restarts`, `faults`, `stragglers`, `goodput` and `ettr` of one launch."""
    events = [e for e in events if wall_start <= e["time"] <= wall_end]
    steps = [m for m in metrics if "loss" in m and wall_start <= m.get("time", 0) <= wall_end]
    evals = [m for m in metrics if "eval_seconds" in m and wall_start <= m.get("time", 0) <= wall_end]
    wall = wall_end - wall_start

    last_run = {m["step"]: i for i, m in enumerate(steps)}  # the run of each step that counts
    kept = [m for i, m in enumerate(steps) if last_run[m["step"]] == i]
    buckets = {
        "productive": sum(m["step_seconds"] for m in kept if "skipped" not in m),
        "redone": sum(m["step_seconds"] for i, m in enumerate(steps) if last_run[m["step"]] != i),
        "skipped": sum(m["step_seconds"] for m in kept if "skipped" in m),
        "eval": sum(m["eval_seconds"] for m in evals),
        # What saving stopped training for: all of a synchronous save, the staging of an asynchronous one.
        "checkpoint_save": sum(
            e.get("stall_seconds", e.get("seconds", 0.0))
            for e in events
            if e["kind"] in ("checkpoint_saved", "save_failed")
        ),
        "checkpoint_load": _total(events, LOADS),
        "startup": _startup(events, evals, wall_start),
        "detection": sum(e.get("stalled_for") or 0.0 for e in events if e["kind"] in FAILURES),
        "restart": _restart_time(events, evals),
    }
    buckets["other"] = max(0.0, wall - sum(buckets.values()))
    faults = Counter(_fault_kind(e) for e in events if e["kind"] in FAULT_KINDS)
    faults.update(e["anomaly"] for e in events if e["kind"] == "anomaly")
    return {
        "restarts": sum(e["kind"] == "restart" for e in events),
        "faults": dict(faults),
        "stragglers": _stragglers(events),
        "goodput": {k: round(v, 3) for k, v in buckets.items()},
        "ettr": buckets["productive"] / wall if wall > 0 else None,
    }


# Failures of ranks that are not crashes of their code, by the worker_failed event's reason (safe/agent.py).
FAILURE_REASONS = ("out_of_memory", "agent_frozen", "fork_server_died")


def _fault_kind(event: dict) -> str:
    """A failure's kind as the summary counts it: a rank out of memory, or ranks that stopped with their
    frozen agent or died with their fork server, are not crashes of the code."""
    if event["kind"] == "worker_failed" and event.get("reason") in FAILURE_REASONS:
        return event["reason"]
    return FAULT_KINDS[event["kind"]]


def run_report(run_dir: Path, metrics: list[dict], wall_start: float, wall_end: float) -> dict[str, Any]:
    """What `phalanx train` adds to the summary at the end of a launch: this launch's goodput, and the
    run's tokens_per_sec, achieved_tflops and mfu over all its launches (phalanx/run/throughput.py, the
    one definition the store and the dashboard show too)."""
    events = read_events(run_dir)
    return {**account(events, metrics, wall_start, wall_end), **run_throughput(metrics, events)}


def _total(events: list[dict], kinds: tuple[str, ...]) -> float:
    return sum(e.get("seconds", 0.0) for e in events if e["kind"] in kinds)


def _startup(events: list[dict], evals: list[dict], wall_start: float) -> float:
    """From the command to the first step (data preparation included), less loading and step-0 eval;
    cut short by a fault before any step, from which on the time is detection and restart."""
    end = next((e for e in events if e["kind"] in ("training_started",) + FAILURES), None)
    if end is None:
        return 0.0
    busy = _total([e for e in events if e["time"] <= end["time"]], LOADS)
    busy += sum(m["eval_seconds"] for m in evals if m["step"] == 0 and m["time"] <= end["time"])
    stalled = end.get("stalled_for") or 0.0  # counted as detection
    return max(0.0, end["time"] - wall_start - busy - stalled)


def _restart_time(events: list[dict], evals: list[dict]) -> float:
    """From each detected fault until training runs again, less checkpoint loading and evaluation."""
    total, detected = 0.0, None
    for e in events:
        if e["kind"] in FAILURES and detected is None:
            detected = e["time"]
        elif e["kind"] == "training_started" and detected is not None:
            between = [x for x in events if detected <= x["time"] <= e["time"]]
            busy = _total(between, LOADS)
            busy += sum(m["eval_seconds"] for m in evals if detected <= m["time"] <= e["time"])
            total += max(0.0, e["time"] - detected - busy)
            detected = None
    return total


def _stragglers(events: list[dict]) -> list[dict]:
    worst: dict[int, dict] = {}
    for e in events:
        if e["kind"] == "straggler":
            rank = e["straggler_rank"]
            entry = worst.setdefault(
                rank, {"rank": rank, "node": e["straggler_node"], "score": e["score"], "alerts": 0}
            )
            entry["score"] = min(entry["score"], e["score"])
            entry["alerts"] += 1
    return sorted(worst.values(), key=lambda s: s["rank"])
