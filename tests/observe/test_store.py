"""The run store on SQLite and PostgreSQL: migrations, ingestion exactly once, downsampled reads."""

from __future__ import annotations

import json
import time

import pytest
import sqlalchemy as sa

from phalanx.errors import PhalanxError, StoreError
from phalanx.observe import tables
from phalanx.observe.follower import RunFollower
from phalanx.observe.store import RunStore
from phalanx.observe.store import store_url as make_store_url


def test_migrated_schema_matches_the_table_definitions(store_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    store = RunStore(store_url)
    assert store.schema_version() == "0006"
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), tables.metadata)
    assert diff == []
    RunStore(store_url).close()  # opening a migrated store again is a no-op
    store.close()


def test_a_run_from_start_to_finish(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("r1", tmp_path / "r1", {"train": {"lr": 0.1}}, "tiny", 2, 100, "node-a")
    store.add_node(run_id, "node-b")
    store.add_node(run_id, "node-a")  # again: still listed once
    now = time.time()
    store.ingest(
        run_id,
        [
            {"step": 0, "val_loss": 6.0, "time": now},
            {"step": 1, "loss": 5.0, "lr": 0.1, "tokens_per_sec": 100.0, "mfu": 0.3, "time": now},
            {"step": 2, "loss": float("nan"), "time": now + 1, "skipped": "nan"},
        ],
        [{"step": 1, "rank": r, "compute_seconds": 0.1 * (r + 1), "time": now} for r in range(2)],
        [
            {"kind": "worker_failed", "time": now + 2, "node": "node-a", "rank": 1, "exitcode": -9},
            {"kind": "restart", "time": now + 2.1, "node": "node-a", "rank": None, "attempt": 1},
        ],
        {},
    )
    run = store.find_run("r1")
    assert run["status"] == "restarting" and run["restarts"] == 1 and run["nodes"] == ["node-a", "node-b"]
    assert run["last_step"] == 2 and run["last_loss"] is None  # NaN is stored as null
    assert run["config"] == {"train": {"lr": 0.1}}
    store.ingest(run_id, [], [], [{"kind": "training_started", "time": now + 5, "rank": 0}], {})
    assert store.run(run_id)["status"] == "running"
    store.set_goodput(run_id, {"ettr": 0.5, "goodput": {"productive": 1.0}})
    store.finish_run(run_id, "finished")
    run = store.run(run_id)
    assert run["status"] == "finished" and run["ettr"] == 0.5 and run["ended_at"] is not None
    events = store.events(run_id)
    assert [e["kind"] for e in events] == ["worker_failed", "restart", "training_started"]
    assert events[0]["exitcode"] == -9 and events[0]["rank"] == 1
    assert store.goodput(run_id)["goodput"] == {"productive": 1.0}
    # A relaunch of the same directory is the same run, running again.
    assert store.start_run("r1", tmp_path / "r1", {}, "tiny", 2, 100, "node-a") == run_id
    assert store.run(run_id)["status"] == "running"


def test_long_runs_are_downsampled_short_ones_are_not(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("long", tmp_path / "long", {}, "tiny", 4, 5000, "n")
    metrics = [{"step": s, "loss": 10.0 / s, "time": float(s)} for s in range(1, 5001)]
    ranks = [
        {"step": s, "rank": r, "compute_seconds": 0.5 if r == 3 else 0.1, "time": float(s)}
        for s in range(1, 5001)
        for r in range(4)
    ]
    store.ingest(run_id, metrics, ranks, [], {})
    series = store.series(run_id, max_points=100)
    assert len(series["step"]) == 100 and series["step"][-1] == 5000
    assert series["loss"][-1] == pytest.approx(10.0 / 5000)
    heat = store.rank_heatmap(run_id, max_bins=50)
    assert heat["ranks"] == [0, 1, 2, 3] and len(heat["steps"]) == 50
    assert all(v == pytest.approx(0.5) for v in heat["compute_seconds"][3])  # the slow rank stands out
    assert all(v == pytest.approx(0.1) for v in heat["compute_seconds"][0])
    short = store.start_run("short", tmp_path / "short", {}, "tiny", 1, 10, "n")
    store.ingest(short, metrics[:7] + metrics[4:7], [], [], {})  # steps 5-7 run twice (a restart)
    assert store.series(short, max_points=100)["step"] == list(range(1, 8))


def test_the_follower_copies_each_line_exactly_once_across_launches(store_url, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "ranks").mkdir(parents=True)
    store = RunStore(store_url)
    run_id = store.start_run("run", run_dir, {}, "tiny", 1, 10, "n")

    def append(name, *records, partial=""):
        with open(run_dir / name, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records) + partial)

    append("metrics.jsonl", {"step": 1, "loss": 3.0, "time": 1.0})
    append("ranks/rank_0.jsonl", {"step": 1, "rank": 0, "compute_seconds": 0.1, "time": 1.0})
    append(
        "events.jsonl", {"kind": "training_started", "time": 1.0, "rank": 0}, partial='{"kind": "checkpoint_sa'
    )  # a line still being written
    follower = RunFollower(run_dir, "run", 0.0, store, run_id)
    follower.sync()
    follower.sync()  # nothing new: nothing doubled
    assert store.series(run_id)["step"] == [1]
    assert [e["kind"] for e in store.events(run_id)] == ["training_started"]
    append("events.jsonl", partial='ved", "time": 2.0, "rank": 0, "step": 1}\n')  # the line completes
    append("metrics.jsonl", {"step": 2, "loss": 2.5, "time": 2.0})
    # A later launch starts a new follower: it continues from the offsets in the store.
    RunFollower(run_dir, "run", 0.0, store, run_id).sync()
    assert store.series(run_id)["step"] == [1, 2]
    assert [e["kind"] for e in store.events(run_id)] == ["training_started", "checkpoint_saved"]
    assert store.rank_heatmap(run_id)["ranks"] == [0]


def test_quarantine_keeps_a_node_until_cleared(store_url):
    store = RunStore(store_url)
    store.quarantine_node("gpu-07", "matmul bf16 310 TFLOP/s below the 600 floor", run="big")
    store.quarantine_node("gpu-07", "memory bandwidth 1.2 TB/s below the 3.0 floor")  # newest reason wins
    assert [(q["node"], q["reason"][:6]) for q in store.quarantined()] == [("gpu-07", "memory")]
    assert store.clear_quarantine("gpu-07") is True
    assert store.clear_quarantine("gpu-07") is False
    assert store.quarantined() == []


def test_bad_store_urls_and_names_are_one_line_errors(tmp_path):
    with pytest.raises(PhalanxError, match="no run store at"):
        RunStore.open(None, tmp_path / "nowhere", create=False)
    with pytest.raises(PhalanxError, match="not a database URL"):
        RunStore("postgresql://:::")
    with pytest.raises(StoreError, match="run store .* unavailable: .*refused") as down:
        RunStore("postgresql://nobody:secret@127.0.0.1:1/none")
    assert down.value.transient and down.value.exit_code == 7
    store = RunStore(make_store_url(None, tmp_path))
    with pytest.raises(PhalanxError, match="no run named 'ghost'"):
        store.find_run("ghost")


def test_store_url_forms(tmp_path):
    assert make_store_url(None, tmp_path) == f"sqlite:///{tmp_path.resolve() / 'phalanx.db'}"
    assert make_store_url("postgresql://h/db", tmp_path) == "postgresql://h/db"
    assert make_store_url(str(tmp_path / "x.db"), tmp_path) == f"sqlite:///{tmp_path.resolve() / 'x.db'}"


def test_the_password_never_shows_in_errors():
    with pytest.raises(PhalanxError) as info:
        RunStore("postgresql://user:hunter2@127.0.0.1:1/db")
    assert "hunter2" not in str(info.value)


def test_lines_wait_in_memory_while_the_store_is_down_and_land_once_it_is_back(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = RunStore(make_store_url(None, tmp_path))
    run_id = store.start_run("run", run_dir, {}, "tiny", 1, 10, "n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0, "time": 1.0}) + "\n")
    follower = RunFollower(run_dir, "run", 0.0, store, run_id)
    working = store.engine
    # A real engine pointed at a port nothing listens on: the store is down.
    store.engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none", connect_args={"connect_timeout": 1})
    follower.sync()
    assert follower.state()["last"]["step"] == 1  # /metrics carries on without the store
    store.engine = working
    assert store.series(run_id)["step"] == []
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "loss": 2.0, "time": 2.0}) + "\n")
    follower.sync()
    follower.sync()
    assert store.series(run_id)["step"] == [1, 2]
    assert store.offsets(run_id)["metrics.jsonl"] == (run_dir / "metrics.jsonl").stat().st_size


