"""Asynchronous checkpoints (checkpoint.async): training goes on while a save is written, the losses are
those of synchronous saving, every published checkpoint is complete and verified (manifest hashed by
every rank in parallel), and a crash mid-save leaves nothing that looks like a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.parallel.distributed import DistEnv
from phalanx.run.checkpoints import list_checkpoints, verify_checkpoint, write_manifest
from phalanx.run.layout import RunDir
from phalanx.run.records import read_events
from phalanx.train.checkpoint import hash_files
from tests.helpers import losses_by_step, train_json


def test_parallel_hashing_gives_the_serial_manifest(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * (1000 + i))
    hashed = hash_files(tmp_path, DistEnv(0, 1, 0, None, None))
    write_manifest(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["files"] == hashed


@pytest.fixture
def two_ranks(tiny_args):
    return [*tiny_args, "--nproc", "2"]


def published(run_dir: Path) -> list[Path]:
    found = list_checkpoints(RunDir(run_dir).checkpoints)
    assert all(verify_checkpoint(p) is None for p in found)
    return found


@pytest.mark.slow
def test_async_saves_train_like_sync_and_resume_exactly(two_ranks):
    sync = train_json(*two_ranks[:-2], "run.name=sync-saves", "--nproc", "2")
    run = train_json(*two_ranks, "checkpoint.async=true")
    assert losses_by_step(Path(run["run_dir"])) == losses_by_step(Path(sync["run_dir"]))  # bit for bit
    assert [p.name for p in published(Path(run["run_dir"]))] == ["step_00000004", "step_00000008", "step_00000012"]
    saves = [e for e in read_events(run["run_dir"]) if e["kind"] == "checkpoint_saved"]
    assert len(saves) == 3 and all(0 <= e["stall_seconds"] <= e["seconds"] for e in saves)

    # Halted after step 6 (its save waits: the process ends) and resumed: the same losses.
    name = "run.name=async-halted"
    train_json(*two_ranks, name, "checkpoint.async=true", "train.halt_at_step=6")
    resumed = train_json(*two_ranks, name, "checkpoint.async=true")
    assert losses_by_step(Path(resumed["run_dir"])) == losses_by_step(Path(sync["run_dir"]))


@pytest.mark.slow
def test_a_rank_killed_while_a_save_is_written_resumes_exactly(two_ranks):
    straight = train_json(*two_ranks, "run.name=async-straight", "checkpoint.async=true")
    # Step 4's save starts in the background; rank 1 dies at the next step, possibly mid-write.
    run = train_json(*two_ranks, "checkpoint.async=true", "safe.inject=[{fault: kill, rank: 1, step: 5}]")
    assert run["restarts"] == 1
    assert losses_by_step(Path(run["run_dir"])) == losses_by_step(Path(straight["run_dir"]))
    published(Path(run["run_dir"]))  # whatever the kill cut short was never published
