"""After `phalanx eval --tasks` saved its report in a run directory: the report into the run's store too,
where the dashboard and /metrics show it.

A run that is training copies its reports itself (its store writer follows RUN_DIR/eval/, which is how
eval.tasks' reports get there); for any other run this brings the run's store copy up to date as
`phalanx runs import RUN_DIR` does (the report, and whatever else the store lacks of the run). The
report is saved either way: a store that cannot be reached is a warning, not a failed evaluation.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.run.layout import RunDir


def store_report(run_dir: Path) -> str | None:
    """Copy the run's reports into its store; a line saying where they went, None without a store."""
    from phalanx.config.loader import load_config
    from phalanx.observe.availability import store_in_use

    run = RunDir(Path(run_dir))
    if not run.config.is_file():
        return None
    config = load_config(str(run.config), [])
    if not store_in_use(config):
        return None
    if training(run):
        return "the run is training: its store writer copies the report into the run store"
    from phalanx.observe.observer import sync_run_dir
    from phalanx.observe.store import RunStore

    try:
        # The runs root is where the run directory is now (its config may name a relative run.dir).
        store = RunStore.open(config.observe.store, run.path.parent)
        try:
            sync_run_dir(store, run.path)
        finally:
            store.close()
    except PhalanxError as exc:  # down, refused, or the run started training meanwhile
        return f"warning: the report is not in the run store yet ({exc}); `phalanx runs import {run.path}` adds it"
    return "stored in the run store"


def training(run: RunDir) -> bool:
    """Whether a launch holds the run (run/lock.py: its command and ranks hold RUN_DIR/.lock)."""
    try:
        with open(run.lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError:  # a read-only run directory: nobody trains there
        return False
    return False
