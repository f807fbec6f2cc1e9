"""Heartbeats between ranks and their node agent through a small shared, memory-mapped file.

Each local rank owns one fixed-size slot: step, phase, pid, the monotonic time of its last beat and its
last step's duration. A beat is one struct.pack_into into the mapping: no syscall, no lock, about a
microsecond, so ranks beat at every phase change. The agent reads all slots on each monitoring tick.
CLOCK_MONOTONIC is system-wide on Linux, so the agent can compare the ranks' times with its own.

The beats go the other way too: a header slot holds the agent's pid and its own beat, written by a
thread of the agent every AGENT_BEAT_SECONDS. Each rank watches it (AgentWatch) and exits when its agent
is gone or frozen, so that no rank trains on unsupervised (a parent-death signal covers the common
case, `kill -9` of the agent; this catches the rest). The file is named after the agent's pid, so that
the next launch can remove the boards of agents that died without removing their own.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phalanx.run.lock import pid_alive

ENV_FILE = "PHALANX_HEARTBEAT_FILE"
HEADER = struct.Struct("<qd")  # the agent's pid, its beat time (monotonic)
# step, phase, pid, beat time (monotonic), last step seconds, sync points entered (see Heartbeat.beat)
SLOT = struct.Struct("<qiiddq")
FILE_PREFIX = "phalanx-heartbeat-"  # then the agent's pid and a random part: phalanx-heartbeat-PID-XXXX
AGENT_BEAT_SECONDS = 0.5
# A rank gives its agent this long without a beat before it counts it frozen. Generous: the beating
# thread only needs the GIL for a moment, but a host swapping hard can starve it for seconds.
AGENT_STALE_SECONDS = 30.0
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
    progress: int = 0  # sync points of the job entered this attempt: the rank behind the others has fewer


class HeartbeatBoard:
    """The agent's side: creates the file, clears it for each attempt, reads the slots, and beats for
    the agent itself from a thread of its own (so a main thread waiting on its ranks still beats)."""

    def __init__(self, path: Path, local_world_size: int):
        self.path, self.n = Path(path), local_world_size
        size = HEADER.size + SLOT.size * local_world_size
        self.path.write_bytes(bytes(size))
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        self._stop = threading.Event()
        self._beat_agent()
        self._beater = threading.Thread(target=self._beat_forever, name="phalanx-agent-beat", daemon=True)
        self._beater.start()

    def _beat_agent(self) -> None:
        HEADER.pack_into(self._map, 0, os.getpid(), time.monotonic())

    def _beat_forever(self) -> None:
        while not self._stop.wait(AGENT_BEAT_SECONDS):
            self._beat_agent()

    def clear(self) -> None:
        self._map[HEADER.size :] = bytes(len(self._map) - HEADER.size)

    def read(self) -> list[Beat]:
        beats = []
        for i in range(self.n):
            step, phase, pid, when, last, progress = SLOT.unpack_from(self._map, HEADER.size + i * SLOT.size)
            beats.append(Beat(i, step, PHASES[phase] if 0 <= phase < len(PHASES) else "?", pid, when, last, progress))
        return beats

    def close(self) -> None:
        self._stop.set()
        self._beater.join()
        self._map.close()
        self.path.unlink(missing_ok=True)


def open_board(local_world_size: int) -> HeartbeatBoard:
    """This agent's board, in /dev/shm (memory: no beat ever reaches a disk), or in the temp directory where
    /dev/shm is not writable or has no room for it: a full /dev/shm must not stop a launch (the agent then
    starts its ranks cold, safe/agent.py). The boards that dead agents left there go first."""
    import tempfile

    if os.access("/dev/shm", os.W_OK):
        try:
            return _new_board(Path("/dev/shm"), local_world_size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return _new_board(Path(tempfile.gettempdir()), local_world_size)


def _new_board(directory: Path, local_world_size: int) -> HeartbeatBoard:
    remove_stale_boards(directory)
    path = board_path(directory)
    try:
        return HeartbeatBoard(path, local_world_size)
    except OSError:
        path.unlink(missing_ok=True)  # the empty file board_path made
        raise


def board_path(directory: Path) -> Path:
    """A fresh, unused board file name for this agent in `directory` (/dev/shm where it is writable)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix=f"{FILE_PREFIX}{os.getpid()}-", dir=directory)
    os.close(fd)
    return Path(path)


