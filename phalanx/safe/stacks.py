"""Python stacks of a stuck rank, captured before it is killed.

Each rank registers faulthandler on SIGUSR1 at start, writing into its own file in RUN_DIR/stacks/
(RunDir.stack_file).
faulthandler dumps from the C signal handler, so it works even while the rank is blocked inside a C++
collective that never returns to Python.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from pathlib import Path

STACK_SIGNAL = signal.SIGUSR1
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def register_stack_dump(path: Path):
    """Arm SIGUSR1 to dump every thread's stack into `path`; returns the open file (keep it alive)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True, chain=False)
    return handle


def innermost_frame(dump: str) -> str | None:
    """'file:line in function' of the most recent call of the thread that took the signal (the main
    thread, which runs the training loop), else of the first thread listed; None if nothing parses."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    current = [b for b in blocks if b.startswith("Current thread")]
    match = _FRAME.search((current or blocks)[0])
    if not match:
        return None
    return f"{Path(match['file']).name}:{match['line']} in {match['func']}"


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R running, S sleeping, D in the kernel, T stopped, t traced,
    Z zombie), or None if it is gone or the system has no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]  # after "pid (command) ": the command itself may hold spaces


_CANNOT_ANSWER = {
    "T": "stopped (SIGSTOP or a job-control stop)",
    "t": "stopped by a tracer",
    "Z": "already dead (a zombie)",
    "D": "blocked inside the kernel (uninterruptible sleep)",
}


def take_stacks(targets: dict[int, tuple[int, Path]], wait_seconds: float) -> dict[int, str | None]:
    """Ask each rank (rank -> (pid, its stack file)) for its stacks with STACK_SIGNAL and wait up to
    `wait_seconds` for the dumps. Returns rank -> None where a stack came, else why none could be taken;
    that reason is also written into the rank's file, so no stack file is ever left empty unexplained
    (a stopped process cannot run the handler that writes its stack)."""
    for pid, _ in targets.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_seconds

    def dumped(path: Path) -> bool:
        return path.is_file() and path.stat().st_size > 0

    while time.monotonic() < deadline and not all(dumped(path) for _, path in targets.values()):
        if all(
            dumped(path) or process_state(pid) in _CANNOT_ANSWER or process_state(pid) is None
            for pid, path in targets.values()
        ):
            break  # the rest can never answer: no point waiting for them
        time.sleep(0.05)
    reasons: dict[int, str | None] = {}
    for rank, (pid, path) in targets.items():
        if dumped(path):
            reasons[rank] = None
            continue
        state = process_state(pid)
        why = (
            f"no stack: process {pid} is {_CANNOT_ANSWER[state]}, so it could not run its stack dump"
            if state in _CANNOT_ANSWER
            else "no stack: the process is gone"
            if state is None
            else f"no stack: process {pid} (state {state}) did not answer within {wait_seconds:g} s"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(why + "\n")
        reasons[rank] = why
    return reasons