def test_a_long_run_name_and_unknown_large_ids_are_handled(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("x" * 300, tmp_path / "long", {}, "tiny", 1, 10, "n")
    assert store.run(run_id)["name"] == "x" * 200
    with pytest.raises(PhalanxError, match="no run with id 9999999999"):
        store.run(9999999999)
    with pytest.raises(PhalanxError, match="no run named '9999999999'"):
        store.find_run("9999999999")


def test_a_store_at_an_older_schema_version_is_migrated_with_its_runs_kept(store_url, tmp_path):
    from alembic import command
    from alembic.config import Config

    from phalanx.observe.store import MIGRATIONS

    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:  # a store as the first release of phalanx left it
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
        conn.execute(
            sa.text(
                "INSERT INTO runs (name, dir, status, started_at, updated_at, restarts) "
                "VALUES ('old', '/runs/old', 'finished', 1.0, 1.0, 0)"
            )
        )
    engine.dispose()
    store = RunStore(store_url)
    assert store.schema_version() == "0006"
    assert [r["name"] for r in store.list_runs()] == ["old"]
    assert store.quarantined() == []


def test_processes_opening_a_new_store_at_once_all_succeed(store_url):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        versions = pool.map(_open_and_read_version, [store_url] * 4)
    assert versions == ["0006"] * 4


def _open_and_read_version(url: str) -> str:
    return RunStore(url).schema_version()
