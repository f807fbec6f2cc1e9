"""Silent data corruption, end to end: bytes zeroed inside a prepared token shard (its size unchanged)
stop the next `phalanx train` before any rank trains on them, with one line naming the shard."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.data.prepare import PreparedData
from phalanx.data.shards import HEADER
from phalanx.run.layout import RunDir
from phalanx.run.prepare import prepared_data
from tests.helpers import phalanx, train_json

pytestmark = pytest.mark.slow  # each test here takes over 5 s (TESTING.md)


def test_zeroed_bytes_in_a_shard_are_refused_before_training(tiny_args, tmp_path):
    # Its own runs root: the prepared-data cache it corrupts must not be the one other tests share.
    tiny_args = [a for a in tiny_args if not a.startswith("run.dir=")] + [f"run.dir={tmp_path}"]
    summary = train_json(*tiny_args, "train.max_steps=2")
    data: PreparedData = prepared_data(RunDir(summary["run_dir"]).path)
    shard = data.train_shards[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(HEADER.size + (size - HEADER.size) // 2)
        f.write(bytes(4096))
    assert shard.stat().st_size == size

    proc = phalanx("train", *tiny_args, "train.max_steps=4", "run.name=after-corruption", check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"corrupt token shard {shard}" in proc.stderr and "checksum" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (Path(summary["run_dir"]).parent / "after-corruption" / "metrics.jsonl").exists()
    assert str(tmp_path) in str(shard)
