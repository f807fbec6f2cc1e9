"""What a run directory keeps of its faults: a retention rule applied at every launch (node 0, under the
run lock), so forensics stay readable and the directory does not grow with every incident.

- stacks/: a stack file that is empty (a rank's faulthandler file that never received a dump, left by
  a rank that was killed) says nothing and is removed; the newest `keep_stacks` attempts' files stay.
- checkpoints/corrupt-step_N (checkpoints set aside as corrupt, kept for inspection): the newest
  `keep_corrupt` stay, older ones are deleted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from phalanx.run.layout import RunDir

KEEP_CORRUPT = 2
KEEP_STACK_ATTEMPTS = 5
_STACK_FILE = re.compile(r"attempt(\d+)-rank\d+\.txt")
_CORRUPT = re.compile(r"corrupt-step_(\d+)")


def apply_retention(
    run_dir: Path, keep_corrupt: int = KEEP_CORRUPT, keep_stacks: int = KEEP_STACK_ATTEMPTS
) -> list[Path]:
    """Remove what the rule says goes; returns the paths removed."""
    run = RunDir(run_dir)
    removed: list[Path] = []
    if run.stacks.is_dir():
        files = [(int(m[1]), p) for p in run.stacks.iterdir() if (m := _STACK_FILE.fullmatch(p.name))]
        attempts = sorted({a for a, _ in files}, reverse=True)[:keep_stacks]
        for attempt, path in files:
            if attempt not in attempts or path.stat().st_size == 0:
                path.unlink(missing_ok=True)
                removed.append(path)
    if run.checkpoints.is_dir():
        corrupt = sorted((int(m[1]), p) for p in run.checkpoints.iterdir() if (m := _CORRUPT.fullmatch(p.name)))
        for _, path in corrupt[:-keep_corrupt] if keep_corrupt else corrupt:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
