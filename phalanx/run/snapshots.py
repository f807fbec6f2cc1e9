"""Where in-memory snapshots live, as the node agent and the ranks both see them.

A rank's snapshots (phalanx/train/memory_checkpoint.py writes and loads them) live in host shared
memory, one directory per run and launch:

    SHM/phalanx-snapshots-<hash of the run directory>-<node agent pid>/rank_<global rank>/slot_K.bin

three slot files per rank, reused, and a JSON sidecar step_N.json per snapshot naming its slot, written
last (a snapshot counts once its sidecar is there); across nodes, also peer_rank_<source rank>/ with
the copies this node holds of another node's rank's snapshots (step_N.bin, then step_N.json). SHM is
/dev/shm (tmpfs: it outlives the ranks, not the node), or the system temp directory where /dev/shm is
not writable. Two runs, or two launches of one run, never share a directory, so a new launch never
sees an older one's snapshots. The agent reads the newest step every rank has (what a restart resumes
from when it is newer than the disk) and removes its launch's directory when the launch ends; a later
launch removes those of launches whose agent is gone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from phalanx.run.lock import pid_alive

DIR_PREFIX = "phalanx-snapshots-"


def shm_root() -> Path:
    return Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())


def _run_key(run_dir: Path) -> str:
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def launch_dir(run_dir: Path, owner: int, root: Path | None = None) -> Path:
    """The snapshot directory of run `run_dir` under the launch whose node agent is pid `owner`."""
    return (root or shm_root()) / f"{DIR_PREFIX}{_run_key(run_dir)}-{owner}"


def run_snapshot_dirs(run_dir: Path, root: Path | None = None) -> list[Path]:
    """Every launch directory of this run that exists (any launch)."""
    return sorted((root or shm_root()).glob(f"{DIR_PREFIX}{_run_key(run_dir)}-*"))


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove the snapshot directories of launches whose node agent is gone; returns them."""
    removed = []
    for path in (root or shm_root()).glob(f"{DIR_PREFIX}*-*"):
        owner = path.name.rsplit("-", 1)[1]
        if owner.isdigit() and not pid_alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def peer_dir(launch: Path, source_rank: int) -> Path:
    """Where a rank keeps the peer copies it holds of rank `source_rank`'s snapshots (another node's),
    inside its own launch directory: step_N.bin, then the sidecar step_N.json (peer_snapshots.py)."""
    return launch / f"peer_rank_{source_rank}"


def peer_sources(launch: Path) -> dict[int, Path]:
    """Source rank -> the directory of the peer copies this launch holds for it."""
    found = {}
    for path in Path(launch).glob("peer_rank_*"):
        source = path.name[len("peer_rank_") :]
        if source.isdigit():
            found[int(source)] = path
    return found


def sidecar_path(directory: Path, step: int) -> Path:
    """The sidecar of a snapshot (or a peer copy) of `step` in a rank or peer directory."""
    return Path(directory) / f"step_{step:08d}.json"


def write_sidecar(directory: Path, step: int, text: str) -> None:
    """Write the sidecar of `step` whole or not at all (a temporary file, then a rename): it is written
    last, and from then on the snapshot counts."""
    side = sidecar_path(directory, step)
    tmp = side.with_name(f".tmp-{side.name}")
    tmp.write_text(text)
    os.replace(tmp, side)


def complete_steps(rank_dir: Path) -> list[int]:
    """The steps a rank directory holds a complete snapshot of (its sidecar written), oldest first."""
    found = []
    for side in Path(rank_dir).glob("step_*.json"):
        stem = side.stem[len("step_") :]
        if stem.isdigit():
            found.append(int(stem))
    return sorted(found)


def newest_common_step(run_dir: Path, owner: int) -> int | None:
    """The newest step that every rank directory of this launch on this node has a complete snapshot of,
    or None: for the node agent (pid `owner`), what a restart would resume from if it is newer than the
    disk (the ranks still check layout and contents, and agree across nodes)."""
    sets = [set(complete_steps(d)) for d in launch_dir(run_dir, owner).glob("rank_*")]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None
