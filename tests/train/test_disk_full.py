"""A run directory on a small real file system (a tmpfs mounted for the test): saves fail for want of
space, the run says the disk is full and how much a checkpoint needs, and a run whose final save failed
exits 8 instead of looking finished; a launch onto a file system with less free space than one
checkpoint is warned before it trains."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from phalanx.train.checkpoint_space import checkpoint_bytes, is_disk_full
from tests.helpers import phalanx

# One tiny checkpoint is ~1.8 MiB: 3 MiB holds the run's own files and one of them, with room left for the
# run's records (at 4 MiB a second one could fit, leaving no room for the next metrics line).
SIZE = "3m"


@pytest.fixture
def small_fs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_enospc_is_recognised_through_wrapping_and_by_the_full_file_system(small_fs):
    try:
        with open(small_fs / "fill", "wb") as f:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
        wrapped = RuntimeError("unexpected pos 704 vs 598")  # what torch's zip writer says, no errno
        wrapped.__cause__ = exc
        assert is_disk_full(wrapped, small_fs)
    assert is_disk_full(RuntimeError("unexpected pos 704 vs 598"), small_fs)  # nothing free: full
    (small_fs / "fill").unlink()
    assert not is_disk_full(RuntimeError("unexpected pos 704 vs 598"), small_fs)


def test_a_real_dcp_save_onto_a_full_disk_is_recognised_from_its_exception(small_fs):
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from phalanx.run.checkpoints import dcp_error_line

    with pytest.raises(BaseException) as failed:  # CheckpointException is a BaseException
        dcp.save({"w": torch.zeros(2 << 20)}, checkpoint_id=small_fs / "ck")  # 8 MB onto 4 MiB
    shutil.rmtree(small_fs / "ck")  # the space is free again: only the exception can tell
    assert "unexpected pos" in dcp_error_line(failed.value) or "No space" in dcp_error_line(failed.value)
    assert is_disk_full(failed.value, small_fs)
    assert not is_disk_full(RuntimeError("unexpected pos 704 vs 598"), small_fs)


@pytest.mark.slow
def test_a_run_whose_final_save_fails_on_a_full_disk_exits_8_and_says_why(small_fs, tiny_args, tmp_path):
    store = tmp_path / "store.db"  # off the small file system: the store records how the run ended
    args = [a for a in tiny_args if not a.startswith("run.dir=")] + [f"run.dir={small_fs}", f"observe.store={store}"]
    proc = phalanx("train", *args, check=False, timeout=300)
    assert proc.returncode == 8, proc.stderr
    run_dir = small_fs / next(a for a in args if a.startswith("run.name=")).removeprefix("run.name=")
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    # One or two fit (the margin depends on what else the run directory holds), never all three.
    assert saved and saved == ["step_00000004", "step_00000008"][: len(saved)], saved
    newest = saved[-1]
    size = checkpoint_bytes(run_dir / "checkpoints" / newest)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the final checkpoint (step 12) could not be saved: no space left on device"), last
    assert "a checkpoint needs about" in last and f"the size of {newest}" in last, last
    assert f"{size / 2**20:,.2f} MiB" in last and f"resumes from step {int(newest[5:])}" in last, last
    assert "unexpected pos" not in proc.stderr and "free there now" in last
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "save_failed"]
    assert [e["step"] for e in failed][-2:] == [12, 12]  # the final save and its retry
    assert all(e["error"].startswith("no space left on device") for e in failed), failed

    from phalanx.observe.store import RunStore

    stored = RunStore(f"sqlite:///{store}", create=False).run_id_for_dir(run_dir)
    run = RunStore(f"sqlite:///{store}", create=False).run(stored)
    assert run["status"] == "failed" and "no space left on device" in run["error"]

    # Relaunching onto the same full disk: warned before training, and the same exit 8.
    again = phalanx("train", *args, "train.max_steps=16", check=False, timeout=300)
    assert again.returncode == 8, again.stderr
    assert "warning: only" in again.stderr and "less than one checkpoint" in again.stderr, again.stderr


def test_a_disk_with_room_gives_no_warning(tmp_path):
    from phalanx.train.checkpoint_space import low_space_warning

    assert low_space_warning(tmp_path / "checkpoints", n_params=1000) is None
    assert "less than one checkpoint" in low_space_warning(tmp_path / "checkpoints", n_params=10**15)
