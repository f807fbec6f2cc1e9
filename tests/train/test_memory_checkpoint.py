"""In-memory checkpoints (phalanx/train/memory_checkpoint.py).

Through the real launcher (2 gloo ranks under the node agent): a rank killed mid-interval resumes from
the in-memory snapshot of the step before, not from disk, with every loss bit-identical to a clean run,
and no snapshot directory is left once the run ends; a NaN loss rolls back to the snapshot of the step
before it, not to the disk. In one process, with a real model and optimizer
and real files in /dev/shm: a snapshot restores exactly what it held, a torn file falls back to the
older snapshot with one line and an event, a snapshot of another layout is ignored with one line.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from phalanx.parallel.distributed import DistEnv
from phalanx.run.records import read_events
from phalanx.run.snapshots import newest_common_step, run_snapshot_dirs
from phalanx.train.memory_checkpoint import MemorySnapshots, choose_interval, owner_pid, remove_rank
from tests.helpers import losses_by_step, phalanx

# A disk checkpoint only at the end (interval 50 > 12 steps): a restart can only be quick from memory.
DRILL = ["train.max_steps=12", "checkpoint.interval=50", "safe.hang_floor_s=2", "--nproc", "2"]


def _train(args: list[str]) -> tuple[dict, str]:
    proc = phalanx("train", *args, "--json")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def clean(corpus, runs_root):
    from tests.conftest import TINY

    args = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}"]
    summary, stderr = _train([*args, "run.name=memory-clean", *DRILL, "checkpoint.memory_interval=auto"])
    return args, summary, stderr, losses_by_step(summary["run_dir"])


@pytest.mark.slow
def test_auto_interval_is_chosen_once_and_snapshots_are_removed_at_the_end(clean):
    _, summary, stderr, _ = clean
    chosen = [e for e in read_events(Path(summary["run_dir"])) if e["kind"] == "memory_snapshot_interval"]
    assert len(chosen) == 1 and chosen[0]["interval"] >= 1 and chosen[0]["snapshot_ms"] > 0
    assert stderr.count("in-memory snapshots every") == 1
    assert run_snapshot_dirs(Path(summary["run_dir"])) == []  # finished: gone from /dev/shm


@pytest.mark.slow
def test_kill_resumes_from_the_in_memory_snapshot_bit_identically(clean):
    args, _, _, clean_losses = clean
    kill = [{"fault": "kill", "rank": 1, "step": 8}]
    summary, stderr = _train(
        [*args, "run.name=memory-kill", *DRILL, "checkpoint.memory_interval=1", f"safe.inject={json.dumps(kill)}"]
    )
    run_dir = Path(summary["run_dir"])
    assert summary["steps"] == 12 and summary["restarts"] == 1
    assert losses_by_step(run_dir) == clean_losses  # every step, bit for bit
    loaded = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_loaded"]
    # Rank 1 died in step 8's forward: step 7's snapshot (or 6's, were 7's still being written) is newest.
    assert len(loaded) == 1 and loaded[0]["source"] == "memory" and loaded[0]["step"] in (6, 7)
    assert loaded[0]["disk_step"] == 0  # no disk checkpoint yet: without memory, all 7 steps are redone
    assert f"resuming from the in-memory snapshot of step {loaded[0]['step']}" in stderr
    assert "Traceback" not in stderr
    assert run_snapshot_dirs(run_dir) == []


@pytest.mark.slow
def test_a_nan_loss_rolls_back_to_the_snapshot_of_the_step_before(clean):
    args, _, _, clean_losses = clean
    nan = [{"fault": "nan", "rank": 1, "step": 8}]
    summary, stderr = _train(
        [*args, "run.name=memory-nan", *DRILL, "checkpoint.memory_interval=1", f"safe.inject={json.dumps(nan)}"]
    )
    run_dir = Path(summary["run_dir"])
    assert summary["steps"] == 12 and summary["restarts"] == 0
    assert losses_by_step(run_dir) == clean_losses  # the poisoned step replayed, bit for bit
    events = read_events(run_dir)
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert rollback["step"] == 8 and rollback["to_step"] == 7  # not step 0: no disk checkpoint yet
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and loaded[0]["source"] == "memory" and loaded[0]["step"] == 7
    assert "step 8: numerics guard rolled back to step 7" in stderr
    assert "resuming from the in-memory snapshot" not in stderr  # a rollback, not a restart


# -- one process: the snapshot files themselves ------------------------------------------------------
def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer):
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def snapshots(tmp_path):
    env = DistEnv(0, 1, 0, torch.device("cpu"), None)
    made = []

    def make(layout=None):
        emit = lambda kind, **details: make.events.append({"kind": kind, **details})  # noqa: E731
        made.append(MemorySnapshots(tmp_path / "run", env, layout or {"tp": 1}, 1, say=lines.append, emit=emit))
        return made[-1]

    lines: list[str] = []
    make.events = []  # what the run's event log would get
    yield make, lines
    for s in made:
        s.close()
    remove_rank(tmp_path / "run", 0)
    assert run_snapshot_dirs(tmp_path / "run") == []


def _taken(make, steps=3):
    model, optimizer = _model_and_optimizer()
    writer = make()
    kept = {}
    for step in range(1, steps + 1):
        _step(model, optimizer)
        writer.take(step, model, optimizer, {"loader": {"samples_seen": step}})
        kept[step] = ([p.detach().clone() for p in model.parameters()], torch.get_rng_state())
    writer.close()
    return model, optimizer, writer, kept


def test_a_snapshot_restores_model_optimizer_rng_and_trainer_state(snapshots, tmp_path):
    make, lines = snapshots
    model, optimizer, writer, kept = _taken(make)
    assert writer.steps() == [1, 2, 3]  # three slots: each holds one
    _step(model, optimizer)
    torch.manual_seed(123)
    loaded = make().resume(model, optimizer, 0, {})
    assert loaded.step == 3 and loaded.state == {"loader": {"samples_seen": 3}, "step": 3}
    params, rng = kept[3]
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())
    assert int(optimizer.state_dict()["state"][0]["step"]) == 3
    assert lines == []
    assert make().resume(model, optimizer, 3, {}) is None  # not newer than the disk checkpoint: disk
    assert newest_common_step(tmp_path / "run", owner_pid()) == 3  # what the node agent can tell of a restart
    assert newest_common_step(tmp_path / "another-run", owner_pid()) is None


def _slot_of(writer, step: int) -> Path:
    return writer.dir / f"slot_{json.loads((writer.dir / f'step_{step:08d}.json').read_text())['slot']}.bin"


def test_a_torn_snapshot_falls_back_to_the_older_one_with_one_line(snapshots):
    make, lines = snapshots
    model, optimizer, writer, kept = _taken(make)
    slot = _slot_of(writer, 3)
    with open(slot, "r+b") as f:  # half of it overwritten, as a copy cut short would leave it
        f.write(bytes(slot.stat().st_size // 2))
    loaded = make().resume(model, optimizer, 0, {})
    assert loaded.step == 2
    assert all(torch.equal(a, b) for a, b in zip(kept[2][0], model.parameters()))
    assert len(lines) == 1 and "step 3 is unusable" in lines[0] and "CRC-32" in lines[0]
    assert [(e["kind"], e["step"]) for e in make.events] == [("snapshot_unusable", 3)]
    assert "CRC-32" in make.events[0]["reason"]


def test_an_unloadable_snapshot_is_skipped_without_a_traceback(snapshots):
    make, lines = snapshots
    model, optimizer, writer, _ = _taken(make, steps=2)
    side = writer.dir / "step_00000002.json"  # a layout reading past its slot (the CRC matches)
    record = json.loads(side.read_text())
    record["tensors"][0][1] = record["bytes"]
    side.write_text(json.dumps(record))
    side = writer.dir / "step_00000001.json"  # a slot the rank does not have
    side.write_text(json.dumps({**json.loads(side.read_text()), "slot": 7}))
    assert make().resume(model, optimizer, 0, {}) is None  # nothing usable: disk (or step 0)
    assert len(lines) == 2 and all("unusable" in line for line in lines)
    assert "do not fit the slot" in lines[0] and "not this rank's snapshot" in lines[1]


def test_a_snapshot_holds_raw_bytes_and_json_only(snapshots):
    """Nothing in a snapshot is unpickled: its files are a flat slot and a JSON sidecar."""
    make, _ = snapshots
    _, _, writer, _ = _taken(make, steps=1)
    assert sorted(p.name for p in writer.dir.iterdir()) == [
        "slot_0.bin",
        "slot_1.bin",
        "slot_2.bin",
        "step_00000001.json",
    ]
    record = json.loads((writer.dir / "step_00000001.json").read_text())
    assert record["values"]["group.0.betas"] == {"tuple": [0.9, 0.999]}
    assert record["crc32"] == zlib.crc32((writer.dir / "slot_0.bin").read_bytes())


def test_a_snapshot_of_another_layout_is_ignored_with_one_line(snapshots):
    make, lines = snapshots
    model, optimizer, _, _ = _taken(make)
    reader = make(layout={"tp": 2})
    assert reader.resume(model, optimizer, 0, {}) is None
    assert lines == [
        (
            "warning: in-memory snapshots ignored (steps 1, 2, 3: taken under {'layout': {'tp': 1}}, "
            "this group has {'layout': {'tp': 2}})"
        )
    ]


def test_a_snapshot_of_another_model_shape_is_not_loaded(snapshots):
    make, lines = snapshots
    _taken(make)
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in other.parameters()]
    assert make().resume(other, optimizer, 0, {}) is None
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # untouched
    assert len(lines) == 3 and "was saved as" in lines[0]


def test_a_rank_that_cannot_write_snapshots_says_so_once_and_trains_on(snapshots):
    make, lines = snapshots
    model, optimizer = _model_and_optimizer()
    writer = make()
    writer.take(1, model, optimizer, {})
    writer.flush()
    shutil.rmtree(writer.dir)  # as good as a full /dev/shm: every write fails from here
    for step in (2, 3, 4):
        _step(model, optimizer)
        writer.take(step, model, optimizer, {})
    writer.close()
    assert len(lines) == 1 and "in-memory snapshots stop" in lines[0] and "rank 0" in lines[0]


def test_the_auto_interval_keeps_a_snapshot_under_two_percent_of_a_step():
    assert choose_interval(0.001, 0.1) == 1  # 1 %: every step
    assert choose_interval(0.002, 0.1) == 1  # exactly 2 %
    assert choose_interval(0.003, 0.1) == 2
    assert choose_interval(0.05, 0.1) == 25
