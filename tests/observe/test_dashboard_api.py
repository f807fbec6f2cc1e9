"""The dashboard's JSON API, figures, /metrics and static files over real loopback HTTP, on a real
SQLite run store filled through RunStore's own writing API."""

from __future__ import annotations

import html
import json
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import httpx
import plotly.graph_objects as go
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from phalanx.observe.app import WEB, bind, create_app, plotly_js_path, running
from phalanx.observe.store import RunStore

RANKS, SLOW_RANK = 4, 2
EVIL = '<img src=x onerror="document.body.dataset.pwned=1">'


def fill_run(
    store: RunStore,
    root: Path,
    name: str,
    steps: int,
    ranks: int = RANKS,
    status: str | None = "finished",
    events: list[dict] | None = None,
) -> int:
    """A run with `steps` trained steps (validation every 10), every rank's timings, and its events."""
    run_id = store.start_run(
        name,
        root / name,
        {"run": {"name": name}, "train": {"max_steps": 30, "lr": 3e-4}},
        "tiny (0.1M)",
        ranks,
        30,
        "node-a",
    )
    t0 = 1_700_000_000.0
    metrics = [
        {
            "step": s,
            "time": t0 + s,
            "loss": 6.0 - 0.1 * s,
            "lr": 3e-4,
            "grad_norm": 1.0,
            "tokens_per_sec": 1e4,
            "mfu": 0.3,
            "peak_mem_gib": 1.5,
            "step_seconds": 0.5,
        }
        for s in range(1, steps + 1)
    ]
    metrics += [
        {"step": s, "time": t0 + s, "val_loss": 6.1 - 0.1 * s, "eval_seconds": 0.2} for s in range(10, steps + 1, 10)
    ]
    rank_records = [
        {
            "step": s,
            "rank": r,
            "node": "node-a",
            "time": t0 + s,
            "step_seconds": 0.5,
            "compute_seconds": 0.6 if r == SLOW_RANK else 0.3,
            "data_seconds": 0.01,
        }
        for s in range(1, steps + 1)
        for r in range(ranks)
    ]
    store.ingest(run_id, metrics, rank_records, events or [], {})
    if status is not None:
        store.finish_run(run_id, status)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> SimpleNamespace:
    """The store and the ids of its runs: finished, running, just started, and one named like an attack."""
    root = tmp_path_factory.mktemp("dash-api")
    store = RunStore.open(None, root)
    events = [
        {"kind": "worker_failed", "time": 1_700_000_012.0, "rank": 1, "node": "node-a", "exitcode": -9, "step": 12},
        {"kind": "restart", "time": 1_700_000_013.0, "node": "node-a", "rank": None, "attempt": 1},
        {"kind": "anomaly", "time": 1_700_000_020.0, "rank": 0, "node": "node-a", "message": EVIL},
    ]
    alpha = fill_run(store, root, "alpha", 30, events=events)
    store.set_goodput(
        alpha,
        {
            "restarts": 1,
            "faults": {"crash": 1},
            "stragglers": [],
            "ettr": 0.8,
            "goodput": {"productive": 80.0, "redone": 5.0, "restart": 15.0},
        },
    )
    beta = fill_run(store, root, "beta", 20, status=None)
    empty = store.start_run("empty", root / "empty", {}, "tiny", 1, 30, "node-a")
    evil = fill_run(store, root, "<script>alert(1)</script>", 3)
    store.set_goodput(evil, {"goodput": {"productive": 1.0}, "ettr": float("nan")})  # NaN as a report may hold
    yield SimpleNamespace(store=store, alpha=alpha, beta=beta, empty=empty, evil=evil)
    store.close()


