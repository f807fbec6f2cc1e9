"""Store faults against the real databases, without training (the drills through `phalanx train` are in
test_store_drills.py): an SQLite file deleted or replaced under the follower is rebuilt from the run
directory; a PostgreSQL outage (a relay in front of the real server, cut and restored) only delays the
copy and the end of the run lands once the server is back, within a bounded time; the writer process
survives its own death and its agent's; `phalanx runs import` brings a partly stored run up to date."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from phalanx.observe import tables as t
from phalanx.observe.follower import RunFollower, refill_unfinished
from phalanx.observe.observer import sync_run_dir
from phalanx.observe.store import RunStore
from phalanx.observe.store_writer import StoreWriter
from tests.helpers import phalanx
from tests.observe.tcp_proxy import TcpRelay


def make_run_dir(root: Path, name: str = "run") -> Path:
    run_dir = root / name
    (run_dir / "ranks").mkdir(parents=True)
    return run_dir


def append_steps(run_dir: Path, steps: range) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.writelines(
            json.dumps({"step": s, "loss": 5.0 - s / 100, "step_seconds": 0.1, "time": 1000.0 + s}) + "\n"
            for s in steps
        )
    with open(run_dir / "ranks" / "rank_0.jsonl", "a") as f:
        f.writelines(
            json.dumps({"step": s, "rank": 0, "compute_seconds": 0.1, "time": 1000.0 + s}) + "\n" for s in steps
        )


def append_event(run_dir: Path, kind: str, **details) -> None:
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"kind": kind, "time": time.time(), "rank": 0, **details}) + "\n")


def stored_steps(store: RunStore, run_id: int) -> list[int]:
    """Every step row of the run, in step order: a step stored twice shows twice."""
    with store.engine.connect() as conn:
        return list(
            conn.execute(sa.select(t.steps.c.step).where(t.steps.c.run_id == run_id).order_by(t.steps.c.step)).scalars()
        )


def connector(url: str, run_dir: Path):
    def connect():
        store = RunStore(url)
        return store, store.start_run(run_dir.name, run_dir, {}, "tiny", 1, 10, "node-a")

    return connect


def test_a_deleted_sqlite_store_is_rebuilt_with_the_runs_whole_history(tmp_path):
    root = tmp_path / "runs"
    run_dir = make_run_dir(root)
    db = root / "phalanx.db"
    follower = RunFollower(run_dir, "run", 0.0, connect=connector(f"sqlite:///{db}", run_dir))
    append_event(run_dir, "training_started")
    append_steps(run_dir, range(1, 4))
    assert follower.sync()
    for f in root.glob("phalanx.db*"):  # what `rm phalanx.db*` does mid-run
        f.unlink()
    append_steps(run_dir, range(4, 6))
    assert follower.sync() and follower.rebuilds == 1
    follower.sync()  # nothing new: nothing twice
    store = RunStore(f"sqlite:///{db}", create=False)
    run_id = store.run_id_for_dir(run_dir)
    assert stored_steps(store, run_id) == [1, 2, 3, 4, 5]
    assert store.rank_heatmap(run_id)["steps"] == [1, 2, 3, 4, 5]
    kinds = [e["kind"] for e in store.events(run_id)]
    assert kinds[0] == "training_started" and "store_rebuilt" in kinds  # said in the run's own events
    assert store.run(run_id)["status"] == "running"


def test_the_refill_of_a_rebuilt_store_is_retried_until_done_even_by_the_next_writer(tmp_path):
    root = tmp_path / "runs"
    run_dir = make_run_dir(root)
    db = root / "phalanx.db"
    answers = [False, True]  # the store refuses the other runs once (made immutable, say), then takes them
    calls = []

    def refill(store):
        calls.append(store)
        return answers[len(calls) - 1]

    follower = RunFollower(run_dir, "run", 0.0, connect=connector(f"sqlite:///{db}", run_dir), on_rebuilt=refill)
    append_steps(run_dir, range(1, 3))
    assert follower.sync() and not calls  # a store that was never rebuilt is not refilled
    for f in root.glob("phalanx.db*"):
        f.unlink()
    assert not follower.sync() and len(calls) == 1 and refill_unfinished(run_dir)
    assert follower.sync() and len(calls) == 2 and not refill_unfinished(run_dir)
    assert follower.sync() and len(calls) == 2  # done: not again
    # A writer killed mid-refill: the next one learns from the run's events that it is still to do.
    append_event(run_dir, "store_rebuilt", path=str(db))
    assert refill_unfinished(run_dir)
    again = []
    successor = RunFollower(
        run_dir,
        "run",
        0.0,
        connect=connector(f"sqlite:///{db}", run_dir),
        on_rebuilt=lambda store: again.append(store) or True,
        refill_pending=refill_unfinished(run_dir),
    )
    assert successor.sync() and len(again) == 1 and not refill_unfinished(run_dir)


def test_an_sqlite_store_replaced_by_an_older_copy_gets_what_the_copy_lacks(tmp_path):
    root = tmp_path / "runs"
    run_dir = make_run_dir(root)
    db = root / "phalanx.db"
    follower = RunFollower(run_dir, "run", 0.0, connect=connector(f"sqlite:///{db}", run_dir))
    append_steps(run_dir, range(1, 4))
    assert follower.sync()
    backup = root / "backup.db"  # a consistent copy, WAL included, as a restore from backup would bring
    with sqlite3.connect(db) as src, sqlite3.connect(backup) as dst:
        src.backup(dst)
    append_steps(run_dir, range(4, 7))
    assert follower.sync()
    os.replace(backup, db)  # the file is replaced: same name, another inode, only steps 1-3
    for f in root.glob("phalanx.db-*"):
        f.unlink()
    append_steps(run_dir, range(7, 8))
    assert follower.sync() and follower.rebuilds == 1
    store = RunStore(f"sqlite:///{db}", create=False)
    assert stored_steps(store, store.run_id_for_dir(run_dir)) == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_postgres_outage_delays_the_copy_and_the_end_lands_once_the_server_is_back(store_url, tmp_path):
    server = sa.engine.make_url(store_url)
    relay = TcpRelay(server.host or "127.0.0.1", server.port or 5432).up()
    url = server.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
    run_dir = make_run_dir(tmp_path)
    follower = RunFollower(run_dir, "run", 0.0, interval=0.2, connect=connector(url, run_dir))
    append_steps(run_dir, range(1, 4))
    assert follower.sync()
    relay.down()  # the server goes away at step 3, connections and all
    append_steps(run_dir, range(4, 7))
    assert not follower.sync()  # the lines wait in memory
    started = time.monotonic()
    assert not follower.drain(1.5, "finished")  # an outage longer than the retry window: it gives up, on time
    assert time.monotonic() - started < 10
    back = threading.Timer(2.0, relay.up)
    back.start()
    try:
        assert follower.drain(60, "finished")  # retried with backoff until the server answers again
    finally:
        back.join()
        relay.down()
    store = RunStore(store_url)
    run_id = store.run_id_for_dir(run_dir)
    assert stored_steps(store, run_id) == [1, 2, 3, 4, 5, 6]
    assert store.run(run_id)["status"] == "finished"


def test_the_writer_process_outlives_its_own_death_and_stores_the_end(tmp_path):
    root = tmp_path / "runs"
    run_dir = make_run_dir(root)
    url = f"sqlite:///{root / 'phalanx.db'}"
    spec = {
        "url": url,
        "run_dir": str(run_dir),
        "name": "run",
        "wall_start": 0.0,
        "interval": 0.2,
        "retry_s": 5,
        "register": {"config": {}, "model": "tiny", "world_size": 1, "max_steps": 10, "node": "node-a"},
    }
    writer = StoreWriter(spec)
    append_steps(run_dir, range(1, 4))
    wait_for_steps(url, run_dir, 3)
    first = writer.proc.pid
    os.kill(first, signal.SIGKILL)  # as a SIGBUS from a database file would end it
    append_steps(run_dir, range(4, 7))
    wait_for_steps(url, run_dir, 6)  # a new writer, from the offsets in the store
    assert writer.proc.pid != first and writer.restarts == 1
    assert writer.finish("finished", None)
    store = RunStore(url, create=False)
    run_id = store.run_id_for_dir(run_dir)
    assert stored_steps(store, run_id) == [1, 2, 3, 4, 5, 6]
    assert store.run(run_id)["status"] == "finished"

    # The agent dies without a word (its end of the pipe closes): the writer stores the rest, and a failure.
    orphan = StoreWriter(spec)
    append_steps(run_dir, range(7, 9))
    orphan._ending.set()  # no restarts: the agent is gone
    orphan.proc.stdin.close()
    assert orphan.proc.wait(timeout=60) == 0
    run = store.run(run_id)
    assert stored_steps(store, run_id) == list(range(1, 9))
    assert run["status"] == "failed" and "node agent ended" in run["error"]


def wait_for_steps(url: str, run_dir: Path, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            store = RunStore(url, create=False)
            run_id = store.run_id_for_dir(run_dir)
            if run_id is not None and len(stored_steps(store, run_id)) >= n:
                store.close()
                return
            store.close()
        except Exception:
            pass  # not created yet
        time.sleep(0.2)
    pytest.fail(f"the store never got {n} steps")


def test_runs_import_brings_a_run_the_store_has_only_part_of_up_to_date(store_url, tmp_path):
    run_dir = make_run_dir(tmp_path)
    (run_dir / "config.yaml").write_text("run:\n  name: run\n")
    store = RunStore(store_url)
    run_id = store.start_run("run", run_dir, {}, "tiny", 1, 6, "node-a")
    append_steps(run_dir, range(1, 4))
    RunFollower(run_dir, "run", 0.0, store, run_id).sync()
    # The launch went on while the store was down, and ended: its status never landed.
    append_steps(run_dir, range(4, 7))
    append_event(run_dir, "checkpoint_saved", step=6)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 6, "halted": False}))
    if store_url.startswith("sqlite"):  # the command itself once (a CLI start costs seconds here)
        done = json.loads(phalanx("runs", "import", str(run_dir), "--store", store_url, "--json").stdout)
        assert done == {"imported": [{"run_dir": str(run_dir), "id": run_id, "updated": True}]}
    else:
        assert sync_run_dir(store, run_dir) == (run_id, True)
    assert stored_steps(store, run_id) == [1, 2, 3, 4, 5, 6]
    assert store.run(run_id)["status"] == "finished"
    assert [e["kind"] for e in store.events(run_id)] == ["checkpoint_saved"]
    assert sync_run_dir(store, run_dir) == (run_id, True)
    assert stored_steps(store, run_id) == [1, 2, 3, 4, 5, 6]  # nothing twice
