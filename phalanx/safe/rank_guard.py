"""What a rank sets up first, before it imports torch: it must not outlive its node agent, it holds its
share of the run lock for as long as it lives, and SIGTERM means "stop at the next step and save".

Three layers keep a rank from training on unsupervised once its agent is gone:
  - the parent-death signal (Linux prctl PR_SET_PDEATHSIG): the kernel SIGKILLs the rank the moment its
    parent dies, `kill -9` included. For a rank the agent started itself that is the agent (the signal
    fires when the *thread* that started the rank exits: the thread running the agent's loop, since
    launch() runs it in the caller's thread and returns only once the ranks are stopped); for a rank
    forked by the agent's warm server (phalanx/launch/warm_ranks.py) it is that server;
  - a check right after setting it that the agent is still this process's parent or grandparent (it may
    have died before the signal was armed);
  - a watch over the agent on the heartbeat board (AgentWatch: its pid, every half second, and its beat),
    for what the signal misses: the agent of a warm-started rank (whose server outlives it while its
    ranks hold the server's pipe), a frozen agent, a system without prctl.
Holding the run lock shared (run.lock.hold_shared) means a new launch cannot take the run directory
while any rank of the old one still lives, however the old agent died.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

from phalanx.errors import AgentGoneError, PhalanxError
from phalanx.run.lock import hold_shared
from phalanx.safe.heartbeat import ENV_FILE, AgentWatch
from phalanx.safe.preemption import PREEMPTION

ENV_AGENT_PID = "PHALANX_AGENT_PID"  # set by the launcher: the node agent's pid
ENV_RUN_LOCK = "PHALANX_RUN_LOCK"  # set by the launcher on the node that owns the run directory
PR_SET_PDEATHSIG = 1  # linux/prctl.h

_kept: list = []  # what must stay referenced for the rank's life (the lock's open file, the watch)


def guard_rank() -> None:
    """Called first thing in a rank (python -m phalanx.train.worker). Outside a launch (no agent pid in
    the environment: a test, a rank started by hand) only the SIGTERM handling is set up."""
    PREEMPTION.install()
    agent = os.environ.get(ENV_AGENT_PID)
    if agent is None:
        return
    die_with_parent()
    # Started by the agent itself, or forked by its warm server (phalanx/launch/warm_ranks.py), which is
    # the agent's child: either way the agent is the parent or the grandparent while it lives.
    if int(agent) not in (os.getppid(), parent_of(os.getppid())):
        stop(f"the node agent (pid {agent}) exited before this rank started")
    lock = os.environ.get(ENV_RUN_LOCK)
    if lock:
        try:
            _kept.append(hold_shared(Path(lock)))
        except PhalanxError as exc:
            stop(str(exc))
    board = os.environ.get(ENV_FILE)
    if board:
        try:
            _kept.append(AgentWatch(Path(board), stop))
        except OSError:  # the agent removes its board as it exits
            stop(f"the node agent (pid {agent}) is gone: its heartbeat board {board} is")


def parent_of(pid: int) -> int | None:
    """The parent pid of process `pid` (Linux /proc), or None where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state": the parent's pid


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent (thread) exits; whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop(reason: str) -> None:
    """End this rank at once: its agent is gone, so no one would stop it, and its peers may be blocked in
    a collective with it (os._exit does not wait for any thread)."""
    rank = os.environ.get("RANK", "?")
    print(f"rank {rank}: {reason}; stopping so that it does not train unsupervised", file=sys.stderr, flush=True)
    os._exit(AgentGoneError.exit_code)