@pytest.fixture(scope="module")
def client(store):
    with running(create_app(store.store)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def test_runs_api_lists_every_run_newest_first(client, store):
    body = client.get("/api/runs").json()
    names = [r["name"] for r in body["runs"]]
    assert names == ["<script>alert(1)</script>", "empty", "beta", "alpha"]
    by_name = {r["name"]: r for r in body["runs"]}
    assert by_name["alpha"]["status"] == "finished" and by_name["alpha"]["last_step"] == 30
    assert by_name["alpha"]["restarts"] == 1 and by_name["beta"]["status"] == "running"
    assert body["now"] >= by_name["alpha"]["updated_at"]


def test_run_api_holds_page_data_and_figures_of_every_chart(client, store):
    body = client.get(f"/api/runs/{store.alpha}").json()
    assert set(body) >= {"run", "series", "heatmap", "events", "goodput", "figures", "config_yaml"}
    assert (
        yaml.safe_load(body["config_yaml"])
        == body["run"]["config"]
        == {"run": {"name": "alpha"}, "train": {"max_steps": 30, "lr": 3e-4}}
    )
    figures = body["figures"]
    assert set(figures) == {
        "loss",
        "eval_scores",
        "moe_imbalance",
        "moe_heatmap",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "mfu",
        "peak_mem_gib",
        "step_seconds",
        "heatmap",
        "events",
        "goodput",
        "sys_cpu",
        "sys_memory",
        "sys_disk",
        "sys_device_util",
        "sys_device_memory",
        "sys_device_temp",
        "sys_device_power",
    }
    train, val, restart = figures["loss"]["data"]
    assert restart["name"] == "restart" and restart["x"] == [13]  # the restart, at the step logged before it
    assert train["x"] == list(range(1, 31)) and train["y"][0] == pytest.approx(5.9)
    assert val["x"] == [10, 20, 30] and val["name"] == "validation loss"
    assert figures["mfu"]["data"][0]["y"] == [0.3] * 30

    heatmap = figures["heatmap"]["data"][0]
    assert heatmap["y"] == [f"rank {r}" for r in range(RANKS)] and len(heatmap["x"]) == 30
    row_means = [sum(row) / len(row) for row in heatmap["z"]]
    assert row_means.index(max(row_means)) == SLOW_RANK  # the straggler is the bright row

    traces = {t["name"]: t for t in figures["events"]["data"]}
    assert traces["failure"]["y"] == ["worker_failed", "anomaly"] and traces["recovery"]["y"] == ["restart"]
    assert "exitcode: -9" in traces["failure"]["hovertext"][0]

    goodput = figures["goodput"]["data"][0]
    assert goodput["y"] == ["productive", "redone", "restart"] and goodput["x"] == [80.0, 5.0, 15.0]
    assert "ETTR 80.0%" in figures["goodput"]["layout"]["title"]["text"]


def test_every_figure_passes_plotly_validation(client, store):
    for run_id in (store.alpha, store.beta, store.empty):
        for figure in client.get(f"/api/runs/{run_id}").json()["figures"].values():
            go.Figure(figure)  # raises on any property outside Plotly's schema
    for figure in client.get(f"/api/compare?ids={store.alpha},{store.beta}").json()["figures"].values():
        go.Figure(figure)


def test_a_run_without_data_yet_shows_empty_charts(client, store):
    figures = client.get(f"/api/runs/{store.empty}").json()["figures"]
    for name in ("loss", "lr", "heatmap", "events", "goodput"):
        assert figures[name]["layout"]["annotations"][0]["text"] == "no data yet", name


def test_compare_overlays_train_and_validation_loss(client, store):
    body = client.get(f"/api/compare?ids={store.beta},{store.alpha},{store.beta}").json()
    assert [r["run"]["name"] for r in body["runs"]] == ["beta", "alpha"]  # duplicates dropped, order kept
    train = body["figures"]["train_loss"]["data"]
    assert [t["name"] for t in train] == [f"beta (#{store.beta})", f"alpha (#{store.alpha})"]
    assert [len(t["x"]) for t in train] == [20, 30]
    assert [t["x"] for t in body["figures"]["val_loss"]["data"]] == [[10, 20], [10, 20, 30]]


@pytest.mark.parametrize(
    "path, status",
    [
        ("/api/runs/abc", 400),
        ("/api/runs/0", 400),
        ("/api/runs/-1", 400),
        ("/api/runs/%C2%B2", 400),
        ("/api/runs/" + "9" * 30, 400),
        ("/api/runs/999", 404),
        ("/api/compare", 400),
        ("/api/compare?ids=", 400),
        ("/api/compare?ids=1,x", 400),
        ("/api/compare?ids=1,999", 404),
        ("/api/compare?ids=" + ",".join(map(str, range(1, 30))), 400),
    ],
)
def test_bad_and_unknown_ids_are_answered_with_json_errors(client, path, status):
    response = client.get(path)
    assert response.status_code == status
    assert response.json()["error"]
    assert client.get("/health").json() == {"status": "ok"}  # and it keeps serving


def test_unknown_run_page_is_a_404_page(client):
    response = client.get("/runs/999")
    assert response.status_code == 404 and "no run with id 999" in response.text
    assert client.get("/compare?ids=x").status_code == 400


def test_non_finite_numbers_are_sent_as_null(client, store):
    response = client.get(f"/api/runs/{store.evil}")
    assert response.status_code == 200 and "NaN" not in response.text
    assert json.loads(response.text)["goodput"]["ettr"] is None


def test_run_names_and_event_details_are_escaped(client, store):
    page = client.get(f"/runs/{store.evil}").text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    hover = client.get(f"/api/runs/{store.alpha}").json()["figures"]["events"]["data"][0]["hovertext"]
    assert not any("<img" in text for text in hover)
    assert any(f"message: {html.escape(EVIL, quote=False)}" in text for text in hover)
    compare = client.get(f"/api/compare?ids={store.evil}").json()["figures"]["train_loss"]["data"][0]
    assert compare["name"].startswith("&lt;script&gt;")


def test_metrics_parse_and_count_the_dashboards_own_requests(client, store):
    client.get("/api/runs/999")
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    steps = {s.labels["run"]: s.value for s in families["phalanx_run_step"].samples}
    assert steps["alpha"] == 30 and steps["beta"] == 20
    requests = [s for s in families["phalanx_dashboard_requests"].samples if s.name.endswith("_total")]
    not_found = [s for s in requests if s.labels["route"] == "/api/runs/{run_id}" and s.labels["status"] == "404"]
    assert not_found and not_found[0].value >= 1
    assert not any("999" in s.labels["route"] for s in requests)  # routes, not raw paths, label the counter
    assert "phalanx_dashboard_request_seconds" in families


def test_plotly_js_comes_from_the_installed_plotly_package(client):
    response = client.get("/static/plotly.min.js")
    assert response.status_code == 200 and "javascript" in response.headers["content-type"]
    assert response.content == plotly_js_path().read_bytes()
    for template in (WEB / "templates").glob("*.html"):  # no CDN: every script and style is our own
        for src in re.findall(r'(?:src|href)="([^"]*)"', template.read_text()):
            assert not src.startswith(("http:", "https:", "//")), (template.name, src)


def test_pages_are_served_with_a_content_security_policy(client, store):
    for path in ("/", f"/runs/{store.alpha}", f"/compare?ids={store.alpha},{store.beta}", "/static/run.js"):
        response = client.get(path)
        assert response.status_code == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"]
        assert response.headers["x-content-type-options"] == "nosniff"


def test_the_dashboard_is_read_only_but_for_login_and_a_runs_tags_and_note(client, store):
    app = create_app(store.store)
    while not hasattr(app, "routes"):
        app = app.app
    writes = {"/login": {"POST"}, "/logout": {"POST"}, "/api/runs/{run_id}": {"PATCH"}}
    for route in app.routes:
        methods = getattr(route, "methods", None) or set()
        assert methods <= {"GET", "HEAD"} | writes.get(route.path, set()), route.path
    assert client.post("/api/runs").status_code == 405
    assert client.delete(f"/api/runs/{store.alpha}").status_code == 405


def test_the_listening_socket_is_tcp_so_asyncio_turns_nagle_off():
    # With proto 0 asyncio leaves Nagle on and each kept-alive response waits for a delayed ACK (~40 ms).
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
