"""A real training run (2 gloo ranks, one killed and restarted) observed end to end: the store it fills,
the node agent's /metrics and hardware telemetry while it trains, TensorBoard files and `phalanx runs`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from phalanx.observe.store import RunStore
from tests.helpers import phalanx

STEPS = 12


@pytest.fixture(scope="module")
def observed(corpus, runs_root):
    """Train with a kill at step 6; scrape /metrics until the run is past step 8; return what was seen."""
    from tests.conftest import TINY

    root = runs_root / "observed"
    args = TINY + [
        f"data.sources=[{corpus}]",
        f"run.dir={root}",
        "run.name=watched",
        "safe.inject=[{fault: kill, rank: 1, step: 6}]",
        "observe.metrics_port=0",
        "observe.tensorboard=true",
        "observe.sync_interval_s=0.2",
        "observe.telemetry_interval_s=0.5",
        "observe.alert_disk_free_gib=1000000",
    ]  # more free disk than any machine has: an alert
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "train", *args, "--nproc", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    scraped, port_file = None, root / "watched" / "metrics_port"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if port_file.is_file():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port_file.read_text().strip()}/metrics") as r:
                    text = r.read().decode()
                families = {f.name: f for f in text_string_to_metric_families(text)}
                step = families["phalanx_train_step"].samples
                if step and step[0].value >= 8:
                    scraped = families
            except OSError:
                pass  # not serving yet, or already gone
        if scraped:
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return {
        "root": root,
        "run_dir": root / "watched",
        "summary": json.loads(out.strip().splitlines()[-1]),
        "metrics": scraped,
    }


@pytest.mark.slow
def test_the_store_holds_the_run_its_restart_and_every_ranks_timings(observed):
    store = RunStore.open(None, observed["root"], create=False)
    run = store.find_run("watched")
    assert run["status"] == "finished" and run["restarts"] == 1 and run["last_step"] == STEPS
    assert run["world_size"] == 2 and run["config"]["train"]["max_steps"] == STEPS and run["nodes"]
    series = store.series(run["id"])
    assert series["step"] == list(range(1, STEPS + 1))
    assert series["val_step"] == [0, 6, 12]
    heat = store.rank_heatmap(run["id"])
    assert heat["ranks"] == [0, 1] and heat["steps"] == list(range(1, STEPS + 1))
    kinds = [e["kind"] for e in store.events(run["id"])]
    assert kinds.count("restart") == 1 and "worker_failed" in kinds
    # Every line of the plain-file mirror is in the store once: steps 5 and 6 ran twice (before the kill
    # and after the restart from step 4's checkpoint).
    mirrored = [json.loads(line) for line in (observed["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    with store.engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT count(*) FROM steps WHERE run_id = ?", (run["id"],)).scalar()
    assert stored == len(mirrored)
    goodput = store.goodput(run["id"])
    assert goodput["restarts"] == 1 and 0 < goodput["ettr"] < 1


def test_the_node_agent_serves_prometheus_metrics_while_training(observed):
    families = observed["metrics"]
    assert families is not None, "never scraped /metrics past step 8"
    assert families["phalanx_train_step"].samples[0].labels == {"run": "watched"}
    assert families["phalanx_train_loss"].samples[0].value > 0
    tokens = families["phalanx_train_tokens"]  # a counter: rate() of it is the throughput
    step = families["phalanx_train_step"].samples[0].value
    assert tokens.type == "counter" and tokens.samples[0].value == step * 8 * 32  # steps x batch x seq_len
    assert "phalanx_train_tokens_per_second" not in families
    restarts = families["phalanx_train_restarts"]  # the parser strips _total from counter names
    assert restarts.type == "counter" and restarts.samples[0].value == 1
    assert families["phalanx_train_worker_failures"].samples[0].value == 1
    ranks = {s.labels["rank"] for s in families["phalanx_rank_compute_seconds"].samples}
    assert ranks == {"0", "1"}


def test_the_agent_samples_the_host_and_alerts_once_on_a_crossed_threshold(observed):
    samples = [json.loads(line) for line in (observed["run_dir"] / "telemetry.jsonl").read_text().splitlines()]
    assert len(samples) >= 2
    assert all(s["host"]["memory_total_bytes"] > s["host"]["memory_used_bytes"] > 0 for s in samples)
    assert samples[0]["devices"] == []  # no GPU and no vendor library here
    families = observed["metrics"]
    assert families["phalanx_host_memory_total_bytes"].samples[0].value == samples[0]["host"]["memory_total_bytes"]
    assert families["phalanx_host_disk_free_bytes"].samples[0].value > 0
    store = RunStore.open(None, observed["root"], create=False)
    alerts = [e for e in store.events(store.find_run("watched")["id"]) if e["kind"] == "telemetry_alert"]
    assert [(a["metric"], a["threshold"]) for a in alerts] == [("disk_free_gib", 1000000)]


def test_tensorboard_event_files_hold_the_curves(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed["run_dir"] / "tensorboard"))
    events.Reload()
    loss_steps = {e.step for e in events.Scalars("train/loss")}
    assert loss_steps == set(range(1, STEPS + 1))
    assert [e.step for e in events.Scalars("val/loss")][-1] == STEPS


def step_rows(root, run_id: int) -> int:
    import sqlalchemy as sa

    from phalanx.observe import tables as t

    store = RunStore.open(None, root, create=False)
    with store.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).where(t.steps.c.run_id == run_id)).scalar()


def config_lr(observed) -> float:
    return yaml.safe_load((observed["run_dir"] / "config.yaml").read_text())["train"]["lr"]


@pytest.mark.slow
def test_runs_commands_read_the_same_store(observed, tmp_path):
    root = str(observed["root"])
    listed = json.loads(phalanx("runs", "list", "--runs", root, "--json").stdout)
    assert [r["name"] for r in listed] == ["watched"]
    shown = json.loads(phalanx("runs", "show", "watched", "--runs", root, "--json").stdout)
    assert shown["restarts"] == 1 and any(e["kind"] == "restart" for e in shown["events"])
    table = phalanx("runs", "show", "watched", "--runs", root).stdout  # the terminal lists what --json does
    assert {e["kind"] for e in shown["events"][-30:]} <= set(re.findall(r"[a-z_]+", table)), table
    assert "checkpoint_saved" in table
    # A copy of the run with another learning rate, imported into the same store, then compared.
    copy = tmp_path / "watched-lr"
    shutil.copytree(observed["run_dir"], copy, ignore=shutil.ignore_patterns(".lock"))
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["train"]["lr"] = 0.5
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    phalanx("runs", "import", str(copy), "--runs", root)
    imported = json.loads(phalanx("runs", "show", "watched-lr", "--runs", root, "--json").stdout)
    assert imported["last_step"] == STEPS and imported["status"] == "finished"
    rows_before = step_rows(observed["root"], imported["id"])
    # Importing it again brings it up to date (nothing was missing): no refusal, no row twice.
    again = json.loads(phalanx("runs", "import", str(copy), "--runs", root, "--json").stdout)
    assert again["imported"] == [{"run_dir": str(copy), "id": imported["id"], "updated": True}]
    assert step_rows(observed["root"], imported["id"]) == rows_before > 0
    compared = json.loads(phalanx("runs", "compare", "watched", "watched-lr", "--runs", root, "--json").stdout)
    assert [r["name"] for r in compared["runs"]] == ["watched", "watched-lr"]
    assert compared["config_differences"] == {"train.lr": [config_lr(observed), 0.5]}
    missing = phalanx("runs", "show", "nope", "--runs", root, check=False)
    assert missing.returncode == 2 and missing.stderr.startswith("error: no run named 'nope'")
    assert "Traceback" not in missing.stderr
