"""Timing device work properly (warm-up, a device sync around each sample, the median of several), and
the drill that makes one rank slow on purpose.

GPUs run kernels asynchronously: a host clock read right after a launch measures the launch, not the
work. Each sample therefore syncs the device before starting the clock and again before stopping it,
and runs `reps` operations in between so the sync itself is a small part of what is timed.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phalanx.errors import PhalanxError

SLOW_RANK_ENV = "PHALANX_PREFLIGHT_SLOW_RANK"
SLOW_FACTOR_ENV = "PHALANX_PREFLIGHT_SLOW_FACTOR"
DEFAULT_SLOW_FACTOR = 4.0


@dataclass(frozen=True)
class SlowRank:
    """A drill: rank `rank` takes `factor` times as long as it should for everything the preflight
    times. After each timed sample it sleeps (factor - 1) times what the sample took, so its own compute
    figures drop by that factor, and in a loop of collectives its peers wait for it at the next one, as
    they would for a rank with a slow device or link."""

    rank: int
    factor: float = DEFAULT_SLOW_FACTOR

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise PhalanxError(f"the slow rank must be 0 or more, not {self.rank}")
        if not self.factor > 1:
            raise PhalanxError(f"the slow-rank factor must be above 1, not {self.factor}")

    @classmethod
    def from_env(cls) -> SlowRank | None:
        """PHALANX_PREFLIGHT_SLOW_RANK=R [PHALANX_PREFLIGHT_SLOW_FACTOR=F], or None when unset."""
        rank = os.environ.get(SLOW_RANK_ENV, "").strip()
        if not rank:
            return None
        factor = os.environ.get(SLOW_FACTOR_ENV, "").strip() or str(DEFAULT_SLOW_FACTOR)
        try:
            return cls(int(rank), float(factor))
        except ValueError:
            raise PhalanxError(
                f"{SLOW_RANK_ENV} takes a rank number and {SLOW_FACTOR_ENV} a number above 1 (got {rank!r}, {factor!r})"
            ) from None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Times operations on one rank; `stretch` > 1 on the rank a SlowRank drill slows down."""

    def __init__(self, device: torch.device, stretch: float = 1.0):
        self.device, self.stretch = device, stretch

    def sample(
        self, op: Callable[[], object], reps: int = 1, collective: bool = False, previous: float | None = None
    ) -> float:
        """Seconds per operation of one sample of `reps` operations.

        On a drill's slow rank, compute is stretched by sleeping after it, and the sleep counts in the
        rank's own figure. A collective is stretched by sleeping *before* joining it, (stretch - 1)
        times the `previous` sample: the peers wait for the late rank inside the call, so the delay
        shows in their figures as it would for a rank with a slow device or link."""
        sync(self.device)
        if collective and self.stretch > 1 and previous:
            time.sleep((self.stretch - 1.0) * previous * reps)
        start = time.perf_counter()
        for _ in range(reps):
            op()
        sync(self.device)
        elapsed = time.perf_counter() - start
        if not collective and self.stretch > 1:
            time.sleep((self.stretch - 1.0) * elapsed)
            elapsed *= self.stretch
        return elapsed / reps

    def samples(
        self, op: Callable[[], object], warmup: int, samples: int, reps: int = 1, collective: bool = False
    ) -> list[float]:
        previous = None
        for _ in range(warmup):
            previous = self.sample(op, 1, collective, previous)
        times = []
        for _ in range(samples):
            previous = self.sample(op, reps, collective, previous)
            times.append(previous)
        return times

    def median(
        self, op: Callable[[], object], warmup: int, samples: int, reps: int = 1, collective: bool = False
    ) -> float:
        return statistics.median(self.samples(op, warmup, samples, reps, collective))
