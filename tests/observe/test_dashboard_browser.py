"""The dashboard in a real headless Chromium, over the store a real training run filled: 2 gloo ranks,
rank 0 killed at step 6 and restarted by the node agent.

Screenshots go to $PHALANX_SCREENSHOTS (or a pytest temporary folder); the path is printed (pytest -s).
"""

from __future__ import annotations

import html
import os
import time
from pathlib import Path

import pytest

from phalanx.observe.app import create_app, running
from phalanx.observe.store import RunStore
from tests.helpers import read_metrics, train_json
from tests.observe.conftest import CHROMIUM

TOKEN = "browser-test-token-0123456789"
RUN = "dash-drill"
EVIL = '<img src=x onerror="document.body.dataset.pwned=1">'

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium; CI installs it)"
)


@pytest.fixture(scope="module")
def drill(corpus, tmp_path_factory):
    """The real CLI trains the run; its node agent fills RUNS_ROOT/phalanx.db as it goes."""
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("dash-browser")
    summary = train_json(
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={root}",
        f"run.name={RUN}",
        "safe.inject=[{fault: kill, rank: 0, step: 6}]",
        "safe.hang_floor_s=2",
        "--nproc",
        "2",
    )
    assert summary["restarts"] == 1
    store = RunStore.open(None, root, create=False)
    yield {"root": root, "store": store, "run": store.find_run(RUN), "run_dir": Path(summary["run_dir"])}
    store.close()


@pytest.fixture(scope="module")
def url(drill):
    with running(create_app(drill["store"])) as url:
        yield url


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("PHALANX_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\ndashboard screenshots: {folder}")
    return folder


def figure(page, name: str) -> list[dict]:
    """The traces Plotly drew in the figure's element, as the page holds them."""
    return page.evaluate(f"""() => document.getElementById("fig-{name}").data.map(t => (
        {{name: t.name, x: Array.from(t.x), y: Array.from(t.y), hovertext: t.hovertext || null}}))""")


def test_runs_list_shows_the_run_and_its_status(url, page, drill, screenshots):
    page.goto(url)
    row = page.locator("#runs-body tr", has=page.get_by_role("link", name=RUN, exact=True))
    row.wait_for()
    cells = row.locator("td").all_inner_texts()
    assert cells[2] == "finished" and cells[4] == "12/12" and cells[11] == "1"  # status, step, restarts
    assert cells[7] == "3.07k"  # tokens: 12 steps of 8 x 32
    assert cells[14].endswith("ago")
    page.screenshot(path=screenshots / "runs.png", full_page=True)
    row.get_by_role("link", name=RUN).click()
    page.wait_for_url(f"**/runs/{drill['run']['id']}")
    assert not page.errors


def test_run_page_draws_every_step_the_restart_and_each_rank(url, page, drill, screenshots):
    page.goto(f"{url}/runs/{drill['run']['id']}")
    page.wait_for_selector("body[data-loaded=true]")
    trained = sorted({m["step"] for m in read_metrics(drill["run_dir"]) if m.get("loss") is not None})
    assert trained == list(range(1, 13))
    loss = {t["name"]: t for t in figure(page, "loss")}
    assert loss["train loss"]["x"] == trained  # one point per step, though steps 5-6 ran twice
    assert loss["validation loss"]["x"] == [0, 6, 12]

    events = figure(page, "events")
    recovery = next(t for t in events if t["name"] == "recovery")
    assert "restart" in recovery["y"]
    failure = next(t for t in events if t["name"] == "failure")
    crash = failure["hovertext"][failure["y"].index("worker_failed")]
    assert "exitcode: -9" in crash and "step: 6" in crash
    kinds = page.locator("#events-body td.kind").all_inner_texts()
    assert kinds.count("restart") == 1 and kinds.count("worker_failed") == 1

    heatmap = figure(page, "heatmap")[0]
    assert heatmap["y"] == ["rank 0", "rank 1"]
    assert heatmap["x"] == trained
    assert [g["x"][g["y"].index("productive")] > 0 for g in figure(page, "goodput")] == [True]
    assert page.locator("#config").inner_text().startswith("run:")
    assert page.locator("#nodes li").count() == 1
    page.screenshot(path=screenshots / "run.png", full_page=True)
    assert not page.errors