def remove_stale_boards(directory: Path) -> list[Path]:
    """Delete the boards of agents that are gone (killed before they could remove theirs); returns them."""
    removed = []
    for path in Path(directory).glob(f"{FILE_PREFIX}*-*"):
        owner = path.name[len(FILE_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


class AgentWatch:
    """A rank's watch over its node agent: a daemon thread that calls `on_gone(reason)` once the agent
    that owns the board is gone (its pid dead, or this process reparented away from it) or its beat is
    older than `stale_after` seconds. The thread blocks the signals the rank handles itself, so they
    are always delivered to the main thread (faulthandler's stack dump names the thread that took it)."""

    def __init__(
        self,
        path: Path,
        on_gone: Callable[[str], None],
        stale_after: float = AGENT_STALE_SECONDS,
        interval: float = AGENT_BEAT_SECONDS,
    ):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.on_gone, self.stale_after, self.interval = on_gone, stale_after, interval
        self.agent_pid = HEADER.unpack_from(self._map, 0)[0]
        self._parent = os.getppid()
        self._thread = threading.Thread(target=self._watch, name="phalanx-agent-watch", daemon=True)
        self._thread.start()

    def reason(self) -> str | None:
        """Why the agent counts as gone, or None while it is alive and beating."""
        pid, when = HEADER.unpack_from(self._map, 0)
        if self._parent == pid and os.getppid() != pid:
            return f"the node agent (pid {pid}) exited: this rank was left to another parent"
        if not pid_alive(pid):
            return f"the node agent (pid {pid}) is gone"
        silent = time.monotonic() - when
        if silent > self.stale_after:
            return f"the node agent (pid {pid}) has not beaten for {silent:.0f} s"
        return None

    def _watch(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})
        exited = _exit_waiter(self.agent_pid)
        while True:
            if exited(self.interval):  # at once, where the kernel can tell (a zombie still looks alive)
                self.on_gone(f"the node agent (pid {self.agent_pid}) is gone")
                return
            reason = self.reason()
            if reason is not None:
                self.on_gone(reason)
                return


def _exit_waiter(pid: int) -> Callable[[float], bool]:
    """wait(seconds): True as soon as process `pid` exits, else False after that long (a pidfd, Linux
    5.3+: a rank forked by the warm server is not the agent's child, so no parent-death signal tells it
    at once). Where there is no pidfd it only sleeps, and the watch's pid check notices."""
    try:
        poller = select.poll()
        poller.register(os.pidfd_open(pid), select.POLLIN)  # the fd lives as long as the watch
    except (AttributeError, OSError):  # no pidfd here, or the agent already gone: the pid check says so
        return lambda seconds: time.sleep(seconds) or False
    return lambda seconds: bool(poller.poll(seconds * 1000))


class Heartbeat:
    """A rank's side, writing into the file its agent named in PHALANX_HEARTBEAT_FILE. With no file
    (heartbeats off, or no agent) every call is a cheap no-op."""

    def __init__(self, local_rank: int, enabled: bool = True):
        path = os.environ.get(ENV_FILE) if enabled else None
        self._map = None
        if path:
            with open(path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), 0)
        self._offset = HEADER.size + local_rank * SLOT.size
        self._pid = os.getpid()
        self.step, self._last, self.progress = 0, 0.0, 0

    def beat(self, phase: str, step: int | None = None, counted: bool = True) -> None:
        """Enter `phase`. Every rank of the job passes the same phases in the same order (each one ends at,
        or holds, a collective of the job's group: the FSDP all-gathers of forward, the gradient
        reductions of backward, the step's all-reduce), so the count of phases entered is the count of
        the job's sync points a rank has reached, as a collective flight recorder counts collectives: when
        the ranks hang, the one with the fewest has not entered the collective the others wait in.
        counted=False: a phase outside that common sequence (a fault drill's own side collective)."""
        if self._map is not None:
            if step is not None:
                self.step = step
            if counted:
                self.progress += 1
            SLOT.pack_into(
                self._map,
                self._offset,
                self.step,
                PHASE_CODE[phase],
                self._pid,
                time.monotonic(),
                self._last,
                self.progress,
            )

    def step_done(self, step: int, seconds: float) -> None:
        self._last = seconds
        self.beat("data", step)  # the next thing a rank does after a step is fetch the next batch
