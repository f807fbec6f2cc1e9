"""A real Slurm for the launcher's tests: scripts/start_slurm.sh starts (or finds) munged, slurmctld and
slurmd on this machine, and these helpers submit, watch and nudge jobs through Slurm's own commands."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def start_slurm() -> str:
    """The slurm.conf of the running test cluster: PHALANX_TEST_SLURM_CONF (.ci/run starts it), else
    scripts/start_slurm.sh run here. Skips only when the cluster cannot start on this machine."""
    conf = os.environ.get("PHALANX_TEST_SLURM_CONF")
    if not conf:
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "start_slurm.sh")], capture_output=True, text=True, timeout=600, check=False
        )
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            pytest.skip(f"slurmctld cannot start on this machine (scripts/start_slurm.sh: {reason})")
        conf = proc.stdout.strip().splitlines()[-1]
    os.environ["SLURM_CONF"] = conf  # every Slurm command, ours and the generated script's, reads it
    sinfo = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, check=False)
    assert sinfo.returncode == 0 and sinfo.stdout.strip(), f"Slurm is not answering: {sinfo.stderr}"
    return conf


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (there is no accounting database for sacct on the test cluster;
    MinJobAge keeps finished jobs here for an hour)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_job(
    job_id: str, states: tuple[str, ...] = FINISHED, timeout: float = 300, min_restarts: int = 0
) -> dict[str, str]:
    """Until the job is in one of `states` having been requeued at least `min_restarts` times (a job is
    PENDING before its first start too, so waiting for a requeue needs the count)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info["JobState"] in states and (
            int(info.get("Restarts", "0")) >= min_restarts or info["JobState"] in FINISHED
        ):
            return info
        time.sleep(0.5)
    pytest.fail(f"job {job_id} still {job_info(job_id)['JobState']} after {timeout:.0f} s, not {'/'.join(states)}")


def wait_for_step(run_dir: Path, step: int, timeout: float = 300) -> None:
    """Until the run has logged a training step >= `step`."""
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [
                json.loads(line).get("step", 0)
                for line in metrics.read_text().splitlines()
                if line.endswith("}") and '"loss"' in line
            ]
            if steps and max(steps) >= step:
                return
        time.sleep(0.1)
    pytest.fail(f"{run_dir} never reached step {step}")


def job_output(script: Path, job_id: str) -> str:
    return (script.parent / f"{script.stem}-{job_id}.out").read_text()
