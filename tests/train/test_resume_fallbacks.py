"""No quiet fallbacks on resume: a checkpoint missing its manifest and corrupt checkpoints are said on the
console and in events, and losing every checkpoint to corruption stops the run rather than silently
training again from step 0 (checkpoint.resume=never does that on purpose)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.run.layout import RunDir
from phalanx.run.records import read_events
from phalanx.safe.inject import corrupt_checkpoint
from tests.helpers import phalanx, train_json

pytestmark = pytest.mark.slow  # each test here takes over 5 s (TESTING.md)


def test_a_step_without_manifest_is_named_and_skipped(tiny_args):
    first = train_json(*tiny_args, "train.max_steps=8")
    run = RunDir(first["run_dir"])
    (run.checkpoints / "step_00000008" / "manifest.json").unlink()
    proc = phalanx("train", *tiny_args, "train.max_steps=10", "--json")
    assert "step_00000008 has no manifest" in proc.stderr
    events = read_events(run.path)
    assert any(e["kind"] == "checkpoint_incomplete" and e["path"].endswith("step_00000008") for e in events)
    assert [e["step"] for e in events if e["kind"] == "checkpoint_loaded"][-1] == 4


def test_every_checkpoint_corrupt_stops_unless_asked_to_start_over(tiny_args):
    first = train_json(*tiny_args, "train.max_steps=8")
    run = RunDir(first["run_dir"])
    for step in ("step_00000004", "step_00000008"):
        corrupt_checkpoint(run.checkpoints / step)
    proc = phalanx("train", *tiny_args, "train.max_steps=10", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint" in proc.stderr and "is corrupt" in proc.stderr
    assert "no sound checkpoint is left to resume from" in proc.stderr and "checkpoint.resume=never" in proc.stderr
    assert sum(e["kind"] == "checkpoint_corrupt" for e in read_events(run.path)) == 2
    again = train_json(*tiny_args, "train.max_steps=10", "checkpoint.resume=never")
    assert again["steps"] == 10 and Path(again["last_checkpoint"]).name == "step_00000010"
