"""`phalanx cluster slurm`: an sbatch script that runs one phalanx node agent per node of the allocation.

The script is plain bash a Slurm user can read and edit. Slurm places the node agents (srun, one task
per node); the agents rendezvous at the allocation's first host and do everything they do locally
(heartbeats, hang and straggler detection, restarts from the newest checkpoint). What is left to the
script is the scheduler's part: the time limit, preemption and requeueing, decided per exit code from
phalanx/errors.py EXIT_CODES (through exit_policy), never from a copy of it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import phalanx
from phalanx.errors import PhalanxError
from phalanx.launch.cluster.exit_policy import MAX_SIGNAL, exit_policy

# Slurm names (partitions, accounts) end up in `#SBATCH` lines: nothing that could break out of one.
NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    ranks_per_node: int  # --gpus-per-node: one rank per GPU (or per CPU share with `cpu`)
    job_name: str
    partition: str | None = None
    time: str | None = None  # Slurm's time limit syntax: MINUTES, HH:MM:SS, D-HH:MM...
    account: str | None = None
    cpu: bool = False  # ranks on CPUs: ask for no GPUs (CPU clusters, tests)
    signal_before_s: int = 120  # SIGTERM to the node agents this long before the time limit
    port: int | None = None  # the rendezvous port; None: derived from the job id
    max_requeues: int = 5  # the script's own requeues (Slurm counts them in SLURM_RESTART_COUNT)

    def validate(self) -> None:
        for option, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not NAME.match(value):
                raise PhalanxError(f"{option} must be a Slurm name (letters, digits, '_.+-'), not {value!r}")
        if self.time is not None:
            limit = time_limit_seconds(self.time)
            if limit <= self.signal_before_s:
                raise PhalanxError(
                    f"--time {self.time} leaves no time before the {self.signal_before_s} s "
                    "warning signal; give a longer --time or a shorter --signal-before"
                )
        if not 0 < self.signal_before_s <= 65535:
            raise PhalanxError(f"--signal-before must be 1 to 65535 seconds, not {self.signal_before_s}")
        if self.port is not None and not 1024 <= self.port < 65536:
            raise PhalanxError(f"--port must be between 1024 and 65535, not {self.port}")


def time_limit_seconds(text: str) -> int:
    """Seconds of a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)."""
    match = TIME.match(text)
    if not match or text in ("0", ""):
        raise PhalanxError(f"--time must be a Slurm time limit (MINUTES, HH:MM:SS, D-HH:MM, ...), not {text!r}")
    days, *parts = match.groups()
    parts = [int(p) for p in parts if p is not None]
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 3:
        return (parts[0] * 60 + parts[1]) * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)  # MM or MM:SS


def config_path_for(script: Path) -> Path:
    """The resolved config travels next to the script: job.sbatch -> job.config.yaml."""
    return script.with_name(f"{script.stem}.config.yaml")


def render_sbatch(job: SlurmJob, script: Path, config_file: Path, phalanx_cmd: list[str] | None = None) -> str:
    """The sbatch script's text. `script` and `config_file` must be absolute paths on a filesystem every
    node sees (the run directory must be too: checkpoints are read back by whichever node resumes)."""
    job.validate()
    if any(c.isspace() for c in str(script)):  # #SBATCH lines take no quoting
        raise PhalanxError(f"--out {script}: Slurm cannot take a path with spaces in #SBATCH lines; choose another")
    phalanx_cmd = phalanx_cmd or [sys.executable, "-m", "phalanx"]
    policy = exit_policy()
    out_dir, stem = script.parent, script.stem
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        # whole nodes: the node agent's ranks need every core (and GPU) of their node
        "--exclusive",
    ]
    if not job.cpu:
        directives.append(f"--gpus-per-node={job.ranks_per_node}")
    directives += [f"--partition={job.partition}"] if job.partition else []
    directives += [f"--account={job.account}"] if job.account else []
    directives += [f"--time={job.time}"] if job.time else []
    directives += [
        f"--signal=TERM@{job.signal_before_s}",
        "--requeue",
        "--open-mode=append",
        f"--chdir={out_dir}",
        f"--output={out_dir / stem}-%j.out",
    ]
    gpus = "" if job.cpu else f" --gpus-per-node={job.ranks_per_node}"
    port = str(job.port) if job.port else "$((20000 + SLURM_JOB_ID % 20000))"
    requeue_cases = "|".join(str(c) for c in policy.requeue) or "none"
    never_cases = "|".join(str(c) for c in policy.never) or "none"
    stop = 'echo "phalanx: a node agent exited $c: not requeued"; rm -rf "$EXITS"; exit "$c"'
    other = stop  # any other code: an exit by signal N (128 + N) if the table requeues those, else stop
    if policy.requeue_signalled:
        other = f'if [ "$c" -gt 128 ] && [ "$c" -le {128 + MAX_SIGNAL} ]; then requeue_code=$c; else {stop}; fi'
    lines = [
        "#!/bin/bash",
        f"# Written by `phalanx cluster slurm` (phalanx {phalanx.__version__}): one phalanx node agent",
        "# per node. Submit it with `sbatch`; it requeues itself when the run can go on.",
        *(f"#SBATCH {d}" for d in directives),
        r"""set -uo pipefail  # not -e: the node agents' exit codes decide what happens next

