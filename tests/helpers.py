"""Helpers for tests that run the real `phalanx` CLI in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def phalanx(
    *args: str, timeout: float = 600, check: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run the real `phalanx` CLI in a fresh process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"phalanx {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def launched(script: Path, *args: str, nproc: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a test's worker script under torch's launcher on `nproc` local ranks (alone in this process for
    one). --standalone: a free port of its own, not the default 29500 another launch may still hold."""
    command = [sys.executable, str(script), *args]
    if nproc > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)


def train_json(*args: str) -> dict:
    proc = phalanx("train", *args, "--json")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last logged training loss of each step (a resumed run appends)."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60) -> None:
    """Until something listens on 127.0.0.1:port (a rendezvous store, a server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"nothing listens on port {port}")


# -- the processes of a launch -------------------------------------------------------------------------
def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def is_rank(pid: int) -> bool:
    """Whether `pid` is a training rank: `python -m phalanx.train.worker`, or a process forked by a warm
    server (phalanx/launch/warm_ranks.py), which shares the server's command line (that names the
    worker among what it preloads): forked, its parent has the same one."""
    command = _cmdline(pid)
    if b"phalanx.train.worker" not in command:
        return False
    if b"multiprocessing.forkserver" not in command:
        return True
    try:
        return _cmdline(parent_of(pid)) == command
    except (OSError, IndexError, ValueError):
        return False


def agent_of(rank: int) -> int:
    """The node agent of a rank: its parent, or its fork server's parent."""
    parent = parent_of(rank)
    return parent_of(parent) if b"multiprocessing.forkserver" in _cmdline(parent) else parent


def ranks_of(agent: int) -> list[int]:
    """The pids of the ranks node agent `agent` started."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and is_rank(int(p.name)) and _safe_agent_of(int(p.name)) == agent
    ]


def _safe_agent_of(rank: int) -> int | None:
    try:
        return agent_of(rank)
    except (OSError, IndexError, ValueError):
        return None
