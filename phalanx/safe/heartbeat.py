"""Heartbeats from ranks to their node agent through a small shared, memory-mapped file.

Each local rank owns one fixed-size slot: step, phase, pid, the monotonic time of its last beat and its
last step's duration. A beat is one struct.pack_into into the mapping: no syscall, no lock, about a
microsecond, so ranks beat at every phase change. The agent reads all slots on each monitoring tick.
CLOCK_MONOTONIC is system-wide on Linux, so the agent can compare the ranks' times with its own.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

ENV_FILE = "PHALANX_HEARTBEAT_FILE"
SLOT = struct.Struct("<qiidd")  # step, phase, pid, beat time (monotonic), last step seconds
PHASES = ("start", "data", "forward", "backward", "optimizer", "collective", "eval", "checkpoint", "done")
PHASE_CODE = {name: i for i, name in enumerate(PHASES)}


@dataclass(frozen=True)
class Beat:
    local_rank: int
    step: int
    phase: str
    pid: int
    time: float  # 0.0: the rank has not beaten yet
    last_step_seconds: float


class HeartbeatBoard:
    """The agent's side: creates the file, clears it for each attempt, reads the slots."""

    def __init__(self, path: Path, local_world_size: int):
        self.path, self.n = Path(path), local_world_size
        self.path.write_bytes(bytes(SLOT.size * local_world_size))
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SLOT.size * local_world_size)

    def clear(self) -> None:
        self._map[:] = bytes(len(self._map))

    def read(self) -> list[Beat]:
        beats = []
        for i in range(self.n):
            step, phase, pid, when, last = SLOT.unpack_from(self._map, i * SLOT.size)
            beats.append(Beat(i, step, PHASES[phase] if 0 <= phase < len(PHASES) else "?", pid, when, last))
        return beats

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


class Heartbeat:
    """A rank's side, writing into the file its agent named in PHALANX_HEARTBEAT_FILE. With no file
    (heartbeats off, or no agent) every call is a cheap no-op."""

    def __init__(self, local_rank: int, enabled: bool = True):
        path = os.environ.get(ENV_FILE) if enabled else None
        self._map = None
        if path:
            with open(path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), 0)
        self._offset = local_rank * SLOT.size
        self._pid = os.getpid()
        self.step, self._last = 0, 0.0

    def beat(self, phase: str, step: int | None = None) -> None:
        if self._map is not None:
            if step is not None:
                self.step = step
            SLOT.pack_into(self._map, self._offset, self.step, PHASE_CODE[phase], self._pid, time.monotonic(),
                           self._last)

    def step_done(self, step: int, seconds: float) -> None:
        self._last = seconds
        self.beat("data", step)  # the next thing a rank does after a step is fetch the next batch
