"""How much disk one checkpoint needs, and saying so when a save fails for want of it.

A full disk shows up inside DCP as whatever the writer hit first: an OSError(ENOSPC) wrapped in a
CheckpointException, or torch's zip writer's "unexpected pos 704 vs 598", which carries no errno at
all. Both are recognised here, so the user reads "no space left" and the size a checkpoint needs
(the previous checkpoint's, or params + AdamW moments when there is none yet) rather than the
writer's internals.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import torch

from phalanx.run.checkpoints import list_checkpoints

# fp32 weights plus AdamW's two fp32 moments: what a checkpoint of the model and its optimizer holds.
BYTES_PER_PARAM = 4 * 3
# Below this much free space a failed write is taken as the disk being full (the zip writer's error
# names no errno): a writer fails on its next chunk once less than a chunk is left.
FULL_BELOW_BYTES = 1 << 20


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def needed_bytes(root: Path, n_params: int | None = None, state_bytes: int | None = None) -> tuple[int, str] | None:
    """(bytes, where the figure comes from) for one checkpoint in `root`: the newest one's size, else an
    estimate from the state being saved or from the parameter count; None when nothing tells."""
    existing = list_checkpoints(root) if Path(root).is_dir() else []
    if existing:
        return checkpoint_bytes(existing[-1]), f"the size of {existing[-1].name}"
    if state_bytes:
        return state_bytes, "the model and optimizer state"
    if n_params:
        return n_params * BYTES_PER_PARAM, f"{n_params:,} parameters and their AdamW moments"
    return None


def state_dict_bytes(*state_dicts: dict[str, Any]) -> int:
    """Bytes of every tensor in nested state dicts, at its global size (a DTensor's numel is global)."""
    total = 0

    def walk(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    for sd in state_dicts:
        walk(sd)
    return total


def is_disk_full(exc: BaseException | None, directory: Path) -> bool:
    """An ENOSPC anywhere in the exception, its causes or DCP's per-rank failures; or, for a writer error
    that names no errno, a file system left with (almost) nothing free."""
    if exc is not None and _has_enospc(exc, set()):
        return True
    return free_bytes(directory) is not None and free_bytes(directory) < FULL_BELOW_BYTES


def _has_enospc(exc: BaseException, seen: set[int]) -> bool:
    if id(exc) in seen:
        return False
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    if "No space left on device" in str(exc):
        return True
    failures = getattr(exc, "failures", None) or {}  # DCP: {rank: (exception, traceback)}
    nested = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    nested += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    return any(isinstance(e, BaseException) and _has_enospc(e, seen) for e in nested)


def free_bytes(directory: Path) -> int | None:
    """Free space of the file system holding `directory` (or its nearest existing parent)."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_full_line(directory: Path, needed: tuple[int, str] | None) -> str:
    # No free figure here: at the moment of failure it is ~0, and the partial save is discarded next.
    need = f"; a checkpoint needs about {human(needed[0])} ({needed[1]})" if needed else ""
    return f"no space left on device at {directory}{need}"


def free_now(directory: Path) -> str:
    free = free_bytes(directory)
    return "" if free is None else f"{human(free)} free there now; "


def low_space_warning(root: Path, n_params: int | None) -> str | None:
    """The pre-launch warning when the run directory's file system has less free space than one checkpoint."""
    needed, free = needed_bytes(root, n_params), free_bytes(root)
    if needed is None or free is None or free >= needed[0]:
        return None
    return (
        f"only {human(free)} free at {root}, less than one checkpoint ({human(needed[0])}, {needed[1]}): "
        "saves will fail, and a run whose last save fails ends with exit code 8"
    )


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"
