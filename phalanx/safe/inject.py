"""Fault injection for drills and tests, driven by `safe.inject`; does nothing unless configured.

Every fault fires on one rank at one step, once per run: firing is recorded as a `fault_injected` event
before the fault acts, and a restarted attempt (or a later launch of the run) skips a fault the event
log says already fired (unless the item has `repeat: true`, for crash-loop drills).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from phalanx.config.schema import FaultSpec
from phalanx.run.checkpoints import latest_checkpoint
from phalanx.run.layout import RunDir
from phalanx.run.records import EventSink, read_events
from phalanx.safe.heartbeat import Heartbeat

# What the `oom` fault asks the allocator for: more than any machine has (1 PiB), so the real allocator
# refuses it at once, as it refuses a batch that does not fit (CPU: "can't allocate memory: you tried to
# allocate N bytes"; GPU: torch.OutOfMemoryError), and nothing is ever allocated.
OOM_BYTES = 1 << 50


class FaultInjector:
    def __init__(
        self,
        specs: list[FaultSpec],
        rank: int,
        events: EventSink,
        run_dir: Path,
        heartbeat: Heartbeat,
        device: torch.device,
    ):
        self.device = device  # where the training tensors live: where an `oom` fault allocates
        fired = {e.get("spec") for e in read_events(run_dir) if e["kind"] == "fault_injected"}
        self._pending = [s for s in specs if s.rank == rank and (s.repeat or _key(s) not in fired)]
        self.rank, self.events, self.heartbeat = rank, events, heartbeat
        self.checkpoints = RunDir(run_dir).checkpoints
        self.slow_seconds = 0.0
        # A hang inside a collective needs a group its peers share but never use: made by every rank
        # (creating a group is itself collective) whenever any rank has such a fault configured.
        wants_side_group = any(s.fault == "hang" and s.phase == "collective" for s in specs)
        self._side_group = dist.new_group(backend="gloo") if wants_side_group and dist.is_initialized() else None

    def _fire(self, kinds: tuple[str, ...], step: int, at_or_after: bool = False) -> FaultSpec | None:
        for spec in self._pending:
            if spec.fault in kinds and (spec.step <= step if at_or_after else spec.step == step):
                self._pending.remove(spec)
                self.events.emit(
                    "fault_injected",
                    rank=self.rank,
                    spec=_key(spec),
                    fault=spec.fault,
                    step=step,
                    phase=spec.phase if spec.fault == "hang" else None,
                    ms=spec.ms or None,
                )
                return spec
        return None

    def in_forward(self, step: int) -> None:
        """Called as a step's forward begins: every fault but nan and fail_save acts here."""
        if self._fire(("corrupt_checkpoint",), step):
            newest = latest_checkpoint(self.checkpoints)
            if newest is not None:
                corrupt_checkpoint(newest)
        if self._fire(("kill",), step):
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no exception handler
        if self._fire(("stop",), step):
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive, silent, and deaf to the stack signal
        if self._fire(("oom",), step):
            torch.empty(OOM_BYTES, dtype=torch.uint8, device=self.device)  # raises the allocator's own error
        if slow := self._fire(("slow",), step):
            self.slow_seconds = slow.ms / 1000
        hang = self._fire(("hang",), step)
        if hang and hang.phase == "forward":
            _block_forever()
        elif hang:  # phase == collective: blocks inside an all-reduce that no peer joins
            self.heartbeat.beat("collective", counted=False)  # a side group's collective, not the job's
            dist.all_reduce(torch.zeros(1), group=self._side_group)
            _block_forever()
        if self.slow_seconds:
            time.sleep(self.slow_seconds)

    def nan_loss(self, step: int) -> bool:
        return self._fire(("nan",), step) is not None

    def storage_writer(self, step: int, path: Path) -> FileSystemWriter | None:
        """A DCP writer that fails like a full disk, for the first save at or after a fail_save step."""
        if self._fire(("fail_save",), step, at_or_after=True):
            return _FailingWriter(path)
        return None


class _FailingWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


def corrupt_checkpoint(path: Path) -> None:
    """Flip bytes in the middle of the checkpoint's largest file, keeping its size."""
    target = max((f for f in path.iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(target.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))


def _key(spec: FaultSpec) -> str:
    """What makes two injected faults the same one: a fault fires once per run, whatever list it is in."""
    return json.dumps(spec.model_dump(exclude={"repeat"}), sort_keys=True)


def _block_forever() -> None:
    while True:
        time.sleep(3600)
