"""A run directory deleted under a running job stops the job with one line and exit 9, through the real
launcher: its ranks would otherwise write checkpoints into deleted files, and the lock, gone with the
directory, would let a second launch of the same run train beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import TINY
from tests.helpers import ranks_of


def test_deleting_the_run_directory_mid_run_stops_the_job_with_one_line(corpus, runs_root):
    run_dir = runs_root / "deleted-mid-run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phalanx",
            "train",
            *TINY,
            f"data.sources=[{corpus}]",
            f"run.dir={runs_root}",
            "run.name=deleted-mid-run",
            "train.max_steps=5000",
            "train.eval_interval=5000",
            "checkpoint.interval=5000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    ranks = [psutil.Process(pid) for pid in ranks_of(proc.pid)]
    assert ranks
    shutil.rmtree(run_dir)
    deleted_at = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 9, err
    assert time.monotonic() - deleted_at < 15
    assert "was deleted or replaced while the job ran" in err
    assert "Traceback" not in err
    for rank in ranks:  # stopped with the job, not left writing into the deleted directory
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
    assert not Path(run_dir).exists()  # nothing made it again behind the user's back
