"""The run page's expert-balance charts in a real headless Chromium: over a mixture of experts the real
CLI trained (tiny-moe, one process, 6 steps; its node agent filled the store from metrics.jsonl) and a
dense run written through the store's API, whose page leaves them out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from phalanx.observe.app import create_app, running
from phalanx.observe.store import RunStore
from tests.helpers import read_metrics, train_json
from tests.observe.conftest import CHROMIUM
from tests.observe.dashboard_runs import fill_run
from tests.observe.test_dashboard_browser import figure

RUN = "moe-run"
STEPS = 6  # TINY's 12 halved, with one checkpoint: the charts need a few steps, not a long run

pytestmark = [
    pytest.mark.slow,  # the module's training run takes over 5 s (TESTING.md)
    pytest.mark.skipif(
        not Path(CHROMIUM).is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium; CI installs it)"
    ),
]


@pytest.fixture(scope="module")
def site(corpus, tmp_path_factory):
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("dash-moe")
    tiny_moe = [a for a in TINY if not a.startswith("model.")] + ["model.preset=tiny-moe", "model.max_seq_len=64"]
    shorter = [f"train.max_steps={STEPS}", f"train.eval_interval={STEPS}", f"checkpoint.interval={STEPS}"]
    summary = train_json(*tiny_moe, *shorter, f"data.sources=[{corpus}]", f"run.dir={root}", f"run.name={RUN}")
    steps = [m for m in read_metrics(summary["run_dir"]) if "loss" in m]
    store = RunStore.open(None, root, create=False)
    moe, dense = store.find_run(RUN)["id"], fill_run(store, root, "dense-run", steps=STEPS)
    with running(create_app(store)) as url:
        yield SimpleNamespace(url=url, moe=moe, dense=dense, steps=steps)
    store.close()


def open_run(page, site, run_id: int) -> None:
    page.goto(f"{site.url}/runs/{run_id}")
    page.wait_for_selector("body[data-loaded=true]")


def heatmap_cells(page) -> dict:
    return page.evaluate("""() => { const t = document.getElementById("fig-moe_heatmap").data[0];
        return {x: Array.from(t.x), y: Array.from(t.y), z: t.z.map(row => Array.from(row)), zmin: t.zmin}; }""")


def test_an_moe_runs_page_draws_its_imbalance_curve_and_one_heatmap_row_per_moe_layer(site, page):
    trained = [m["step"] for m in site.steps]
    layers = len(site.steps[0]["moe_imbalance_by_layer"])
    assert trained == list(range(1, STEPS + 1)) and layers == 4  # tiny-moe: 4 layers, each a mixture of 8 experts
    open_run(page, site, site.moe)

    assert page.locator("#fig-moe_imbalance").is_visible()
    curve = figure(page, "moe_imbalance")[0]
    assert curve["x"] == trained and curve["y"] == [m["moe_imbalance"] for m in site.steps]
    assert all(1.0 <= y <= 4.0 for y in curve["y"])  # 8 experts, 2 a token: 4 is all tokens on 2 experts

    assert page.locator("#fig-moe_heatmap").is_visible()
    cells = heatmap_cells(page)
    assert cells["y"] == [f"MoE layer {layer}" for layer in range(layers)] and cells["x"] == trained
    by_step = [[m["moe_imbalance_by_layer"][layer] for m in site.steps] for layer in range(layers)]
    assert cells["z"] == by_step and cells["zmin"] == 1.0
    assert not page.errors


def test_a_dense_runs_page_leaves_the_expert_charts_out(site, page):
    open_run(page, site, site.dense)
    assert page.locator("#fig-loss").is_visible() and page.locator("#fig-heatmap").is_visible()
    assert page.locator("#fig-moe_imbalance").is_hidden() and page.locator("#fig-moe_heatmap").is_hidden()
    assert not page.errors