@pytest.mark.slow
def test_run_page_follows_a_training_run_live(url, page, drill):
    store = drill["store"]
    run_id = store.start_run("live", drill["root"] / "live", {"train": {"max_steps": 10}}, "tiny", 1, 10, "node-a")

    def add_steps(first: int, last: int) -> None:
        records = [
            {"step": s, "loss": 6.0 - 0.1 * s, "time": time.time(), "step_seconds": 0.1} for s in range(first, last + 1)
        ]
        store.ingest(
            run_id, records, [{"step": s, "rank": 0, "compute_seconds": 0.1} for s in range(first, last + 1)], [], {}
        )

    add_steps(1, 3)
    page.goto(f"{url}/runs/{run_id}")
    page.wait_for_selector("body[data-loaded=true]")
    assert len(figure(page, "loss")[0]["x"]) == 3
    add_steps(4, 7)
    page.wait_for_function('() => document.getElementById("fig-loss").data[0].x.length === 7', timeout=15_000)
    store.ingest(run_id, [], [], [{"kind": "restart", "time": time.time(), "attempt": 1}], {})
    page.wait_for_function('() => document.getElementById("run-status").textContent === "restarting"', timeout=15_000)
    assert not page.errors


@pytest.mark.slow
def test_compare_page_overlays_the_runs_ticked_in_the_list(url, page, drill, screenshots):
    store = drill["store"]
    other = store.start_run("other", drill["root"] / "other", {}, "tiny", 1, 12, "node-a")
    store.ingest(other, [{"step": s, "loss": 5.5 - 0.05 * s, "time": time.time()} for s in range(1, 9)], [], [], {})
    page.goto(url)
    for name in (RUN, "other"):
        row = page.locator("#runs-body tr", has=page.get_by_role("link", name=name, exact=True))
        row.locator("input[type=checkbox]").check()
    page.wait_for_timeout(3500)  # a refresh of the list keeps the ticks
    page.get_by_role("button", name="Compare selected (2)").click()
    page.wait_for_url("**/compare?ids=*")
    page.wait_for_selector("body[data-loaded=true]")
    train = figure(page, "train_loss")
    assert sorted(t["name"] for t in train) == sorted([f"{RUN} (#{drill['run']['id']})", f"other (#{other})"])
    assert sorted(len(t["x"]) for t in train) == [8, 12]
    assert [len(t["x"]) for t in figure(page, "val_loss")] == [3]  # only the drill validated
    page.screenshot(path=screenshots / "compare.png", full_page=True)
    assert not page.errors


def test_html_in_names_and_event_details_is_shown_as_text(url, page, drill):
    store = drill["store"]
    run_id = store.start_run(EVIL, drill["root"] / "evil", {"note": EVIL}, EVIL, 1, 5, EVIL)
    store.ingest(
        run_id,
        [{"step": 1, "loss": 5.0, "time": time.time()}],
        [],
        [{"kind": "anomaly", "time": time.time(), "rank": 0, "node": EVIL, "message": EVIL}],
        {},
    )
    page.goto(url)
    page.get_by_role("link", name=EVIL, exact=True).wait_for()
    page.goto(f"{url}/runs/{run_id}")
    page.wait_for_selector("body[data-loaded=true]")
    assert page.locator("#run-name").inner_text() == EVIL
    assert EVIL in page.locator("#events-body").inner_text()
    assert EVIL in page.locator("#config").inner_text() and page.locator("#nodes").inner_text() == EVIL
    hover = figure(page, "events")[0]["hovertext"][0]
    assert html.escape(EVIL, quote=False) in hover  # Plotly shows the escaped form as the literal text
    point = page.locator("#fig-events .scatterlayer .point").first
    point.scroll_into_view_if_needed()
    box = point.bounding_box()
    for dx in (-3, 0):  # Plotly's hover label follows the mouse's moves
        page.mouse.move(box["x"] + box["width"] / 2 + dx, box["y"] + box["height"] / 2)
    label = page.locator("#fig-events .hoverlayer .hovertext")
    label.wait_for()
    assert f"message: {EVIL}" in label.text_content()  # the markup, shown as the literal text
    assert page.locator("main img").count() == 0
    assert page.evaluate("document.body.dataset.pwned") is None


def test_a_token_protected_dashboard_logs_a_browser_in_with_a_cookie(page, drill):
    with running(create_app(drill["store"], token=TOKEN)) as url:
        run_id = drill["run"]["id"]
        page.goto(f"{url}/runs/{run_id}")
        assert "/login?next=" in page.url
        page.fill("input[name=token]", "not-the-token-at-all")
        page.click("button[type=submit]")
        assert page.locator("#login-failed").is_visible()
        page.fill("input[name=token]", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/runs/{run_id}")
        page.wait_for_selector("body[data-loaded=true]")
        cookie = next(c for c in page.context.cookies() if c["name"] == "phalanx_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # scripts cannot read it
        assert len(figure(page, "loss")[0]["x"]) == 12
        assert [e for e in page.errors if "401" not in e] == []  # the refused first try is expected
