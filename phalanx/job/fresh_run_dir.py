"""A command refused before it did any work leaves no run directory behind that it created.

`phalanx train my.yaml model.vocab_size=100` makes RUN_DIR (the lock, the config, the data pointer) and
only then learns that the vocabulary is too small; without this, every typo would leave a half-made run
that `runs`, the dashboard and the next launch would have to make sense of.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator

from phalanx.config.schema import Config


@contextlib.contextmanager
def removed_unless_kept(config: Config, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Around a command's preparations: if the block fails (Ctrl-C included) before it calls the yielded
    `keep()`, the run directory it created is removed again, and so is the runs root if it created that
    too (with the store and data cache it made there). Directories that were there before are left alone."""
    run_made = enabled and not config.run_dir.exists()
    root_made = enabled and not config.run.dir.exists()
    kept = False

    def keep() -> None:
        nonlocal kept
        kept = True

    try:
        yield keep
    except BaseException:
        if run_made and not kept:
            shutil.rmtree(config.run.dir if root_made else config.run_dir, ignore_errors=True)
        raise
