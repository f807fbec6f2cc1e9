"""`phalanx cluster slurm` against a real Slurm on this machine (scripts/start_slurm.sh): a 2-task job's
losses equal a local `--nproc 2` run's; the warning signal before the time limit requeues the job, which
resumes with no step lost; exits the table says not to requeue are not, and the others are, up to
--max-requeues.

The test cluster has one node, so the 2 ranks are one node agent's (`--nodes 1 --gpus-per-node 2 --cpu`);
the script's multi-node parts (the rendezvous host from the allocation, one agent per node) run the
same with one node.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import FINISHED, job_info, job_output, start_slurm, wait_for_step, wait_job

from phalanx.run.records import read_events
from tests.helpers import losses_by_step, phalanx, read_metrics, train_json

TWO_RANKS = ["--nodes", "1", "--gpus-per-node", "2", "--cpu"]
# Long enough to be stopped in the middle: 40 steps, rank 0 slowed by 150 ms a step, a checkpoint every 10.
LONG = ["train.max_steps=40", "train.eval_interval=20", "checkpoint.interval=10", "checkpoint.keep=10"]
SLOW = 'safe.inject=[{"fault": "slow", "rank": 0, "step": 1, "ms": 150}]'


@pytest.fixture(scope="module")
def slurm():
    return start_slurm()


def named(args, name):
    return [a for a in args if not a.startswith("run.name=")] + [f"run.name={name}"]


def submit(args, script: Path, *options: str) -> dict:
    proc = phalanx("cluster", "slurm", *args, *TWO_RANKS, *options, "--out", str(script), "--submit", "--json")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["job_id"], report
    return report


@pytest.mark.slow
def test_two_task_job_matches_a_local_run(slurm, tiny_args, tmp_path):
    local = train_json(*named(tiny_args, "slurm-local"), "--nproc", "2")
    report = submit(tiny_args, tmp_path / "job.sbatch")
    info = wait_job(report["job_id"])
    output = job_output(tmp_path / "job.sbatch", report["job_id"])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output
    assert info["Restarts"] == "0"
    assert "rendezvous localhost:" in output and "phalanx: done" in output
    assert losses_by_step(report["run_dir"]) == losses_by_step(local["run_dir"])  # bit for bit
    summary = json.loads((Path(report["run_dir"]) / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["restarts"] == 0


@pytest.mark.slow
def test_the_time_limit_signal_requeues_and_the_job_resumes_with_no_step_lost(slurm, tiny_args, tmp_path):
    args = [*tiny_args, *LONG]
    local = train_json(*named(args, "slurm-requeue-local"), "--nproc", "2")
    script = tmp_path / "job.sbatch"
    report = submit([*args, SLOW], script)
    job, run_dir = report["job_id"], Path(report["run_dir"])
    wait_for_step(run_dir, 13)  # past the step-10 checkpoint: the SIGTERM saves where the ranks stop
    # What --signal=TERM@120 does before the time limit: SIGTERM to the job's steps (the node agents),
    # not to the batch shell, which then requeues the job itself.
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
    info = wait_job(job, ("PENDING", *FINISHED), timeout=120, min_restarts=1)
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", job_output(script, job)
    info = wait_job(job)
    output = job_output(script, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output
    assert "exit 143: requeueing" in output and "(requeue 1)" in output

    # Preempted: every rank finished its step and the job saved there, so the requeued job resumes at the
    # very step it stopped at and no step is trained twice.
    stopped = next(e["step"] for e in read_events(run_dir) if e["kind"] == "preempted")
    resumed_from = [e["step"] for e in read_events(run_dir) if e["kind"] == "checkpoint_loaded"]
    assert stopped >= 13 and resumed_from == [stopped]
    steps = [m["step"] for m in read_metrics(run_dir) if "loss" in m]
    assert steps == list(range(1, 41))  # each step exactly once, across the requeue
    assert losses_by_step(run_dir) == losses_by_step(local["run_dir"])


def test_bad_input_on_the_nodes_is_never_requeued(slurm, tiny_args, tmp_path):
    script = tmp_path / "job.sbatch"
    report = json.loads(phalanx("cluster", "slurm", *tiny_args, *TWO_RANKS, "--out", str(script), "--json").stdout)
    config = Path(report["config"])
    config.write_text(config.read_text().replace("max_steps: 12", "max_steps: -1"))  # exit 2 on the node
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    info = wait_job(job, timeout=120)
    output = job_output(script, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0", output
    assert "exited 2: not requeued" in output
    assert not (tmp_path / ".job-exits" / job).exists()


@pytest.mark.slow
def test_restarts_exhausted_is_requeued_until_max_requeues(slurm, tiny_args, tmp_path):
    script = tmp_path / "job.sbatch"
    kill = 'safe.inject=[{"fault": "kill", "rank": 1, "step": 2, "repeat": true}]'
    report = submit([*tiny_args, kill, "safe.max_restarts=0"], script, "--max-requeues", "1")
    job = report["job_id"]
    info = wait_job(job, ("PENDING", *FINISHED), timeout=300, min_restarts=1)  # exit 4: requeued
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", job_output(script, job)
    info = wait_job(job)
    output = job_output(script, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "4:0" and info["Restarts"] == "1", output
    assert "exit 4: requeueing" in output and "exit 4 after 1 requeues: giving up" in output
    assert job_info(job)["JobState"] == "FAILED"
