"""What several machines must share for one run, checked before a cluster job trains.

- The run directory: every node writes its ranks' records and checkpoints there and resumes from it, so
  on several machines it must be one shared filesystem. Node 0 writes a probe file with a fresh token and
  every other node must read the same token back (a path that merely exists on each machine is not
  enough: each may have its own empty copy).
- The prepared data: node 0 tokenises the corpus once into the content-addressed cache under the runs
  root; every other node then finds it there and must arrive at the same digest (the tokenizer and each
  shard's chunk checksums) before any rank starts, so that no two nodes can train on different tokens.
- The run store: an SQLite file works for one machine; several machines need a store they all reach
  (PostgreSQL, `observe.store`), and SQLite's file locks are unreliable on network filesystems.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import psutil

from phalanx.data.prepare import PreparedData
from phalanx.data.shards import VerifiedShard
from phalanx.errors import PhalanxError
from phalanx.run.layout import RunDir

# Filesystem types (as /proc/mounts names them) whose files live on another machine.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "afs",
        "ncpfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "ocfs2",
        "gfs2",
        "pvfs2",
        "orangefs",
        "wekafs",
        "panfs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "fuse.glusterfs",
        "fuse.ceph",
        "fuse.cephfs",
        "fuse.rclone",
        "fuse.goofys",
        "fuse.mountpoint-s3",
        "fuse.blobfuse2",
        "fuse.lxcfs-network",
    }
)


def filesystem_type(path: Path, mounts: list[tuple[str, str]] | None = None) -> str:
    """The type of the filesystem that holds (or will hold) `path`: the mount with the longest mount
    point above it. `mounts` is (mount point, type) pairs,
    this machine's by default."""
    if mounts is None:
        mounts = [(p.mountpoint, p.fstype) for p in psutil.disk_partitions(all=True)]
    real = os.path.realpath(Path(path).absolute())  # links resolved as far as the path exists
    best, kind = "", "unknown"
    for point, fstype in mounts:
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the last of equal mount points is the one on top
            best, kind = point, fstype
    return kind


def is_network_filesystem(fstype: str) -> bool:
    return fstype in NETWORK_FILESYSTEMS


def write_share_probe(run_dir: Path, token: str) -> None:
    run = RunDir(run_dir)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        run.share_probe(token).write_text(token)
    except OSError as exc:
        raise PhalanxError(f"cannot write into the run directory {run.path}: {exc.strerror}") from None


def sees_share_probe(run_dir: Path, token: str) -> bool:
    try:
        return RunDir(run_dir).share_probe(token).read_text() == token
    except OSError:
        return False


def remove_share_probe(run_dir: Path, token: str) -> None:
    RunDir(run_dir).share_probe(token).unlink(missing_ok=True)


def sqlite_store_dir(store: str | None, runs_root: Path) -> Path | None:
    """The folder of the run store's SQLite file, or None when the store is a server (or off). The rules
    are observe.store's: null is a file in the runs root, a URL is taken as it is, anything else a path."""
    if store == "none":
        return None
    if store is None:
        return Path(runs_root).absolute()
    if "://" in store:
        from sqlalchemy.engine import make_url

        url = make_url(store)
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return None
        return Path(url.database).absolute().parent
    return Path(store).absolute().parent


def store_warning(
    store: str | None, runs_root: Path, machines: int, mounts: list[tuple[str, str]] | None = None
) -> str | None:
    """Why the run store will not serve this cluster job well, or None. `machines` is how many machines
    the job's nodes are on."""
    folder = sqlite_store_dir(store, runs_root)
    if folder is None:
        return None
    fstype = filesystem_type(folder, mounts)
    fix = "set observe.store to a PostgreSQL URL (postgresql://USER@HOST/DB) that every node reaches"
    if is_network_filesystem(fstype):
        return (
            f"the run store is an SQLite file in {folder}, on a network filesystem ({fstype}), where SQLite's "
            f"file locks are unreliable; {fix}"
        )
    if machines > 1:
        return (
            f"the run store is an SQLite file in {folder} while the job spans {machines} machines; "
            f"SQLite on a shared filesystem is unreliable; {fix}"
        )
    return None


def data_digest(data: PreparedData) -> str:
    """A digest of what the ranks will train on: the tokenizer, and every shard's name, length and stored
    chunk checksums (reading the checksums, not the tokens). The same corpus prepared the same way gives
    the same digest wherever it lies; the shards' own checksums then catch bytes changed on disk."""
    h = hashlib.sha256()
    try:
        h.update(Path(data.tokenizer_path).read_bytes())
    except OSError as exc:
        raise PhalanxError(f"cannot read the prepared tokenizer {data.tokenizer_path}: {exc.strerror}") from None
    h.update(json.dumps([data.vocab_size, data.train_tokens, data.val_tokens]).encode())
    for path in data.shards:  # tokens, and fine-tuning's trained flags and example lengths
        shard = VerifiedShard(path)
        h.update(json.dumps([Path(path).name, len(shard), shard.vocab_size]).encode())
        h.update(shard.checksums.tobytes())
    return h.hexdigest()
