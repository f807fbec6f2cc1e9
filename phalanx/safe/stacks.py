"""Python stacks of a stuck rank, captured before it is killed.

Each rank registers faulthandler on SIGUSR1 at start, writing into its own file in RUN_DIR/stacks/
(RunDir.stack_file).
faulthandler dumps from the C signal handler, so it works even while the rank is blocked inside a C++
collective that never returns to Python.
"""

from __future__ import annotations

import faulthandler
import re
import signal
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
