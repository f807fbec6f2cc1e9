"""A full /dev/shm at a restart, through the real launcher (2 gloo ranks, warm restarts, in-memory snapshots).

The launch runs in a mount namespace of its own (`unshare -m`, root only) with a 32 MiB tmpfs on /dev/shm,
which the test fills from outside (through /proc/PID/root) once the run trains, and keeps full, as another
job growing there would: the snapshots stop with their warning, then a rank is killed. The warm restart's
semaphores find no room in /dev/shm; the agent must start that attempt's ranks as fresh interpreters and
finish the run, rather than die inside torch's process context (exit 1, no restart: the issue). A launch
into a /dev/shm full from the start must train too (its heartbeat board goes to the temp directory).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phalanx.run.records import read_events
from tests.conftest import TINY
from tests.helpers import ranks_of

SHM_MIB = 32  # room for the ranks' snapshot slots (3 x 1.5 MiB each) and the heartbeat board
# Rank 0 is slowed by 100 ms a step (until the restart: a fault fires once per run), so that the test
# fills /dev/shm and kills a rank well before step 24.
DRILL = [
    "train.max_steps=24",
    "train.eval_interval=100",
    "checkpoint.interval=4",
    "checkpoint.memory_interval=1",
    "safe.inject=[{fault: slow, rank: 0, step: 1, ms: 100}]",
    "--nproc",
    "2",
    "--json",
]


def in_own_shm(mib: int, then: str = "") -> list[str]:
    """A command-line prefix: run the rest with a tmpfs of `mib` MiB on /dev/shm, seen by it alone (shell
    `then` runs first, in that namespace)."""
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={mib}m tmpfs /dev/shm && {then} exec "$0" "$@"']


def own_shm_works() -> bool:
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    try:
        return subprocess.run(probe, check=False, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def keep_full(shm: Path, proc: subprocess.Popen) -> None:
    """Fill `shm` to the last page, then take every page freed again until `proc` ends."""
    fd = os.open(shm / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    for chunk in (1 << 20, 4096):
        try:
            while True:
                os.write(fd, bytes(chunk))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc

    def take_freed_pages() -> None:
        while proc.poll() is None:
            try:
                os.write(fd, bytes(4096))
            except OSError:
                time.sleep(0.002)
        os.close(fd)

    threading.Thread(target=take_freed_pages, daemon=True).start()


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} never happened (exit {proc.returncode})")
        time.sleep(0.02)


needs_root = pytest.mark.skipif(not own_shm_works(), reason="needs root: `unshare -m` and a tmpfs mount")


@needs_root
@pytest.mark.slow  # about 24 s beside another worker (TESTING.md)
def test_a_restart_into_a_full_dev_shm_starts_cold_and_the_run_finishes(corpus, runs_root, tmp_path):
    name = "shm-full-restart"
    run_dir = runs_root / name
    args = [*TINY, f"data.sources=[{corpus}]", f"run.dir={runs_root}", f"run.name={name}", *DRILL]
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [*in_own_shm(SHM_MIB), sys.executable, "-m", "phalanx", "train", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and metrics.read_text().count('"loss"') >= 5, proc, "step 5")
    keep_full(Path(f"/proc/{proc.pid}/root/dev/shm"), proc)  # the launch's own /dev/shm, not this machine's
    wait_for(lambda: "in-memory snapshots stop" in stderr.read_text(), proc, "the snapshots' warning")
    os.kill(max(ranks_of(proc.pid)), signal.SIGKILL)  # a crash, as the drill

    out, _ = proc.communicate(timeout=180)
    said = stderr.read_text()
    assert proc.returncode == 0, said[-4000:]
    assert "Traceback" not in said
    assert (
        "warning: /dev/shm is full (no room for the semaphores of a warm start): this attempt's ranks start "
        "as fresh interpreters" in said
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 24 and summary["restarts"] == 1
    events = read_events(run_dir)
    assert [e["attempt"] for e in events if e["kind"] == "cold_start"] == [1]
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and 4 <= loaded[0]["step"] < 24  # resumed, from disk or a snapshot still sound


@needs_root
def test_a_launch_into_a_full_dev_shm_trains(tiny_args):
    fill = "dd if=/dev/zero of=/dev/shm/filler bs=4k 2>/dev/null;"  # until no page is left (dd then fails)
    proc = subprocess.run(
        [
            *in_own_shm(1, then=fill),
            sys.executable,
            "-m",
            "phalanx",
            "train",
            *tiny_args,
            "train.max_steps=8",  # past `auto`'s probes, which choose the snapshot interval
            "--nproc",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert "warning: /dev/shm is full (no room for the semaphores of a warm start)" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 8
    # The snapshots said once that they stopped; no interval is then announced for them.
    assert "no in-memory snapshots" in proc.stderr or "in-memory snapshots stop" in proc.stderr
    assert "in-memory snapshots every" not in proc.stderr
