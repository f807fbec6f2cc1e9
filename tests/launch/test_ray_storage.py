"""What a cluster job checks about storage before it trains (phalanx/launch/cluster/shared_storage.py):
filesystem types, the shared run-directory probe, the run store warning, and the prepared data's digest."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.data.shards import CRC
from phalanx.launch.cluster.shared_storage import (
    data_digest,
    filesystem_type,
    is_network_filesystem,
    remove_share_probe,
    sees_share_probe,
    sqlite_store_dir,
    store_warning,
    write_share_probe,
)

MOUNTS = [("/", "ext4"), ("/mnt/shared", "nfs4"), ("/mnt/shared/local", "xfs"), ("/scratch", "lustre")]


@pytest.mark.parametrize(
    "path, fstype",
    [
        ("/home/me/runs", "ext4"),
        ("/mnt/shared/runs", "nfs4"),
        ("/mnt/shared", "nfs4"),
        ("/mnt/shared/local/runs", "xfs"),
        ("/mnt/sharedx/runs", "ext4"),
        ("/scratch/a/b", "lustre"),
    ],
)
def test_the_deepest_mount_above_a_path_gives_its_filesystem(path, fstype):
    assert filesystem_type(Path(path), MOUNTS) == fstype


def test_this_machines_own_mounts_are_read():
    assert filesystem_type(Path("/dev/shm/not-there-yet")) == "tmpfs"
    assert not is_network_filesystem(filesystem_type(Path.cwd()))
    assert is_network_filesystem("nfs4") and is_network_filesystem("fuse.sshfs") and not is_network_filesystem("xfs")


def test_the_share_probe_is_seen_only_where_node_0_wrote_it(tmp_path):
    shared, elsewhere = tmp_path / "shared" / "run", tmp_path / "other" / "run"
    write_share_probe(shared, "token-1")
    assert sees_share_probe(shared, "token-1")
    assert not sees_share_probe(shared, "token-2")  # a stale probe of another launch does not count
    assert not sees_share_probe(elsewhere, "token-1")  # another machine's own, empty, run directory
    remove_share_probe(shared, "token-1")
    assert not sees_share_probe(shared, "token-1") and list(shared.iterdir()) == []


@pytest.mark.parametrize(
    "store, expected",
    [
        (None, "/runs"),
        ("none", None),
        ("postgresql://me@db/phalanx", None),
        ("sqlite:////mnt/shared/x.db", "/mnt/shared"),
        ("/mnt/shared/store/p.db", "/mnt/shared/store"),
        ("sqlite://", None),
    ],
)
def test_where_the_sqlite_store_file_lives(store, expected):
    found = sqlite_store_dir(store, Path("/runs"))
    assert (None if found is None else str(found)) == expected


def test_the_store_warning_names_a_network_filesystem_and_several_machines():
    assert store_warning("postgresql://me@db/phalanx", Path("/mnt/shared/runs"), 4, MOUNTS) is None
    assert store_warning(None, Path("/home/me/runs"), 1, MOUNTS) is None  # one machine, a local disk
    on_nfs = store_warning(None, Path("/mnt/shared/runs"), 1, MOUNTS)
    assert "network filesystem (nfs4)" in on_nfs and "observe.store" in on_nfs
    several = store_warning(None, Path("/home/me/runs"), 2, MOUNTS)
    assert "spans 2 machines" in several and "PostgreSQL" in several


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> PreparedData:
    return prepare_data([str(corpus)], Path.cwd(), tmp_path_factory.mktemp("cache"), 384, None, 0.05)


def test_the_data_digest_is_the_same_for_the_same_data_wherever_it_lies(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared.dir, copy)
    assert data_digest(PreparedData.load(copy)) == data_digest(prepared)


def test_the_data_digest_changes_with_any_shard_or_the_tokenizer(prepared, tmp_path):
    digest = data_digest(prepared)
    other_shard = tmp_path / "shard"
    shutil.copytree(prepared.dir, other_shard)
    shard = other_shard / prepared.train_shards[0].name
    data = bytearray(shard.read_bytes())
    data[-CRC.itemsize] ^= 0xFF  # the last chunk's stored checksum: another shard's content
    shard.write_bytes(bytes(data))
    assert data_digest(PreparedData.load(other_shard)) != digest
    other_tokenizer = tmp_path / "tokenizer"
    shutil.copytree(prepared.dir, other_tokenizer)
    tokenizer = other_tokenizer / prepared.tokenizer_path.name
    tokenizer.write_bytes(tokenizer.read_bytes().replace(b'"vocab"', b'"vocab" ', 1))  # same JSON, other bytes
    assert tokenizer.read_bytes() != prepared.tokenizer_path.read_bytes()
    assert data_digest(PreparedData.load(other_tokenizer)) != digest