CONFIG=%(config)s
PHALANX=(%(phalanx)s)  # how every node runs phalanx (the same path on all of them)
MAX_REQUEUES=%(max_requeues)d

# The first host of the allocation hosts the rendezvous; the port follows the job id, so two jobs
# sharing a node never meet.
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=%(port)s
export EXITS=%(exits)s/$SLURM_JOB_ID  # each node agent's exit code, on the shared filesystem
mkdir -p "$EXITS"
echo "phalanx: job $SLURM_JOB_ID (requeue ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, rendezvous $HEAD:$PORT"

# Slurm's SIGTERM (the --signal above before the time limit, a preemption, scancel, scontrol requeue)
# reaches every node agent, which stops its ranks and exits 143. The shells here only wait for that.
trap 'echo "phalanx: SIGTERM received: the node agents stop their ranks and exit 143"' TERM

# One node agent per node, with that node's rank (SLURM_NODEID is expanded on the node itself).
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE"%(gpus)s \
  bash -c 'trap : TERM; "$@" --node-rank "$SLURM_NODEID"; code=$?; echo "$code" > "$EXITS/$SLURM_NODEID"; exit "$code"' \
  node-agent "${PHALANX[@]}" train "$CONFIG" --nnodes %(nodes)d --nproc %(nproc)d --rdzv-endpoint "$HEAD:$PORT"
code=$?

# What to do, from phalanx/errors.py EXIT_CODES: a failure that running again cannot fix on any node
# stops the job with its code; otherwise a failure that can pass (a lost node, the time limit or a
# preemption: 143) requeues it, and the agents resume from the newest checkpoint.
requeue_code=0
for c in $(cat "$EXITS"/* 2>/dev/null) "$code"; do
  case "$c" in
    0) ;;
    %(requeue)s) requeue_code=$c ;;
    %(never)s) echo "phalanx: a node agent exited $c: not requeued (see the exit-code table)"; rm -rf "$EXITS"; exit "$c" ;;
    *) %(other)s ;;
  esac
done
rm -rf "$EXITS"
if [ "$requeue_code" = 0 ]; then
  echo "phalanx: done"
  exit 0
fi
if [ "${SLURM_RESTART_COUNT:-0}" -ge "$MAX_REQUEUES" ]; then
  echo "phalanx: exit $requeue_code after $MAX_REQUEUES requeues: giving up"
  exit "$requeue_code"
fi
echo "phalanx: exit $requeue_code: requeueing job $SLURM_JOB_ID to resume from the newest checkpoint"
scontrol requeue "$SLURM_JOB_ID"
exit "$requeue_code"
"""
        % {
            "config": shlex.quote(str(config_file)),
            "phalanx": " ".join(shlex.quote(p) for p in phalanx_cmd),
            "max_requeues": job.max_requeues,
            "port": port,
            "exits": shlex.quote(str(out_dir / f".{stem}-exits")),
            "gpus": gpus,
            "nodes": job.nodes,
            "nproc": job.ranks_per_node,
            "requeue": requeue_cases,
            "never": never_cases,
            "other": other,
        },
    ]
    return "\n".join(lines)


def submit(script: Path) -> str:
    """`sbatch SCRIPT`; returns the job id."""
    try:
        proc = subprocess.run(
            ["sbatch", "--parsable", str(script)], check=False, capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise PhalanxError(
            "--submit needs `sbatch` (run it on a Slurm login node, or submit the script yourself)"
        ) from None
    except subprocess.TimeoutExpired:
        raise PhalanxError("sbatch did not answer within 120 s (is slurmctld up? `sinfo` says)") from None
    if proc.returncode != 0:
        reason = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise PhalanxError(f"sbatch refused {script}: {reason[-1] if reason else f'exit {proc.returncode}'}")
    return proc.stdout.strip().split(";")[0]
