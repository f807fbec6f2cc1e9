"""The soak drill (issue 13's "done when"): one run through the real launcher (2 gloo ranks, tiny preset)
that meets every kind of fault the project contains, in three launches: kills, hangs (one inside a
collective), NaN losses, a slow rank, a failed save and a corrupt checkpoint injected into the ranks;
then SIGTERM to the job (a preemption), `kill -9` of the node agent, and a PostgreSQL outage from the
third launch's step 34 to past its end. The per-step losses must equal an uninterrupted run's bit for
bit, and the store must hold every line of the run's metrics exactly once, with the run finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from phalanx.observe import tables as t
from phalanx.observe.store import RunStore
from phalanx.run.records import read_events
from tests.conftest import TINY
from tests.helpers import losses_by_step, ranks_of, read_metrics, train_json
from tests.observe.tcp_proxy import TcpRelay

pytestmark = pytest.mark.slow

STEPS = 40
RUN = [
    f"train.max_steps={STEPS}",
    "checkpoint.interval=5",
    "checkpoint.keep=10",
    "train.eval_interval=100",
    "checkpoint.memory_interval=1",
    "safe.max_restarts=10",
    "safe.crash_loop_restarts=5",
    "safe.hang_timeout_s=2",
    "observe.sync_interval_s=0.2",
    "observe.store_retry_s=120",
    "--nproc",
    "2",
]
FAULTS = (
    "[{fault: slow, rank: 1, step: 2, ms: 5}, {fault: kill, rank: 1, step: 6}, {fault: nan, rank: 0, step: 8},"
    " {fault: fail_save, rank: 0, step: 10}, {fault: hang, rank: 1, step: 13},"
    " {fault: corrupt_checkpoint, rank: 0, step: 16}, {fault: nan, rank: 1, step: 17},"
    " {fault: hang, rank: 0, step: 21, phase: collective}, {fault: kill, rank: 0, step: 24}]"
)


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if any('"loss"' in line and json.loads(line)["step"] >= step for line in lines if line.endswith("}")):
            return
        time.sleep(0.05)
    pytest.fail(f"{run_dir} did not reach step {step}")


@pytest.fixture
def postgres_db():
    from tests.observe.conftest import POSTGRES_URL, fresh_postgres_database

    if not POSTGRES_URL:
        pytest.skip("no PostgreSQL server: set PHALANX_TEST_POSTGRES_URL")
    with fresh_postgres_database() as url:
        yield sa.engine.make_url(url)


def test_the_soak_meets_every_fault_and_ends_with_a_clean_runs_losses(corpus, runs_root, postgres_db):
    base = TINY + [f"data.sources=[{corpus}]", f"run.dir={runs_root}"]
    clean = losses_by_step(train_json(*base, "run.name=soak-clean", *RUN, "observe.store=none")["run_dir"])
    relay = TcpRelay(postgres_db.host or "127.0.0.1", postgres_db.port or 5432).up()
    url = postgres_db.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
    args = [*base, "run.name=soak", *RUN, f"observe.store={url}", f"safe.inject={FAULTS}"]
    run_dir, procs = runs_root / "soak", []
    try:
        procs.append(first := start(args))  # the injected faults, then a preemption
        wait_for_step(first, run_dir, 28)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
        assert first.returncode == 143, err

        procs.append(second := start(args))  # the node agent killed outright
        wait_for_step(second, run_dir, 31)
        ranks = ranks_of(second.pid)
        second.kill()
        second.wait()

        procs.append(third := start(args))  # the store gone from step 34 to past the end
        wait_for_step(third, run_dir, 34)
        relay.down()
        wait_for_step(third, run_dir, STEPS)
        time.sleep(2)  # the ranks are done and the writer is retrying
        relay.up()
        _, err = third.communicate(timeout=300)
        assert third.returncode == 0, err
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)  # the killed agent's ranks are gone
    finally:
        relay.down()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    kinds = [e["kind"] for e in read_events(run_dir)]
    for kind in (
        "worker_failed",
        "hang_detected",
        "anomaly",
        "rollback",
        "save_failed",
        "checkpoint_corrupt",
        "preempted",
    ):
        assert kind in kinds, f"no {kind} event: the soak did not meet that fault"
    assert kinds.count("hang_detected") == 2 and kinds.count("anomaly") == 2
    assert any(e["kind"] == "checkpoint_loaded" and e.get("source") == "memory" for e in read_events(run_dir))
    assert losses_by_step(run_dir) == clean  # bit for bit, every step
    assert {m["step"] for m in read_metrics(run_dir) if "loss" in m} == set(range(1, STEPS + 1))

    store = RunStore(postgres_db.render_as_string(hide_password=False))
    try:
        run = store.find_run("soak")
        with store.engine.connect() as conn:
            stored = list(
                conn.execute(
                    sa.select(t.steps.c.step).where(t.steps.c.run_id == run["id"]).order_by(t.steps.c.step)
                ).scalars()
            )
        # Every line of metrics.jsonl exactly once: a step redone after a restart is a line of its own.
        assert stored == sorted(m["step"] for m in read_metrics(run_dir) if "step" in m)
        assert set(stored) == set(range(0, STEPS + 1))  # 0: the first validation loss
        assert run["status"] == "finished" and run["last_step"] == STEPS
    finally:
        store.close()
