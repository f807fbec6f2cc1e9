"""Hang detection on the node agent: which ranks have made no progress for longer than they should.

A rank's limit depends on what it is doing: start-up (until its first step of this attempt is done)
and tear-down (after its last step),
evaluation and checkpoint saves get their own generous timeouts; a training step gets a timeout
calibrated from the step times seen so far (a multiple of their 99th percentile, never below a floor),
unless `safe.hang_timeout_s` fixes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from phalanx.config.schema import SafeSection
from phalanx.safe.heartbeat import Beat

MIN_STEPS_TO_CALIBRATE = 5
WAITING_PHASES = ("backward", "collective")  # phases in which a rank can be blocked by its peers


@dataclass(frozen=True)
class Stall:
    local_rank: int
    step: int
    phase: str
    stalled_for: float  # seconds since the rank's last heartbeat
    limit: float  # the timeout that applied to it
    progress: int = 0  # the job's sync points it entered this attempt (Heartbeat.beat)


class HangDetector:
    def __init__(self, safe: SafeSection):
        self.safe = safe
        self.step_times: deque[float] = deque(maxlen=500)
        self._seen_steps: dict[int, int] = {}
        self._attempt_start = 0.0

    def reset(self, now: float) -> None:
        """A new attempt: ranks that have not beaten yet count as stalled from `now`."""
        self._attempt_start = now
        self._seen_steps.clear()

    def step_timeout(self) -> float:
        if self.safe.hang_timeout_s:
            return self.safe.hang_timeout_s
        if len(self.step_times) < MIN_STEPS_TO_CALIBRATE:
            return self.safe.startup_timeout_s
        p99 = float(np.percentile(np.fromiter(self.step_times, float), 99))
        return max(self.safe.hang_floor_s, self.safe.hang_multiplier * p99)

    def limit(self, beat: Beat) -> float:
        if beat.phase == "eval":
            return self.safe.eval_timeout_s
        if beat.phase == "checkpoint":
            return self.safe.checkpoint_timeout_s
        if beat.phase in ("start", "done") or beat.last_step_seconds == 0.0:  # start-up, tear-down
            return self.safe.startup_timeout_s
        return self.step_timeout()

    def check(self, beats: list[Beat], now: float) -> list[Stall]:
        """Every rank's stall when at least one rank is past its limit, else []."""
        for beat in beats:  # learn step times from each step change
            if beat.step != self._seen_steps.get(beat.local_rank) and beat.last_step_seconds > 0:
                self._seen_steps[beat.local_rank] = beat.step
                self.step_times.append(beat.last_step_seconds)
        stalls = [
            Stall(b.local_rank, b.step, b.phase, now - (b.time or self._attempt_start), self.limit(b), b.progress)
            for b in beats
        ]
        return stalls if any(s.stalled_for > s.limit for s in stalls) else []


def culprit(stalls: list[Stall]) -> Stall:
    """The rank the others wait for. Ranks of one job enter the same sync points in the same order, so the
    one that has entered the fewest (an earlier step, or fewer phases into it) has not reached the
    collective the others sit in. Level with each other, the one stalled in its own work rather than in a
    phase that waits for peers is the likelier cause; among equals, the one silent longest."""
    behind = min((s.step, s.progress) for s in stalls)
    candidates = [s for s in stalls if (s.step, s.progress) == behind]
    return max(candidates, key=lambda s: (s.phase not in WAITING_PHASES, s.stalled_for))
