"""`phalanx train --launcher ray` on a real two-node Ray cluster on loopback (ray.cluster_utils starts a
head and a second node, each with one CPU and a resource of its own): the same losses as two local
ranks, to the last bit; a node agent killed mid-run is replaced and the run resumes with the same
losses; `ray job submit -- phalanx train ...` works from inside the cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.run.records import read_events
from tests.helpers import agent_of, free_port, is_rank, losses_by_step, train_json
from tests.ray_cluster import RAY_CLI, loopback_cluster

pytestmark = pytest.mark.slow  # each test here takes over 5 s (TESTING.md)

ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra (pip install 'phalanx[ray]')")


@pytest.fixture(scope="module")
def ray_cluster():
    """(GCS address, dashboard URL) of a head and one more node, each 1 CPU; stopped after the module."""
    dashboard = free_port()
    head = {
        "num_cpus": 1,
        "resources": {"node_a": 1},
        "include_dashboard": True,
        "dashboard_host": "127.0.0.1",
        "dashboard_port": dashboard,
    }
    with loopback_cluster(head, {"num_cpus": 1, "resources": {"node_b": 1}}) as cluster:
        yield cluster.address, f"http://127.0.0.1:{dashboard}"


def named(args: list[str], name: str) -> list[str]:
    return [a for a in args if not a.startswith("run.name=")] + [f"run.name={name}"]


@pytest.fixture(scope="module")
def two_local_ranks(corpus, runs_root):
    """The reference: the same tiny run with two ranks of one local node agent."""
    from tests.conftest import TINY

    args = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}"]
    return args, train_json(*named(args, "ray-reference"), "--nproc", "2")


def test_two_ray_nodes_train_bit_identical_to_two_local_ranks(ray_cluster, two_local_ranks):
    address, _ = ray_cluster
    args, reference = two_local_ranks
    summary = train_json(
        *named(args, "ray-two-nodes"), "--launcher", "ray", "--ray-address", address, "--nnodes", "2", "--nproc", "1"
    )
    assert summary["launcher"] == "ray" and summary["nodes"] == 2 and summary["nodes_replaced"] == 0
    assert summary["steps"] == 12 and summary["restarts"] == 0
    assert losses_by_step(summary["run_dir"]) == losses_by_step(reference["run_dir"])  # exact, not approx
    assert summary["val_loss_final"] == reference["val_loss_final"]
    # Two node agents, one per Ray node, each started its own rank once.
    attempts = [e for e in read_events(Path(summary["run_dir"])) if e["kind"] == "attempt_started"]
    assert len(attempts) == 2


def ranks_of_ray_node(node: int) -> list[int]:
    """The training ranks that the agent of Ray bundle `node` started (they carry its index)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not is_rank(int(entry.name)):
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PHALANX_RAY_NODE={node}".encode() in env:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_killed_node_agent_is_replaced_and_the_run_resumes_bit_identical(ray_cluster, two_local_ranks):
    address, _ = ray_cluster
    args, reference = two_local_ranks
    run_dir = Path(reference["run_dir"]).parent / "ray-node-killed"
    # From step 5 rank 0 sleeps 0.4 s a step, so the kill surely lands mid-run (the fault fires once: the
    # resumed run goes at full speed); sleeping changes no number.
    slow = "safe.inject=[{fault: slow, rank: 0, step: 5, ms: 400}]"
    command = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        *named(args, run_dir.name),
        slow,
        "--launcher",
        "ray",
        "--ray-address",
        address,
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--json",
    ]
    launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or (run_dir / "metrics.jsonl").read_text().count('"loss"') < 6:
            assert launch.poll() is None and time.monotonic() < deadline, "the Ray run never reached step 6"
            time.sleep(0.05)
        (rank,) = ranks_of_ray_node(1)
        agent = agent_of(rank)
        os.kill(agent, signal.SIGKILL)  # node 1's agent actor dies outright: no Ray clean-up
        deadline = time.monotonic() + 10
        while Path(f"/proc/{rank}").exists() and time.monotonic() < deadline:  # its rank goes with it
            time.sleep(0.05)
        assert not Path(f"/proc/{rank}").exists(), "the dead agent's rank went on running"
        out, err = launch.communicate(timeout=300)
    finally:
        launch.kill()
    assert launch.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 12 and summary["restarts"] == 1 and summary["nodes_replaced"] == 1
    assert summary["faults"] == {"crash": 1}
    events = read_events(run_dir)
    assert [e["node"] for e in events if e["kind"] == "node_replaced"] == [1]
    (resumed,) = [e for e in events if e["kind"] == "checkpoint_loaded"]
    # The replacement rank resumes from its peer's copy of its newest snapshot (step 5-7) when that copy
    # was complete before the kill, else from the newest checkpoint on disk (steps 4 and 8).
    if resumed["source"] == "memory":
        assert resumed["step"] in (5, 6, 7) and resumed["step"] > resumed["disk_step"], resumed
    else:
        assert resumed["step"] in (4, 8), resumed
    assert losses_by_step(run_dir) == losses_by_step(reference["run_dir"])
    assert "node 1" in err and "was lost" in err


def test_ray_job_submit_runs_the_same_command(ray_cluster, two_local_ranks):
    """From inside the cluster: the job's driver finds the cluster through RAY_ADDRESS."""
    _, dashboard = ray_cluster
    args, reference = two_local_ranks
    proc = subprocess.run(
        [
            RAY_CLI,
            "job",
            "submit",
            "--address",
            dashboard,
            "--",
            sys.executable,
            "-m",
            "phalanx",
            "train",
            *named(args, "ray-job-submit"),
            "--launcher",
            "ray",
            "--nnodes",
            "2",
            "--nproc",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith('{"run_dir"'))
    summary = json.loads(line)
    assert summary["launcher"] == "ray" and summary["nodes"] == 2
    assert losses_by_step(summary["run_dir"]) == losses_by_step(reference["run_dir"])
