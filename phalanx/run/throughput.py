"""A run's throughput: its tokens/s, TFLOP/s and MFU, one definition for every view.

Every place that shows a run's figures (the summary `phalanx train` prints and writes to summary.json,
the run store's runs row and so `phalanx runs list|show|compare`, the dashboard's runs list and tiles,
the dashboard's /metrics) gets them from RunThroughput, fed the same records: rank 0's step records
(RUN_DIR/metrics.jsonl, the store's steps table) and the `training_started` events of the event log.

A figure is the run's average over its training time: the work of the counted steps over the seconds
they took, which is each step's own rate weighted by its `step_seconds`:

  tokens/s         sum(tokens of the counted steps) / sum(their step_seconds); global, all ranks together
  TFLOP/s          sum(model FLOPs of one device in those steps) / the same seconds; per device
  MFU              that TFLOP/s over the device's peak (the time-weighted mean of the steps' MFU);
                   None where no peak is known (a CPU without train.peak_tflops)

Training time is the steps' `step_seconds`: from fetching a step's batch to its optimizer update (data,
forward, backward, the update, the numerics guard's all-reduce). It leaves out evaluation, checkpoint and
in-memory snapshot saves, checkpoint loading, start-up and everything between launches (restarts,
downtime), and the first step of each launch, which compiles kernels and allocates memory (the step
after each `training_started` event); only a run whose every step is such a first step counts them. A
step run twice (before a restart and again after it, or again after a rollback) counts each time it ran:
it was trained, and took its time, twice.

Nothing here reads a file or a database: the callers hand the records in, and the store keeps the
running sums (state()) in its runs row to add each new batch to.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

FIGURES = ("tokens_per_sec", "achieved_tflops", "mfu")  # each step record's own rates; the run's, named the same
LAUNCH = "training_started"  # the event a launch's trainer writes before its first step


class RunThroughput:
    """Running sums over a run's step records. add() takes the records in the order they were written,
    all at once or batch by batch (the store adds each batch it ingests, with state() kept in between);
    either way rates() is the same."""

    def __init__(self, state: dict[str, Any] | None = None):
        state = state or {}
        # Per figure: [sum of value x step_seconds, sum of step_seconds of the steps that have the value].
        self.steady = _sums(state.get("steady"))
        self.first = _sums(state.get("first"))  # the first step of each launch
        self.last_step_time: float | None = state.get("last_step_time")
        self.launches: list[float] = sorted(state.get("launches") or [])  # launch starts after the last step

    def add(self, metrics: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]] = ()) -> None:
        self.launches = sorted(
            self.launches + [e["time"] for e in events if e.get("kind") == LAUNCH and _finite(e.get("time"))]
        )
        for m in metrics:
            seconds = m.get("step_seconds")
            if not _finite(seconds) or seconds <= 0:  # not a training step (an evaluation-only record)
                continue
            at = m.get("time")
            first = False
            if _finite(at):
                first = any(
                    start <= at and (self.last_step_time is None or start > self.last_step_time)
                    for start in self.launches
                )
                self.last_step_time = at if self.last_step_time is None else max(self.last_step_time, at)
            sums = self.first if first else self.steady
            for figure in FIGURES:
                value = m.get(figure)
                if _finite(value):
                    sums[figure][0] += value * seconds
                    sums[figure][1] += seconds
        if self.last_step_time is not None:
            self.launches = [start for start in self.launches if start > self.last_step_time]

    def rates(self) -> dict[str, float | None]:
        """The run's tokens_per_sec, achieved_tflops and mfu (None where no counted step has one)."""
        sums = self.steady if self.steady["tokens_per_sec"][1] > 0 else self.first
        return {figure: (work / seconds if seconds > 0 else None) for figure, (work, seconds) in sums.items()}

    def state(self) -> dict[str, Any]:
        """JSON-ready sums, for RunThroughput(state) to go on from."""
        return {
            "steady": self.steady,
            "first": self.first,
            "last_step_time": self.last_step_time,
            "launches": self.launches,
        }


def run_throughput(metrics: Iterable[dict[str, Any]], events: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """The run's tokens_per_sec, achieved_tflops and mfu from all its step records and events."""
    throughput = RunThroughput()
    throughput.add(metrics, events)
    return throughput.rates()


def _sums(saved: dict[str, list[float]] | None) -> dict[str, list[float]]:
    saved = saved or {}
    return {figure: [float(v) for v in saved.get(figure, (0.0, 0.0))] for figure in FIGURES}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
