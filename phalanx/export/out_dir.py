"""Write an export directory atomically: into a hidden sibling, renamed onto --out only once complete.

A crash or a Ctrl-C halfway leaves the hidden directory behind (removed on the next try), never a
half-written model where a user or Ollama would pick it up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from phalanx.errors import PhalanxError


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse to overwrite a non-empty directory (or any file) at `out` unless forced."""
    if out.exists() and not out.is_dir():
        raise PhalanxError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PhalanxError(f"--out {out} already exists and is not empty; pass --force to replace it")


@contextlib.contextmanager
def atomic_out_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success it replaces `out`, on failure it is removed."""
    out = Path(out).absolute()
    check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Next to `out`, so the final rename stays on one filesystem and is atomic.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            # A directory cannot be renamed onto a non-empty one: move the old one aside first, and drop
            # it only after the new one is in place.
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
