"""Straggler detection: which ranks are slower than the fastest one, and by how much.

Every `window` steps the ranks all-gather the median of their recent *compute* times: the part of each
step in which a rank works on its own (data loading and forward passes). Whole step times cannot tell
stragglers apart: every collective makes the fast ranks wait for the slow one, so all ranks finish each
step together. Each rank's score is the fastest rank's median divided by its own; ranks below the
threshold that also lose at least `straggler_min_ms` per step are stragglers. Under FSDP the forward holds parameter all-gathers, which dilutes the score.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from phalanx.parallel.distributed import DistEnv


class ComputeClock:
    """A rank's own work in one step. Host time for data loading; for forward passes host time on CPU
    but CUDA events on GPUs, which run asynchronously: host time there would only count kernel launches.
    Read `seconds()` after the step's host sync, when the events have completed."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host, self.events = 0.0, []

    def reset(self) -> None:
        self.host, self.events = 0.0, []

    @contextlib.contextmanager
    def measure(self, host: bool = False) -> Iterator[None]:
        if self.cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host += time.perf_counter() - t0

    def seconds(self) -> float:
        return self.host + sum(start.elapsed_time(end) for start, end in self.events) / 1000


class StragglerDetector:
    def __init__(self, window: int, threshold: float, min_seconds: float, env: DistEnv):
        self.window, self.threshold, self.min_seconds, self.env = window, threshold, min_seconds, env
        self.compute: list[float] = []
        self.nodes = [socket.gethostname()] * env.world_size
        if env.distributed and window:
            dist.all_gather_object(self.nodes, socket.gethostname())

    def record(self, compute_seconds: float) -> None:
        if self.window:
            self.compute.append(compute_seconds)

    def due(self, step: int) -> bool:
        return bool(self.window) and step % self.window == 0 and bool(self.compute)

    def scores(self) -> list[dict]:
        """Collective: every rank's median compute time and score; clears the window."""
        mine = torch.tensor([statistics.median(self.compute)], dtype=torch.float64, device=self.env.device)
        self.compute.clear()
        medians = [torch.zeros_like(mine) for _ in range(self.env.world_size)]
        if self.env.distributed:
            dist.all_gather(medians, mine)
        else:
            medians = [mine]
        values = [m.item() for m in medians]
        fastest = min(values)
        return [
            {"rank": r, "node": self.nodes[r], "median_compute_s": v, "score": fastest / v if v else 1.0}
            for r, v in enumerate(values)
        ]

    def stragglers(self, scores: list[dict]) -> list[dict]:
        fastest = min(s["median_compute_s"] for s in scores)
        return [
            s for s in scores if s["score"] < self.threshold and s["median_compute_s"] - fastest >= self.min_seconds
        ]
