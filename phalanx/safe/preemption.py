"""Preemption in a rank: SIGTERM (what Slurm, Kubernetes and spot reclaim send before the kill) asks the
rank to stop at the next step boundary, where the trainer saves a checkpoint and exits 143.

The signal only sets a flag; the ranks agree on it inside the all-reduce every step already makes (the
trainer sums the flags with the loss), so they all stop after the same step, none is left waiting in a
collective for a peer that stopped, and the checkpoint they save is a whole one. Before the training loop starts there is nothing newer than the
checkpoint the rank resumes from, so a SIGTERM then ends the rank at once (still 143): a rank still
importing torch or waiting in the rendezvous must not hold up the stop.
"""

from __future__ import annotations

import os
import signal
import time


class Preemption:
    def __init__(self) -> None:
        self.requested_at: float | None = None  # monotonic time of the first SIGTERM
        self.training = False  # in the step loop: stop at a step boundary, not at once

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if not self.training:
            from phalanx.errors import PreemptedError

            os._exit(PreemptedError.exit_code)  # nothing to save yet; os._exit: no waiting on other threads
        if self.requested_at is None:
            self.requested_at = time.monotonic()

    @property
    def requested(self) -> float:
        """1.0 once a SIGTERM came, else 0.0: summed over the ranks, above 0 means stop."""
        return 0.0 if self.requested_at is None else 1.0


# One per rank process: the signal handler and the trainer share it.
PREEMPTION = Preemption()
