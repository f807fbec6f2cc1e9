"""The Grafana dashboard in the repository only queries metrics phalanx actually exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from phalanx.observe.prom import DEVICE_COUNTERS, EVENT_COUNTERS, RUN_COUNTERS, RUN_GAUGES, TRAIN_COUNTERS, TRAIN_GAUGES

DASHBOARD = Path(__file__).parents[2] / "grafana" / "phalanx-training.json"


def test_every_grafana_query_names_an_exposed_metric():
    exposed = {name for name, _, _ in TRAIN_GAUGES + RUN_GAUGES}
    exposed |= {f"{name}_total" for name, _, _ in EVENT_COUNTERS + TRAIN_COUNTERS + DEVICE_COUNTERS + RUN_COUNTERS}
    exposed |= {
        "phalanx_rank_step_seconds",
        "phalanx_rank_compute_seconds",
        "phalanx_run_status",
        "phalanx_run_restarts_total",
    }
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) >= 10
    for query in queries:
        names = set(re.findall(r"\bphalanx_[a-z_]+", query))
        assert names and names <= exposed, f"{query} uses {names - exposed}"
