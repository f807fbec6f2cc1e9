"""A command refused before it did any work leaves no run directory behind that it created, and never
removes one that it did not create.

`phalanx train my.yaml model.vocab_size=100` makes RUN_DIR (the lock, the config, the data pointer) and
only then learns that the vocabulary is too small; without this, every typo would leave a half-made run
that `runs`, the dashboard and the next launch would have to make sense of.

Who made the directory is decided by the run lock's own mkdir (atomic), not by looking first: a look
before the lock can be stale (two launches at once, a slow shared filesystem), and a launch refused by
the lock would then remove the winner's directory, its lock included. The removal happens while the
lock is still held, so no other launch can have started in the directory meanwhile.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

from phalanx.config.schema import Config
from phalanx.run.layout import RunDir
from phalanx.run.lock import run_lock


@contextlib.contextmanager
def owned_run_dir(config: Config, owner: bool = True) -> Iterator[Callable[[], None]]:
    """Around a command's preparations: takes the run lock (when `owner`: node 0 of a launch, or a
    command that writes into the run directory); if the block fails (Ctrl-C included) before it calls
    the yielded `keep()`, the run directory this call created is removed, and so is the runs root if it
    was missing too (with the store and data cache made there). Nothing it did not create is touched."""
    if not owner:
        yield lambda: None
        return
    root_missing = not config.run.dir.exists()
    kept = False

    def keep() -> None:
        nonlocal kept
        kept = True

    with run_lock(config.run_dir) as made:
        try:
            yield keep
        except BaseException:
            if made and not kept:
                shutil.rmtree(config.run_dir, ignore_errors=True)
                if root_missing and not _other_runs(config):
                    shutil.rmtree(config.run.dir, ignore_errors=True)
            raise


def _other_runs(config: Config) -> bool:
    """Whether the runs root holds another run (one started there meanwhile, under another name)."""
    return any(RunDir(p).lock.exists() for p in config.run.dir.iterdir() if p.is_dir())
