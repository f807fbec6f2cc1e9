"""The run lock: one launch owns a run directory at a time, and its ranks hold the lock with it.

The lock is flock(2) on RUN_DIR/.lock. A command takes it exclusively, which succeeds only when no
process holds it in any way, then turns it into a shared lock for as long as it runs, so that the ranks
it starts can take it shared too (hold_shared). A second command's exclusive request fails while the
first command or any of its ranks lives: ranks that outlive their agent (killed with `kill -9`) keep the
run directory locked until they are gone, and the kernel frees their share when they die, however they
die. The holder's pid is written into the file, so that a command finding the lock held by the ranks
of a launch that is gone waits for them to exit (seconds: they die with their agent) instead of
refusing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from phalanx.errors import PhalanxError
from phalanx.run.layout import RunDir

# How long a command waits for the ranks of a launch that is gone to let go of the run directory.
ORPHAN_WAIT_SECONDS = 20.0


@contextlib.contextmanager
def run_lock(run_dir: Path, orphan_wait: float = ORPHAN_WAIT_SECONDS) -> Iterator[bool]:
    """Held by `phalanx train` for the whole launch (and by its ranks, shared), and by every other
    command that writes into a run directory (`data prepare`, `runs import`): a second writer would
    rewrite the config the ranks re-read on restart, or move the live checkpoints aside. Yields whether
    this call created the directory: the one fact a refused command may act on (fresh_run_dir.py), as
    mkdir answers it atomically where an earlier look could be stale."""
    run = RunDir(run_dir)
    try:
        run.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            run.path.mkdir()
            made = True
        except FileExistsError:
            made = False
        handle = open(run.lock, "a+")
    except OSError as exc:
        raise PhalanxError(f"cannot create run directory {run.path}: {exc.strerror}") from None
    with handle:
        _take(handle, run.path, orphan_wait)
        yield made


def _take(handle: IO, path: Path, orphan_wait: float) -> None:
    deadline, said = time.monotonic() + orphan_wait, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            # Shared from here on, so this command's ranks can join. Converting is not atomic (flock(2)):
            # another command may take it exclusively in between, and then this one is the one refused.
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        owner = _recorded_owner(handle)
        if owner is None or pid_alive(owner) or time.monotonic() > deadline:
            break
        if not said:  # the command that took it is gone: what still holds it are its ranks, dying
            print(
                f"waiting for the ranks of a stopped launch (pid {owner}) to let go of {path}",
                file=sys.stderr,
                flush=True,
            )
            said = True
        time.sleep(0.1)
    if owner is not None and not pid_alive(owner):
        raise PhalanxError(
            f"{path} is still held by processes of a launch that is gone (pid {owner}) after "
            f"{orphan_wait:.0f} s; find them with `fuser -v {RunDir(path).lock}` and stop them"
        )
    raise PhalanxError(
        f"{path} is in use by a running `phalanx train` (or another command writing "
        "into it); wait for it or pick another run.name"
    )


def hold_shared(lock_file: Path) -> IO:
    """A rank's share of its launch's lock, held until the returned file is closed or the rank dies."""
    handle = open(lock_file)
    try:
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise PhalanxError(
            f"{lock_file} is held by another command: this rank's launch no longer owns the run directory"
        ) from None
    return handle


def _recorded_owner(handle: IO) -> int | None:
    handle.seek(0)
    text = handle.read().strip()
    return int(text) if text.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill()
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
