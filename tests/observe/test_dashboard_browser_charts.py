"""The dashboard's W&B-style views in a real headless Chromium: over a run the real CLI trained (2 gloo
ranks on CPU, rank 0 killed at step 6 and restarted, telemetry every 0.5 s) and runs written through the
store's API with what a CPU machine cannot make (GPU telemetry, a rollback).

Screenshots go to $PHALANX_SCREENSHOTS (or a pytest temporary folder); the path is printed (pytest -s).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from phalanx.observe.app import create_app, running
from phalanx.observe.figures import COMPARE_CHARTS
from phalanx.observe.store import RunStore
from tests.helpers import train_json
from tests.observe.conftest import CHROMIUM
from tests.observe.dashboard_runs import fill_run
from tests.observe.test_dashboard_browser import figure

RUN = "charts-drill"
TOKEN = "charts-browser-token-0123456789"
TOKENS_PER_STEP = 8 * 32  # TINY's global batch x sequence length

pytestmark = [
    pytest.mark.slow,  # each test here takes over 5 s (TESTING.md)
    pytest.mark.skipif(
        not Path(CHROMIUM).is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium; CI installs it)"
    ),
]


@pytest.fixture(scope="module")
def site(corpus, tmp_path_factory):
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("dash-charts-browser")
    summary = train_json(
        *TINY,
        f"data.sources=[{corpus}]",
        f"run.dir={root}",
        f"run.name={RUN}",
        "safe.inject=[{fault: kill, rank: 0, step: 6}]",
        "observe.telemetry_interval_s=0.5",
        "--nproc",
        "2",
    )
    assert summary["restarts"] >= 1
    store = RunStore.open(None, root, create=False)
    real = store.find_run(RUN)["id"]
    gpu = fill_run(store, root, "gpu-run")
    cpu = fill_run(store, root, "cpu-run", gpus=False, mfu=False, lr=1e-3)
    store.annotate(gpu, ["baseline", "gpu"], "the reference run")
    with running(create_app(store)) as url:
        yield SimpleNamespace(
            url=url, store=store, root=root, real=real, gpu=gpu, cpu=cpu, restarts=summary["restarts"]
        )
    store.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("PHALANX_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\ndashboard chart screenshots: {folder}")
    return folder


def open_run(page, site, run_id: int, query: str = "") -> None:
    page.goto(f"{site.url}/runs/{run_id}{query}")
    page.wait_for_selector("body[data-loaded=true]")


def drawn_with(page, fragment: str) -> None:
    """Wait until the page has drawn the answer for options containing `fragment` (e.g. x=tokens)."""
    page.wait_for_function(f"() => (document.body.dataset.drawn || '').includes({fragment!r})", timeout=15_000)


def layout(page, name: str) -> dict:
    return page.evaluate(f'() => document.getElementById("fig-{name}").layout')


def test_a_cpu_run_says_mfu_is_unknown_and_draws_its_hosts_telemetry(site, page, shots):
    open_run(page, site, site.real)
    mfu = page.locator("[data-card=MFU]")
    assert mfu.locator("dd").inner_text() == "unknown"
    assert "unknown on CPU: no peak FLOP/s" in mfu.locator(".card-note").inner_text()
    assert "TFLOP/s per device" in mfu.locator(".card-note").inner_text()  # what the run did reach
    assert page.locator("#fig-mfu").is_hidden()
    cpu = figure(page, "sys_cpu")
    assert len(cpu) == 1 and len(cpu[0]["x"]) >= 2  # this machine, sampled every 0.5 s while it trained
    assert all(0 <= y <= 1 for y in cpu[0]["y"] if y is not None)
    assert page.locator("#fig-sys_memory").is_visible() and page.locator("#fig-sys_disk").is_visible()
    for name in ("util", "memory", "temp", "power"):
        assert page.locator(f"#fig-sys_device_{name}").is_hidden()
    assert "no accelerator telemetry" in page.locator("#system-note").inner_text()

    marks = {t["name"]: t for t in figure(page, "loss")}
    assert len(marks["restart"]["x"]) == site.restarts and all(0 <= x <= 12 for x in marks["restart"]["x"])
    assert {4, 8, 12} <= set(marks["checkpoint saved"]["x"])
    assert {t["name"] for t in figure(page, "tokens_per_sec")} >= {"restart", "checkpoint saved"}
    shapes = page.evaluate('() => document.getElementById("fig-loss").layout.shapes.length')
    assert shapes == len(marks["restart"]["x"]) + len(marks["checkpoint saved"]["x"])

    # Event details are key/value pairs, not escaped JSON.
    failed = page.locator("#events-body tr.event-worker_failed")
    keys = failed.locator("dl.kv dt").all_inner_texts()
    assert "exitcode" in keys and "phase" in keys
    assert failed.locator("dl.kv dd").nth(keys.index("exitcode")).inner_text() == "-9"
    assert not failed.locator("td.details").inner_text().startswith("{")
    page.screenshot(path=shots / "run-cpu.png", full_page=True)
    assert not page.errors


def test_the_chart_controls_redraw_by_tokens_time_smoothing_and_log_scale(site, page, shots):
    open_run(page, site, site.real)
    assert page.locator("input[name=x][value=step]").is_checked()
    page.locator("#chart-controls label", has_text="tokens").click()
    drawn_with(page, "x=tokens")
    train = {t["name"]: t for t in figure(page, "loss")}["train loss"]
    assert train["x"] == [s * TOKENS_PER_STEP for s in range(1, 13)]
    assert "x=tokens" in page.url

    page.locator("input[name=smooth]").fill("0.8")
    drawn_with(page, "smooth=0.8")
    names = [t["name"] for t in figure(page, "loss")]
    assert "train loss (raw)" in names and "train loss" in names
    assert page.locator("#smooth-value").inner_text() == "0.80"

    page.locator("input[name=log]").check()
    drawn_with(page, "log=1")
    assert layout(page, "loss")["yaxis"]["type"] == "log"

    page.locator("#chart-controls label", has_text="time").click()
    drawn_with(page, "x=time")
    assert layout(page, "loss")["xaxis"]["type"] == "date"
    assert layout(page, "events")["xaxis"]["type"] == "date"
    page.screenshot(path=shots / "run-controls.png", full_page=True)

    page.reload()  # the URL keeps the view
    page.wait_for_selector("body[data-loaded=true]")
    assert page.locator("input[name=x][value=time]").is_checked()
    assert page.locator("input[name=smooth]").input_value() == "0.8"
    assert page.locator("input[name=log]").is_checked()
    open_run(page, site, site.gpu)  # and the next run page starts from the same view
    assert page.locator("input[name=x][value=time]").is_checked()
    drawn_with(page, "x=time")
    assert not page.errors


def test_a_gpu_run_draws_each_device_and_a_heatmap_without_the_warm_up_glare(site, page, shots):
    open_run(page, site, site.gpu)
    assert page.locator("[data-card=MFU] dd").inner_text() == "30.0%"
    assert page.locator("#fig-mfu").is_visible()
    for name in ("util", "temp", "power"):
        assert [t["name"] for t in figure(page, f"sys_device_{name}")] == ["node-a #0", "node-a #1"], name
    assert [t["name"] for t in figure(page, "sys_device_memory")] == ["node-a #0 (of 80 GiB)", "node-a #1 (of 80 GiB)"]
    heatmap = page.evaluate(
        '() => { const t = document.getElementById("fig-heatmap").data[0]; return {zmin: t.zmin, zmax: t.zmax}; }'
    )
    assert heatmap == {"zmin": pytest.approx(0.5), "zmax": pytest.approx(0.8)}
    assert "warm-up steps 1, 16" in layout(page, "heatmap")["title"]["text"]
    assert page.locator("#run-tags .tag").all_inner_texts() == ["baseline", "gpu"]
    page.screenshot(path=shots / "run-gpu.png", full_page=True)
    assert not page.errors


def names_shown(page) -> list[str]:
    return page.locator("#runs-body tr td.name > a").all_inner_texts()


def test_the_runs_list_sorts_filters_searches_and_filters_by_tag(site, page, shots):
    page.goto(site.url)
    page.wait_for_selector("body[data-loaded=true]")
    everything = names_shown(page)
    assert everything[:2] == ["cpu-run", "gpu-run"] and RUN in everything  # newest first
    row = page.locator("#runs-body tr", has=page.get_by_role("link", name=RUN, exact=True))
    cells = row.locator("td").all_inner_texts()
    assert cells[6] != "–" and cells[7] == f"{12 * TOKENS_PER_STEP / 1000:.3g}k"  # val loss, tokens
    assert cells[13].endswith("s")  # duration

    page.locator("th[data-sort=name]").click()
    assert names_shown(page) == sorted(everything)
    page.locator("th[data-sort=name]").click()
    assert names_shown(page) == sorted(everything, reverse=True)
    page.locator("th[data-sort=tokens]").click()
    assert names_shown(page)[-1] == RUN  # 12 steps, the others 40
    assert page.locator("th[data-sort=tokens]").get_attribute("aria-sort") == "descending"

    page.fill("#search", "gpu")
    assert names_shown(page) == ["gpu-run"]
    assert page.locator("#runs-count").inner_text() == f"(1 of {len(everything)})"
    page.fill("#search", "reference")  # the note
    assert names_shown(page) == ["gpu-run"]
    page.fill("#search", "")
    page.select_option("#status-filter", "live")
    assert names_shown(page) == [] and page.locator("#runs-none-match").is_visible()
    page.select_option("#status-filter", "finished")
    assert len(names_shown(page)) == len(everything)

    page.locator("#runs-body button.tag", has_text="baseline").click()
    assert page.locator("#search").input_value() == "tag:baseline"
    assert names_shown(page) == ["gpu-run"]
    assert "q=tag%3Abaseline" in page.url and "status=finished" in page.url
    page.screenshot(path=shots / "runs-filtered.png", full_page=True)
    page.reload()  # the URL keeps the filter and sort
    page.wait_for_selector("body[data-loaded=true]")
    assert names_shown(page) == ["gpu-run"]
    page.fill("#search", "")
    page.select_option("#status-filter", "")
    page.screenshot(path=shots / "runs.png", full_page=True)
    assert not page.errors


def test_tags_and_a_note_are_edited_on_the_run_page(site, page):
    open_run(page, site, site.cpu)
    page.get_by_role("button", name="edit tags and note").click()
    page.fill("#annotations-form input[name=tags]", "x" * 41)
    page.get_by_role("button", name="Save").click()
    page.locator("#annotations-error", has_text="at most 40").wait_for()
    assert site.store.run(site.cpu)["tags"] == []
    page.fill("#annotations-form input[name=tags]", "cpu, lr-sweep, cpu")
    page.fill("#annotations-form textarea[name=note]", "lr 1e-3 <b>not bold</b>")
    page.get_by_role("button", name="Save").click()
    page.locator("#annotations-view").wait_for()
    assert page.locator("#run-tags .tag").all_inner_texts() == ["cpu", "lr-sweep"]
    assert page.locator("#run-note").inner_text() == "lr 1e-3 <b>not bold</b>"  # text, not markup
    stored = site.store.run(site.cpu)
    assert stored["tags"] == ["cpu", "lr-sweep"] and stored["note"] == "lr 1e-3 <b>not bold</b>"
    page.wait_for_timeout(2500)  # a refresh keeps them
    assert page.locator("#run-tags .tag").all_inner_texts() == ["cpu", "lr-sweep"]
    site.store.annotate(site.cpu, [], "")
    assert [e for e in page.errors if "status of 400" not in e] == []  # the refused tag is expected


def test_a_token_protected_dashboard_lets_a_logged_in_browser_edit(site, page):
    with running(create_app(site.store, token=TOKEN)) as url:
        page.goto(f"{url}/runs/{site.real}")
        page.fill("input[name=token]", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_selector("body[data-loaded=true]")
        page.get_by_role("button", name="edit tags and note").click()
        page.fill("#annotations-form input[name=tags]", "drill")
        page.get_by_role("button", name="Save").click()
        page.locator("#run-tags .tag", has_text="drill").wait_for()
        assert site.store.run(site.real)["tags"] == ["drill"]
        site.store.annotate(site.real, [])
        assert [e for e in page.errors if "401" not in e] == []  # the refused first try is expected


def test_compare_shows_the_config_diff_and_every_chart(site, page, shots):
    page.goto(f"{site.url}/compare?ids={site.gpu},{site.cpu}")
    page.wait_for_selector("body[data-loaded=true]")
    assert page.locator("#diff-body td.key").all_inner_texts() == ["parallel.device", "train.lr"]
    assert page.locator("#diff-body tr").nth(1).locator("td").all_inner_texts() == ["train.lr", "0.0003", "0.001"]
    for key, *_ in COMPARE_CHARTS:
        assert len(figure(page, key)) == 2, key  # both runs on every chart
    page.locator("#chart-controls label", has_text="time").click()
    drawn_with(page, "x=time")
    assert layout(page, "train_loss")["xaxis"]["title"]["text"].startswith("time since the run's first step")
    page.screenshot(path=shots / "compare.png", full_page=True)

    page.goto(f"{site.url}/compare?ids={site.real},{site.cpu}")  # two CPU runs: no MFU to overlay
    page.wait_for_selector("body[data-loaded=true]")
    assert page.locator("#fig-mfu").is_hidden()
    assert "MFU: not reported" in page.locator("#hidden-note").inner_text()
    assert "train.lr" in page.locator("#diff-body").inner_text()
    assert not page.errors
