"""The run lock is not free while any rank of the run lives: ranks hold it shared, and a command finding
it held by the ranks of a launch that is gone waits for them (a little) instead of taking it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from phalanx.errors import PhalanxError
from phalanx.run.layout import RunDir
from phalanx.run.lock import hold_shared, run_lock


def orphaned_rank(run_dir) -> tuple[int, int]:
    """A launch that took the lock, started a rank holding its share, and was killed: returns the pids of
    the rank and of the launch."""
    launch = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import os, subprocess, sys, time
        from pathlib import Path
        from phalanx.run.lock import run_lock
        with run_lock(Path({str(run_dir)!r})):
            rank = subprocess.Popen([sys.executable, "-c",
                "import sys, time; from pathlib import Path; from phalanx.run.lock import hold_shared; "
                "h = hold_shared(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)",
                {str(RunDir(run_dir).lock)!r}], stdout=sys.stdout)
            print(rank.pid, flush=True)
            time.sleep(600)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = int(launch.stdout.readline())
    assert launch.stdout.readline().strip() == "held"
    launch.kill()
    launch.wait()
    return pid, launch.pid


def test_a_command_waits_for_the_ranks_of_a_launch_that_is_gone(tmp_path, capsys):
    rank, launch = orphaned_rank(tmp_path / "run")
    subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {rank}"])  # the rank dies a second later
    t0 = time.monotonic()
    with run_lock(tmp_path / "run"):
        waited = time.monotonic() - t0
    assert 0.5 < waited < 15
    assert f"waiting for the ranks of a stopped launch (pid {launch})" in capsys.readouterr().err


def test_ranks_that_never_exit_keep_the_run_directory_locked(tmp_path):
    rank, launch = orphaned_rank(tmp_path / "run")
    try:
        with pytest.raises(PhalanxError, match=rf"still held by processes of a launch that is gone \(pid {launch}\)"):
            with run_lock(tmp_path / "run", orphan_wait=0.5):
                pass
    finally:
        subprocess.run(["kill", "-9", str(rank)])


def test_a_live_launch_is_refused_at_once_and_its_ranks_can_join_it(tmp_path):
    with run_lock(tmp_path / "run"):
        share = hold_shared(RunDir(tmp_path / "run").lock)  # what each rank of this launch takes
        t0 = time.monotonic()
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; "
                "from phalanx.run.lock import run_lock; run_lock(Path(sys.argv[1])).__enter__()",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
        )
        assert probe.returncode != 0 and "is in use by a running `phalanx train`" in probe.stderr
        assert time.monotonic() - t0 < 10  # no waiting: the owner is alive
    with pytest.raises(PhalanxError, match="is in use"):  # the launch is done, but a rank of it lives on
        with run_lock(tmp_path / "run", orphan_wait=0.2):
            pass
    share.close()
    with run_lock(tmp_path / "run"):  # once the last rank is gone, free
        pass
