"""Disk checkpoints as the training loop takes them: when a save starts, how its outcome is reported, the
final save's one retry, and which checkpoint is the newest written (what a summary, a preemption line
and a resume name). Writing one is train/checkpoint.py's; where a run resumes from is train/resume.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.run.layout import step_dir_name
from phalanx.safe.heartbeat import Heartbeat
from phalanx.safe.inject import FaultInjector
from phalanx.train.checkpoint import Checkpointer, SaveOutcome


class CheckpointSaves:
    def __init__(
        self,
        checkpointer: Checkpointer,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        heartbeat: Heartbeat,
        faults: FaultInjector,
        emit: Callable[..., None],
        log: Callable[[str], None],
        saved: Callable[[int, Path], None] | None = None,
    ):
        """emit(kind, **details): a run event (rank 0's); log(line): a console line above the progress;
        saved(step, path): a checkpoint is complete on disk (eval.tasks scores it, train/background_eval.py)."""
        self.checkpointer, self.model, self.optimizer = checkpointer, model, optimizer
        self.heartbeat, self.faults, self.emit, self.log = heartbeat, faults, emit, log
        self.on_saved = saved
        self.last_checkpoint: str | None = None  # the newest checkpoint written (or resumed from)
        self.final_save_failed: dict[str, Any] | None = None  # the job exits 8 on it (train_job)

    def save(self, step: int, state: dict[str, Any], final: bool) -> None:
        """Save `step` with trainer state `state`. An asynchronous save returns once started (a later
        publish() reports it); the final one is synchronous and retried once, as no later interval comes."""
        self.heartbeat.beat("checkpoint", step)
        self.report(self.checkpointer.finish(wait=True))  # an async save still being written
        path = self.checkpointer.root / step_dir_name(step)
        for tries in range(2 if final else 1):
            t0 = time.perf_counter()
            error = self.checkpointer.start(
                step, self.model, self.optimizer, state, storage_writer=self.faults.storage_writer(step, path)
            )
            if error is None and self.checkpointer.asynchronous and not final:
                return
            outcome = self.checkpointer.finish(wait=True) if error is None else None
            if outcome is None:
                outcome = SaveOutcome(step, error, time.perf_counter() - t0, time.perf_counter() - t0)
            if self.report(outcome, retry=tries == 0 and final):
                return
        if final:
            self.final_save_failed = {"step": step, "error": outcome.result}

    def publish(self, wait: bool = False) -> None:
        """Report an asynchronous save once it is written (wait: until it is)."""
        self.report(self.checkpointer.finish(wait=wait))

    def saved(self, step: int) -> bool:
        """Whether the newest checkpoint written is `step`'s."""
        return self.last_checkpoint is not None and Path(self.last_checkpoint).name == step_dir_name(step)

    def report(self, outcome: SaveOutcome | None, retry: bool = False) -> bool:
        """An event (and a console line if it failed) for a finished save; whether it succeeded."""
        if outcome is None:
            return False
        times = {"seconds": outcome.write_seconds, "stall_seconds": outcome.stall_seconds}
        if isinstance(outcome.result, Path):
            self.last_checkpoint = str(outcome.result)
            self.emit("checkpoint_saved", step=outcome.step, path=str(outcome.result), **times)
            if self.on_saved is not None:
                self.on_saved(outcome.step, outcome.result)
            return True
        self.emit("save_failed", step=outcome.step, error=outcome.result, retry=retry, **times)
        self.log(f"step {outcome.step}: checkpoint save failed ({outcome.result}); training goes on")
        return False
