"""A node agent's ranks die with it, however it dies (phalanx/launch/cluster/ray_reaper.py): torch starts
each rank in a session of its own, so nothing else would stop them when the agent is SIGKILLed."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# An "agent": starts its watcher, then a "rank" in a new session as torch's elastic agent does, and waits.
AGENT = textwrap.dedent("""
    import subprocess, sys, time
    from phalanx.launch.cluster.ray_reaper import start_reaper
    start_reaper(sys.argv[1])
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_ranks_of_a_killed_agent_are_stopped():
    agent = subprocess.Popen([sys.executable, "-c", AGENT, "token-of-this-test"], stdout=subprocess.PIPE, text=True)
    rank = int(agent.stdout.readline())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        time.sleep(0.5)
        assert alive(rank)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 10
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(rank), "the rank outlived its agent"
        assert alive(other.pid)  # a process without the agent's token is left alone
    finally:
        other.kill()
        for pid in (rank, agent.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
