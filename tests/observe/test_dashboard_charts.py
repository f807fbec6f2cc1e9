"""The dashboard's W&B-style views over real loopback HTTP on real stores: x axis by step, tokens or
wall time; smoothing; log scale; restarts, rollbacks and checkpoint saves marked; system charts from the
stored telemetry; MFU left out where it cannot be known; the heatmap's colour scale without warm-up
steps; tags and notes; the compare page's config diff and charts. The store-level parts run on SQLite
and, with PHALANX_TEST_POSTGRES_URL, on PostgreSQL."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import httpx
import plotly.graph_objects as go
import pytest
import sqlalchemy as sa

from phalanx.config.schema import ObserveSection
from phalanx.observe.app import create_app, running
from phalanx.observe.figures import (
    COMPARE_CHARTS,
    MOE_CHARTS,
    NO_DEVICE_TELEMETRY,
    NO_EVAL_SCORES,
    NO_TELEMETRY,
    NOT_MOE,
)
from phalanx.observe.follower import RunFollower
from phalanx.observe.store import RunStore
from phalanx.run.records import JsonlEventSink
from phalanx.safe.telemetry import TelemetrySampler
from tests.observe.dashboard_runs import (
    CHECKPOINT_EVERY,
    RESTART_AT,
    RESUMED_FROM,
    ROLLBACK_AT,
    TOKENS_PER_STEP,
    fill_run,
)

TOKEN = "charts-test-token-0123456789"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("dash-charts")
    store = RunStore.open(None, root)
    gpu = fill_run(store, root, "gpu-run")
    cpu = fill_run(store, root, "cpu-run", gpus=False, mfu=False, lr=1e-3)
    cpu2 = fill_run(store, root, "cpu-run-2", gpus=False, mfu=False, steps=12)
    bare = store.start_run("bare", root / "bare", {}, "tiny", 1, 10, "node-a")
    store.ingest(bare, [{"step": s, "loss": 5.0, "time": 1.0e9 + s} for s in range(1, 4)], [], [], {})
    yield SimpleNamespace(store=store, root=root, gpu=gpu, cpu=cpu, cpu2=cpu2, bare=bare)
    store.close()


@pytest.fixture(scope="module")
def client(runs):
    with running(create_app(runs.store)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def run_json(client, run_id: int, **params) -> dict:
    response = client.get(f"/api/runs/{run_id}", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def traces(figure: dict) -> dict[str, dict]:
    return {t["name"]: t for t in figure["data"]}


def trained_steps() -> list[int]:
    return list(range(1, 41))


# -- x axis, smoothing, log scale ----------------------------------------------------------------------
def test_the_x_axis_is_the_step_by_default_and_tokens_on_request(client, runs):
    by_step = run_json(client, runs.gpu)
    assert traces(by_step["figures"]["loss"])["train loss"]["x"] == trained_steps()
    assert by_step["options"] == {"x": "step", "smooth": 0.0, "log": False}
    by_tokens = run_json(client, runs.gpu, x="tokens")
    loss = by_tokens["figures"]["loss"]
    assert traces(loss)["train loss"]["x"] == [s * TOKENS_PER_STEP for s in trained_steps()]
    assert traces(loss)["validation loss"]["x"] == [s * TOKENS_PER_STEP for s in (10, 20, 30, 40)]
    assert loss["layout"]["xaxis"]["title"]["text"] == "tokens"
    assert traces(loss)["restart"]["x"] == [RESTART_AT * TOKENS_PER_STEP]  # marks move with the axis
    for name in ("lr", "tokens_per_sec", "events"):
        assert by_tokens["figures"][name]["layout"]["xaxis"]["title"]["text"] == "tokens", name


def test_tokens_come_from_the_config_when_no_step_reports_them(client, runs):
    # The "bare" run has neither tokens_seen nor a batch in its config: the axis says it shows steps.
    loss = run_json(client, runs.bare, x="tokens")["figures"]["loss"]
    assert loss["data"][0]["x"] == [1, 2, 3]
    assert loss["layout"]["xaxis"]["title"]["text"] == "step (tokens per step not recorded)"


def test_the_time_axis_shows_each_run_of_a_restarted_step_and_a_gap_while_down(client, runs):
    body = run_json(client, runs.gpu, x="time")
    loss = traces(body["figures"]["loss"])["train loss"]
    redone = RESTART_AT - RESUMED_FROM
    assert len(loss["x"]) == 40 + redone + 1  # every logged step, the redone ones twice, and one gap
    gap = loss["y"].index(None)
    assert gap == RESTART_AT  # after the first attempt's 20 points
    assert all(isinstance(x, str) and x.startswith("2023-11-") for x in loss["x"])
    val = traces(body["figures"]["loss"])["validation loss"]
    assert val["y"].count(None) == 1 and len(val["y"]) == 6  # 10, 20, the gap, 20 again, 30, 40
    assert loss["x"] == sorted(loss["x"])
    assert body["figures"]["loss"]["layout"]["xaxis"]["type"] == "date"
    assert body["figures"]["events"]["layout"]["xaxis"]["type"] == "date"


def test_the_event_timeline_switches_between_wall_time_and_step(client, runs):
    by_time = traces(run_json(client, runs.gpu, x="time")["figures"]["events"])
    by_step = traces(run_json(client, runs.gpu, x="step")["figures"]["events"])
    i = by_step["recovery"]["y"].index("restart")
    assert by_step["recovery"]["x"][i] == RESTART_AT  # a restart has no step: the last one logged before it
    assert isinstance(by_time["recovery"]["x"][i], str)
    checkpoints = by_step["checkpoint"]["x"]
    assert checkpoints == sorted(checkpoints) and checkpoints[0] == CHECKPOINT_EVERY


def test_smoothing_draws_a_moving_average_over_the_faint_raw_line(client, runs):
    body = run_json(client, runs.gpu, smooth="0.6")
    loss = traces(body["figures"]["loss"])
    raw, smooth = loss["train loss (raw)"], loss["train loss"]
    assert raw["opacity"] == 0.3 and raw["x"] == smooth["x"]
    # TensorBoard's debiased exponential moving average, computed independently here.
    expected, average = [], 0.0
    for i, value in enumerate(raw["y"], start=1):
        average = 0.6 * average + 0.4 * value
        expected.append(average / (1 - 0.6**i))
    assert smooth["y"] == pytest.approx(expected)
    assert smooth["y"][0] == pytest.approx(raw["y"][0])  # debiased: the first point is not pulled to 0
    assert [t["name"] for t in body["figures"]["lr"]["data"]] == ["Learning rate"]  # a schedule is not smoothed
    flat = traces(body["figures"]["mfu"])["MFU per step"]["y"]
    assert set(flat) == {0.3}  # a constant stays exactly constant, not rounding noise


def test_log_scale_applies_to_the_curves_but_not_the_learning_rate(client, runs):
    figures = run_json(client, runs.gpu, log="1")["figures"]
    assert figures["loss"]["layout"]["yaxis"]["type"] == "log"
    assert figures["grad_norm"]["layout"]["yaxis"]["type"] == "log"
    assert "type" not in figures["lr"]["layout"]["yaxis"]
    assert "type" not in run_json(client, runs.gpu)["figures"]["loss"]["layout"]["yaxis"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"x": "epoch"}, "x must be one of step, tokens, time"),
        ({"smooth": "2"}, "smooth must be a number from 0 to 0.99"),
        ({"smooth": "abc"}, "smooth must be a number"),
        ({"smooth": "nan"}, "smooth must be a number"),
        ({"smooth": "-0.1"}, "smooth must be a number"),
        ({"log": "yes"}, "log must be 0 or 1"),
    ],
)
def test_bad_chart_options_are_400_with_what_is_allowed(client, runs, params, message):
    for path, query in ((f"/api/runs/{runs.gpu}", {}), ("/api/compare", {"ids": f"{runs.gpu},{runs.cpu}"})):
        response = client.get(path, params={**query, **params})
        assert response.status_code == 400 and message in response.json()["error"], path


# -- marks ---------------------------------------------------------------------------------------------
def test_restarts_rollbacks_and_checkpoint_saves_are_vertical_lines_on_loss_and_throughput(client, runs):
    figures = run_json(client, runs.gpu)["figures"]
    saves = [CHECKPOINT_EVERY * k for k in range(1, RESTART_AT // CHECKPOINT_EVERY + 1)] + list(
        range(RESTART_AT, 41, CHECKPOINT_EVERY)
    )  # step 20 saved by both attempts
    for name in ("loss", "tokens_per_sec"):
        figure = figures[name]
        lines = {(s["line"]["dash"], s["x0"]) for s in figure["layout"]["shapes"]}
        assert ("dash", RESTART_AT) in lines and ("dashdot", ROLLBACK_AT) in lines
        assert sorted(x for dash, x in lines if dash == "dot") == sorted(set(saves))
        assert all(s["yref"] == "paper" and s["x0"] == s["x1"] for s in figure["layout"]["shapes"])
        marks = traces(figure)
        assert marks["restart"]["yaxis"] == "y2" and marks["restart"]["x"] == [RESTART_AT]
        assert "attempt: 1" in marks["restart"]["hovertext"][0]
        assert "to_step: 30" in marks["rollback"]["hovertext"][0]
        assert marks["checkpoint saved"]["x"] == saves
    assert figures["loss"]["layout"]["showlegend"] is True
    assert figures["tokens_per_sec"]["layout"]["showlegend"] is False
    for name in ("lr", "grad_norm", "mfu", "heatmap"):
        assert "shapes" not in figures[name]["layout"], name


def test_many_checkpoints_are_thinned_to_a_readable_number_of_marks(runs):
    from phalanx.observe.figures import MAX_CHECKPOINT_MARKS, XAxis, run_marks

    events = [{"kind": "checkpoint_saved", "time": float(s), "step": s} for s in range(1, 1001)]
    marks = run_marks(events, None, XAxis({"step": [1], "time": [1.0]}, "step"))
    assert len(marks) == MAX_CHECKPOINT_MARKS and marks[0]["x"] == 1 and marks[-1]["x"] == 1000


# -- CPU runs, system charts, heatmap -----------------------------------------------------------------
def test_on_cpu_mfu_is_left_out_and_the_tile_says_why(client, runs):
    body = run_json(client, runs.cpu)
    assert body["hidden"]["mfu"].startswith("not reported")
    assert "peak_mem_gib" in body["hidden"]
    assert body["notes"]["mfu"] == "unknown on CPU: no peak FLOP/s to compare with (set train.peak_tflops)"
    assert body["series"]["achieved_tflops"][-1] == pytest.approx(0.02)  # what the tile shows instead
    gpu = run_json(client, runs.gpu)
    # a dense model, never evaluated on tasks
    assert gpu["hidden"] == {**dict.fromkeys(MOE_CHARTS, NOT_MOE), "eval_scores": NO_EVAL_SCORES}
    assert gpu["notes"]["mfu"] is None


def test_system_charts_show_every_node_and_device_from_the_stored_telemetry(client, runs):
    body = run_json(client, runs.gpu)
    figures = body["figures"]
    temperature = traces(figures["sys_device_temp"])
    assert set(temperature) == {"node-a #0", "node-a #1"}
    assert len(temperature["node-a #0"]["x"]) == 40 + RESTART_AT - RESUMED_FROM  # one sample per logged step
    assert temperature["node-a #1"]["y"][0] == pytest.approx(61.1)
    memory = traces(figures["sys_memory"])["node-a (of 64 GiB)"]
    assert memory["y"][0] == pytest.approx(8 + 1 / 64)  # GiB
    assert traces(figures["sys_cpu"])["node-a"]["y"][0] == pytest.approx(0.41)
    assert figures["sys_cpu"]["layout"]["xaxis"]["type"] == "date"
    assert traces(figures["sys_device_power"])["node-a #1"]["y"][0] == 310.0
    cpu = run_json(client, runs.cpu)
    assert {k for k, v in cpu["hidden"].items() if v == NO_DEVICE_TELEMETRY} == {
        "sys_device_util",
        "sys_device_memory",
        "sys_device_temp",
        "sys_device_power",
    }
    assert "sys_cpu" not in cpu["hidden"]
    bare = run_json(client, runs.bare)
    assert bare["hidden"]["sys_cpu"] == NO_TELEMETRY


def test_the_heatmap_colour_scale_leaves_out_the_warm_up_steps(client, runs):
    body = run_json(client, runs.gpu)
    heatmap = body["figures"]["heatmap"]
    trace = heatmap["data"][0]
    # Steady steps take 0.5 s (rank 1: 0.8 s); the first step of each launch 3 s (4.8 s).
    assert max(max(v for v in row if v is not None) for row in trace["z"]) == pytest.approx(4.8)
    assert (trace["zmin"], trace["zmax"]) == pytest.approx((0.5, 0.8))
    assert trace["zauto"] is False
    assert f"warm-up steps 1, {RESUMED_FROM + 1}" in heatmap["layout"]["title"]["text"]


# -- events --------------------------------------------------------------------------------------------
def test_each_event_gets_the_step_it_happened_at(client, runs):
    body = run_json(client, runs.gpu)
    by_kind = {}
    for event, step in zip(body["events"], body["event_steps"]):
        by_kind.setdefault(event["kind"], []).append(step)
    assert by_kind["worker_failed"] == [RESTART_AT]  # its step was null: the newest logged step then
    assert by_kind["restart"] == [RESTART_AT]
    assert by_kind["rollback"] == [ROLLBACK_AT] and by_kind["training_started"] == [0, RESUMED_FROM]


# -- compare -------------------------------------------------------------------------------------------
def test_compare_shows_where_the_configs_differ_and_every_chart(client, runs):
    body = client.get(f"/api/compare?ids={runs.gpu},{runs.cpu}").json()
    assert body["config_diff"] == [
        {"key": "parallel.device", "values": ["auto", "cpu"]},
        {"key": "train.lr", "values": [3e-4, 1e-3]},
    ]  # run.* left out
    assert set(body["figures"]) == {key for key, *_ in COMPARE_CHARTS}
    for key in ("tokens_per_sec", "grad_norm", "step_seconds", "lr"):
        assert [len(t["x"]) for t in body["figures"][key]["data"]] == [40, 40], key
    assert [e["colour"] for e in body["runs"]] == ["#1f77b4", "#ff7f0e"]
    assert body["hidden"] == {}  # the GPU run has an MFU
    assert "config" not in body["runs"][0]["run"]
    cpus = client.get(f"/api/compare?ids={runs.cpu},{runs.cpu2}").json()
    assert set(cpus["hidden"]) == {"mfu", "peak_mem_gib"}
    assert cpus["config_diff"] == [{"key": "train.lr", "values": [1e-3, 3e-4]}]


def test_compare_by_time_starts_every_run_at_zero_and_smooths(client, runs):
    body = client.get(f"/api/compare?ids={runs.gpu},{runs.cpu}&x=time&smooth=0.5&log=1").json()
    loss = body["figures"]["train_loss"]
    assert [t["name"] for t in loss["data"]] == [
        "gpu-run (#1) (raw)",
        "gpu-run (#1)",
        "cpu-run (#2) (raw)",
        "cpu-run (#2)",
    ]
    assert loss["data"][0]["x"][0] == 0 and loss["layout"]["xaxis"]["title"]["text"].startswith("time since")
    assert loss["data"][0]["y"].count(None) == 1  # the restart breaks the line here too
    assert loss["layout"]["yaxis"]["type"] == "log"
    tokens = client.get(f"/api/compare?ids={runs.gpu},{runs.cpu}&x=tokens").json()["figures"]["val_loss"]
    assert tokens["data"][0]["x"] == [s * TOKENS_PER_STEP for s in (10, 20, 30, 40)]


def test_every_figure_passes_plotly_validation_under_every_option(client, runs):
    for params in ({}, {"x": "tokens", "smooth": "0.9"}, {"x": "time", "log": "1"}):
        for run_id in (runs.gpu, runs.cpu, runs.bare):
            for figure in run_json(client, run_id, **params)["figures"].values():
                go.Figure(figure)  # raises on any property outside Plotly's schema
        compare = client.get("/api/compare", params={"ids": f"{runs.gpu},{runs.cpu}", **params}).json()
        for figure in compare["figures"].values():
            go.Figure(figure)


# -- runs list, tags and notes ---------------------------------------------------------------------------
def test_the_runs_list_carries_tokens_tags_note_and_times(client, runs):
    by_name = {r["name"]: r for r in client.get("/api/runs").json()["runs"]}
    gpu = by_name["gpu-run"]
    assert gpu["tokens_seen"] == 40 * TOKENS_PER_STEP and gpu["last_val_loss"] is not None
    assert gpu["started_at"] <= gpu["ended_at"] and gpu["status"] == "finished"
    assert by_name["bare"]["tags"] == [] and by_name["bare"]["note"] is None


def test_tags_and_a_note_are_set_with_a_json_patch(client, runs):
    url = f"/api/runs/{runs.cpu}"
    response = client.patch(url, json={"tags": [" baseline ", "cpu", "baseline"], "note": "reference on CPU"})
    assert response.status_code == 200
    assert response.json() == {"tags": ["baseline", "cpu"], "note": "reference on CPU"}
    assert client.patch(url, json={"note": "only the note"}).json() == {
        "tags": ["baseline", "cpu"],
        "note": "only the note",
    }
    listed = {r["id"]: r for r in client.get("/api/runs").json()["runs"]}[runs.cpu]
    assert listed["tags"] == ["baseline", "cpu"] and listed["note"] == "only the note"
    assert run_json(client, runs.cpu)["run"]["tags"] == ["baseline", "cpu"]
    assert client.patch(url, json={"tags": [], "note": ""}).json() == {"tags": [], "note": None}


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"tags": "baseline"}, 400, "tags must be a list of strings"),
        ({"tags": [1, 2]}, 400, "tags must be a list of strings"),
        ({"tags": ["a,b"]}, 400, "without commas"),
        ({"tags": ["x" * 41]}, 400, "at most 40 printable characters"),
        ({"tags": ["bell\a"]}, 400, "printable"),
        ({"tags": [f"t{i}" for i in range(21)]}, 400, "at most 20"),
        ({"note": 5}, 400, "note must be a string"),
        ({"note": "x" * 4001}, 400, "at most 4000"),
        ({"status": "finished"}, 400, 'a JSON object with "tags"'),
        ({}, 400, 'a JSON object with "tags"'),
        (["tags"], 400, 'a JSON object with "tags"'),
    ],
)
def test_bad_tags_and_notes_are_400_and_change_nothing(client, runs, body, status, message):
    before = client.get(f"/api/runs/{runs.bare}").json()["run"]
    response = client.patch(f"/api/runs/{runs.bare}", json=body)
    assert response.status_code == status and message in response.json()["error"]
    after = client.get(f"/api/runs/{runs.bare}").json()["run"]
    assert (after["tags"], after["note"]) == (before["tags"], before["note"])


def test_edits_must_be_json_to_a_run_that_exists(client, runs):
    form = client.patch(f"/api/runs/{runs.bare}", data={"tags": "x"})  # what a cross-site form could send
    assert form.status_code == 415 and "Content-Type: application/json" in form.json()["error"]
    text = client.patch(f"/api/runs/{runs.bare}", content=b'{"note": "x"}', headers={"content-type": "text/plain"})
    assert text.status_code == 415
    broken = client.patch(f"/api/runs/{runs.bare}", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "not JSON" in broken.json()["error"]
    huge = client.patch(f"/api/runs/{runs.bare}", json={"note": "x" * 20_000})
    assert huge.status_code == 413
    assert client.patch("/api/runs/999", json={"note": "x"}).status_code == 404
    assert client.patch("/api/runs/abc", json={"note": "x"}).status_code == 400
    assert client.get(f"/api/runs/{runs.bare}").json()["run"]["note"] is None


def test_with_a_token_only_its_holders_can_edit(runs):
    with running(create_app(runs.store, token=TOKEN)) as url, httpx.Client(base_url=url, timeout=30) as client:
        refused = client.patch(f"/api/runs/{runs.cpu2}", json={"note": "anonymous"})
        assert refused.status_code == 401
        allowed = client.patch(
            f"/api/runs/{runs.cpu2}", json={"note": "token holder"}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert allowed.status_code == 200 and allowed.json()["note"] == "token holder"
    assert runs.store.run(runs.cpu2)["note"] == "token holder"


# -- the store: telemetry, steps at times, migration -----------------------------------------------------
def test_the_follower_stores_the_samplers_real_telemetry_exactly_once(store_url, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = RunStore(store_url)
    run_id = store.start_run("run", run_dir, {}, "tiny", 1, 10, "n")
    sampler = TelemetrySampler(run_dir, ObserveSection(), JsonlEventSink(run_dir))
    first = sampler.sample()  # psutil's real readings of this machine, written to telemetry.jsonl
    follower = RunFollower(run_dir, "run", 0.0, store, run_id)
    follower.sync()
    follower.sync()
    second = sampler.sample()
    RunFollower(run_dir, "run", 0.0, store, run_id).sync()  # a later launch continues from the offsets
    host = store.telemetry(run_id)["host"]
    assert [h["node"] for h in host] == [first["node"]]
    assert host[0]["time"] == [first["time"], second["time"]]
    assert host[0]["memory_total_bytes"][0] == first["host"]["memory_total_bytes"]
    assert host[0]["disk_free_bytes"][0] == first["host"]["disk_free_bytes"]
    assert store.telemetry(run_id)["devices"] == []  # no accelerator library on a CPU machine
    store.close()


def test_long_telemetry_is_sampled_evenly_short_telemetry_is_not(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("t", tmp_path / "t", {}, "tiny", 8, 10, "n")

    def sample(i: int, node: str) -> dict:
        return {
            "time": 1000.0 + 5 * i,
            "node": node,
            "host": {
                "cpu_ratio": 0.5,
                "memory_used_bytes": 2**33,
                "memory_total_bytes": 2**36,
                "disk_free_bytes": 10**12,
                "load1": 1.0,
            },
            "devices": [
                {
                    "device": d,
                    "utilization_ratio": i / 3000,
                    "temperature_c": 50.0 + d,
                    "power_w": None,
                    "memory_used_bytes": 10**9,
                    "memory_total_bytes": 8 * 10**10,
                    "ecc_uncorrectable": 0,
                }
                for d in range(2)
            ],
        }

    samples = [sample(i, node) for i in range(3000) for node in ("node-a", "node-b")]
    store.ingest(run_id, [], [], [], {}, samples[:10])
    short = store.telemetry(run_id, max_points=100)
    assert [len(s["time"]) for s in short["host"]] == [5, 5]
    assert short["host"][0]["time"] == [1000.0 + 5 * i for i in range(5)]
    for start in range(10, len(samples), 1000):  # as the follower sends them: batch after batch
        store.ingest(run_id, [], [], [], {}, samples[start : start + 1000])
    long = store.telemetry(run_id, max_points=100)
    assert [(s["node"], s["device"]) for s in long["devices"]] == [
        ("node-a", 0),
        ("node-a", 1),
        ("node-b", 0),
        ("node-b", 1),
    ]
    for series in long["devices"]:
        assert len(series["time"]) == 100 and series["time"][-1] == 1000.0 + 5 * 2999  # the newest is shown
        gaps = {round(b - a, 6) for a, b in zip(series["time"], series["time"][1:])}
        assert gaps == {150.0}  # every 30th sample: evenly spaced
        assert series["utilization_ratio"] == [pytest.approx((t - 1000) / 5 / 3000) for t in series["time"]]
        assert set(series["power_w"]) == {None} and series["temperature_c"][0] == 50.0 + series["device"]
    assert all(isinstance(v, float) for v in long["host"][0]["memory_used_bytes"])  # floats on PostgreSQL too
    store.close()


def test_steps_at_finds_the_step_a_run_was_at(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("s", tmp_path / "s", {}, "tiny", 1, 10, "n")
    rows = [{"step": s, "loss": 1.0, "time": float(s)} for s in (1, 2, 3, 4)] + [
        {"step": s, "loss": 1.0, "time": float(s + 10)} for s in (3, 4, 5)
    ]  # 3-4 redone after a restart
    store.ingest(run_id, rows, [], [], {})
    assert store.steps_at(run_id, [0.5, 1.0, 4.5, 12.0, 13.5, 99.0]) == [0, 1, 4, 4, 3, 5]
    store.close()


def test_migration_0003_gives_old_runs_their_tokens_and_can_be_undone(store_url):
    from alembic import command
    from alembic.config import Config

    from phalanx.observe.store import MIGRATIONS

    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:  # a store as phalanx left it before telemetry, tags and tokens
        config.attributes["connection"] = conn
        command.upgrade(config, "0002")
        train = json.dumps({"train": {"global_batch_size": 8, "seq_len": 32}})
        conn.execute(
            sa.text(
                "INSERT INTO runs (name, dir, status, started_at, updated_at, restarts, last_step, config) "
                "VALUES ('old', '/runs/old', 'finished', 1.0, 1.0, 0, 3, :config)"
            ),
            {"config": train},
        )
        conn.execute(
            sa.text(
                "INSERT INTO runs (name, dir, status, started_at, updated_at, restarts, config) "
                "VALUES ('odd', '/runs/odd', 'finished', 1.0, 1.0, 0, 'not json')"
            )
        )
        for step in (1, 2, 3):
            conn.execute(sa.text("INSERT INTO steps (run_id, step, time, loss) VALUES (1, :s, :s, 2.0)"), {"s": step})
        conn.execute(sa.text("INSERT INTO steps (run_id, step, time, val_loss) VALUES (1, 3, 3.0, 2.5)"))
    store = RunStore(store_url)
    assert store.schema_version() == "0006"
    old, odd = sorted(store.list_runs(), key=lambda r: r["id"])
    assert old["tokens_seen"] == 3 * 256 and odd["tokens_seen"] is None
    assert old["tags"] == [] and old["note"] is None
    assert store.series(old["id"])["tokens_seen"] == [256.0, 512.0, 768.0]
    store.close()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0002")
        columns = {c["name"] for c in sa.inspect(conn).get_columns("runs")}
        assert "tags" not in columns and not sa.inspect(conn).has_table("host_telemetry")
        command.upgrade(config, "head")
    engine.dispose()
    assert RunStore(store_url).schema_version() == "0006"


def test_smoothing_keeps_gaps_and_stays_within_the_values():
    from phalanx.observe.figures import smooth_values

    assert smooth_values([1.0, None, 3.0], 0.0) == [1.0, None, 3.0]
    out = smooth_values([1.0, None, 3.0, float("nan"), 3.0], 0.5)
    assert out[1] is None and out[3] is None
    assert out[0] == 1.0 and 1.0 < out[2] < 3.0 and out[2] < out[4] <= 3.0
    assert all(v == 0.1 for v in smooth_values([0.1] * 500, 0.99))
    assert math.isclose(smooth_values([2.0, 4.0], 0.5)[1], (0.5 * 0.5 * 2 + 0.5 * 4) / 0.75)
