"""Benchmark reports (RUN_DIR/eval/*.json, from `phalanx eval --tasks` or eval.tasks) into the run store, on
SQLite and PostgreSQL: each report once across launches and store rebuilds, the newest scores for
/metrics, the 0006 migration, and report files that are not what they should be."""

from __future__ import annotations

import json

import sqlalchemy as sa

from phalanx.observe.follower import RunFollower
from phalanx.observe.store import RunStore


def report(step: int, created: str, acc: float, stderr: float | None = 0.05, **extra) -> dict:
    """A report as phalanx/eval/report.py writes it."""
    return {
        "model": f"/runs/r/checkpoints/step_{step:08d}",
        "run_dir": "/runs/r",
        "step": step,
        "created": created,
        "kind": "tasks",
        "tasks": {"mc": {"acc": {"value": acc, "stderr": stderr}, "acc_norm": {"value": acc / 2, "stderr": None}}},
        "samples": {"mc": 20},
        "limit": 20,
        "batch_size": 8,
        "lm_eval_version": "0.4.13",
        **extra,
    }


def save(run_dir, name: str, content) -> None:
    (run_dir / "eval").mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (run_dir / "eval" / name).write_text(text)


def scores(store: RunStore, run_id: int) -> list[tuple]:
    return [(r["step"], r["metric"], r["value"], r["stderr"]) for r in store.eval_scores(run_id)]


def test_each_report_lands_once_across_launches(store_url, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    store = RunStore(store_url)
    run_id = store.start_run("r", run_dir, {}, "tiny", 1, 10, "n")
    save(run_dir, "step_00000004-20260105T101500.json", report(4, "2026-01-05T10:15:00+00:00", 0.25))
    follower = RunFollower(run_dir, "r", 0.0, store, run_id)
    follower.sync()
    follower.sync()  # nothing new: nothing doubled
    assert scores(store, run_id) == [(4, "acc", 0.25, 0.05), (4, "acc_norm", 0.125, None)]
    row = store.eval_scores(run_id)[0]
    assert (row["task"], row["samples"], row["limit"]) == ("mc", 20, 20)
    assert row["report"] == "eval/step_00000004-20260105T101500.json" and row["time"] == 1767608100.0
    # A later launch: a new follower continues from what the store says it read.
    save(run_dir, "step_00000008-20260105T102000.json", report(8, "2026-01-05T10:20:00+00:00", 0.5))
    RunFollower(run_dir, "r", 0.0, store, run_id).sync()
    assert [s[:2] for s in scores(store, run_id)] == [(4, "acc"), (4, "acc_norm"), (8, "acc"), (8, "acc_norm")]
    # The reports' marks are written once, with their rows, not again on every pass.
    with store.engine.connect() as conn:
        marks = conn.execute(sa.text("SELECT path, position FROM ingest_offsets WHERE path LIKE 'eval/%'")).all()
    assert sorted(marks) == [
        ("eval/step_00000004-20260105T101500.json", 1),
        ("eval/step_00000008-20260105T102000.json", 1),
    ]
    store.close()


def test_a_rebuilt_store_gets_the_reports_again(store_url, tmp_path):
    """The store writer's path: a follower that opens the store itself copies what the store lacks."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    save(run_dir, "step_00000004-20260105T101500.json", report(4, "2026-01-05T10:15:00+00:00", 0.25))
    stores = []

    def connect():
        store = RunStore(store_url)
        stores.append(store)
        return store, store.start_run("r", run_dir, {}, "tiny", 1, 10, "n")

    follower = RunFollower(run_dir, "r", 0.0, interval=0.1, connect=connect)
    assert follower.sync()
    store = stores[0]
    run_id = store.run_id_for_dir(run_dir)
    assert [s[:2] for s in scores(store, run_id)] == [(4, "acc"), (4, "acc_norm")]
    store.close()


def test_the_newest_scores_are_of_the_latest_step_and_its_newest_report(store_url, tmp_path):
    store = RunStore(store_url)
    ids = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        run_dir.mkdir()
        ids.append(store.start_run(name, run_dir, {}, "tiny", 1, 10, "n"))
        save(run_dir, "step_00000004-20260105T101500.json", report(4, "2026-01-05T10:15:00+00:00", 0.25))
        save(run_dir, "step_00000008-20260105T102000.json", report(8, "2026-01-05T10:20:00+00:00", 0.5))
        if name == "a":  # step 8 evaluated again later, with more samples: that one counts
            save(run_dir, "step_00000008-20260105T110000.json", report(8, "2026-01-05T11:00:00+00:00", 0.75))
        RunFollower(run_dir, name, 0.0, store, ids[-1]).sync()
    newest = {(r["run_id"], r["metric"]): (r["step"], r["value"]) for r in store.newest_eval_scores()}
    assert newest == {
        (ids[0], "acc"): (8, 0.75),
        (ids[0], "acc_norm"): (8, 0.375),
        (ids[1], "acc"): (8, 0.5),
        (ids[1], "acc_norm"): (8, 0.25),
    }
    store.close()


def test_files_that_are_not_task_reports_give_no_rows_and_stop_nothing(store_url, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    store = RunStore(store_url)
    run_id = store.start_run("r", run_dir, {}, "tiny", 1, 10, "n")
    save(run_dir, "step_00000001-20260105T100000.json", "{not json")
    save(run_dir, "step_00000002-20260105T100000.json", '["a list"]')
    save(run_dir, "step_00000003-20260105T100000.json", {"kind": "text", "step": 3, "text": {"bits_per_byte": 2}})
    save(run_dir, "step_00000005-20260105T100000.json", report(5, "x", 0.1) | {"step": "five"})
    hostile = report(6, "2026-01-05T10:00:00+00:00", float("inf"))
    hostile["tasks"]["mc"]["acc_norm"] = {"value": True, "stderr": "0.1"}
    hostile["tasks"]["t" * 500] = {"m": {"value": 0.5, "stderr": -1}}
    hostile["samples"] = {"mc": 2**40}
    save(run_dir, "step_00000006-20260105T100000.json", hostile)  # its infinite acc: Infinity in the file
    save(run_dir, ".step_00000007-20260105T100000.json.123.tmp", report(7, "2026-01-05T10:00:00+00:00", 0.9))
    save(run_dir, "notes.json", report(9, "2026-01-05T10:00:00+00:00", 0.9))
    RunFollower(run_dir, "r", 0.0, store, run_id).sync()
    rows = store.eval_scores(run_id)
    # Only step 6's report is a task report of a checkpoint; what in it is not a finite number is null,
    # and a name longer than its column is cut.
    assert {r["step"] for r in rows} == {6}
    by_metric = {(r["task"][:5], r["metric"]): (r["value"], r["stderr"], r["samples"]) for r in rows}
    assert by_metric == {
        ("mc", "acc"): (None, 0.05, None),
        ("mc", "acc_norm"): (None, None, None),
        ("ttttt", "m"): (0.5, -1.0, None),
    }
    assert max(len(r["task"]) for r in rows) == 200
    store.close()
