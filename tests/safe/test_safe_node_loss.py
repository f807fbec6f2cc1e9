"""Losing a node: two node agents on one machine (1 rank each, an elastic range of 1 to 2 nodes); one
is killed with its rank mid-run, and the survivor re-forms the job alone from the last checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.run.layout import RunDir
from phalanx.run.records import read_events
from tests.conftest import TINY
from tests.helpers import free_port, losses_by_step, wait_for_port


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


@pytest.mark.slow
def test_losing_a_node_continues_on_the_survivor(corpus, runs_root):
    args = TINY + [
        f"data.sources=[{corpus}]",
        f"run.dir={runs_root}",
        "run.name=drill-node-loss",
        "train.max_steps=60",
        "train.eval_interval=30",
        "checkpoint.interval=10",
        "checkpoint.keep=10",
    ]
    port = free_port()
    node = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        *args,
        "--nnodes",
        "1:2",
        "--nproc",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "last_call_timeout=5",
        "--json",
    ]
    survivor = subprocess.Popen([*node, "--node-rank", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Both nodes are on this machine and would race to host the rendezvous store; as on a real cluster,
    # the store lives with the survivor (node 0, whose address is the endpoint).
    wait_for_port(port)
    doomed = subprocess.Popen([*node, "--node-rank", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Kill once the step-20 checkpoint is saved, not at a step count: saves finish in the background, and
    # on a loaded machine the step-20 save was still in flight at step 25 (the survivor then resumed at 10).
    run_dir = RunDir(runs_root / "drill-node-loss")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if any(e["kind"] == "checkpoint_saved" and e["step"] >= 20 for e in read_events(run_dir.path)):
            break
        time.sleep(0.2)
    else:
        survivor.kill(), doomed.kill()
        pytest.fail("the two-node run never saved its step-20 checkpoint")
    for pid in [doomed.pid, *children(doomed.pid)]:  # the node goes: its agent and its rank
        os.kill(pid, signal.SIGKILL)
    doomed.wait()
    out, err = survivor.communicate(timeout=300)
    assert survivor.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 60 and summary["restarts"] == 1 and summary["faults"] == {"crash": 1}
    events = read_events(Path(summary["run_dir"]))
    resumed = [e["step"] for e in events if e["kind"] == "checkpoint_loaded"]
    assert len(resumed) == 1 and 20 <= resumed[0] < 60 and resumed[0] % 10 == 0
    # One rank now takes the whole global batch (two micro-batches): the same data, so the same losses
    # up to float reduction order, compared with an uninterrupted two-rank run.
    from tests.helpers import train_json

    clean = train_json(*[a.replace("drill-node-loss", "drill-node-loss-clean") for a in args], "--nproc", "2")
    expected, got = losses_by_step(clean["run_dir"]), losses_by_step(summary["run_dir"])
    assert expected.keys() == got.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step
