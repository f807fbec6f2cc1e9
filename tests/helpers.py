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


def phalanx(*args: str, timeout: float = 600, check: bool = True,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real `phalanx` CLI in a fresh process."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "phalanx", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"phalanx {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


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
