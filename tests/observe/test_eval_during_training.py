"""eval.tasks (issue 31): a real run scores lm-evaluation-harness tasks on its checkpoints while it trains,
and the scores reach the run directory, the run store (PostgreSQL when a server is there, else SQLite),
the dashboard's run page in headless Chromium, and Prometheus (the node agent's collector and the
dashboard's /metrics).

The task is local (tests/eval/local_tasks.py) and the harness runs offline. checkpoint.interval 4 and
eval.interval 8 over 12 steps: steps 8 and 12 (the last) are scored, step 4 is not.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.observe.store import RunStore
from tests.conftest import TINY
from tests.eval.local_tasks import OFFLINE, write_mc_task
from tests.helpers import phalanx
from tests.observe.conftest import CHROMIUM, POSTGRES_URL, fresh_postgres_database

RUN = "eval-during"
LIMIT = 12


@pytest.fixture(scope="module")
def store_spec():
    """The store the run writes to: a fresh PostgreSQL database when a server is there, else the default
    SQLite file in the runs root (None)."""
    if not POSTGRES_URL:
        yield None
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory, store_spec):
    root = tmp_path_factory.mktemp("eval-during")
    tasks = write_mc_task(tmp_path_factory.mktemp("tasks"), corpus)
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(root / "hf-cache")}.items():
            env.setenv(name, value)
        proc = phalanx(
            "train",
            *TINY,
            "model.max_seq_len=128",  # room for a question and its longest choice
            f"data.sources=[{corpus}]",
            f"run.dir={root}",
            f"run.name={RUN}",
            "eval.tasks=[eval_mc]",
            "eval.interval=8",
            f"eval.limit={LIMIT}",
            f"eval.include_path={tasks}",
            f"observe.store={store_spec or 'null'}",
            "observe.sync_interval_s=0.2",
            "--json",
        )
    run_dir = Path(json.loads(proc.stdout.strip().splitlines()[-1])["run_dir"])
    store = RunStore.open(store_spec, root, create=False)
    yield {
        "root": root,
        "run_dir": run_dir,
        "store": store,
        "run": store.find_run(RUN),
        "stderr": proc.stderr,
        "tasks": tasks,
        "store_spec": store_spec,
    }
    store.close()


def reports(run_dir: Path) -> dict[int, dict]:
    found = {}
    for path in sorted((run_dir / "eval").glob("step_*.json")):
        report = json.loads(path.read_text())
        found[report["step"]] = report
    return found


def events(run_dir: Path, prefix: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"].startswith(prefix)]


def test_the_chosen_checkpoints_are_scored_in_the_run_directory(trained):
    run_dir = trained["run_dir"]
    saved = reports(run_dir)
    assert sorted(saved) == [8, 12]
    for step, report in saved.items():
        assert report["model"] == str(run_dir / "checkpoints" / f"step_{step:08d}")
        assert report["limit"] == LIMIT and report["samples"] == {"eval_mc": LIMIT}
        for score in report["tasks"]["eval_mc"].values():
            assert 0 <= score["value"] <= 1 and score["stderr"] > 0
    finished = events(run_dir, "eval_tasks_finished")
    assert [e["step"] for e in finished] == [8, 12]
    assert all(e["seconds"] > 0 and e["saved"].startswith(str(run_dir / "eval")) for e in finished)
    # Step 8's evaluation ran while steps 9-12 trained: its cost against the steps before it.
    assert finished[0]["steps_during"] >= 1 and finished[0]["slowdown"] > 0
    assert finished[1]["blocked_seconds"] > 0  # the end of the run waited for the last checkpoint's
    assert [e["step"] for e in events(run_dir, "eval_tasks_started")] == [8, 12]
    assert not events(run_dir, "eval_tasks_failed") and not events(run_dir, "eval_tasks_skipped")
    assert "step 12: eval_mc acc" in trained["stderr"]  # the console line with the scores


def test_the_store_holds_every_score_once(trained):
    store, run = trained["store"], trained["run"]
    rows = store.eval_scores(run["id"])
    expected = [
        (step, "eval_mc", metric, score["value"], score["stderr"])
        for step, report in sorted(reports(trained["run_dir"]).items())
        for metric, score in sorted(report["tasks"]["eval_mc"].items())
    ]
    got = sorted((r["step"], r["task"], r["metric"], r["value"], r["stderr"]) for r in rows)
    assert got == expected
    assert {r["samples"] for r in rows} == {LIMIT} and {r["limit"] for r in rows} == {LIMIT}
    # Importing the run again adds nothing: each report is read once.
    phalanx("runs", "import", str(trained["run_dir"]), *store_option(trained))
    assert len(store.eval_scores(run["id"])) == len(rows)


def store_option(trained) -> list[str]:
    url = trained["store"].url
    return ["--store", url] if not url.startswith("sqlite") else ["--store", str(trained["root"] / "phalanx.db")]


def newest(trained) -> dict[str, float]:
    report = reports(trained["run_dir"])[12]
    return {metric: score["value"] for metric, score in report["tasks"]["eval_mc"].items()}


def test_prometheus_has_the_newest_scores(trained):
    """The node agent's collector (a follower of the run directory) and the dashboard's /metrics."""
    from phalanx.observe.app import create_app, running
    from phalanx.observe.follower import RunFollower
    from phalanx.observe.prom import TrainingCollector

    follower = RunFollower(trained["run_dir"], RUN, 0.0)
    follower.sync()
    registry = CollectorRegistry()
    registry.register(TrainingCollector(follower.state))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    scores = {s.labels["metric"]: s.value for s in families["phalanx_train_eval_score"].samples}
    assert scores == newest(trained)
    assert {s.labels["task"] for s in families["phalanx_train_eval_score"].samples} == {"eval_mc"}
    assert {s.value for s in families["phalanx_train_eval_step"].samples} == {12}

    import httpx

    with running(create_app(trained["store"])) as url:
        text = httpx.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["phalanx_run_eval_score"].samples
    assert {s.labels["metric"]: s.value for s in samples} == newest(trained)
    assert all(s.labels["run"] == RUN and s.labels["id"] == str(trained["run"]["id"]) for s in samples)


@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"no Chromium at {CHROMIUM}")
def test_the_run_page_shows_a_table_per_checkpoint_and_the_chart(trained, page):
    from phalanx.observe.app import create_app, running

    with running(create_app(trained["store"])) as url:
        page.goto(f"{url}/runs/{trained['run']['id']}")
        page.wait_for_selector("body[data-loaded=true]")
        page.wait_for_selector("#eval:not([hidden]) table.eval-table")
        tables = page.eval_on_selector_all(
            "table.eval-table",
            "tables => tables.map(t => ({step: t.dataset.step, caption: t.caption.textContent,"
            " rows: [...t.tBodies[0].rows].map(r => [...r.cells].map(c => c.textContent))}))",
        )
        chart = page.eval_on_selector(
            "#fig-eval_scores", "el => ({hidden: el.hidden, names: (el.data || []).map(t => t.name)})"
        )
        screenshot = Path(os.environ.get("PHALANX_SCREENSHOTS") or trained["root"]) / "eval-scores.png"
        page.screenshot(path=str(screenshot), full_page=True)
    assert page.errors == []
    assert [t["step"] for t in tables] == ["12", "8"]  # newest first
    for table in tables:
        report = reports(trained["run_dir"])[int(table["step"])]
        assert table["caption"].startswith(f"step {table['step']}") and f"at most {LIMIT}" in table["caption"]
        want = sorted(
            ["eval_mc", metric, f"{s['value']:.4f}", f"± {s['stderr']:.4f}", str(LIMIT)]
            for metric, s in report["tasks"]["eval_mc"].items()
        )
        assert sorted(table["rows"]) == want
    assert not chart["hidden"] and sorted(chart["names"]) == ["eval_mc acc", "eval_mc acc_norm"]


def test_an_interval_no_checkpoint_falls_on_is_refused_in_one_line(corpus, tmp_path):
    proc = phalanx(
        "train",
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={tmp_path}",
        "eval.tasks=[eval_mc]",
        "eval.interval=6",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "eval.interval=6 is not a multiple of checkpoint.interval=4" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    missing = tmp_path / "no-tasks-here"
    proc = phalanx(
        "train",
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={tmp_path}",
        "eval.tasks=[eval_mc]",
        f"eval.include_path={missing}",
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: eval.include_path={missing} is not a directory of task files (*.yaml)"
    ], proc.stderr


@pytest.mark.slow  # a run or an evaluation of its own: over 10 s
def test_a_phalanx_eval_by_hand_lands_in_the_store_too(trained, tmp_path, monkeypatch):
    """Item 2: `phalanx eval` of a run that is not training saves its report and brings the run's store up
    to date (here a copy of the run, so the other tests keep theirs): the new report and the copied ones."""
    copy = tmp_path / RUN
    shutil.copytree(trained["run_dir"], copy, ignore=shutil.ignore_patterns(".lock"))
    for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}.items():
        monkeypatch.setenv(name, value)
    proc = phalanx(
        "eval",
        str(copy / "checkpoints" / "step_00000008"),
        "--tasks",
        "eval_mc",
        "--include-path",
        str(trained["tasks"]),
        "--limit",
        "4",
        "--json",
    )
    assert "stored in the run store" in proc.stderr
    store = RunStore.open(trained["store_spec"], tmp_path, create=False)
    try:
        rows = store.eval_scores(store.run_id_for_dir(copy))
    finally:
        store.close()
    by_report = {}
    for row in rows:
        by_report.setdefault(row["report"], set()).add((row["step"], row["limit"]))
    assert sorted(v for values in by_report.values() for v in values) == [(8, 4), (8, LIMIT), (12, LIMIT)]


@pytest.mark.slow  # a run or an evaluation of its own: over 10 s
def test_a_failing_evaluation_is_an_event_and_a_newer_checkpoint_replaces_a_waiting_one(corpus, tmp_path):
    """eval.tasks names a task there is not: each evaluation fails in one line and training goes on. Every
    checkpoint is chosen (no eval.interval): step 4's runs while 8 and then 12 are saved, so 12 replaces 8,
    which waited."""
    tasks = write_mc_task(tmp_path, corpus)
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}.items():
            env.setenv(name, value)
        proc = phalanx(
            "train",
            *TINY,
            f"data.sources=[{corpus}]",
            f"run.dir={tmp_path}",
            "run.name=failing",
            "eval.tasks=[no_such_task]",
            f"eval.include_path={tasks}",
            "observe.store=none",
            "--json",
        )
    run_dir = tmp_path / "failing"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 12
    failed = events(run_dir, "eval_tasks_failed")
    assert [e["step"] for e in failed] == [4, 12]
    assert all(e["exit_code"] == 2 and "unknown task 'no_such_task'" in e["error"] for e in failed)
    assert [(e["step"], e["newer_step"]) for e in events(run_dir, "eval_tasks_skipped")] == [(8, 12)]
    assert "step 4: eval.tasks failed (error: unknown task 'no_such_task'" in proc.stderr
    assert not (run_dir / "eval").exists()


@pytest.mark.slow  # a run of its own
def test_an_evaluation_over_its_time_is_stopped_and_the_run_ends(corpus, tmp_path):
    """eval.timeout_s: a harness that hangs (here: one that cannot even start in 1 s) is stopped, said in
    an event and a console line, and the end of the run, which waits for the last checkpoint's, ends."""
    tasks = write_mc_task(tmp_path, corpus)
    proc = phalanx(
        "train",
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={tmp_path}",
        "run.name=slow-eval",
        "eval.tasks=[eval_mc]",
        f"eval.include_path={tasks}",
        "eval.interval=12",
        "eval.timeout_s=1",
        "observe.store=none",
        "--json",
    )
    run_dir = tmp_path / "slow-eval"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 12
    failed = events(run_dir, "eval_tasks_failed")
    assert [(e["step"], e["error"]) for e in failed] == [(12, "stopped after eval.timeout_s=1 s")]
    assert "step 12: eval.tasks failed (stopped after eval.timeout_s=1 s)" in proc.stderr
