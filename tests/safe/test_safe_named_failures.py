"""Failures around the ranks are named for what failed, through the real launcher (2 gloo ranks, tiny
preset): the warm ranks' fork server killed mid-run, and the node agent frozen (SIGSTOP) for longer than
its ranks wait for it. Both runs recover and finish; the console line, the worker_failed event and the
summary's fault count say what died, not "rank 0 exited"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from phalanx.run.records import read_events
from phalanx.safe.heartbeat import AGENT_STALE_SECONDS
from tests.conftest import TINY
from tests.helpers import parent_of, ranks_of
from tests.safe.test_soak import start, wait_for_step

pytestmark = pytest.mark.slow

DRILL = ["train.max_steps=40", "checkpoint.interval=5", "train.eval_interval=100", "--nproc", "2", "--json"]


def launch(corpus, runs_root, name: str) -> subprocess.Popen:
    return start([*TINY, f"data.sources=[{corpus}]", f"run.dir={runs_root}", f"run.name={name}", *DRILL])


def finished(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def failures(run_dir) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == "worker_failed"]


def test_a_killed_fork_server_is_named(corpus, runs_root):
    proc = launch(corpus, runs_root, "fork-server-killed")
    wait_for_step(proc, runs_root / "fork-server-killed", 8)
    server = parent_of(ranks_of(proc.pid)[0])
    assert server != proc.pid  # the ranks are the fork server's children
    os.kill(server, signal.SIGKILL)
    summary, err = finished(proc)
    assert f"the fork server that starts this node's ranks (pid {server}) died, and its ranks with it" in err, err
    (failed,) = failures(runs_root / "fork-server-killed")
    assert failed["reason"] == "fork_server_died" and summary["faults"] == {"fork_server_died": 1}


def test_a_frozen_agent_is_named_not_taken_for_a_crash(corpus, runs_root):
    proc = launch(corpus, runs_root, "agent-frozen")
    wait_for_step(proc, runs_root / "agent-frozen", 8)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(AGENT_STALE_SECONDS + 4)  # the ranks stop once their agent has been silent this long
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    summary, err = finished(proc)
    assert "this node agent did not run for" in err and "so its ranks stopped rather than train unsupervised" in err
    (failed,) = failures(runs_root / "agent-frozen")
    assert failed["reason"] == "agent_frozen" and summary["faults"] == {"agent_frozen": 1}
