"""Warm restarts through the real launcher (2 gloo ranks, tiny preset): the ranks of every attempt are
forked by the launch's one fork server, which the agent started and which survives a rank's death;
a killed rank is back training sooner than with fresh interpreters, and the losses are a clean run's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from phalanx.run.records import read_events
from tests.conftest import TINY
from tests.helpers import losses_by_step, parent_of, ranks_of, train_json

pytestmark = pytest.mark.slow  # three launches of two ranks

DRILL = ["train.max_steps=20", "checkpoint.interval=4", "train.eval_interval=100", "--nproc", "2"]
KILL = "safe.inject=[{fault: kill, rank: 1, step: 10}]"


@pytest.fixture(scope="module")
def base(corpus, runs_root):
    return TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}"]


def restart_seconds(run_dir) -> float:
    """From the agent's detection of the failure to the restarted ranks training again."""
    events = read_events(run_dir)
    failed = next(e for e in events if e["kind"] == "worker_failed")["time"]
    return next(e for e in events if e["kind"] == "training_started" and e["time"] > failed)["time"] - failed


def test_ranks_are_forked_by_one_server_that_outlives_a_rank_and_restart_sooner(base, runs_root):
    clean = losses_by_step(train_json(*base, "run.name=warm-clean", *DRILL)["run_dir"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "train", *base, "run.name=warm-kill", *DRILL, KILL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    servers: dict[int, set[int]] = {}  # fork server pid -> the rank pids seen under it
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        for rank in ranks_of(proc.pid):
            try:
                servers.setdefault(parent_of(rank), set()).add(rank)
            except (OSError, IndexError):  # gone between the listing and the read
                continue
        time.sleep(0.01)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    warm_dir = runs_root / "warm-kill"
    assert "rank 1 exited (SIGKILL) at step 10" in err
    # One server, the agent's child, forked both attempts' ranks: two first, then two more after the kill.
    (server,) = servers
    assert server != proc.pid and len(servers[server]) == 4
    assert losses_by_step(warm_dir) == clean

    cold = train_json(*base, "run.name=cold-kill", *DRILL, KILL, "safe.warm_restarts=false")
    assert cold["restarts"] == 1 and losses_by_step(cold["run_dir"]) == clean
    # Fresh interpreters import torch again (seconds); forked ranks do not.
    assert restart_seconds(warm_dir) < restart_seconds(cold["run_dir"]) / 2
