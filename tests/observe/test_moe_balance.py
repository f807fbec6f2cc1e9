"""A mixture of experts' routing balance in the run store (SQLite and PostgreSQL) and the run page's
figures: every step's worst-layer ratio and per-layer ratios, stored as the trainer writes them, the
layer-by-step heatmap (binned past its most columns), the 0005 migration, and metrics lines that try to
break or bloat the store."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from phalanx.observe import tables
from phalanx.observe.figures import MOE_CHARTS, NOT_MOE, ChartOptions
from phalanx.observe.pages import run_answer
from phalanx.observe.store import MAX_MOE_LAYERS, RunStore


def moe_step(step: int, by_layer: list, time: float | None = None) -> dict:
    """A training step's metrics line as the trainer writes it for an MoE model."""
    numbers = [v for v in by_layer if isinstance(v, float)]
    return {
        "step": step,
        "time": float(step) if time is None else time,
        "loss": 5.0 - step / 100,
        "step_seconds": 0.5,
        "moe_imbalance": max(numbers) if numbers else None,
        "moe_imbalance_by_layer": by_layer,
    }


def dense_step(step: int) -> dict:
    return {"step": step, "time": float(step), "loss": 5.0 - step / 100, "step_seconds": 0.5}


def stored_layers(store: RunStore, run_id: int) -> list:
    """Each stored step row's moe_imbalance_by_layer as the database holds it (JSON text or null)."""
    c = tables.steps.c
    with store.engine.connect() as conn:
        query = sa.select(c.moe_imbalance_by_layer).where(c.run_id == run_id).order_by(c.id)
        return list(conn.execute(query).scalars())


def test_moe_steps_keep_their_balance_and_dense_steps_none(store_url, tmp_path):
    store = RunStore(store_url)
    moe = store.start_run("moe", tmp_path / "moe", {}, "tiny-moe", 1, 3, "node-a")
    dense = store.start_run("dense", tmp_path / "dense", {}, "tiny", 1, 3, "node-a")
    store.ingest(
        moe, [moe_step(s, [1.25, 1.5 + s / 10]) for s in (1, 2, 3)] + [{"step": 3, "val_loss": 4.0}], [], [], {}
    )
    store.ingest(dense, [dense_step(s) for s in (1, 2, 3)], [], [], {})

    assert store.series(moe)["moe_imbalance"] == [1.6, 1.7, 1.8]
    assert [json.loads(text) for text in stored_layers(store, moe)[:3]] == [[1.25, 1.6], [1.25, 1.7], [1.25, 1.8]]
    assert store.moe_heatmap(moe) == {
        "steps": [1, 2, 3],
        "layers": [0, 1],
        "imbalance": [[1.25, 1.25, 1.25], [1.6, 1.7, 1.8]],
        "stride": 1,
    }
    assert store.series(dense)["moe_imbalance"] == [None, None, None]
    assert stored_layers(store, dense) == [None, None, None]
    assert store.moe_heatmap(dense) == {"steps": [], "layers": [], "imbalance": [], "stride": 1}
    store.close()


