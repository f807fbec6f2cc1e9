"""Ranks never outlive their node agent under Ray.

torch's elastic agent starts each rank in a session of its own, and Ray kills a worker's children only
when the worker exits through Ray (`ray.kill`), not when the process is killed outright (SIGKILL, the
OOM killer). A rank left running after its agent died would go on training against its peers, and
writing checkpoints, while Ray starts a replacement agent beside it. So each agent actor starts this
small watcher: when its parent (the actor) is gone, it kills every process that carries the actor's
token in its environment (the ranks inherit it, and so do their own children), then exits.

`python -m phalanx.launch.cluster.ray_reaper AGENT_PID TOKEN`
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TOKEN_ENV = "PHALANX_AGENT_TOKEN"
POLL_SECONDS = 0.2


def start_reaper(token: str) -> subprocess.Popen:
    """Mark this process's future children with `token` and start its watcher."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # the watcher must not match itself
    os.environ[TOKEN_ENV] = token
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.launch.cluster.ray_reaper", str(os.getpid()), token],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def marked_processes(token: str) -> list[int]:
    """Every process this user can read whose environment holds TOKEN_ENV=token."""
    mark = f"{TOKEN_ENV}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone already, or another user's
            continue
    return found


def reap(token: str) -> list[int]:
    killed = []
    for pid in marked_processes(token):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def main(argv: list[str]) -> int:
    agent, token = int(argv[0]), argv[1]
    while os.getppid() == agent:  # reparented (to init or a subreaper) once the agent is gone
        time.sleep(POLL_SECONDS)
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
