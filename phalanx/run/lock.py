"""The run lock: one launch owns a run directory at a time."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.run.layout import RunDir


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Held by `phalanx train` for the whole launch, and by every other command that writes into a run
    directory (`data prepare`, `runs import`): a second writer would rewrite the config the ranks re-read
    on restart, or move the live checkpoints aside."""
    run = RunDir(run_dir)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        handle = open(run.lock, "a+")
    except OSError as exc:
        raise PhalanxError(f"cannot create run directory {run.path}: {exc.strerror}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PhalanxError(f"{run.path} is in use by a running `phalanx train` (or another command writing "
                               "into it); wait for it or pick another run.name") from None
        yield