def test_a_step_run_twice_is_the_mean_of_its_runs_and_a_missing_layer_a_gap(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("redo", tmp_path / "redo", {}, "tiny-moe", 1, 4, "node-a")
    first = [moe_step(s, [1.0, 2.0, 3.0]) for s in (1, 2, 3)]
    # A restart resumes from step 2: steps 3 and 4 run (again), and step 4's layer 1 reported nothing.
    again = [moe_step(3, [2.0, 4.0, 3.0], time=13.0), moe_step(4, [1.5, "nan?", 3.5], time=14.0)]
    store.ingest(run_id, first + again, [], [], {})
    heatmap = store.moe_heatmap(run_id)
    assert heatmap["steps"] == [1, 2, 3, 4] and heatmap["layers"] == [0, 1, 2]
    assert heatmap["imbalance"] == [[1.0, 1.0, 1.5, 1.5], [2.0, 2.0, 3.0, None], [3.0, 3.0, 3.0, 3.5]]
    store.close()


def test_past_max_bins_the_heatmap_bins_steps_and_reads_only_a_sample(store_url, tmp_path):
    store = RunStore(store_url)
    every = store.start_run("binned", tmp_path / "binned", {}, "tiny-moe", 1, 50, "node-a")
    store.ingest(every, [moe_step(s, [1.0 + s / 100, 2.0]) for s in range(1, 51)], [], [], {})
    # 50 steps in 10 bins of 5, each bin the mean of its 5 steps (few enough to read them all).
    heatmap = store.moe_heatmap(every, max_bins=10, samples_per_bin=5)
    assert heatmap["stride"] == 5 and heatmap["steps"] == list(range(5, 51, 5))
    assert heatmap["imbalance"][0] == pytest.approx([1.0 + (end - 2) / 100 for end in range(5, 51, 5)])
    assert heatmap["imbalance"][1] == [2.0] * 10

    sampled = store.start_run("sampled", tmp_path / "sampled", {}, "tiny-moe", 1, 200, "node-a")
    store.ingest(sampled, [moe_step(s, [1.0 + s / 1000]) for s in range(1, 201)], [], [], {})
    # 200 steps in 10 bins of 20, 2 samples a bin: steps 10 and 20 of each, so bin k's mean is step 20k - 5.
    heatmap = store.moe_heatmap(sampled, max_bins=10, samples_per_bin=2)
    assert heatmap["stride"] == 20 and heatmap["steps"] == list(range(20, 201, 20))
    assert heatmap["imbalance"] == [pytest.approx([1.0 + (end - 5) / 1000 for end in range(20, 201, 20)])]
    store.close()


def test_hostile_moe_values_are_dropped_without_breaking_or_bloating_the_store(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("hostile", tmp_path / "hostile", {}, "tiny-moe", 1, 20, "node-a")
    huge = 10**400  # JSON integers have no size limit; no float holds this one
    lines = [
        {**dense_step(1), "moe_imbalance": "1.5", "moe_imbalance_by_layer": "[1.5, 2.0]"},
        {**dense_step(2), "moe_imbalance": float("nan"), "moe_imbalance_by_layer": {"0": 1.5}},
        {**dense_step(3), "moe_imbalance": float("inf"), "moe_imbalance_by_layer": [1.5] * 10**6},
        {**dense_step(4), "moe_imbalance": huge, "moe_imbalance_by_layer": [1.5] * (MAX_MOE_LAYERS + 1)},
        {**dense_step(5), "moe_imbalance": [2.0], "moe_imbalance_by_layer": []},
        {**dense_step(6), "moe_imbalance": {"x": 1}, "moe_imbalance_by_layer": [None, "x", float("nan"), huge]},
        {**dense_step(7), "moe_imbalance": 1.75, "moe_imbalance_by_layer": ["x", 1.75, float("-inf"), [1], 1.25]},
        {**dense_step(8), "moe_imbalance": 2.0, "moe_imbalance_by_layer": [2.0] * MAX_MOE_LAYERS},
        {**dense_step(9), "grad_norm": huge, "mfu": "high"},  # the other numbers of a line are as guarded
    ]
    store.ingest(run_id, lines, [], [], {})

    series = store.series(run_id)
    assert series["step"] == list(range(1, 10))  # every line landed, its loss with it
    assert series["moe_imbalance"] == [None] * 6 + [1.75, 2.0, None]
    assert series["grad_norm"][-1] is None and series["mfu"][-1] is None
    layers = stored_layers(store, run_id)
    assert layers[:6] == [None] * 6 and layers[8] is None
    assert json.loads(layers[6]) == [None, 1.75, None, None, 1.25]  # a bad entry keeps its layer's place
    assert len(json.loads(layers[7])) == MAX_MOE_LAYERS  # the most a line may report is kept
    assert max(len(text) for text in layers if text) < 8 * MAX_MOE_LAYERS  # nothing near the 10^6 list

    heatmap = store.moe_heatmap(run_id)
    assert heatmap["steps"] == [7, 8] and len(heatmap["layers"]) == MAX_MOE_LAYERS
    assert [row[0] for row in heatmap["imbalance"][:5]] == [None, 1.75, None, None, 1.25]
    assert heatmap["imbalance"][1000] == [None, 2.0]
    store.close()


def test_a_row_written_by_other_means_does_not_break_the_heatmap(store_url, tmp_path):
    store = RunStore(store_url)
    run_id = store.start_run("edited", tmp_path / "edited", {}, "tiny-moe", 1, 3, "node-a")
    store.ingest(run_id, [moe_step(s, [1.5]) for s in (1, 2, 3)], [], [], {})
    with store.engine.begin() as conn:  # say, an older copy or a hand edit
        c = tables.steps.c
        for step, text in ((1, "not json"), (2, '{"0": 1.5}')):
            conn.execute(
                tables.steps.update().where(c.run_id == run_id, c.step == step).values(moe_imbalance_by_layer=text)
            )
    assert store.moe_heatmap(run_id) == {"steps": [3], "layers": [0], "imbalance": [[1.5]], "stride": 1}
    store.close()


def test_migration_0005_keeps_the_steps_a_store_holds_and_can_be_undone(store_url):
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext

    from phalanx.observe.store import MIGRATIONS

    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:  # a store as phalanx left it before it kept the experts' balance
        config.attributes["connection"] = conn
        command.upgrade(config, "0004")
        conn.execute(
            sa.text(
                "INSERT INTO runs (name, dir, status, started_at, updated_at, restarts) "
                "VALUES ('old', '/runs/old', 'finished', 1.0, 1.0, 0)"
            )
        )
        for step in (1, 2):
            conn.execute(sa.text("INSERT INTO steps (run_id, step, time, loss) VALUES (1, :s, :s, 2.0)"), {"s": step})
    store = RunStore(store_url)
    assert store.schema_version() == "0006"
    assert store.series(1)["step"] == [1, 2] and store.series(1)["moe_imbalance"] == [None, None]
    assert store.moe_heatmap(1)["layers"] == []
    store.ingest(1, [moe_step(3, [1.5, 2.5])], [], [], {})  # and it goes on with a step that has them
    assert store.moe_heatmap(1)["imbalance"] == [[1.5], [2.5]]
    store.close()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0004")
        columns = {c["name"] for c in sa.inspect(conn).get_columns("steps")}
        assert not {"moe_imbalance", "moe_imbalance_by_layer"} & columns
        assert conn.execute(sa.text("SELECT step FROM steps ORDER BY step")).scalars().all() == [1, 2, 3]
        command.upgrade(config, "head")
        assert compare_metadata(MigrationContext.configure(conn), tables.metadata) == []  # indexes and all
    engine.dispose()


# -- the run page's figures ------------------------------------------------------------------------------
@pytest.fixture
def sqlite_store(tmp_path):
    store = RunStore(f"sqlite:///{tmp_path / 'phalanx.db'}")
    yield store
    store.close()


def test_an_moe_run_gets_its_curve_and_layer_heatmap_and_they_pass_plotly_validation(sqlite_store, tmp_path):
    import plotly.graph_objects as go

    run_id = sqlite_store.start_run("moe", tmp_path / "moe", {}, "tiny-moe", 1, 3, "node-a")
    sqlite_store.ingest(run_id, [moe_step(s, [1.25, 1.0, 3.0 - s / 2]) for s in (1, 2, 3)], [], [], {})
    for options in (ChartOptions(), ChartOptions("tokens", 0.6, True), ChartOptions("time")):
        answer = run_answer(sqlite_store, run_id, options)
        assert not set(MOE_CHARTS) & set(answer["hidden"])
        for name in MOE_CHARTS:
            go.Figure(answer["figures"][name])  # raises on anything Plotly's schema does not allow
    answer = run_answer(sqlite_store, run_id, ChartOptions())
    curve = answer["figures"]["moe_imbalance"]["data"][0]
    assert curve["x"] == [1, 2, 3] and curve["y"] == [2.5, 2.0, 1.5]
    heatmap = answer["figures"]["moe_heatmap"]
    cells = heatmap["data"][0]
    assert cells["y"] == ["MoE layer 0", "MoE layer 1", "MoE layer 2"] and cells["x"] == [1, 2, 3]
    assert cells["z"] == [[1.25] * 3, [1.0] * 3, [2.5, 2.0, 1.5]]
    assert (cells["zmin"], cells["zmax"]) == (1.0, 2.5)  # the scale starts at even, whatever the run's least
    assert "annotations" not in heatmap["layout"]  # no "no data yet"


def test_a_dense_run_leaves_the_expert_charts_out_from_its_first_poll(sqlite_store, tmp_path):
    run_id = sqlite_store.start_run("dense", tmp_path / "dense", {}, "tiny", 1, 3, "node-a")
    assert run_answer(sqlite_store, run_id, ChartOptions())["hidden"].keys() >= set(MOE_CHARTS)  # no step yet
    sqlite_store.ingest(run_id, [dense_step(s) for s in (1, 2, 3)], [], [], {})
    answer = run_answer(sqlite_store, run_id, ChartOptions())
    assert {name: answer["hidden"][name] for name in MOE_CHARTS} == dict.fromkeys(MOE_CHARTS, NOT_MOE)
    assert answer["figures"]["moe_heatmap"]["layout"]["annotations"][0]["text"] == "no data yet"
