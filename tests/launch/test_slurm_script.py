"""What `phalanx cluster slurm` writes, without a cluster: the sbatch directives, the node-agent command,
the requeue decision taken from phalanx/errors.py EXIT_CODES, and one clear line for bad options.
tests/launch/test_slurm.py runs the scripts on a real Slurm."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from phalanx.config.loader import load_config
from phalanx.errors import EXIT_CODES, ExitCode
from phalanx.launch.cluster import exit_policy as policy_module
from phalanx.launch.cluster.exit_policy import exit_policy
from phalanx.launch.cluster.slurm import SlurmJob, render_sbatch, time_limit_seconds
from tests.helpers import phalanx


def write(args, out: Path, *options: str) -> dict:
    proc = phalanx("cluster", "slurm", *args, *options, "--out", str(out), "--json")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def directives(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def case_codes(text: str) -> dict[str, set[int]]:
    """The script's requeue decision: the codes of its `requeue_code=` branch and of its stop branch."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^\s+([0-9|]+)\) (.*)", line)
        if match and match.group(1) != "0":
            kind = "requeue" if match.group(2).startswith("requeue_code=") else "never"
            found[kind] = {int(c) for c in match.group(1).split("|")}
    return found


def test_the_script_asks_slurm_for_the_job_and_runs_one_node_agent_per_node(tiny_args, tmp_path):
    report = write(
        [*tiny_args, "train.micro_batch_size=null"],
        tmp_path / "job.sbatch",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--partition",
        "gpu",
        "--time",
        "1-12:00:00",
        "--account",
        "proj1",
    )
    script = Path(report["script"])
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    assert script.stat().st_mode & 0o100
    d = directives(text)
    for wanted in (
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        "--partition=gpu",
        "--time=1-12:00:00",
        "--account=proj1",
        "--signal=TERM@120",
        "--requeue",
        "--open-mode=append",
    ):
        assert wanted in d, (wanted, d)
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert '"$@" --node-rank "$SLURM_NODEID"' in text  # expanded on each node, not in the batch shell
    assert re.search(r'srun --nodes="\$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 .*--gpus-per-node=4', text)
    assert 'train "$CONFIG" --nnodes 2 --nproc 4 --rdzv-endpoint "$HEAD:$PORT"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    # The config travels resolved beside the script, and is the config the user asked for.
    assert Path(report["config"]) == tmp_path / "job.config.yaml"
    assert f"CONFIG={report['config']}" in text
    assert load_config(report["config"]) == load_config(None, [*tiny_args, "train.micro_batch_size=null"])


def test_cpu_ranks_ask_for_no_gpus(tiny_args, tmp_path):
    text = Path(write(tiny_args, tmp_path / "job.sbatch", "--gpus-per-node", "2", "--cpu")["script"]).read_text()
    assert not any(d.startswith(("--gpus", "--gres")) for d in directives(text)) and "--gpus-per-node" not in text
    assert "--nnodes 1 --nproc 2" in text


def test_the_requeue_decision_is_the_exit_code_table():
    policy = exit_policy()
    assert {2, 3, 6} <= set(policy.never) and {4, 5} <= set(policy.requeue)
    assert policy.should_requeue(143) and policy.should_requeue(4) and policy.should_requeue(5)
    assert not any(policy.should_requeue(c) for c in (0, 1, 2, 3, 6))
    text = render_sbatch(
        SlurmJob(nodes=1, ranks_per_node=1, job_name="t"), Path("/s/job.sbatch"), Path("/s/job.config.yaml")
    )
    codes = case_codes(text)
    assert codes["requeue"] == {int(e.code) for e in EXIT_CODES if e.code.isdigit() and e.requeue}
    assert codes["never"] == {int(e.code) for e in EXIT_CODES if e.code.isdigit() and e.code != "0" and not e.requeue}
    assert '[ "$c" -gt 128 ] && [ "$c" -le 192 ]; then requeue_code=$c' in text  # 143 and other signals


def test_a_change_to_the_table_changes_the_script(monkeypatch):
    """The script is generated from EXIT_CODES, not from a copy: flip exit 2 to requeue and signals (a
    preemption's 143 among them) to stop."""
    changed = tuple(
        ExitCode(e.code, e.meaning, not e.requeue if e.code in ("2", "143", "128 + N") else e.requeue)
        for e in EXIT_CODES
    )
    monkeypatch.setattr(policy_module, "EXIT_CODES", changed)
    text = render_sbatch(
        SlurmJob(nodes=1, ranks_per_node=1, job_name="t"), Path("/s/job.sbatch"), Path("/s/job.config.yaml")
    )
    codes = case_codes(text)
    assert 2 in codes["requeue"] and 2 not in codes["never"]
    assert "-gt 128" not in text and not exit_policy().should_requeue(143)


def test_time_limits_in_slurm_syntax():
    assert time_limit_seconds("90") == 5400
    assert time_limit_seconds("10:30") == 630
    assert time_limit_seconds("2:00:00") == 7200
    assert time_limit_seconds("1-12") == 129600
    assert time_limit_seconds("1-00:30") == 88200
    assert time_limit_seconds("1-00:00:05") == 86405


@pytest.mark.parametrize(
    "options, message",
    [
        (["--time", "soon"], "--time must be a Slurm time limit"),
        (["--time", "1"], "leaves no time before the 120 s warning signal"),
        (["--partition", "gpu; rm -rf /"], "--partition must be a Slurm name"),
        (["--nodes", "3"], "must be a multiple of the 3 data-parallel ranks"),
        (["--signal-before", "0"], "--signal-before must be 1 to 65535 seconds"),
    ],
)
def test_bad_options_get_one_line_and_exit_2(tiny_args, tmp_path, options, message):
    argv = ["cluster", "slurm", *tiny_args, "train.micro_batch_size=null", "--out", str(tmp_path / "job.sbatch")]
    proc = phalanx(*argv, *options, check=False)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(tmp_path.iterdir())


def test_the_users_config_is_never_overwritten(tiny_args, tmp_path):
    own = tmp_path / "job.config.yaml"
    own.write_text("extends: demo\n")
    proc = phalanx("cluster", "slurm", str(own), *tiny_args, "--out", str(tmp_path / "job.sbatch"), check=False)
    assert proc.returncode == 2 and "is the config being resolved" in proc.stderr
    assert own.read_text() == "extends: demo\n"
