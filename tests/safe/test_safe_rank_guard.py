"""The pieces that keep a rank from outliving its node agent, on real processes: the parent-death signal,
the watch over the agent's beat on the heartbeat board, and the removal of boards dead agents left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from phalanx.safe.heartbeat import AgentWatch, remove_stale_boards


def python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], **kwargs)


def agent_with_board(path: Path) -> subprocess.Popen:
    """A stand-in node agent: a process that owns a heartbeat board (and beats on it) until killed."""
    proc = python(
        f"""
        import time
        from pathlib import Path
        from phalanx.safe.heartbeat import HeartbeatBoard
        HeartbeatBoard(Path({str(path)!r}), 2)
        print("ready", flush=True)
        time.sleep(600)
    """,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def watch(path: Path, **kwargs) -> list[str]:
    reasons: list[str] = []
    AgentWatch(path, reasons.append, interval=0.05, **kwargs)
    return reasons


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_rank_sees_its_agent_die(tmp_path):
    agent = agent_with_board(tmp_path / "board")
    reasons = watch(tmp_path / "board")
    time.sleep(0.3)
    assert reasons == []  # alive and beating: nothing to say
    agent.kill()
    assert wait_for(lambda: reasons, 5), "the watch did not notice the agent's death"
    assert reasons == [f"the node agent (pid {agent.pid}) is gone"]
    agent.wait()


def test_a_rank_sees_its_agent_freeze(tmp_path):
    agent = agent_with_board(tmp_path / "board")
    reasons = watch(tmp_path / "board", stale_after=1.0)
    try:
        time.sleep(1.5)
        assert reasons == []  # the agent's own thread beats every 0.5 s
        os.kill(agent.pid, signal.SIGSTOP)
        assert wait_for(lambda: reasons, 5)
        assert reasons[0].startswith(f"the node agent (pid {agent.pid}) has not beaten for ")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
        agent.kill()
        agent.wait()


def test_a_rank_dies_with_its_parent_even_when_killed_with_sigkill():
    # parent -> child; the child arms the parent-death signal and sleeps; the parent is SIGKILLed.
    parent = python(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "from phalanx.safe.rank_guard import die_with_parent; import time; "
            "assert die_with_parent(); print('armed', flush=True); time.sleep(600)"], stdout=sys.stdout)
        print(child.pid, flush=True)
        time.sleep(600)
    """,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline().strip() == "armed"
    parent.kill()
    parent.wait()
    assert wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 5)


def test_the_next_launch_removes_boards_of_dead_agents_only(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"phalanx-heartbeat-{dead.pid}-abc123"
    live = tmp_path / f"phalanx-heartbeat-{os.getpid()}-def456"
    legacy = tmp_path / "phalanx-heartbeat-x1y2z3"  # an older name with no pid: whose it is is unknown
    for path in (stale, live, legacy):
        path.write_bytes(b"\0" * 64)
    assert remove_stale_boards(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and legacy.exists()
